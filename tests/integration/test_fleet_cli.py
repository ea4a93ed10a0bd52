"""``receipts jobs pause|resume`` and the bulk ``retry --all-failed`` / ``discard --failed``
as an operator runs them (CLI processes, real PostgreSQL)."""

from __future__ import annotations

import json

import pytest

from receipts.jobqueue import JobQueue
from receipts.model import PauseReason
from receipts.supervisor import run_command
from tests.conftest import fetch_rows


def jobs(dsn: str, *args: str) -> tuple[int, str, str]:
    result = run_command(["jobs", *args], {"RECEIPTS_DATABASE_URL": dsn})
    return result.returncode, result.stdout, result.stderr


def flow(dsn: str) -> tuple[object, ...]:
    (row,) = fetch_rows(dsn, "SELECT pause_reason, pause_cause, pause_note, paused_by,"
                             " pause_cause_until = paused_until FROM receipt_flow")
    return row


@pytest.mark.slow
def test_an_operator_pauses_and_resumes_deliveries_from_the_command_line(dsn: str) -> None:
    code, out, err = jobs(dsn, "pause", "--for", "15m", "--reason", "provider maintenance")
    assert code == 0, err
    assert out.startswith("paused every worker's deliveries until ") and "(15 min)" in out
    reason, cause, note, by, applies = flow(dsn)
    assert (reason, cause, note, applies) == ("retry_after", "manual", "provider maintenance",
                                             True)
    assert str(by).startswith("cli:") and "@" in str(by)
    assert '"event": "fleet_paused"' in err and '"note": "provider maintenance"' in err

    code, out, err = jobs(dsn, "stats")
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("provider"))
    assert "paused (manual) for 1" in line and "'provider maintenance' by cli:" in line
    code, out, _ = jobs(dsn, "stats", "--json")
    provider = json.loads(out)["provider"]
    assert provider["paused"] and provider["reason"] == "manual"
    assert 880 < provider["remaining_seconds"] <= 900

    code, out, err = jobs(dsn, "resume")
    assert code == 0 and out.startswith("resumed deliveries (lifted a manual pause: "
                                        "'provider maintenance')"), err
    assert flow(dsn) == (None, None, None, None, None)
    code, out, _ = jobs(dsn, "resume", "--json")
    assert code == 0 and json.loads(out)["resumed"] is False


@pytest.mark.slow
async def test_a_manual_pause_does_not_cut_a_longer_outage_pause_short_unless_replaced(
        dsn: str, queue: JobQueue) -> None:
    await queue.extend_pause(PauseReason.OUTAGE, 3600)
    code, out, err = jobs(dsn, "pause", "--for", "5m", "--reason", "x", "--json")
    assert code == 1 and json.loads(out)["previous_reason"] == "outage"
    assert "automatic outage pause is already in force" in err and "--replace" in err
    assert flow(dsn)[:2] == ("outage", "outage")
    code, _, err = jobs(dsn, "pause", "--for", "5m", "--reason", "x", "--replace")
    assert code == 0, err
    assert flow(dsn)[:2] == ("retry_after", "manual")


@pytest.mark.slow
def test_pause_usage_is_checked_before_any_connection() -> None:
    env = {"RECEIPTS_DATABASE_URL": "postgresql://nobody@127.0.0.1:9/none"}
    for args, words in ((["pause", "--reason", "x"], "--for"),
                        (["pause", "--for", "soon", "--reason", "x"], "a duration is like"),
                        (["pause", "--for", "30d", "--reason", "x"], "from 10 s to 7 days"),
                        (["pause", "--for", "5m", "--reason", " "], "say why")):
        result = run_command(["jobs", *args], env)
        assert result.returncode == 2, (args, result.stderr)
        assert words in result.stderr.strip().splitlines()[-1], result.stderr


@pytest.mark.slow
def test_retry_all_failed_and_discard_by_filter_run_as_batched_bulk_actions(dsn: str) -> None:
    fetch_rows(dsn, """
        INSERT INTO receipt_jobs (id, order_id, state, attempts, last_error, finished_at)
        SELECT gen_random_uuid(), 'bulk-' || g, 'failed', 5,
               CASE WHEN mod(g, 2) = 0 THEN '422 gone' ELSE '503 busy' END,
               statement_timestamp() - make_interval(secs => g)
        FROM generate_series(1, 2500) AS g RETURNING 1""")
    code, out, err = jobs(dsn, "retry", "--all-failed", "--dry-run", "--json")
    data = json.loads(out)
    assert code == 0 and data["count"] == 2500 and len(data["would_retry"]) == 500, err
    code, out, err = jobs(dsn, "retry", "--all-failed", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["count"] == 2500 and len(data["retried"]) == 1000
    (action,) = fetch_rows(dsn, "SELECT id::text, status, changed, batches, created_by"
                                " FROM receipt_bulk_actions")
    assert action[0] == data["action_id"] and action[1:3] == ("done", 2500)
    assert action[3] >= 2  # the first batch is 1,000 jobs
    assert str(action[4]).startswith("cli:")
    assert '"event": "bulk_action_ended"' in err
    fetch_rows(dsn, "UPDATE receipt_jobs SET state = 'failed', finished_at = now()"
                    " RETURNING 1")
    code, out, err = jobs(dsn, "discard", "--failed", "--since", "2000-01-01")
    assert code == 0 and out.startswith("discarded 2500 job(s)"), err
    assert fetch_rows(dsn, "SELECT state, count(*) FROM receipt_jobs GROUP BY state") == [
        ("discarded", 2500)]
