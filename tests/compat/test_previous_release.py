"""The previous release on today's schema: receipts 0.2.0's runtime statements (frozen in
queries_0_2_0.sql) against a database migrated with every migration this tree ships.

The upgrade contract (docs/design.md, "Upgrades and rollbacks"): migrations only add within
a major version, so during an upgrade the old workers (and the orders service's 0.2.0
enqueue) keep working beside the new ones, and after a `helm rollback` the old workers run
on the schema the new release left. These tests run the old statements with the parameters
0.2.0's JobQueue passed, through the lease protocol (claim → ack, a stale ack refused,
reschedule, recovery of an expired lease, prune) and the fleet-wide flow state, including
pauses written by newer code with a cause 0.2.0 never knew: it must read them as one of
the reasons it knows. The database is the test template, migrated by apply_migrations()
with every bundled file, so these checks follow each migration as it lands.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

FROZEN = Path(__file__).with_name("queries_0_2_0.sql")
#: Pause reasons 0.2.0 understands; any other value would stop its claims for good.
OLD_REASONS = {"auth", "outage", "retry_after"}
MAX_ATTEMPTS, LEASE_SECONDS, MAX_IN_PROGRESS = 5, 60.0, 3
#: Blocks that are not statements on the queue's tables (a fragment; a WAL probe).
NOT_ON_THE_SCHEMA = {"review_matching", "commit_probe"}


def frozen_statements() -> dict[str, str]:
    """The named blocks, loaded as 0.2.0's statements() loaded them (schema "public")."""
    text = FROZEN.read_text("utf-8").replace("{schema}.", '"public".')
    blocks: dict[str, str] = {}
    for chunk in re.split(r"^-- name: ", text, flags=re.M)[1:]:
        name, _, body = chunk.partition("\n")
        lines = [ln for ln in body.splitlines() if not ln.lstrip().startswith("--")]
        blocks[name.strip()] = "\n".join(lines).strip().rstrip(";")
    return blocks


OLD = frozen_statements()


class OldRelease:
    """0.2.0's statements, run with the parameters its JobQueue and review passed."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.ran: set[str] = set()

    def run(self, name: str, params: dict[str, Any] | None = None,
            query: sql.Composable | None = None) -> list[tuple[Any, ...]]:
        self.ran.add(name)
        cur = self.conn.execute(query or sql.SQL(OLD[name]),  # type: ignore[arg-type]
                                params or {})
        return cur.fetchall() if cur.description else []

    # -- the worker
    def enqueue(self, *order_ids: str, traced: bool = False) -> list[uuid.UUID]:
        params = {"order_ids": chr(31).join(order_ids), "count": len(order_ids),
                  "run_at": None, "channel": "receipts_jobs", "notify": True}
        if traced:
            params["traceparent"] = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
        ((ids, _start),) = self.run("enqueue_traced" if traced else "enqueue", params)
        return list(ids or [])

    def claim(self, limit: int, *, probe: bool = False) -> list[tuple[Any, ...]]:
        query = sql.SQL(OLD["claim"]).format(limit=sql.Literal(limit))  # type: ignore[arg-type]
        return self.run("claim", {"max_attempts": MAX_ATTEMPTS, "probe": probe,
                                  "lease_seconds": LEASE_SECONDS}, query)

    def claim_limited(self, limit: int, *, rate: float, burst: float) -> list[tuple[Any, ...]]:
        query = sql.SQL(OLD["claim_limited"]).format(  # type: ignore[arg-type]
            limit=sql.Literal(limit))
        return self.run("claim_limited", {"max_attempts": MAX_ATTEMPTS, "probe": False,
                                          "lease_seconds": LEASE_SECONDS, "rate": rate,
                                          "burst": burst}, query)

    def ack(self, pairs: list[tuple[uuid.UUID, uuid.UUID]]) -> list[uuid.UUID]:
        return [r[0] for r in self.run("ack", {
            "ids": ",".join(i.hex for i, _ in pairs), "tokens": ",".join(t.hex for _, t in pairs)})]

    def reschedule(self, job: uuid.UUID, token: uuid.UUID, *, delay: float, error: str,
                   permanent: bool = False, refund: bool = False,
                   in_progress: bool = False) -> list[tuple[Any, ...]]:
        return self.run("reschedule", {
            "ids": [job], "tokens": [token], "delays": [delay], "errors": [error],
            "permanent": [permanent], "refund": [refund], "in_progress": [in_progress],
            "max_attempts": MAX_ATTEMPTS, "max_in_progress": MAX_IN_PROGRESS})

    def resolve_writes(self, pairs: list[tuple[uuid.UUID, uuid.UUID]]) -> list[tuple[Any, ...]]:
        return self.run("resolve_writes", {
            "ids": ",".join(i.hex for i, _ in pairs), "tokens": ",".join(t.hex for _, t in pairs)})

    def record_attempts(self, job: uuid.UUID, attempt: int, reason: str) -> None:
        self.run("record_attempts", {
            "job_ids": [job], "attempts": [attempt], "reasons": [reason], "statuses": [200],
            "errors": [None], "durations": [0.05], "workers": ["receipts-worker-0.2.0"]})

    # -- flow control
    def extend_pause(self, seconds: float, reason: str) -> tuple[Any, ...]:
        (row,) = self.run("extend_pause", {"seconds": seconds, "reason": reason})
        return row

    def begin_probe(self) -> list[tuple[Any, ...]]:
        return self.run("begin_probe", {"guard_seconds": 30.0})

    def resume(self, probe_until: Any) -> list[tuple[Any, ...]]:
        return self.run("resume", {"probe_until": probe_until})

    def flow_state(self) -> tuple[Any, ...]:
        (row,) = self.run("flow_state", {"burst": 10.0, "rate": 5.0})
        return row

    # -- recovery
    def recover_expired(self) -> list[str]:
        return [r[0] for r in self.run("recover_expired", {
            "batch": 100, "max_attempts": MAX_ATTEMPTS, "delay_seconds": 0.0})]

    def fail_exhausted(self) -> list[tuple[Any, ...]]:
        return self.run("fail_exhausted", {"max_attempts": MAX_ATTEMPTS, "batch": 100})

    def prune(self, retention_seconds: float) -> list[tuple[Any, ...]]:
        return self.run("prune", {"retention_seconds": retention_seconds, "batch": 100})


@pytest.fixture
def old(dsn: str) -> Iterator[OldRelease]:
    with psycopg.connect(dsn, autocommit=True,
                         application_name="receipts-worker-0.2.0") as conn:
        yield OldRelease(conn)


def _state(old: OldRelease, job: uuid.UUID) -> tuple[Any, ...]:
    (row,) = old.conn.execute("SELECT state, attempts, lease_token, last_error"
                              " FROM receipt_jobs WHERE id = %s", (job,)).fetchall()
    return row


def _expire(old: OldRelease, job: uuid.UUID) -> None:
    old.conn.execute("UPDATE receipt_jobs SET lease_until = statement_timestamp()"
                     " - interval '1 second' WHERE id = %s", (job,))


# -------------------------------------------------------------- the lease protocol


@pytest.mark.slow
def test_the_old_lease_protocol_holds_on_today_s_schema(old: OldRelease) -> None:
    a, b = old.enqueue("order-a", "order-b")
    assert old.enqueue("order-a") == []  # a duplicate enqueue is a no-op
    (traced,) = old.enqueue("order-c", traced=True)

    claimed = {r[0]: r for r in old.claim(10)}
    assert set(claimed) == {a, b, traced}
    for row in claimed.values():
        assert row[5] is None  # no pause: the flow columns read as 0.2.0 expects
    token_a, token_b = claimed[a][2], claimed[b][2]

    # claim → ack; the same ack again, or with another attempt's token, changes nothing.
    assert old.ack([(a, token_a)]) == [a]
    assert _state(old, a)[0] == "done"
    assert old.ack([(a, token_a)]) == []
    assert old.ack([(b, uuid.uuid4())]) == []
    assert old.resolve_writes([(a, token_a), (b, token_b)]) == [(a, "done")]

    # reschedule: a known failure goes back to ready with its delay, attempts kept.
    assert old.reschedule(b, token_b, delay=0.0, error="provider 503") == [(b, "ready")]
    assert _state(old, b)[:2] == ("ready", 1)
    old.record_attempts(b, 1, "provider_5xx")

    # An expired lease: recovery takes it back; the late ack of that attempt is refused.
    ((_, _, token_b2, attempts, *_),) = [r for r in old.claim(10) if r[0] == b]
    assert attempts == 2
    _expire(old, b)
    assert old.recover_expired() == ["ready"]
    assert _state(old, b)[0] == "ready" and _state(old, b)[3] == "lease expired"
    assert old.ack([(b, token_b2)]) == []
    assert old.reschedule(b, token_b2, delay=0.0, error="late") == []

    # A permanent failure, then the operator's retry, then fail_exhausted and prune.
    ((_, _, token_b3, *_),) = [r for r in old.claim(10) if r[0] == b]
    assert old.reschedule(b, token_b3, delay=0.0, error="422", permanent=True) == [(b, "failed")]
    assert [r[0] for r in old.run("retry_failed", {"ids": [b]})] == [b]
    old.conn.execute("UPDATE receipt_jobs SET attempts = %s WHERE id = %s", (MAX_ATTEMPTS, b))
    assert old.fail_exhausted() == [(b,)]
    old.conn.execute("UPDATE receipt_jobs SET finished_at = now() - interval '40 days'"
                     " WHERE id IN (%s, %s)", (a, b))
    assert sorted(r[0] for r in old.prune(30 * 86400.0)) == sorted([a, b])
    assert old.run("job_attempts", {"id": b}) == []  # its history went with it


@pytest.mark.slow
def test_the_old_rate_limited_claim_charges_the_bucket_on_today_s_schema(
        old: OldRelease) -> None:
    old.enqueue(*(f"limited-{n}" for n in range(5)))
    old.conn.execute("UPDATE receipt_flow SET tokens = 2, tokens_at = now()")
    rows = old.claim_limited(10, rate=0.0, burst=10.0)
    assert len([r for r in rows if r[0] is not None]) == 2
    assert rows[0][7] == pytest.approx(0.0)  # what is left in the bucket


# ----------------------------------------------------------------- the flow state


def _pause(old: OldRelease, *, reason: str, cause: str, seconds: float) -> None:
    """A pause as newer code writes one with a cause 0.2.0 does not know (migration 0006):
    pause_reason one of the three, the cause beside it while pause_cause_until equals
    paused_until."""
    old.conn.execute(
        "UPDATE receipt_flow SET pause_reason = %s, pause_cause = %s,"
        " paused_until = statement_timestamp() + make_interval(secs => %s),"
        " pause_cause_until = statement_timestamp() + make_interval(secs => %s),"
        " pause_seconds = %s, pause_note = 'provider maintenance', paused_by = 'ops',"
        " paused_at = statement_timestamp(), probe_until = NULL WHERE id = 1",
        (reason, cause, seconds, seconds, seconds))


@pytest.mark.slow
@pytest.mark.parametrize(("cause", "reason"), [("rejecting", "outage"),
                                               ("manual", "retry_after")])
def test_a_newer_pause_reads_as_one_the_old_release_knows(
        old: OldRelease, cause: str, reason: str) -> None:
    old.enqueue("paused-1")
    _pause(old, reason=reason, cause=cause, seconds=600)
    state = old.flow_state()
    assert state[0] == reason and state[0] in OLD_REASONS
    assert 590 < state[1] <= 600
    (row,) = old.run("provider_pause")
    assert row[0] in OLD_REASONS
    # Nobody claims while it holds: every row carries the pause, no job comes back.
    rows = old.claim(10)
    assert [(r[0], r[5]) for r in rows] == [(None, reason)]


def test_the_old_release_ends_a_systemic_rejection_pause_by_a_probe(old: OldRelease) -> None:
    (job,) = old.enqueue("probe-1")
    _pause(old, reason="outage", cause="rejecting", seconds=0.01)
    old.conn.execute("SELECT pg_sleep(0.05)")
    ((reason, probe_until, _),) = old.begin_probe()
    assert reason == "outage"
    assert [r[0] for r in old.claim(1, probe=True)] == [job]
    assert old.resume(probe_until) == [(1,)]
    assert old.flow_state()[0] is None


def test_an_operator_s_pause_ends_by_itself_for_the_old_release(old: OldRelease) -> None:
    (job,) = old.enqueue("manual-1")
    _pause(old, reason="retry_after", cause="manual", seconds=0.01)
    old.conn.execute("SELECT pg_sleep(0.05)")
    assert [r[0] for r in old.claim(1)] == [job]  # retry_after: over when its time is up


def test_an_old_worker_extending_a_newer_pause_takes_the_cause_out_of_force(
        old: OldRelease) -> None:
    _pause(old, reason="outage", cause="rejecting", seconds=60)
    reason, left, _ = old.extend_pause(300, "outage")
    assert reason == "outage" and left > 290
    ((cause, until_matches),) = old.conn.execute(
        "SELECT pause_cause, pause_cause_until = paused_until FROM receipt_flow").fetchall()
    # The cause stays written but no longer applies: newer code reads this pause as
    # 'outage', the old worker's own (migration 0006's effective-reason rule).
    assert cause == "rejecting" and until_matches is False


def test_no_newer_code_can_write_a_reason_the_old_release_does_not_know(
        old: OldRelease) -> None:
    for value in ("rejecting", "manual"):
        with pytest.raises(psycopg.errors.CheckViolation):
            old.conn.execute("UPDATE receipt_flow SET pause_reason = %s,"
                             " paused_until = now() + interval '1 minute'", (value,))


# ------------------------------------------------------- review and every statement


@pytest.mark.slow
def test_every_old_statement_runs_on_today_s_schema(old: OldRelease) -> None:
    """Each block of the frozen file runs (parses, finds its columns) with 0.2.0's
    parameters; the lease-protocol tests above check what the main ones do."""
    ids = old.enqueue("review-1", "review-2", "review-3")
    (job, token), = [(r[0], r[2]) for r in old.claim(1)]
    old.record_attempts(job, 1, "rejected")
    old.reschedule(job, token, delay=0.0, error="422", permanent=True)
    old.ack([(uuid.uuid4(), uuid.uuid4())])
    old.resolve_writes([(job, token)])
    old.extend_pause(0.01, "retry_after")
    old.begin_probe()
    old.resume(None)
    old.flow_state()
    old.claim_limited(1, rate=1.0, burst=1.0)
    old.recover_expired()
    old.fail_exhausted()
    old.prune(86400.0)
    (stats,) = old.run("queue_stats")
    assert (stats[1] + stats[2], stats[4]) == (2, 1)  # ready + running 2, failed 1
    old.run("state_counts")
    old.run("oldest_failed")
    old.run("list_jobs", {"state": "failed", "since": None, "limit": 10})
    old.run("show_job", {"id": job})
    old.run("show_job_by_order", {"order_id": "review-1"})
    old.run("job_attempts", {"id": job})
    old.run("job_states", {"ids": ids})
    old.run("provider_pause")
    view = {"reason": "rejected", "status": None, "since": None, "until": None,
            "order_contains": None}
    matching = sql.SQL(OLD["review_matching"]).format(  # type: ignore[arg-type]
        state=sql.Literal("failed"), key=sql.Identifier("finished_at"))
    for name in ("review_jobs", "review_count"):
        query = sql.SQL(OLD[name]).format(  # type: ignore[arg-type]
            matching=matching, key=sql.Identifier("finished_at"))
        rows = old.run(name, {**view, "after_at": None, "after_id": None, "limit": 50}, query)
        assert rows and (rows[0][0] == job or rows[0][0] == 1)
    by_ids = sql.SQL("j.id = ANY(%(ids)s::uuid[])")
    retry = sql.SQL(OLD["retry_jobs"]).format(target=by_ids)  # type: ignore[arg-type]
    assert old.run("retry_jobs", {**view, "ids": [job], "expected": 1}, retry) == [(job,)]
    discard = sql.SQL(OLD["discard_jobs"]).format(target=matching)  # type: ignore[arg-type]
    old.run("discard_jobs", {**view, "expected": 0}, discard)
    old.run("retry_failed", {"ids": None})
    old.enqueue("review-4", traced=True)
    assert set(OLD) - NOT_ON_THE_SCHEMA - old.ran == set(), "a frozen statement never ran"
