"""Fleet-wide flow control in PostgreSQL: the pause, the probe, the token bucket, 409s."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import psycopg
import pytest

from receipts.db import make_pool
from receipts.embedded import EmbeddedPostgres
from receipts.jobqueue import JobQueue
from receipts.migrate import apply_migrations
from receipts.model import JobState, PauseReason
from tests.conftest import (
    check_invariants,
    claim_jobs,
    enqueue_many,
    fetch_rows,
    make_settings,
)


@pytest.fixture
async def limited(dsn: str) -> AsyncIterator[JobQueue]:
    """A queue under a (slow) rate limit with a burst of 30 tokens."""
    settings = make_settings(dsn)
    pool = make_pool(settings, "test", max_size=8)
    await pool.open(wait=True, timeout=10)
    try:
        yield JobQueue(pool, lease_seconds=30, max_attempts=5, rate_limit_per_second=0.001,
                       burst=30)
    finally:
        await pool.close()


async def test_nothing_is_claimed_while_the_fleet_is_paused(dsn, queue):
    enqueue_many(dsn, [f"order-{i}" for i in range(5)])
    flow = await queue.extend_pause(PauseReason.OUTAGE, 60)
    assert flow.pause_reason is PauseReason.OUTAGE and 59 < flow.pause_left_seconds <= 60
    result = await queue.claim(5)
    assert result.attempts == []
    assert result.flow.pause_reason is PauseReason.OUTAGE
    assert 59 < result.flow.pause_left_seconds <= 60


async def test_a_pause_is_never_shortened_and_the_later_end_keeps_its_reason(queue):
    await queue.extend_pause(PauseReason.RETRY_AFTER, 120)
    flow = await queue.extend_pause(PauseReason.OUTAGE, 5)
    assert flow.pause_reason is PauseReason.RETRY_AFTER and flow.pause_left_seconds > 115
    flow = await queue.extend_pause(PauseReason.AUTH, 600)
    assert flow.pause_reason is PauseReason.AUTH and flow.pause_left_seconds > 595


async def test_exactly_one_of_many_pods_wins_the_probe(dsn, limited):
    enqueue_many(dsn, [f"order-{i}" for i in range(5)])
    await limited.extend_pause(PauseReason.OUTAGE, 0.01)
    await asyncio.sleep(0.05)  # the pause (10 ms) runs out
    won = await asyncio.gather(*(limited.begin_probe(30) for _ in range(8)))
    winners = [w for w in won if w is not None]
    assert len(winners) == 1
    probe_until, state = winners[0]
    assert state.pause_reason is PauseReason.OUTAGE
    # Everyone else still sees the fleet paused until the probe answers.
    assert (await limited.claim(5)).attempts == []
    probe = await limited.claim(1, probe=True)
    assert len(probe.attempts) == 1
    assert await limited.resume(probe_until)
    assert len((await limited.claim(5)).attempts) == 4


async def test_a_pause_extended_during_the_probe_is_not_ended_by_it(queue, operations):
    await queue.extend_pause(PauseReason.OUTAGE, 0.01)
    await asyncio.sleep(0.05)
    probe_until, _ = await queue.begin_probe(30)
    await queue.extend_pause(PauseReason.RETRY_AFTER, 30)  # another pod got a 429
    assert not await queue.resume(probe_until)
    assert (await operations.flow_state()).pause_reason is PauseReason.RETRY_AFTER


@pytest.mark.slow
async def test_a_claim_takes_exactly_one_token_per_job_it_returns(dsn, limited):
    enqueue_many(dsn, [f"order-{i}" for i in range(100)])
    first = await limited.claim(20)
    assert len(first.attempts) == 20 and first.flow.tokens == pytest.approx(10, abs=0.01)
    second = await limited.claim(20)
    assert len(second.attempts) == 10 and second.flow.tokens == pytest.approx(0, abs=0.01)
    third = await limited.claim(20)
    assert third.attempts == [] and third.flow.tokens < 1
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs WHERE state = 'running'") == [
        (30,)]


@pytest.mark.slow
async def test_concurrent_claimers_never_claim_more_than_the_tokens(dsn, limited):
    """Eight claimers race on real row locks; the bucket holds 30 tokens."""
    enqueue_many(dsn, [f"order-{i}" for i in range(200)])

    async def claimer() -> int:
        got = 0
        for _ in range(10):
            got += len((await limited.claim(7)).attempts)
        return got

    total = sum(await asyncio.gather(*(claimer() for _ in range(8))))
    assert total == 30
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs WHERE state = 'running'") == [
        (30,)]
    check_invariants(dsn, 5)


@pytest.mark.slow
async def test_the_bucket_refills_at_the_rate_up_to_the_burst(dsn):
    enqueue_many(dsn, [f"order-{i}" for i in range(300)])
    settings = make_settings(dsn)
    pool = make_pool(settings, "test", max_size=2)
    await pool.open(wait=True, timeout=10)
    try:
        queue = JobQueue(pool, lease_seconds=30, max_attempts=5, rate_limit_per_second=100,
                         burst=20)
        assert len((await queue.claim(100)).attempts) == 20  # a full bucket: the burst
        started = time.monotonic()
        claimed = 0
        while time.monotonic() - started < 1.0:
            claimed += len((await queue.claim(100)).attempts)
            await asyncio.sleep(0.01)
        elapsed = time.monotonic() - started
        assert 100 * elapsed * 0.85 <= claimed <= 100 * elapsed * 1.05 + 2
    finally:
        await pool.close()


@pytest.mark.slow
async def test_the_bucket_row_is_updated_in_place_hot(dsn):
    enqueue_many(dsn, [f"order-{i}" for i in range(40)])
    pool = make_pool(make_settings(dsn), "test", max_size=1)
    await pool.open(wait=True, timeout=10)
    queue = JobQueue(pool, lease_seconds=30, max_attempts=5, rate_limit_per_second=0.001,
                     burst=30)
    for _ in range(200):
        await queue.claim(1)
    await pool.close()  # a backend flushes its table statistics when it exits
    deadline = time.monotonic() + 15
    while True:
        (upd, hot), = fetch_rows(dsn, "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
                                      " WHERE relname = 'receipt_flow'")
        if upd >= 200 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert upd >= 200 and hot >= 0.9 * upd, (upd, hot)
    print(f"\n[bench] receipt_flow: {upd} updates, {hot} HOT ({hot / upd:.0%})")


@pytest.mark.slow
async def test_a_409_gives_the_attempt_back_up_to_its_own_budget(dsn, queue):
    from receipts.model import Attempt, Outcome, Reason, Reschedule, Verdict
    from tests.conftest import reschedule_one  # noqa: F401  (the helper's shape)

    enqueue_many(dsn, ["order-busy"])
    busy = Outcome(Verdict.RETRY, Reason.IN_PROGRESS, 409, None, "409 in progress")
    for _ in range(queue.max_in_progress + 3):
        (job,) = await claim_jobs(queue, 1)
        states = await queue.reschedule([Reschedule(Attempt(job, time.monotonic()), busy, 0)])
        assert states == {job.id: JobState.READY}
    (attempts, count), = fetch_rows(dsn, "SELECT attempts, in_progress_count FROM receipt_jobs")
    assert count == queue.max_in_progress + 3
    assert attempts == 3  # the budget gave back 20 attempts; the 3 beyond it counted


@pytest.mark.slow
async def test_a_refunded_failure_keeps_the_attempt_and_never_leaves_ready_at_max(dsn, queue):
    from receipts.model import Attempt, Outcome, Reason, Reschedule, Verdict

    enqueue_many(dsn, ["order-outage"])
    down = Outcome(Verdict.RETRY, Reason.PROVIDER_5XX, 503, None, "503")
    for _ in range(20):
        (job,) = await claim_jobs(queue, 1)
        await queue.reschedule([Reschedule(Attempt(job, time.monotonic()), down, 0, True)])
    assert fetch_rows(dsn, "SELECT state, attempts FROM receipt_jobs") == [("ready", 0)]
    check_invariants(dsn, 5)


@pytest.mark.slow
def test_a_pause_survives_a_postgresql_restart(tmp_path):
    server = EmbeddedPostgres(fast=True)
    server.start()
    try:
        apply_migrations(server.dsn)
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("UPDATE receipt_flow SET pause_reason = 'retry_after',"
                         " paused_until = now() + interval '1 hour', pause_seconds = 3600")
        server.stop()
        server.start()
        assert fetch_rows(server.dsn, "SELECT pause_reason, paused_until > now()"
                                      " FROM receipt_flow") == [("retry_after", True)]
    finally:
        server.cleanup()


@pytest.mark.slow
async def test_a_retry_after_pause_ends_by_itself_without_a_probe(dsn, queue):
    enqueue_many(dsn, ["order-1"])
    await queue.extend_pause(PauseReason.RETRY_AFTER, 0.05)
    assert (await queue.claim(1)).attempts == []
    await asyncio.sleep(0.1)
    assert await queue.begin_probe(30) is None  # nothing to probe: the provider said when
    result = await queue.claim(1)
    assert len(result.attempts) == 1 and result.flow.pause_reason is None


# ------------------------------------------- causes, the probe cadence, released workers

#: The extend_pause statement of the released 0.2.0 worker (a frozen copy): it writes
#: only the columns that release knew.
RELEASED_EXTEND_PAUSE = """
UPDATE receipt_flow
SET pause_reason = CASE
      WHEN paused_until IS NULL
        OR statement_timestamp() + make_interval(secs => %(seconds)s) > paused_until
      THEN %(reason)s ELSE pause_reason END,
    paused_until = greatest(paused_until,
                            statement_timestamp() + make_interval(secs => %(seconds)s)),
    pause_seconds = greatest(pause_seconds, %(seconds)s),
    probe_until = NULL
WHERE id = 1
"""


def flow_row(dsn: str) -> dict[str, object]:
    names = ("pause_reason", "pause_cause", "cause_current", "pause_note", "paused_by",
             "last_probe_outcome", "probed_recently")
    (row,) = fetch_rows(dsn, "SELECT pause_reason, pause_cause,"
                             " pause_cause_until = paused_until, pause_note, paused_by,"
                             " last_probe_outcome, last_probe_at > now() - interval '1 minute'"
                             " FROM receipt_flow")
    return dict(zip(names, row, strict=True))


@pytest.mark.slow
async def test_a_systemic_rejection_is_stored_as_an_outage_that_released_workers_honour(
        dsn, queue, operations):
    enqueue_many(dsn, ["order-1"])
    flow = await queue.extend_pause(PauseReason.REJECTING, 60)
    assert flow.pause_reason is PauseReason.REJECTING
    row = flow_row(dsn)
    assert (row["pause_reason"], row["pause_cause"], row["cause_current"]) == (
        "outage", "rejecting", True)
    claim = await queue.claim(1)
    assert claim.attempts == [] and claim.flow.pause_reason is PauseReason.REJECTING
    assert (await operations.flow_state()).pause_reason is PauseReason.REJECTING
    assert (await operations.provider_pause())["pause_reason"] == "rejecting"
    # A released worker extends it: it writes pause_reason alone, so the cause no
    # longer applies and the pause reads as what that worker said.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(RELEASED_EXTEND_PAUSE, {"reason": "outage", "seconds": 120})
    assert (await queue.claim(1)).flow.pause_reason is PauseReason.OUTAGE
    assert (await operations.provider_pause())["pause_reason"] == "outage"


@pytest.mark.slow
async def test_a_probe_is_due_an_interval_after_the_last_failure_whatever_the_pause_length(
        dsn, queue):
    enqueue_many(dsn, [f"order-{i}" for i in range(3)])
    flow = await queue.extend_pause(PauseReason.OUTAGE, 300, next_probe_seconds=0.2)
    assert 0 < flow.pause_left_seconds <= 0.2  # the claims' countdown is to the probe
    assert await queue.begin_probe(30) is None
    await asyncio.sleep(0.25)
    probe_until, state = await queue.begin_probe(30)
    assert state.pause_reason is PauseReason.OUTAGE and state.pause_left_seconds == 300
    assert len((await queue.claim(1, probe=True)).attempts) == 1
    # The probe failed: the pause doubles to its cap, the next probe is again an interval away.
    await queue.extend_pause(PauseReason.OUTAGE, 300, next_probe_seconds=0.2,
                             probe_outcome="provider_5xx")
    assert flow_row(dsn)["last_probe_outcome"] == "provider_5xx"
    assert not await queue.resume(probe_until)  # that probe lost its claim to resume
    await asyncio.sleep(0.25)
    probe_until, _ = await queue.begin_probe(30)
    # Answered at last: the fleet resumes 300 s before the pause's nominal end.
    assert await queue.resume(probe_until, probe_outcome="delivered")
    row = flow_row(dsn)
    assert row["pause_reason"] is None and row["probed_recently"]
    assert row["last_probe_outcome"] == "delivered"
    assert len((await queue.claim(5)).attempts) == 2


@pytest.mark.slow
async def test_an_operators_pause_is_not_probed_not_shortened_and_kept_until_a_longer_one(
        dsn, queue):
    enqueue_many(dsn, ["order-1"])
    with psycopg.connect(dsn, autocommit=True) as conn:  # what the pause command writes
        conn.execute("UPDATE receipt_flow SET pause_reason = 'retry_after',"
                     " paused_until = now() + interval '1 hour', pause_seconds = 3600,"
                     " pause_cause = 'manual', pause_cause_until = now() + interval '1 hour',"
                     " pause_note = 'provider maintenance', paused_by = 'alice',"
                     " paused_at = now()")
    claim = await queue.claim(1)
    assert claim.attempts == [] and claim.flow.pause_reason is PauseReason.MANUAL
    assert 3590 < claim.flow.pause_left_seconds <= 3600
    assert await queue.begin_probe(30) is None
    flow = await queue.extend_pause(PauseReason.OUTAGE, 5)  # an outage inside it
    assert flow.pause_reason is PauseReason.MANUAL and flow.pause_left_seconds > 3590
    assert flow_row(dsn)["pause_note"] == "provider maintenance"
    flow = await queue.extend_pause(PauseReason.RETRY_AFTER, 7200)  # a later end wins
    assert flow.pause_reason is PauseReason.RETRY_AFTER
    row = flow_row(dsn)
    assert (row["pause_cause"], row["pause_note"], row["paused_by"]) == (
        "retry_after", None, None)
