"""Acks that ride on the worker's next claim (``Completer.carried_by``), against the fakes.

At a trickle an ack waits up to ``ride_seconds`` for a claim to carry it, so
the two writes cost one statement. What must hold: every ack is written
exactly once and counted once, whether the claim carried it, failed before
it committed, lost its answer after it committed, or was cancelled; an ack
no claim comes for is written on its own; a busy worker's acks do not ride.
The real statement: tests/integration/test_queue.py and tests/contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from receipts.completion import Completer
from receipts.errors import DatabaseUnavailable, QueueError
from receipts.metrics import Metrics
from receipts.model import Attempt, ClaimResult, JobState
from tests.unit.fakes import FakeQueue, ScriptedDeliverer
from tests.unit.test_completion_durability import until
from tests.unit.test_worker_loop import Loop


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels or None) or 0.0


async def claimed(queue: FakeQueue, n: int) -> list[Attempt]:
    queue.add(n)
    return (await queue.claim(n)).attempts


async def acked(queue: FakeQueue, completer: Completer, n: int) -> list[Attempt]:
    """*n* jobs claimed, delivered and handed to the completer as acks."""
    attempts = await claimed(queue, n)
    for a in attempts:
        completer.ack(a)
    return attempts


def claim_with(queue: FakeQueue, limit: int = 1
               ) -> Callable[[list[tuple[uuid.UUID, uuid.UUID]]], asyncio.Future[ClaimResult]]:
    """The worker's claim as carried_by calls it: acks only when there are some."""
    return lambda acks: queue.claim(limit, **({"acks": acks} if acks else {}))  # type: ignore[return-value]


async def claiming_often(completer: Completer, queue: FakeQueue) -> None:
    """Two claims back to back: the completer sees a pod that claims often enough
    for an ack to wait for the next one (``Completer._claims_often``)."""
    for _ in range(2):
        await completer.carried_by(claim_with(queue))


async def started(queue: FakeQueue, *, often: bool = True, lease_seconds: float = 30,
                  ride_seconds: float = 30.0, **options: float) -> tuple[Completer, Metrics]:
    """A started completer at a trickle over *queue* (*often*: after two claims)."""
    metrics = Metrics()
    completer = Completer(queue, metrics, lease_seconds=lease_seconds,
                          ride_seconds=ride_seconds, **options)  # type: ignore[arg-type]
    completer.busy = False  # a trickle
    completer.start()
    if often:
        await claiming_often(completer, queue)
    return completer, metrics


@pytest.fixture
async def riding() -> AsyncIterator[tuple[FakeQueue, Completer, Metrics]]:
    queue = FakeQueue(carries_acks=True)
    completer, metrics = await started(queue)
    yield queue, completer, metrics
    await completer.close(timeout_seconds=5)


async def test_acks_at_a_trickle_ride_on_the_next_claim_and_are_counted_once(riding):
    queue, completer, metrics = riding
    attempts = await acked(queue, completer, 3)
    queue.add(2)
    result = await completer.carried_by(claim_with(queue, 2))
    assert len(result.attempts) == 2  # the claim itself is unchanged
    assert result.acked == {a.job.id for a in attempts}
    assert queue.count(JobState.DONE) == 3 and queue.riding_acks == 3
    assert queue.ack_statements == 0  # no statement of their own
    assert value(metrics, "receipts_acks_total") == 3 and completer.backlog == 0


async def test_a_stale_ack_that_rode_counts_as_stale_not_as_an_ack(riding):
    queue, completer, metrics = riding
    good, late = await claimed(queue, 2)
    queue.rows[late.job.id].token = uuid.uuid4()  # recovery gave the job to another attempt
    completer.ack(good)
    completer.ack(late)
    await completer.carried_by(claim_with(queue))
    assert value(metrics, "receipts_acks_total") == 1
    assert value(metrics, "receipts_stale_acks_total") == 1
    assert queue.rows[late.job.id].state is JobState.RUNNING


async def test_an_ack_no_claim_comes_for_is_written_on_its_own_after_the_ride_time():
    queue = FakeQueue(carries_acks=True)
    completer, _ = await started(queue, ride_seconds=0.2)
    try:
        (attempt,) = await claimed(queue, 1)
        handed = time.monotonic()
        completer.ack(attempt)
        await until(lambda: queue.count(JobState.DONE) == 1)
        waited = time.monotonic() - handed
    finally:
        await completer.close(timeout_seconds=5)
    assert queue.ack_statements == 1 and queue.riding_acks == 0
    assert waited >= 0.2  # it waited for a claim first


async def test_acks_handed_in_after_a_claim_wait_for_the_next_one(riding):
    queue, completer, metrics = riding
    first, second = await claimed(queue, 2)
    completer.ack(first)
    await completer.carried_by(claim_with(queue))
    completer.ack(second)
    await asyncio.sleep(0.05)  # the flusher looks again; the ride time is far off
    assert queue.ack_statements == 0 and queue.rows[second.job.id].state is JobState.RUNNING
    await completer.carried_by(claim_with(queue))
    assert queue.riding_acks == 2 and value(metrics, "receipts_acks_total") == 2


async def test_acks_whose_claim_failed_before_it_ran_are_written_on_their_own(riding):
    queue, completer, metrics = riding
    await acked(queue, completer, 2)
    queue.fail_claims = 1
    with pytest.raises(DatabaseUnavailable):
        await completer.carried_by(claim_with(queue))
    # Back with the flusher; it may not know whether they landed, so it asks first.
    await until(lambda: queue.count(JobState.DONE) == 2)
    await until(lambda: value(metrics, "receipts_acks_total") == 2)
    assert queue.resolves == 1 and queue.ack_statements == 1
    assert value(metrics, "receipts_stale_acks_total") == 0


async def test_acks_whose_claim_lost_its_answer_after_committing_count_once(riding):
    queue, completer, metrics = riding
    await acked(queue, completer, 3)
    queue.lose_ack_answers = 1
    with pytest.raises(DatabaseUnavailable):
        await completer.carried_by(claim_with(queue))
    assert queue.count(JobState.DONE) == 3  # they landed; the worker does not know it
    await until(lambda: value(metrics, "receipts_acks_total") == 3)
    assert queue.resolves == 1 and queue.ack_statements == 0  # resolved, not rewritten
    assert value(metrics, "receipts_stale_acks_total") == 0
    assert value(metrics, "receipts_leases_lost_total") == 0


async def test_acks_riding_on_a_claim_cancelled_at_a_stop_are_flushed_by_the_close():
    queue = FakeQueue(carries_acks=True)
    completer, metrics = await started(queue)
    attempts = await claimed(queue, 2)
    queue.claim_gate = asyncio.Event()  # the next claim hangs
    for a in attempts:
        completer.ack(a)
    claim = asyncio.create_task(completer.carried_by(claim_with(queue)))
    await until(lambda: queue.claims_waiting == 1)
    claim.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await claim
    await completer.close(timeout_seconds=5)
    assert queue.count(JobState.DONE) == 2
    assert value(metrics, "receipts_acks_total") == 2 and completer.backlog == 0


async def test_a_close_waits_for_a_claim_that_carries_acks():
    queue = FakeQueue(carries_acks=True)
    completer, metrics = await started(queue)
    await acked(queue, completer, 2)
    queue.fail_claims = 1  # the carrying claim fails after the close began
    gate = asyncio.Event()

    async def late_claim(acks: list[tuple[uuid.UUID, uuid.UUID]]) -> ClaimResult:
        await gate.wait()
        return await queue.claim(1, acks=acks)

    claim = asyncio.create_task(completer.carried_by(late_claim))
    await asyncio.sleep(0)
    closing = asyncio.create_task(completer.close(timeout_seconds=5))
    await asyncio.sleep(0.05)
    assert not closing.done()  # the riders are out: the flusher may not end yet
    gate.set()
    with pytest.raises(DatabaseUnavailable):
        await claim
    await closing
    assert queue.count(JobState.DONE) == 2 and value(metrics, "receipts_acks_total") == 2


async def test_a_busy_worker_writes_its_acks_on_their_own(riding):
    queue, completer, _ = riding
    completer.busy = True  # claims come back full: the saturated path is unchanged
    (attempt,) = await claimed(queue, 1)
    completer.ack(attempt)
    result = await completer.carried_by(claim_with(queue))
    assert result.acked is None and queue.riding_acks == 0
    await until(lambda: queue.ack_statements == 1)


async def test_a_queue_that_cannot_carry_acks_gets_none():
    queue = FakeQueue()  # carries_acks off, as a queue from before riding acks
    completer, _ = await started(queue, often=False, trickle_linger_seconds=0.0)
    try:
        (attempt,) = await claimed(queue, 1)
        completer.ack(attempt)
        await until(lambda: queue.ack_statements == 1)  # at once: nothing to wait for
        result = await completer.carried_by(claim_with(queue))
        assert result.acked is None
    finally:
        await completer.close(timeout_seconds=5)


async def test_a_worker_at_a_trickle_writes_its_acks_on_its_claims():
    queue, deliverer = FakeQueue(carries_acks=True), ScriptedDeliverer()
    async with Loop(queue, deliverer, poll_interval_seconds=0.05) as loop:
        for _ in range(10):  # one job at a time: each claim comes back short
            queue.add(1)
            await asyncio.sleep(0.02)
        await until(lambda: loop.value("receipts_acks_total") == 10)
    assert queue.count(JobState.DONE) == 10
    # The claims (short ones and empty polls alike) carried the acks, within the
    # ride time; a very slow loop may have written one or two on their own.
    assert queue.riding_acks >= 8 and queue.ack_statements <= 2
    assert queue.riding_acks + queue.ack_statements >= 1


async def test_acks_whose_claim_was_refused_are_written_on_their_own_not_carried_again(riding):
    queue, completer, metrics = riding
    await acked(queue, completer, 2)

    async def refused(acks: list[tuple[uuid.UUID, uuid.UUID]]) -> ClaimResult:
        assert acks
        raise QueueError("the statement was refused")  # it surely did not commit

    with pytest.raises(QueueError):
        await completer.carried_by(refused)
    # The next claim carries nothing: were the acks the cause, claiming must go on.
    result = await completer.carried_by(claim_with(queue))
    assert result.acked is None
    await until(lambda: value(metrics, "receipts_acks_total") == 2)
    assert queue.ack_statements == 1 and queue.resolves == 0  # not in doubt: no question


def claimed_ago(attempt: Attempt, seconds: float) -> Attempt:
    """*attempt* as if its claim had been sent *seconds* ago (its lease that much older)."""
    sent = time.monotonic() - seconds
    return dataclasses.replace(attempt, claim_sent_at=sent, claimed_at=sent)


async def seconds_to_land(queue: FakeQueue, completer: Completer, attempt: Attempt, *,
                          done: int) -> float:
    """Hand in *attempt*'s ack; seconds until the queue holds *done* done rows."""
    handed = time.monotonic()
    completer.ack(attempt)
    await until(lambda: queue.count(JobState.DONE) == done, timeout=2)
    return time.monotonic() - handed


async def test_an_ack_never_waits_for_a_claim_past_half_the_lease_it_has_left():
    """A short lease with a small margin (a 1 s lease, the answer 0.8 s after the
    claim): the ack is written within 0.1 s, not after the 30 s ride time."""
    queue = FakeQueue(carries_acks=True, lease_seconds=1.0)
    completer, _ = await started(queue, lease_seconds=1.0)
    try:
        (attempt,) = await claimed(queue, 1)
        waited = await seconds_to_land(queue, completer, claimed_ago(attempt, 0.8), done=1)
    finally:
        await completer.close(timeout_seconds=5)
    assert waited < 0.15 and queue.ack_statements == 1


async def test_an_ack_handed_in_during_a_linger_is_not_held_past_its_own_lease_cap():
    """The flusher waits for a claim to carry a fresh ack (30 s of lease left); an
    ack with 0.2 s left arrives meanwhile: both are written within 0.1 s of it, not
    when the first one's wait ends."""
    queue = FakeQueue(carries_acks=True, lease_seconds=1.0)
    completer, _ = await started(queue, lease_seconds=30.0)
    try:
        fresh, late = await claimed(queue, 2)
        completer.ack(fresh)  # may wait up to the 30 s ride time: the flusher lingers
        await asyncio.sleep(0.05)
        assert queue.count(JobState.DONE) == 0
        # 0.2 s of its lease left
        waited = await seconds_to_land(queue, completer, claimed_ago(late, 29.8), done=2)
    finally:
        await completer.close(timeout_seconds=5)
    assert waited < 0.15 and queue.ack_statements == 1


async def test_a_pod_that_claims_seldom_writes_its_acks_without_waiting_for_a_claim():
    queue = FakeQueue(carries_acks=True)
    completer, _ = await started(queue, often=False, trickle_linger_seconds=0.0)
    try:
        await completer.carried_by(claim_with(queue))  # one claim: no gap known yet
        (attempt,) = await claimed(queue, 1)
        completer.ack(attempt)
        await until(lambda: queue.ack_statements == 1, timeout=2)  # not after 30 s
    finally:
        await completer.close(timeout_seconds=5)


async def test_the_claim_that_charges_the_shared_bucket_row_carries_no_acks():
    """Without a waker's shares every claim locks the fleet's bucket row: an ack in
    it could keep that row locked while it waits for an acked row's lock."""
    queue, deliverer = FakeQueue(carries_acks=True, rate=100.0), ScriptedDeliverer()
    async with Loop(queue, deliverer, poll_interval_seconds=0.05,
                    rate_limit_per_second=100.0) as loop:
        for _ in range(5):
            queue.add(1)
            await asyncio.sleep(0.02)
        await until(lambda: loop.value("receipts_acks_total") == 5)
    assert queue.riding_acks == 0 and queue.ack_statements >= 1
