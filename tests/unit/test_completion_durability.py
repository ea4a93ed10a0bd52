"""The completer under asynchronous commits: counts only what a crash cannot undo.

The fake queue keeps a write-ahead log: with ``auto_flush`` off a write is on
disk only after ``flush()``, and ``crash()`` undoes the rest and replaces the
connection, as a PostgreSQL crash does to ``synchronous_commit = off`` writes.
The same behaviour against a real PostgreSQL killed with SIGKILL:
``tests/chaos/test_crash.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest

from receipts.completion import UNDONE_CLAIM, Completer
from receipts.metrics import Metrics
from receipts.model import Attempt, Job, JobState, Outcome, Reason, Reschedule, Verdict
from tests.unit.fakes import FakeQueue


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def setup() -> AsyncIterator[tuple[FakeQueue, Completer, Metrics]]:
    queue = FakeQueue(auto_flush=False)
    metrics = Metrics()
    completer = Completer(queue, metrics, lease_seconds=30, linger_seconds=0,
                          watch_durability=True, watch_interval_seconds=0.005)
    completer.start()
    yield queue, completer, metrics
    await completer.close(timeout_seconds=5)


async def claimed(queue: FakeQueue) -> Attempt:
    queue.add(1)
    (attempt,) = (await queue.claim(1)).attempts
    return attempt


async def test_an_ack_counts_only_once_the_wal_is_flushed_past_it(setup):
    queue, completer, metrics = setup
    attempt = await claimed(queue)
    completer.ack(attempt)
    await until(lambda: queue.count(JobState.DONE) == 1 and queue.wal_reads >= 3)
    assert value(metrics, "receipts_acks_total") == 0 and completer.unproven == 1
    queue.flush()
    await until(lambda: value(metrics, "receipts_acks_total") == 1)
    assert completer.unproven == 0


async def test_an_ack_a_crash_undid_is_written_again_and_counted_once(setup):
    queue, completer, metrics = setup
    attempt = await claimed(queue)
    queue.flush()  # the claim is on disk, the ack will not be
    completer.ack(attempt)
    await until(lambda: queue.count(JobState.DONE) == 1)
    queue.crash()
    assert queue.count(JobState.RUNNING) == 1  # the lease holds: the ack can land again
    await until(lambda: queue.count(JobState.DONE) == 1 and queue.lsn > queue.flushed)
    queue.flush()
    await until(lambda: value(metrics, "receipts_acks_total") == 1)
    assert value(metrics, "receipts_writes_rewritten_total", statement="ack") == 1
    assert value(metrics, "receipts_stale_acks_total") == 0
    assert value(metrics, "receipts_writes_undone_total", statement="claim") == 0


async def test_an_ack_refused_because_the_crash_undid_its_claim_is_not_a_stale_ack(setup):
    queue, completer, metrics = setup
    attempt = await claimed(queue)  # neither the claim nor the ack reaches the disk
    completer.ack(attempt)
    await until(lambda: queue.count(JobState.DONE) == 1)
    queue.crash()
    assert queue.count(JobState.READY) == 1  # another attempt will deliver it again
    await until(lambda: value(metrics, "receipts_writes_undone_total", statement="claim") == 1)
    assert value(metrics, "receipts_acks_total") == 0
    assert value(metrics, "receipts_stale_acks_total") == 0
    # The row forgot the sending (attempts is back to 0); the history keeps it.
    await until(lambda: bool(queue.records))
    (record,) = queue.records
    assert (record.job_id, record.attempt, record.reason, record.error) == (
        attempt.job.id, 1, Reason.DELIVERED, UNDONE_CLAIM)


async def test_a_write_sent_after_the_crash_for_an_undone_claim_is_counted_undone(setup):
    queue, completer, metrics = setup
    attempt = await claimed(queue)
    queue.crash()  # during the delivery
    outcome = Outcome(Verdict.RETRY, Reason.PROVIDER_5XX, detail="503")
    completer.reschedule(Reschedule(attempt, outcome, 1.0))
    await until(lambda: value(metrics, "receipts_writes_undone_total", statement="claim") == 1)
    assert value(metrics, "receipts_stale_acks_total") == 0
    assert value(metrics, "receipts_retries_total", reason="provider_5xx") == 0
    await until(lambda: bool(queue.records))
    assert [(r.reason, r.status, r.error) for r in queue.records] == [
        (Reason.PROVIDER_5XX, None, UNDONE_CLAIM)]


async def test_without_a_crash_a_write_refused_after_its_lease_is_a_stale_ack(setup):
    queue, completer, metrics = setup
    attempt = await claimed(queue)
    queue.flush()
    late = Attempt(attempt.job, attempt.claimed_at - 60, claim_sent_at=attempt.claimed_at - 60)
    queue.rows[attempt.job.id].lease_until = 0.0  # expired
    completer.ack(late)
    await until(lambda: value(metrics, "receipts_stale_acks_total") == 1)
    assert value(metrics, "receipts_writes_undone_total", statement="claim") == 0
    assert queue.records == []  # a stale ack is no resend: nothing for the history


async def test_two_attempts_of_one_job_are_never_written_in_one_statement():
    """The answer names jobs: written together, the late attempt would read as acked."""
    queue = FakeQueue()
    metrics = Metrics()
    completer = Completer(queue, metrics, lease_seconds=30, linger_seconds=0)
    attempt = await claimed(queue)
    late = Attempt(Job(attempt.job.id, attempt.job.order_id, token=type(attempt.job.token)(
        int=attempt.job.token.int ^ 1), attempt=1), attempt.claimed_at)
    completer.ack(late)
    completer.ack(attempt)
    completer.start()  # both are pending before the first statement
    await until(lambda: value(metrics, "receipts_stale_acks_total") == 1)
    await completer.close(timeout_seconds=5)
    assert value(metrics, "receipts_acks_total") == 1 and queue.ack_statements == 2


@contextlib.asynccontextmanager
async def watching(queue: FakeQueue, interval: float) -> AsyncIterator[tuple[Completer, Metrics]]:
    """A started completer with the durability watch (reads after *interval* s)."""
    metrics = Metrics()
    completer = Completer(queue, metrics, lease_seconds=30, linger_seconds=0,
                          watch_durability=True, watch_interval_seconds=interval)
    completer.start()
    try:
        yield completer, metrics
    finally:
        await completer.close(timeout_seconds=5)


async def test_acks_that_carry_the_wal_positions_prove_each_other_without_reads():
    queue = FakeQueue(auto_flush=False, carry_positions=True)
    async with watching(queue, 0.5) as (completer, metrics):
        queue.add(3)
        first, second, third = (await queue.claim(3)).attempts
        completer.ack(first)
        await until(lambda: queue.count(JobState.DONE) == 1)
        queue.flush()  # the WAL writer: the first ack is on disk
        completer.ack(second)  # its positions bound the first ack and prove it
        await until(lambda: value(metrics, "receipts_acks_total") == 1, timeout=0.4)
        assert queue.wal_reads == 0 and completer.unproven == 1
        queue.flush()
        completer.ack(third)
        await until(lambda: value(metrics, "receipts_acks_total") == 2, timeout=0.4)
        assert queue.wal_reads == 0
        queue.flush()
        # No ack follows the third: the watch reads on its own after its interval.
        await until(lambda: value(metrics, "receipts_acks_total") == 3, timeout=3)
        assert queue.wal_reads >= 1


async def test_carried_positions_from_a_younger_connection_send_the_write_to_its_row():
    queue = FakeQueue(carry_positions=True)  # every write flushed at once
    async with watching(queue, 0.5) as (completer, metrics):
        queue.add(2)
        first, second = (await queue.claim(2)).attempts
        completer.ack(first)
        await until(lambda: queue.count(JobState.DONE) == 1)
        # A new connection (the pool grew, or the server restarted): its positions
        # prove nothing about the first ack, which is asked about instead.
        queue.connection_since = time.monotonic()
        completer.ack(second)
        await until(lambda: value(metrics, "receipts_acks_total") >= 1, timeout=3)
        assert queue.resolves >= 1
        assert value(metrics, "receipts_writes_rewritten_total", statement="ack") == 0
    assert value(metrics, "receipts_acks_total") == 2  # the close counted the second


async def test_time_to_receipt_ends_at_the_answer_not_at_the_proof():
    queue = FakeQueue(auto_flush=False)
    async with watching(queue, 0.005) as (completer, metrics):
        queue.add(1)
        (claimed_attempt,) = (await queue.claim(1)).attempts
        attempt = Attempt(claimed_attempt.job, claimed_attempt.claimed_at, 2.0,
                          claim_sent_at=claimed_attempt.claim_sent_at)
        answered = time.monotonic()
        completer.ack(attempt)
        await until(lambda: queue.count(JobState.DONE) == 1)
        await asyncio.sleep(0.3)  # the proof waits for the WAL writer
        queue.flush()
        await until(lambda: value(metrics, "receipts_acks_total") == 1)
    observed = value(metrics, "receipts_time_to_receipt_seconds_sum")
    expected = 2.0 + answered - attempt.claimed_at
    assert expected - 0.05 <= observed <= expected + 0.05
