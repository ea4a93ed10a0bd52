"""The claim loop with adaptive concurrency, against in-memory fakes: claims take no more
than min(slots, limit) - in flight, the limit starts at the fleet's mean (or the floor),
grows on calm answers and shrinks on overload; off, nothing changes."""

from __future__ import annotations

from receipts.model import JobState, Outcome, Reason, Verdict
from tests.unit.fakes import FakeQueue, ScriptedDeliverer
from tests.unit.test_worker_loop import Loop, until


class FleetQueue(FakeQueue):
    """A fake queue whose live heartbeat rows report a mean limit of *mean*."""

    def __init__(self, mean: float | None) -> None:
        super().__init__()
        self.mean = mean

    async def fleet_concurrency_limit(self) -> tuple[float | None, int]:
        return self.mean, 0 if self.mean is None else 3


async def test_a_new_pod_starts_at_the_floor_and_claims_within_its_limit():
    queue, deliverer = FakeQueue(), ScriptedDeliverer()
    queue.add(20)
    deliverer.release.clear()
    async with Loop(queue, deliverer, concurrency=8, adaptive_concurrency=True) as loop:
        await until(lambda: deliverer.in_flight == 1)
        assert loop.worker.concurrency_limit() == 1
        assert loop.value("receipts_concurrency_limit") == 1
        assert all(limit <= 1 for limit, _ in queue.claims)
        deliverer.release.set()
        await until(lambda: queue.count(JobState.DONE) == 20)
    assert deliverer.most_in_flight == 1  # 20 answers: less than one window to grow


async def test_a_new_pod_starts_at_the_fleets_mean_limit():
    queue, deliverer = FleetQueue(mean=3.4), ScriptedDeliverer()
    queue.add(20)
    deliverer.release.clear()
    async with Loop(queue, deliverer, concurrency=8, adaptive_concurrency=True) as loop:
        await until(lambda: deliverer.in_flight == 3)
        assert loop.worker.concurrency_limit() == 3
        # It joined the fleet's share: it does not search, and it shares its increase
        # with the three pods the heartbeat rows report (no waker announcement here).
        assert loop.worker.capacity is not None and not loop.worker.capacity.searching
        assert loop.worker.capacity_peers() == 4
        deliverer.release.set()
    assert deliverer.most_in_flight == 3


async def test_calm_answers_raise_the_limit_and_overload_brings_it_down():
    queue, deliverer = FleetQueue(mean=2), ScriptedDeliverer()
    queue.add(2000)
    overloaded = False

    def answer(_job: object) -> Outcome:
        if overloaded:
            return Outcome(Verdict.RETRY, Reason.PROVIDER_5XX, 503)
        return Outcome(Verdict.DELIVERED, Reason.DELIVERED, 201)

    deliverer.answer = answer
    # A round trip of 5 ms, not 0: an instant answer's round trip is the event loop's
    # scheduling noise, which on a busy machine reads as a provider slowing down (no
    # calm window, no increase).
    deliverer.latency_seconds = 0.005
    async with Loop(queue, deliverer, concurrency=8, adaptive_concurrency=True,
                    retry_base_seconds=5, retry_cap_seconds=5) as loop:
        await until(lambda: loop.value("receipts_concurrency_limit") >= 4, timeout=30)
        overloaded = True
        await until(lambda: loop.value("receipts_concurrency_limit") == 1, timeout=30)
        assert loop.value("receipts_concurrency_limit_decreases_total",
                          signal="overload") >= 2
    assert deliverer.most_in_flight <= 8
    assert loop.worker.max_overclaim == 0


async def test_off_the_slots_alone_bound_deliveries_and_no_limit_is_reported():
    queue, deliverer = FleetQueue(mean=1), ScriptedDeliverer()
    queue.add(20)
    deliverer.release.clear()
    async with Loop(queue, deliverer, concurrency=4) as loop:
        await until(lambda: deliverer.in_flight == 4)
        assert loop.worker.concurrency_limit() is None
        assert loop.value("receipts_concurrency_limit") == 0
        deliverer.release.set()
        await until(lambda: queue.count(JobState.DONE) == 20)


async def test_a_floor_above_the_slots_is_lowered_to_them_and_said(caplog):
    queue, deliverer = FakeQueue(), ScriptedDeliverer()
    queue.add(4)
    async with Loop(queue, deliverer, concurrency=2, adaptive_concurrency=True,
                    adaptive_concurrency_floor=8) as loop:
        await until(lambda: queue.count(JobState.DONE) == 4)
        assert loop.worker.capacity is not None and loop.worker.capacity.policy.floor == 2
    (event,) = [r for r in caplog.records if r.getMessage() == "concurrency_floor_above_slots"]
    assert (event.floor, event.applied, event.slots) == (8, 2, 2)  # type: ignore[attr-defined]
