"""Attempt history, discard and the review statements on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import timedelta

import psycopg
import pytest

from receipts import recovery
from receipts.enqueue import enqueue
from receipts.errors import QueueError
from receipts.jobqueue import JobQueue
from receipts.model import ATTEMPT_HISTORY, AttemptRecord, Job, JobState, PauseReason, Reason
from receipts.operations import Operations, ReviewFilter
from receipts.supervisor import run_command
from tests.conftest import (
    check_invariants,
    claim_jobs,
    enqueue_many,
    fetch_rows,
    make_settings,
    reschedule_one,
)


async def _failed(dsn: str, queue: JobQueue, orders: list[str], *, status: int = 422,
                  reason: Reason = Reason.REJECTED) -> dict[str, Job]:
    """Enqueue *orders*, claim them and fail each permanently with one attempt record."""
    enqueue_many(dsn, orders)
    jobs = {j.order_id: j for j in await claim_jobs(queue, len(orders))}
    for job in jobs.values():
        await reschedule_one(queue, job, delay_seconds=0, error=f"{status} nope", permanent=True)
    await queue.record_attempts([
        AttemptRecord(job.id, job.attempt, reason, status, f"{status} nope", 0.25, "worker-a")
        for job in jobs.values()])
    return jobs


async def test_a_batch_of_records_lands_in_one_statement_newest_first(
    dsn: str, queue: JobQueue, operations: Operations
) -> None:
    enqueue_many(dsn, ["a-1", "a-2"])
    jobs = await claim_jobs(queue, 2)
    first, second = jobs
    await queue.record_attempts([
        AttemptRecord(first.id, 1, Reason.PROVIDER_5XX, 503, "503 busy", 0.5, "pod-1"),
        AttemptRecord(second.id, 1, Reason.TIMEOUT, None, "", 10.0, "pod-2"),
        AttemptRecord(first.id, 2, Reason.DELIVERED, 200, "", 0.01, "pod-1"),
    ])
    history = await operations.job_attempts(first.id)
    assert [(h["seq"], h["attempt"], h["reason"], h["status"]) for h in history] == [
        (2, 2, "delivered", 200), (1, 1, "provider_5xx", 503)]
    assert history[1]["error"] == "503 busy" and history[1]["duration_seconds"] == 0.5
    assert history[1]["worker"] == "pod-1" and history[1]["at"] is not None
    other = await operations.job_attempts(second.id)
    assert [(h["reason"], h["status"], h["error"]) for h in other] == [("timeout", None, None)]


async def test_history_keeps_the_last_twenty_records_per_job(
        dsn: str, queue: JobQueue, operations: Operations) -> None:
    enqueue_many(dsn, ["ring-1"])
    (job,) = await claim_jobs(queue, 1)
    # Records arrive one batch at a time and, once, 23 of them in one batch.
    for n in range(1, 8):
        await queue.record_attempts([AttemptRecord(job.id, n, Reason.PROVIDER_5XX, 500)])
    await queue.record_attempts(
        [AttemptRecord(job.id, n, Reason.PROVIDER_5XX, 500) for n in range(8, 31)])
    history = await operations.job_attempts(job.id)
    assert len(history) == ATTEMPT_HISTORY == 20
    # The batch of 23 keeps its last 20: 11..30 survive, numbered by arrival.
    assert [h["attempt"] for h in history] == list(range(30, 10, -1))
    rows = fetch_rows(dsn, "SELECT count(*) FROM receipt_attempts")
    assert rows == [(20,)]


async def test_records_of_unknown_jobs_are_dropped_and_long_fields_are_cut(
    dsn: str, queue: JobQueue, operations: Operations
) -> None:
    enqueue_many(dsn, ["cut-1"])
    (job,) = await claim_jobs(queue, 1)
    await queue.record_attempts([
        AttemptRecord(uuid.uuid4(), 1, Reason.DELIVERED, 200),
        AttemptRecord(job.id, 1, Reason.REJECTED, 422, "x" * 10_000, 0.1, "w" * 300),
    ])
    (record,) = await operations.job_attempts(job.id)
    assert len(record["error"]) == 500 and len(record["worker"]) == 100
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_attempts") == [(1,)]
    await queue.record_attempts([])  # nothing to write: no statement, no error


async def test_recovery_records_a_lease_expired_attempt(dsn: str) -> None:
    from receipts.db import make_pool

    settings = make_settings(dsn, lease_seconds=1.0, lease_margin_seconds=0.0,
                             delivery_timeout_seconds=1.0, recovery_delay_seconds=0.0)
    pool = make_pool(settings, "recover", max_size=2)
    await pool.open(wait=True)
    try:
        queue = JobQueue(pool, lease_seconds=0.2, max_attempts=5)
        operations = Operations(pool)
        enqueue_many(dsn, ["lost-1"])
        (job,) = await claim_jobs(queue, 1)
        await asyncio.sleep(0.3)  # let the 0.2 s lease run out (database time)
        report = await recovery.run_once(queue, settings)
        assert report.expired_to_ready == 1
        (record,) = await operations.job_attempts(job.id)
        assert record["reason"] == Reason.LEASE_EXPIRED and record["attempt"] == 1
        assert record["status"] is None and record["duration_seconds"] is None
        assert record["worker"] == "receipts-recover"
    finally:
        await pool.close()


async def test_discard_moves_ready_and_failed_jobs_and_keeps_the_order_deduplicated(
    dsn: str, queue: JobQueue, operations: Operations
) -> None:
    failed = await _failed(dsn, queue, ["d-failed"])
    enqueue_many(dsn, ["d-1", "d-2"])
    running_id = (await claim_jobs(queue, 1))[0].id
    (ready_id,) = (i for (i,) in fetch_rows(dsn, "SELECT id FROM receipt_jobs"
                                                 " WHERE state = 'ready'"))
    changed = await operations.discard_jobs([failed["d-failed"].id, ready_id], expected=2)
    assert sorted(changed) == sorted([failed["d-failed"].id, ready_id])
    rows = fetch_rows(dsn, "SELECT state, finished_at IS NOT NULL, lease_token IS NULL"
                           " FROM receipt_jobs WHERE id = ANY(%s)",
                      ([failed["d-failed"].id, ready_id],))
    assert rows == [("discarded", True, True)] * 2
    # The row stays: enqueueing the same order again is still a no-op.
    with psycopg.connect(dsn) as conn:
        assert enqueue(conn, "d-failed") is None
    # Never a running job, and all or nothing: nothing changes when one does not qualify.
    assert await operations.discard_jobs([running_id], expected=1) == []
    before = fetch_rows(dsn, "SELECT * FROM receipt_jobs ORDER BY id")
    assert await operations.discard_jobs([running_id, ready_id], expected=2) == []
    assert fetch_rows(dsn, "SELECT * FROM receipt_jobs ORDER BY id") == before
    stats = await queue.queue_stats()
    assert stats.discarded == 2 and stats.running == 1
    assert (await operations.state_counts())[JobState.DISCARDED] == 2
    check_invariants(dsn, 5)


async def test_the_check_constraint_requires_a_finish_time_for_discarded(dsn: str) -> None:
    enqueue_many(dsn, ["c-1"])
    with pytest.raises(psycopg.errors.CheckViolation), psycopg.connect(dsn) as conn:
        conn.execute("UPDATE receipt_jobs SET state = 'discarded'")
    with pytest.raises(psycopg.errors.CheckViolation), psycopg.connect(dsn) as conn:
        conn.execute("UPDATE receipt_jobs SET state = 'cancelled', finished_at = now()")


async def test_filter_actions_change_nothing_unless_the_confirmed_count_still_holds(
    dsn: str, queue: JobQueue, operations: Operations
) -> None:
    await _failed(dsn, queue, ["f-422-a", "f-422-b"], status=422)
    await _failed(dsn, queue, ["f-500-a"], status=500, reason=Reason.MAX_ATTEMPTS)
    only_422 = ReviewFilter(state=JobState.FAILED, status=422)
    assert await operations.review_count(only_422) == 2
    assert await operations.review_count(ReviewFilter(reason="max_attempts")) == 1
    assert await operations.review_count(ReviewFilter(order_contains="500")) == 1
    assert await operations.review_count(ReviewFilter(order_contains="%")) == 0  # no patterns
    # The operator confirmed 3, but only 2 match now: nothing is retried.
    assert await operations.retry_jobs(only_422, expected=3) == []
    assert await operations.review_count(only_422) == 2
    retried = await operations.retry_jobs(only_422, expected=2)
    assert len(retried) == 2
    assert fetch_rows(dsn, "SELECT order_id, state, attempts FROM receipt_jobs"
                           " WHERE id = ANY(%s) ORDER BY order_id", (retried,)) == [
        ("f-422-a", "ready", 0), ("f-422-b", "ready", 0)]
    # Ready jobs can be discarded by filter too, and a time window bounds it.
    ready = ReviewFilter(state=JobState.READY, until=(await _now(dsn)) + timedelta(seconds=5))
    assert await operations.review_count(ready) == 2
    assert len(await operations.discard_jobs(ready, expected=2)) == 2
    assert await operations.review_count(ReviewFilter(state=JobState.DISCARDED)) == 2


async def _now(dsn: str):  # type: ignore[no-untyped-def]
    return fetch_rows(dsn, "SELECT statement_timestamp()")[0][0]


async def test_review_pages_follow_the_keyset_cursor(
        dsn: str, queue: JobQueue, operations: Operations) -> None:
    await _failed(dsn, queue, [f"p-{n:02}" for n in range(7)])
    view = ReviewFilter()
    seen: list[str] = []
    after = None
    while True:
        page = await operations.review_jobs(view, limit=3, after=after)
        seen += [r["order_id"] for r in page]
        if len(page) < 3:
            break
        after = (page[-1]["sort_at"], page[-1]["id"])
    assert sorted(seen) == [f"p-{n:02}" for n in range(7)] and len(set(seen)) == 7
    first = (await operations.review_jobs(view, limit=1))[0]
    assert first["reason"] == "rejected" and first["status"] == 422


async def test_pruning_deletes_the_history_with_its_job(
        dsn: str, queue: JobQueue, operations: Operations) -> None:
    jobs = await _failed(dsn, queue, ["old-1", "old-2"])
    assert await operations.discard_jobs([jobs["old-1"].id], expected=1) == [jobs["old-1"].id]
    enqueue_many(dsn, ["old-3"])
    (kept,) = await claim_jobs(queue, 1)
    await queue.record_attempts([AttemptRecord(kept.id, 1, Reason.TIMEOUT)])
    fetch_rows(dsn, "UPDATE receipt_jobs SET finished_at = finished_at - interval '2 days'"
                    " WHERE finished_at IS NOT NULL RETURNING 1")
    # One batch: up to `batch` done/failed rows and up to `batch` discarded rows.
    assert await queue.prune(retention_seconds=86_400, batch=1) == 2
    assert await queue.prune(retention_seconds=86_400, batch=1) == 0
    assert fetch_rows(dsn, "SELECT job_id FROM receipt_attempts") == [(kept.id,)]


async def test_provider_pause_reads_the_fleet_wide_flow_row(
        queue: JobQueue, operations: Operations) -> None:
    assert (await operations.provider_pause())["pause_reason"] is None
    await queue.extend_pause(PauseReason.AUTH, 30)
    pause = await operations.provider_pause()
    assert pause["pause_reason"] == "auth"
    assert 20 < pause["remaining_seconds"] <= 30


@pytest.mark.slow
def test_cli_discard_is_all_or_nothing_and_show_lists_the_attempts(dsn: str) -> None:
    async def seed() -> dict[str, Job]:
        from receipts.db import make_pool

        pool = make_pool(make_settings(dsn), "test", max_size=2)
        await pool.open(wait=True)
        try:
            q = JobQueue(pool, lease_seconds=30, max_attempts=5)
            jobs = await _failed(dsn, q, ["cli-1", "cli-2"])
            enqueue_many(dsn, ["cli-running"])
            jobs["cli-running"] = (await claim_jobs(q, 1))[0]
            return jobs
        finally:
            await pool.close()

    jobs = asyncio.run(seed())
    env = {"RECEIPTS_DATABASE_URL": dsn}
    one, two, running = (str(jobs[k].id) for k in ("cli-1", "cli-2", "cli-running"))
    result = run_command(["jobs", "discard", one, running], env)
    assert result.returncode == 1, result.stderr
    assert f"job {running} is running; only ready or failed jobs can be discarded" in (
        result.stderr)
    assert "nothing was discarded" in result.stderr
    result = run_command(["jobs", "discard", "--failed", "--status", "422", "--dry-run",
                           "--json"], env)
    assert result.returncode == 0, result.stderr
    assert sorted(json.loads(result.stdout)["would_discard"]) == sorted([one, two])
    result = run_command(["jobs", "discard", one, two], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("discarded 2 job(s)")
    result = run_command(["jobs", "show", "cli-1", "--json"], env)
    shown = json.loads(result.stdout)
    assert shown["state"] == "discarded"
    assert [(a["attempt"], a["reason"], a["status"]) for a in shown["attempts"]] == [
        (1, "rejected", 422)]
    result = run_command(["jobs", "show", running, "--json"], env)
    token = json.loads(result.stdout)["lease_token"]
    assert len(token.rstrip("…")) == 8


async def test_a_stale_writer_cannot_break_a_batch(
        dsn: str, queue: JobQueue, operations: Operations) -> None:
    """Two writers racing on one job's next slot: one record wins, neither raises."""
    enqueue_many(dsn, ["race-1"])
    (job,) = await claim_jobs(queue, 1)
    records = [AttemptRecord(job.id, 1, Reason.TIMEOUT, None, "first", 1.0, "a")]
    other = [AttemptRecord(job.id, 1, Reason.LEASE_EXPIRED, None, "second", None, "b")]
    results = await asyncio.gather(queue.record_attempts(records),
                                   queue.record_attempts(other), return_exceptions=True)
    assert not [r for r in results if isinstance(r, QueueError)]
    assert 1 <= len(await operations.job_attempts(job.id)) <= 2
