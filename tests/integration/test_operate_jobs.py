"""``receipts jobs``: stats, list, show and retry as an operator runs them (CLI processes)."""

from __future__ import annotations

import json
import re
import uuid

import pytest

from receipts.jobqueue import JobQueue
from receipts.supervisor import run_command
from tests.conftest import claim_jobs, enqueue_many, fetch_rows, reschedule_one

SNAPSHOT = "SELECT * FROM receipt_jobs ORDER BY order_id"


def _jobs(dsn: str, *args: str) -> tuple[int, str, str]:
    result = run_command(["jobs", *args], {"RECEIPTS_DATABASE_URL": dsn})
    return result.returncode, result.stdout, result.stderr


async def _seed(dsn: str, queue: JobQueue) -> dict[str, str]:
    """Two failed jobs, one running, one done, one ready; returns {order id: job id}."""
    enqueue_many(dsn, ["failed-1", "failed-2", "running-1", "done-1", "ready-1"])
    fetch_rows(dsn, "UPDATE receipt_jobs SET run_at = run_at + interval '1 hour'"
                    " WHERE order_id = 'ready-1' RETURNING 1")
    claimed = {j.order_id: j for j in await claim_jobs(queue, 10)}
    await queue.ack([(claimed["done-1"].id, claimed["done-1"].token)])
    for order in ("failed-1", "failed-2"):
        await reschedule_one(queue, claimed[order], delay_seconds=0, error="422 order unknown",
                               permanent=True)
    return {str(o): str(i) for o, i in fetch_rows(dsn, "SELECT order_id, id FROM receipt_jobs")}


@pytest.mark.slow
async def test_retry_makes_failed_jobs_deliverable_again(dsn: str, queue: JobQueue) -> None:
    ids = await _seed(dsn, queue)
    code, out, err = _jobs(dsn, "retry", ids["failed-1"], ids["failed-2"])
    assert code == 0, err
    assert out.startswith("retried 2 failed job(s)")
    rows = fetch_rows(dsn, "SELECT state, attempts, run_at <= statement_timestamp(), last_error,"
                           " finished_at FROM receipt_jobs WHERE order_id LIKE 'failed-%%'")
    assert rows == [("ready", 0, True, "manual retry after: 422 order unknown", None)] * 2
    again = await claim_jobs(queue, 10)
    assert sorted(j.order_id for j in again) == ["failed-1", "failed-2"]
    assert {j.attempt for j in again} == {1}


@pytest.mark.slow
async def test_retry_refuses_a_job_that_is_not_failed_and_changes_nothing(
    dsn: str, queue: JobQueue
) -> None:
    ids = await _seed(dsn, queue)
    before = fetch_rows(dsn, SNAPSHOT)
    for other in ("running-1", "done-1", "ready-1"):
        code, out, err = _jobs(dsn, "retry", ids["failed-1"], ids[other])
        assert code == 1, (other, out, err)
        state = other.split("-")[0]
        assert f"job {ids[other]} is {state}; only failed jobs can be retried" in err
        assert "nothing was retried" in err
        assert fetch_rows(dsn, SNAPSHOT) == before
    unknown = str(uuid.uuid4())
    code, out, err = _jobs(dsn, "retry", unknown, "--json")
    assert code == 1 and f"job {unknown} no such job" in err
    assert json.loads(out) == {"dry_run": False, "retried": [], "would_retry": [], "count": 0,
                               "refused": [{"id": unknown, "state": "unknown"}]}
    assert fetch_rows(dsn, SNAPSHOT) == before


@pytest.mark.slow
async def test_retry_all_failed_dry_run_changes_nothing(dsn: str, queue: JobQueue) -> None:
    ids = await _seed(dsn, queue)
    before = fetch_rows(dsn, SNAPSHOT)
    code, out, err = _jobs(dsn, "retry", "--all-failed", "--dry-run")
    assert code == 0, err
    assert out.startswith("would retry 2 failed job(s)")
    code, out, err = _jobs(dsn, "retry", "--all-failed", "--dry-run", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["dry_run"] is True and data["retried"] == []
    assert sorted(data["would_retry"]) == sorted([ids["failed-1"], ids["failed-2"]])
    assert fetch_rows(dsn, SNAPSHOT) == before
    code, out, err = _jobs(dsn, "retry", "--all-failed", "--json")
    assert code == 0 and sorted(json.loads(out)["retried"]) == sorted(data["would_retry"])
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs WHERE state = 'failed'") == [(0,)]


@pytest.mark.slow
async def test_json_outputs_parse_and_describe_the_queue(dsn: str, queue: JobQueue) -> None:
    ids = await _seed(dsn, queue)
    code, out, err = _jobs(dsn, "stats", "--json")
    assert code == 0, err
    stats = json.loads(out)
    assert stats["jobs"] == {"ready": 1, "running": 1, "done": 1, "failed": 2,
                             "discarded": 0}
    assert stats["ready_due"] == 0 and stats["queue_lag_seconds"] == 0
    assert stats["oldest_failed_at"] is not None
    code, out, _ = _jobs(dsn, "list", "--state", "failed", "--json", "--limit", "1")
    assert code == 0 and len(json.loads(out)) == 1
    code, out, _ = _jobs(dsn, "list", "--state", "failed", "--json",
                         "--since", "2000-01-01T00:00:00")
    listed = json.loads(out)
    assert sorted(r["order_id"] for r in listed) == ["failed-1", "failed-2"]
    assert all(r["last_error"] == "422 order unknown" for r in listed)
    code, out, _ = _jobs(dsn, "show", ids["running-1"], "--json")
    shown = json.loads(out)
    assert code == 0 and shown["state"] == "running" and shown["order_id"] == "running-1"
    assert len(shown["lease_token"].rstrip("…")) == 8  # never the whole token
    code, out, _ = _jobs(dsn, "show", "done-1", "--json")  # by order id
    assert code == 0 and json.loads(out)["id"] == ids["done-1"]
    code, out, _ = _jobs(dsn, "stats")
    assert code == 0 and re.search(r"^failed +2$", out, re.MULTILINE)  # labels aligned
    code, out, _ = _jobs(dsn, "list")
    assert code == 0 and out.splitlines()[0].startswith("ID") and "failed-2" in out


@pytest.mark.slow
def test_bad_usage_exits_2_and_unknown_jobs_exit_1(dsn: str) -> None:
    for args in (["retry"], ["retry", "not-a-uuid"], ["retry", str(uuid.uuid4()), "--all-failed"],
                 ["list", "--limit", "0"], ["list", "--since", "yesterday"],
                 ["list", "--state", "lost"]):
        code, _, err = _jobs(dsn, *args)
        assert code == 2, (args, err)
        assert err.strip(), args
    code, _, err = _jobs(dsn, "show", "no-such-order")
    assert code == 1 and "no job with id or order id 'no-such-order'" in err


@pytest.mark.slow
def test_held_rejections_sent_again_stay_one_group_until_something_decides_them(
        dsn: str) -> None:
    """`jobs retry --held` while the fleet is paused must not hide the jobs from a later
    `jobs discard --held`: they keep their mark; only their time moves."""
    enqueue_many(dsn, ["held-1", "held-2", "held-3", "other-1"])
    fetch_rows(dsn, "UPDATE receipt_jobs SET run_at = run_at + interval '1 hour',"
                    " last_error = 'held rejection: 422 {\"id\": \"r-' || order_id || '\"}'"
                    " WHERE order_id LIKE 'held-%%' RETURNING 1")
    code, out, err = _jobs(dsn, "retry", "--held")
    assert code == 0 and "3 held rejection(s) due now" in out, err
    code, out, _ = _jobs(dsn, "list", "--held", "--json")
    rows = json.loads(out)
    assert sorted(r["order_id"] for r in rows) == ["held-1", "held-2", "held-3"]
    assert all(r["last_error"].startswith("held rejection: 422 ") for r in rows)
    (due,) = fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs WHERE order_id LIKE 'held-%%'"
                             " AND run_at <= statement_timestamp()")
    assert due == (3,)
    # Already due: the answer still counts them, as the dry run does, and a paused
    # fleet is named (nothing will claim them until it resumes).
    code, out, _ = _jobs(dsn, "retry", "--held", "--dry-run")
    assert code == 0 and "would retry 3 held rejection(s)" in out
    code, out, err = _jobs(dsn, "retry", "--held")
    assert code == 0 and "3 held rejection(s) due now (all due already)" in out
    assert "the fleet is paused" not in err
    code, _, err = _jobs(dsn, "pause", "--for", "60s", "--reason", "test")
    assert code == 0, err
    fetch_rows(dsn, "UPDATE receipt_jobs SET run_at = run_at + interval '1 hour'"
                    " WHERE order_id = 'held-1' RETURNING 1")
    code, out, err = _jobs(dsn, "retry", "--held", "--json")
    assert code == 0 and json.loads(out) == {"action": "retry", "dry_run": False, "count": 3,
                                             "made_due": 1}
    # An operator's pause ends by itself: no probe to wait for.
    assert "the fleet is paused (manual)" in err and " s) or `receipts jobs resume`" in err, err
    assert "probe" not in err
    code, out, _ = _jobs(dsn, "discard", "--held")
    assert code == 0 and "3 held rejection(s) discarded" in out
    assert fetch_rows(dsn, "SELECT order_id, state FROM receipt_jobs ORDER BY order_id") == [
        ("held-1", "discarded"), ("held-2", "discarded"), ("held-3", "discarded"),
        ("other-1", "ready")]
