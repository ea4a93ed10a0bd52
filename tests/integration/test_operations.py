"""The operator's statements on a real PostgreSQL: fleet pause and resume, heartbeats and
the lease holder, bulk actions in batches, counts under a time budget, slow statements."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import psycopg
import pytest

from receipts import bulk, fleet, review
from receipts.db import borrow, make_pool
from receipts.errors import StatementTimeout
from receipts.heartbeat import new_tag
from receipts.jobqueue import JobQueue
from receipts.model import JobState, PauseReason
from receipts.operations import Operations, ReviewFilter
from tests.compat.test_previous_release import frozen_statements
from tests.conftest import claim_jobs, enqueue_many, fetch_rows, make_settings
from tests.integration._operate import wait_for

FAST = bulk.BulkPolicy(first_batch=7, min_batch=3, max_batch=7, pace=0.0)


@pytest.fixture
async def ops(dsn: str) -> AsyncIterator[Operations]:
    pool = make_pool(make_settings(dsn), "test", max_size=4)
    await pool.open(wait=True, timeout=10)
    try:
        yield Operations(pool)
    finally:
        await pool.close()


def failed_rows(dsn: str, n: int, *, prefix: str = "f", minutes_ago: float = 10) -> None:
    """*n* failed jobs finished in the last *minutes_ago* minutes, newest last (one INSERT)."""
    fetch_rows(dsn, """
        INSERT INTO receipt_jobs (id, order_id, state, attempts, last_error, finished_at)
        SELECT gen_random_uuid(), %s || '-' || g, 'failed', 5, '503 busy',
               statement_timestamp() - make_interval(secs => %s * 60.0 * (%s - g) / %s)
        FROM generate_series(1, %s) AS g RETURNING 1""", (prefix, minutes_ago, n, n, n))


def counts(dsn: str) -> dict[str, int]:
    return {str(s): int(n) for s, n in  # type: ignore[call-overload]
            fetch_rows(dsn, "SELECT state, count(*) FROM receipt_jobs GROUP BY state")}


# ------------------------------------------------------------------ pause


@pytest.mark.slow
async def test_a_manual_pause_stops_claims_as_a_retry_after_pause_old_workers_read(
        dsn: str, ops: Operations, queue: JobQueue) -> None:
    enqueue_many(dsn, ["p-1", "p-2"])
    outcome = await fleet.pause(ops, seconds=600, note="provider migration", author="ui:abc")
    assert outcome.paused and outcome.previous_reason is None
    stored = fetch_rows(dsn, "SELECT pause_reason, pause_cause, pause_note, paused_by,"
                             " pause_cause_until = paused_until, paused_at IS NOT NULL,"
                             " paused_until - paused_at FROM receipt_flow")
    assert stored == [("retry_after", "manual", "provider migration", "ui:abc", True, True,
                       timedelta(seconds=600))]
    result = await queue.claim(10)
    # Workers read the effective reason (a released worker reads pause_reason: retry_after).
    assert result.attempts == [] and result.flow.pause_reason is PauseReason.MANUAL
    assert 590 < (result.flow.pause_left_seconds or 0) <= 600
    flow = await ops.fleet_flow()
    assert (flow.reason, flow.note, flow.paused_by) == ("manual", "provider migration", "ui:abc")

    lifted = await fleet.resume(ops, author="test")
    assert lifted.lifted and lifted.reason == "manual" and lifted.note == "provider migration"
    assert fetch_rows(dsn, "SELECT pause_reason, paused_until, pause_cause, pause_note,"
                           " paused_by, paused_at, pause_cause_until, probe_until, pause_seconds"
                           " FROM receipt_flow") == [(None,) * 8 + (0.0,)]
    assert len((await queue.claim(10)).attempts) == 2


@pytest.mark.slow
async def test_a_manual_pause_never_shortens_a_longer_automatic_one_unless_told(
        dsn: str, ops: Operations, queue: JobQueue) -> None:
    await queue.extend_pause(PauseReason.OUTAGE, 3600)
    refused = await fleet.pause(ops, seconds=60, note="short", author="cli:me@here")
    assert not refused.paused and refused.previous_reason == "outage"
    assert "automatic outage pause" in fleet.refusal(refused)
    assert fetch_rows(dsn, "SELECT pause_reason, pause_cause FROM receipt_flow") == [
        ("outage", "outage")]
    # A longer manual pause replaces it; then a shorter manual one replaces that.
    assert (await fleet.pause(ops, seconds=7200, note="longer", author="a")).paused
    assert (await fleet.pause(ops, seconds=60, note="shorter", author="a")).paused
    assert (await ops.fleet_flow()).remaining_seconds <= 60
    # An automatic pause that outlasts the manual one takes over, and with it its reason.
    await queue.extend_pause(PauseReason.AUTH, 900)
    flow = await ops.fleet_flow()
    assert flow.reason == "auth" and flow.note is None and flow.paused_by is None
    # Told explicitly, the operator's shorter pause replaces it.
    assert (await fleet.pause(ops, seconds=30, note="override", author="a",
                              replace=True)).paused
    assert (await ops.fleet_flow()).reason == "manual"


@pytest.mark.slow
async def test_resume_lifts_only_the_pause_the_operator_saw(ops: Operations,
                                                            queue: JobQueue) -> None:
    await fleet.pause(ops, seconds=600, note="seen", author="a")
    seen = (await ops.fleet_flow()).paused_until
    await queue.extend_pause(PauseReason.AUTH, 1200)  # started after the page was drawn
    outcome = await fleet.resume(ops, author="test", expected_until=seen)
    assert not outcome.lifted and outcome.reason == "auth"
    assert (await ops.fleet_flow()).reason == "auth"
    assert (await fleet.resume(ops, author="test")).lifted  # the CLI lifts whatever is there
    assert not (await ops.fleet_flow()).paused


async def test_pause_requests_are_checked() -> None:
    assert fleet.parse_duration("90s") == 90 and fleet.parse_duration("1h30m") == 5400
    assert fleet.parse_duration("2d") == 172_800 and fleet.parse_duration("300") == 300
    for bad in ("", "soon", "5", "8d", "-1m", "1x"):
        with pytest.raises(fleet.PauseError):
            fleet.parse_duration(bad)
    for bad in ("", "   ", "x" * 201, "line\nbreak", "rtl\u202eevil"):
        with pytest.raises(fleet.PauseError):
            fleet.check_note(bad)


# ------------------------------------------------------- heartbeats, holders


@pytest.mark.slow
async def test_a_lease_token_names_the_worker_that_holds_the_job(
        dsn: str, ops: Operations) -> None:
    tag = new_tag()
    pool = make_pool(make_settings(dsn), "worker", max_size=1)
    await pool.open(wait=True)
    try:
        tagged = JobQueue(pool, lease_seconds=30, max_attempts=5, worker_tag=tag)
        enqueue_many(dsn, ["held-1", "held-2"])
        jobs = await claim_jobs(tagged, 2)
        assert {j.token.hex[-8:] for j in jobs} == {tag}
        assert len({j.token for j in jobs}) == 2 and all(j.token.version == 4 for j in jobs)
        await tagged.heartbeat(tag=tag, pod="receipts-worker-7f9c", pid=42, version="0.3.0",
                               slots=32, inflight=2, claimed_total=2, uptime_seconds=90,
                               since_claim_seconds=1.5)
        (seen,) = await ops.workers_seen(seconds=120)
        assert (seen["pod"], seen["slots"], seen["inflight"], seen["claimed_total"]) == (
            "receipts-worker-7f9c", 32, 2, 2)
        assert timedelta(seconds=89) < seen["seen_at"] - seen["started_at"] <= timedelta(
            seconds=91)
        rows = await ops.review_jobs(ReviewFilter(state=JobState.RUNNING))
        assert {r["holder"] for r in rows} == {"receipts-worker-7f9c"}
        assert {r["expired"] for r in rows} == {False}
        # The second beat keeps the start and the last claim; a stopping one says so.
        await tagged.heartbeat(tag=tag, pod="receipts-worker-7f9c", pid=42, version="0.3.0",
                               slots=32, inflight=0, claimed_total=2, uptime_seconds=95,
                               since_claim_seconds=None, stopped=True)
        (again,) = await ops.workers_seen(seconds=120)
        assert again["started_at"] == seen["started_at"]
        assert again["last_claim_at"] == seen["last_claim_at"]
        assert again["stopped_at"] is not None
        assert fetch_rows(dsn, "SELECT n_tup_hot_upd FROM pg_stat_user_tables"
                               " WHERE relname = 'receipt_workers'")  # a plain table
    finally:
        await pool.close()


async def test_running_jobs_can_be_listed_by_whether_their_lease_expired(
        dsn: str, queue: JobQueue, ops: Operations) -> None:
    enqueue_many(dsn, ["r-1", "r-2", "r-3"])
    jobs = await claim_jobs(queue, 3)
    fetch_rows(dsn, "UPDATE receipt_jobs SET lease_until = now() - interval '1 s'"
                    " WHERE id = %s RETURNING 1", (jobs[0].id,))
    expired = await ops.review_jobs(ReviewFilter(state=JobState.RUNNING, expired=True))
    assert [r["id"] for r in expired] == [jobs[0].id] and expired[0]["holder"] is None
    live = ReviewFilter(state=JobState.RUNNING, expired=False)
    assert await ops.review_count(live) == 2
    assert await ops.review_count(ReviewFilter(state=JobState.RUNNING), cap=2) == 2


# ------------------------------------------------------------ named retries


def _failed_ids(dsn: str, *order_ids: str) -> list[uuid.UUID]:
    return [r[0] for r in fetch_rows(dsn, """
        INSERT INTO receipt_jobs (id, order_id, state, attempts, last_error, finished_at)
        SELECT gen_random_uuid(), o, 'failed', 5, '503 busy', statement_timestamp()
        FROM unnest(%s::text[]) WITH ORDINALITY AS g(o, n) ORDER BY n RETURNING id""",
        (list(order_ids),))]  # type: ignore[misc]


async def _waiting_on_a_row_lock(dsn: str) -> bool:
    """True once a session of the test database waits for a row lock."""
    return bool(fetch_rows(dsn, "SELECT 1 FROM pg_stat_activity WHERE datname ="
                                " current_database() AND wait_event_type = 'Lock'"))


def _states(dsn: str, ids: list[uuid.UUID]) -> list[str]:
    return [str(fetch_rows(dsn, "SELECT state FROM receipt_jobs WHERE id = %s", (i,))[0][0])
            for i in ids]


async def test_a_named_retry_never_leaves_a_partial_retry_when_a_job_changes_meanwhile(
        dsn: str, ops: Operations) -> None:
    """The command line's retry of named jobs (the page's too): a job that leaves the
    failed state between the check and the update (here another operator discards it
    in a session of its own) makes the update change nothing, never retry the rest."""
    a, b = _failed_ids(dsn, "race-a", "race-b")
    with psycopg.connect(dsn) as other:
        other.execute("UPDATE receipt_jobs SET state = 'discarded', finished_at = now()"
                      " WHERE id = %s", (b,))  # not committed yet: b still reads as failed
        retrying = asyncio.create_task(review.retry(ops, [a, b]))
        # The check saw both failed; the update now waits for b's row lock.
        await wait_for(lambda: _waiting_on_a_row_lock(dsn), timeout_seconds=30,
                       what="the retry's update to wait for the discard's row lock")
        other.commit()
    result = await retrying
    assert not result.ok and result.changed and result.retried == [] and result.count == 0
    assert [(r.id, r.state) for r in result.refused] == [(str(b), "discarded")]
    assert _states(dsn, [a, b]) == ["failed", "discarded"]  # a was not retried alone
    # Nothing in the way: both are retried, in one statement.
    c, d = _failed_ids(dsn, "race-c", "race-d")
    done = await review.retry(ops, [c, d, c])
    assert done.ok and sorted(done.retried) == sorted([str(c), str(d)]) and done.count == 2
    assert _states(dsn, [c, d]) == ["ready", "ready"]


async def test_the_released_check_then_update_retried_part_of_the_named_jobs(dsn: str) -> None:
    """Why retry_failed went: under the same interleaving the update of 0.2.0's command
    line (check each job, then ``retry_failed``) retried a alone."""
    a, b = _failed_ids(dsn, "old-a", "old-b")
    retry_failed = frozen_statements()["retry_failed"]
    with psycopg.connect(dsn) as other:
        other.execute("UPDATE receipt_jobs SET state = 'discarded', finished_at = now()"
                      " WHERE id = %s", (b,))
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            updating = asyncio.create_task(conn.execute(retry_failed,  # type: ignore[arg-type]
                                                        {"ids": [a, b]}))
            await wait_for(lambda: _waiting_on_a_row_lock(dsn), timeout_seconds=30,
                           what="retry_failed to wait for the discard's row lock")
            other.commit()
            changed = [r[0] for r in await (await updating).fetchall()]
    assert changed == [a]
    assert _states(dsn, [a, b]) == ["ready", "discarded"]  # a partial retry


# ------------------------------------------------------------ bulk actions


@pytest.mark.slow
async def test_a_bulk_retry_runs_in_batches_bounded_by_its_confirmation(
        dsn: str, ops: Operations, queue: JobQueue) -> None:
    failed_rows(dsn, 40)
    view = ReviewFilter(state=JobState.FAILED)
    cutoff, count, exact = await bulk.confirmation(ops, view)
    assert (count, exact) == (40, True)
    failed_rows(dsn, 5, prefix="later", minutes_ago=-1)  # fail after the confirmation
    row, runner = await bulk.start(ops, action="retry", view=ReviewFilter(
        state=JobState.FAILED, cutoff=cutoff), expected=count, created_by="test")
    seen: list[int] = []
    progress = await bulk.run(ops, row, runner, policy=FAST,
                              on_step=lambda step: seen.append(step.batch_changed))
    assert progress.status == "done" and progress.changed == 40 and progress.examined == 40
    assert seen == [7, 7, 7, 7, 7, 5]
    assert counts(dsn) == {"ready": 40, "failed": 5}
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs WHERE order_id LIKE 'later-%%'"
                           " AND state = 'failed'") == [(5,)]
    (done,) = fetch_rows(dsn, "SELECT status, changed, examined, batches, runner, finished_at"
                              " IS NOT NULL FROM receipt_bulk_actions")
    assert done == ("done", 40, 40, 6, None, True)


async def test_a_bulk_action_skips_jobs_that_changed_and_walks_past_what_does_not_match(
        dsn: str, ops: Operations, queue: JobQueue) -> None:
    failed_rows(dsn, 30)
    fetch_rows(dsn, "UPDATE receipt_jobs SET last_error = 'rare' WHERE order_id IN"
                    " ('f-3', 'f-17', 'f-29') RETURNING 1")
    view = ReviewFilter(state=JobState.FAILED, order_contains="-1")  # f-1, f-10…f-19
    cutoff, count, _ = await bulk.confirmation(ops, view)
    assert count == 11
    fetch_rows(dsn, "UPDATE receipt_jobs SET state = 'ready', finished_at = NULL"
                    " WHERE order_id = 'f-12' RETURNING 1")  # another operator retried it
    row, runner = await bulk.start(ops, action="discard", view=ReviewFilter(
        state=JobState.FAILED, order_contains="-1", cutoff=cutoff), expected=count,
        created_by="test")
    progress = await bulk.run(ops, row, runner, policy=FAST)
    assert (progress.changed, progress.examined) == (10, 29)  # every failed row walked once
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs WHERE state = 'discarded'") == [
        (10,)]
    assert fetch_rows(dsn, "SELECT state FROM receipt_jobs WHERE order_id = 'f-12'") == [
        ("ready",)]


@pytest.mark.slow
async def test_a_stopped_or_abandoned_bulk_action_resumes_where_it_stopped(
        dsn: str, ops: Operations, queue: JobQueue) -> None:
    failed_rows(dsn, 50)
    cutoff, count, _ = await bulk.confirmation(ops, ReviewFilter(state=JobState.FAILED))
    row, runner = await bulk.start(ops, action="retry", view=ReviewFilter(
        state=JobState.FAILED, cutoff=cutoff), expected=count, created_by="test")

    async def stop_after_two(step) -> None:
        if step.examined >= 14:
            assert await ops.bulk_stop(row["id"])

    first = await bulk.run(ops, row, runner, policy=FAST, on_step=stop_after_two)
    assert first.status == "stopped" and first.changed == 14
    assert counts(dsn) == {"ready": 14, "failed": 36}
    # The old runner is fenced out: its batch changes nothing once another took over.
    taken = await bulk.resume(ops, row["id"], policy=FAST)
    assert taken is not None
    again, new_runner = taken
    assert await ops.bulk_step(again, runner=runner, batch=7, after=None) is None
    assert counts(dsn) == {"ready": 14, "failed": 36}
    second = await bulk.run(ops, again, new_runner, policy=FAST)
    assert second.status == "done" and second.changed == 50 and second.examined == 50
    assert counts(dsn) == {"ready": 50}
    # A running action with a live runner cannot be taken; an idle one can.
    failed_rows(dsn, 10, prefix="g")
    cutoff, count, _ = await bulk.confirmation(ops, ReviewFilter(state=JobState.FAILED))
    row, _ = await bulk.start(ops, action="retry", view=ReviewFilter(
        state=JobState.FAILED, cutoff=cutoff), expected=count, created_by="test")
    assert await bulk.resume(ops, row["id"], policy=FAST) is None
    fetch_rows(dsn, "UPDATE receipt_bulk_actions SET updated_at = now() - interval '2 min'"
                    " WHERE id = %s RETURNING 1", (row["id"],))
    assert await bulk.resume(ops, row["id"], policy=FAST) is not None


@pytest.mark.slow
async def test_a_count_that_takes_too_long_gives_up_at_a_bounded_count(
        dsn: str, ops: Operations) -> None:
    failed_rows(dsn, 20)
    _, count, exact = await bulk.confirmation(ops, ReviewFilter(state=JobState.FAILED), cap=5)
    assert (count, exact) == (20, True)
    # Each latest-attempt probe now takes 0.2 s: the exact count needs 4 s.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE receipt_attempts RENAME TO receipt_attempts_real")
        conn.execute("CREATE VIEW receipt_attempts AS SELECT * FROM receipt_attempts_real"
                     " WHERE pg_sleep(0.2) IS NOT NULL")
    fetch_rows(dsn, "INSERT INTO receipt_attempts_real (job_id, slot, seq, attempt, reason)"
                    " SELECT id, 0, 1, 5, 'max_attempts' FROM receipt_jobs RETURNING 1")
    slow = ReviewFilter(state=JobState.FAILED, reason="max_attempts")
    _, count, exact = await bulk.confirmation(ops, slow, timeout_seconds=0.5, cap=3)
    assert (count, exact) == (3, False)


@pytest.mark.slow
async def test_a_statement_the_server_stops_is_slow_not_unavailable(dsn: str) -> None:
    pool = make_pool(make_settings(dsn, statement_timeout_seconds=0.2), "test", max_size=1)
    await pool.open(wait=True)
    try:
        with pytest.raises(StatementTimeout, match="statement timeout"):
            async with borrow(pool) as conn:
                await conn.execute("SELECT pg_sleep(2)")
        async with borrow(pool) as conn:  # the connection is fine afterwards
            await conn.execute("SELECT 1")
    finally:
        await pool.close()


def test_bulk_batch_sizes_aim_at_the_target_time() -> None:
    policy = bulk.BulkPolicy(first_batch=1000, min_batch=100, max_batch=20_000,
                             target_seconds=0.5)
    assert policy.next_batch(1000, 0.1) == 2000  # at most double
    assert policy.next_batch(1000, 4.0) == 500  # at most halve
    assert policy.next_batch(1000, 0.625) == 800
    assert policy.next_batch(150, 10.0) == 100 and policy.next_batch(20_000, 0.01) == 20_000


@pytest.mark.slow
async def test_a_bulk_action_refuses_a_state_it_does_not_apply_to(ops: Operations) -> None:
    with pytest.raises(ValueError, match="retry does not apply to ready"):
        await ops.bulk_create(action="retry", view=ReviewFilter(
            state=JobState.READY, cutoff=None), expected=0, runner=uuid.uuid4(),
            created_by="x")
