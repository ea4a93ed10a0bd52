"""The claim loop against in-memory fakes: slots, sleeps, outages, probes (milliseconds each)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest

from receipts.completion import Completer
from receipts.flow import FlowPolicy, ProviderGate
from receipts.metrics import Metrics
from receipts.model import FlowState, Job, JobState, Outcome, PauseReason, Reason, Verdict
from receipts.ratelimit import TokenBucket
from receipts.settings import Settings, load_settings
from receipts.worker import Worker
from tests.unit.fakes import FakeQueue, ScriptedDeliverer, outcome


def settings(**overrides: object) -> Settings:
    base: dict[str, object] = {
        "database_url": "postgresql://u@127.0.0.1:1/db", "provider_url": "http://127.0.0.1:9/r",
        "concurrency": 4, "poll_interval_seconds": 0.02, "retry_base_seconds": 0.01,
        "retry_cap_seconds": 0.02, "outage_pause_seconds": 0.05, "auth_pause_seconds": 0.05,
        "listen_notify": False, "queue_stats_interval_seconds": 60, "metrics_port": 0,
        "lease_seconds": 30, "delivery_timeout_seconds": 1,
    }
    return load_settings(**(base | overrides))


async def until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


class Loop:
    def __init__(self, queue: FakeQueue, deliverer: ScriptedDeliverer, *,
                 gate: ProviderGate | None = None, **overrides: object):
        self.metrics = Metrics()
        self.worker = Worker(settings(**overrides), queue, deliverer, self.metrics, gate=gate)
        self.task: asyncio.Task[None] | None = None

    def value(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels or None) or 0.0

    async def __aenter__(self) -> Loop:
        self.task = asyncio.create_task(self.worker.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.worker.stop()
        assert self.task is not None
        await asyncio.wait_for(self.task, 5)


async def test_claims_never_ask_for_more_than_the_free_slots_and_the_prefetch():
    queue, deliverer = FakeQueue(), ScriptedDeliverer()
    queue.add(50)
    deliverer.release.clear()
    async with Loop(queue, deliverer) as loop:
        await until(lambda: deliverer.in_flight == 4)
        deliverer.release.set()
        await until(lambda: queue.count(JobState.DONE) == 50)
    assert loop.worker.max_overclaim == 0
    assert deliverer.most_in_flight == 4  # jobs claimed ahead wait for a slot
    assert all(limit <= 4 + 2 for limit, _ in queue.claims)  # at most half the slots ahead
    assert loop.value("receipts_acks_total") == 50


async def test_a_slot_is_free_as_soon_as_its_outcome_is_known_not_when_its_ack_lands():
    queue, deliverer = FakeQueue(ack_gate=asyncio.Event()), ScriptedDeliverer()
    queue.add(12)
    async with Loop(queue, deliverer, concurrency=4) as loop:
        # Every job is delivered before any ack lands: 12 deliveries through 4 slots.
        await until(lambda: len(deliverer.calls) == 12)
        assert queue.count(JobState.DONE) == 0
        await until(lambda: queue.acks_waiting == 1)
        assert queue.ack_gate is not None
        queue.ack_gate.set()
        await until(lambda: queue.count(JobState.DONE) == 12)
    assert loop.worker.max_overclaim == 0 and deliverer.most_in_flight <= 4
    assert loop.value("receipts_acks_total") == 12


async def test_nothing_is_claimed_while_outcome_writes_fall_behind_by_a_set_of_slots():
    queue, deliverer = FakeQueue(ack_gate=asyncio.Event()), ScriptedDeliverer()
    queue.add(40)
    loop = Loop(queue, deliverer, concurrency=4)
    loop.worker.completer.max_batch = 4  # the backlog limit: max(slots, batch) = 4
    async with loop:
        await until(lambda: queue.acks_waiting == 1 and loop.worker.completer.backlog == 4)
        for _ in range(100):  # the fake answers at once: give the loop every chance
            await asyncio.sleep(0)
        assert len(deliverer.calls) == 4 and len(queue.claims) == 1
        assert queue.ack_gate is not None
        queue.ack_gate.set()
        await until(lambda: queue.count(JobState.DONE) == 40)
    assert loop.value("receipts_acks_total") == 40


async def test_outcome_writes_of_a_busy_worker_share_a_statement_per_linger():
    queue = FakeQueue()
    order = {job_id: n for n, job_id in enumerate(queue.add(400))}

    async def spread(job_id: object) -> None:  # answers trickle in, ~4 per ms
        await asyncio.sleep(order[job_id] % 40 * 0.00025)  # type: ignore[index]

    async with Loop(queue, GatedDeliverer(spread), concurrency=40) as loop:
        await until(lambda: queue.count(JobState.DONE) == 400)
    # Written as they came, these 400 answers took ~200 statements; lingering, ~12.
    assert queue.ack_statements <= 40
    assert loop.value("receipts_acks_total") == 400


async def test_a_full_batch_ends_the_linger_at_once():
    queue, deliverer = FakeQueue(), ScriptedDeliverer()
    queue.add(8)
    loop = Loop(queue, deliverer, concurrency=8)
    loop.worker.completer.max_batch = 4
    loop.worker.completer.linger_seconds = 30.0
    async with loop:
        await until(lambda: queue.count(JobState.DONE) == 8)  # two full batches
    assert queue.ack_statements == 2


@pytest.mark.parametrize("ending", ["stop", "queue empty"])
async def test_a_stop_or_an_empty_queue_ends_the_linger_at_once(ending):
    queue = FakeQueue()
    queue.add(1)
    (attempt,) = (await queue.claim(1)).attempts
    completer = Completer(queue, Metrics(), lease_seconds=30, linger_seconds=30.0)
    completer.start()
    completer.ack(attempt)
    await until(lambda: completer._task is not None and queue.ack_statements == 0
                and completer.backlog == 1)
    await asyncio.sleep(0)  # the flusher is lingering now
    if ending == "stop":
        await asyncio.wait_for(completer.close(timeout_seconds=5), 5)
    else:
        completer.busy = False  # the worker's last claim came back short
        await until(lambda: queue.count(JobState.DONE) == 1)
        await completer.close(timeout_seconds=5)
    assert queue.count(JobState.DONE) == 1 and queue.ack_statements == 1


async def test_a_trickle_of_outcomes_shares_one_statement_per_linger():
    queue = FakeQueue()
    attempts = []
    for _ in range(30):
        queue.add(1)
        attempts += (await queue.claim(1)).attempts
    completer = Completer(queue, Metrics(), lease_seconds=30, linger_seconds=0.01,
                          trickle_linger_seconds=0.2)
    completer.busy = False  # claims come back short: a trickle, not a backlog
    completer.start()
    try:
        started = time.monotonic()
        for attempt in attempts:  # 30 outcomes over ~0.3 s: one every 10 ms
            completer.ack(attempt)
            await asyncio.sleep(0.01)
        await until(lambda: queue.count(JobState.DONE) == 30)
        elapsed = time.monotonic() - started
    finally:
        await completer.close(timeout_seconds=5)
    # One statement per outcome would be 30; one per 0.2 s linger is a handful.
    assert queue.ack_statements <= elapsed / 0.2 + 2


async def test_an_outcome_after_a_quiet_spell_is_written_at_once():
    queue = FakeQueue()
    queue.add(2)
    first, second = (await queue.claim(2)).attempts
    completer = Completer(queue, Metrics(), lease_seconds=30, trickle_linger_seconds=30.0)
    completer.busy = False
    completer.start()
    try:
        completer.ack(first)  # nothing written for ages: no wait
        await until(lambda: queue.count(JobState.DONE) == 1, timeout=2)
        completer._last_write -= 30.0  # as if 30 s (a whole linger) had passed since
        completer.ack(second)
        await until(lambda: queue.count(JobState.DONE) == 2, timeout=2)
    finally:
        await completer.close(timeout_seconds=5)
    assert queue.ack_statements == 2


async def test_a_busy_queue_claims_for_a_tenth_of_the_slots_not_for_each_one(monkeypatch):
    import receipts.worker

    monkeypatch.setattr(receipts.worker, "CLAIM_LINGER_SECONDS", 30.0)
    monkeypatch.setattr(receipts.worker, "PREFETCH_MAX_SHARE", 0)  # the linger alone
    queue = FakeQueue()
    queue.add(40)
    gates = {job_id: asyncio.Event() for job_id in queue.rows}

    async def answer(job_id: object) -> None:
        await gates[job_id].wait()  # type: ignore[index]

    deliverer = GatedDeliverer(answer)
    async with Loop(queue, deliverer, concurrency=20, claim_batch_max=20):
        await until(lambda: len(deliverer.started) == 20)  # one full claim
        first, second = deliverer.started[:2]
        gates[first].set()
        await until(lambda: deliverer.finished == 1)
        for _ in range(100):  # one free slot of twenty: the loop waits for a second
            await asyncio.sleep(0)
        assert len(queue.claims) == 1
        gates[second].set()
        await until(lambda: len(queue.claims) == 2)
        assert queue.claims[1] == (2, 2)
        for gate in gates.values():
            gate.set()
        await until(lambda: queue.count(JobState.DONE) == 40)


class GatedDeliverer:
    """Delivers when *wait(job_id)* returns; records start order and finishes."""

    def __init__(self, wait: Callable[[object], Awaitable[None]]) -> None:
        self.wait = wait
        self.started: list[object] = []
        self.finished = 0

    async def deliver(self, job: Job) -> Outcome:
        self.started.append(job.id)
        await self.wait(job.id)
        self.finished += 1
        return outcome(200)

    async def aclose(self) -> None:
        return None


async def test_a_short_claim_sleeps_a_jittered_poll_interval_that_a_notify_cuts_short():
    queue = FakeQueue()
    worker = Worker(settings(poll_interval_seconds=10), queue, ScriptedDeliverer(), Metrics())
    seconds, wakeable = await worker.step(4)  # type: ignore[misc]
    assert 7.5 <= seconds <= 12.5 and wakeable
    queue.add(4)
    assert await worker.step(4) == (0.0, False)  # a full claim: claim again at once


async def test_a_database_outage_backs_off_then_resumes_by_itself():
    queue, deliverer = FakeQueue(fail_claims=5), ScriptedDeliverer()
    queue.add(3)
    async with Loop(queue, deliverer) as loop:
        assert not loop.worker.is_ready()
        await until(lambda: queue.count(JobState.DONE) == 3)
        assert loop.worker.is_ready()
    assert loop.value("receipts_db_errors_total", statement="claim") == 5
    assert loop.value("receipts_database_ready") == 1


async def test_an_outage_pauses_claiming_refunds_attempts_and_a_probe_resumes():
    queue = FakeQueue()
    queue.add(40)
    down = True
    deliverer = ScriptedDeliverer(lambda job: outcome(503 if down else 200))
    async with Loop(queue, deliverer) as loop:
        await until(lambda: queue.pause_reason is PauseReason.OUTAGE)
        await until(lambda: loop.value("receipts_provider_probes_total", result="failed") >= 2)
        # Paused: only the slots in flight at detection and probes (each at most the
        # free slots, 4 here, and probe_jobs) went out.
        assert len(deliverer.calls) <= 4 + 4 + 3 * 4
        assert max(r.attempts for r in queue.rows.values()) <= 1
        assert loop.value("receipts_provider_paused", reason="outage") == 1
        down = False
        await until(lambda: queue.count(JobState.DONE) == 40)
    assert queue.count(JobState.FAILED) == 0
    assert queue.resumed == 1 and queue.pause_reason is None
    assert loop.value("receipts_provider_paused", reason="outage") == 0
    assert loop.value("receipts_provider_probes_total", result="resumed") == 1
    lengths = [s for r, s in queue.pauses if r is PauseReason.OUTAGE]
    assert lengths[1] > lengths[0] * 1.5  # a failed probe doubled the pause


async def test_a_409_in_progress_does_not_use_up_attempts():
    queue = FakeQueue(max_attempts=5)
    (job_id,) = queue.add(1)
    answers = iter([409] * 10 + [200])
    deliverer = ScriptedDeliverer(lambda job: outcome(next(answers)))
    async with Loop(queue, deliverer):
        await until(lambda: queue.count(JobState.DONE) == 1)
    assert len(deliverer.calls) == 11
    assert queue.rows[job_id].in_progress_count == 10


async def test_a_fleet_pause_set_by_another_pod_stops_this_pods_claims():
    queue, deliverer = FakeQueue(), ScriptedDeliverer()
    queue.add(5)
    await queue.extend_pause(PauseReason.RETRY_AFTER, 0.3)
    started = time.monotonic()
    async with Loop(queue, deliverer) as loop:
        await until(lambda: queue.count(JobState.DONE) == 5)
        # A Retry-After pause ends when its time is up: no probe needed.
        assert loop.value("receipts_provider_probes_total", result="resumed") == 0
    assert time.monotonic() - started >= 0.3 and len(deliverer.calls) == 5


@pytest.mark.parametrize("status", [401, 403])
async def test_rejected_credentials_pause_the_fleet_without_failing_jobs(status):
    queue = FakeQueue(max_attempts=2)
    queue.add(20)
    ok = False
    deliverer = ScriptedDeliverer(lambda job: outcome(200 if ok else status))
    async with Loop(queue, deliverer) as loop:
        await until(lambda: loop.value("receipts_provider_probes_total", result="failed") >= 3)
        assert queue.count(JobState.FAILED) == 0
        ok = True
        await until(lambda: queue.count(JobState.DONE) == 20)
    assert next(r for r, _ in queue.pauses) is PauseReason.AUTH


async def test_an_ack_whose_answer_was_lost_counts_as_an_ack_not_a_stale_one():
    queue, deliverer = FakeQueue(lose_ack_answers=2), ScriptedDeliverer()
    queue.add(10)
    async with Loop(queue, deliverer) as loop:
        await until(lambda: queue.count(JobState.DONE) == 10)
        await until(lambda: loop.value("receipts_acks_total") == 10)
    assert loop.value("receipts_stale_acks_total") == 0
    assert loop.value("receipts_leases_lost_total") == 0
    # One or two ack statements lost their answer (batching decides how many ran).
    lost_answers = 2 - queue.lose_ack_answers
    assert lost_answers >= 1
    assert loop.value("receipts_db_errors_total", statement="ack") == lost_answers


async def test_a_wedged_claim_fails_the_watchdog_and_stop_still_returns():
    queue, deliverer = FakeQueue(hang_claims=True), ScriptedDeliverer()
    loop = Loop(queue, deliverer)
    loop.worker.watchdog_seconds = 0.2
    async with loop:
        await until(lambda: not loop.worker.is_alive())
        assert not loop.worker.is_ready()
        started = time.monotonic()
    assert time.monotonic() - started < 3  # the hung claim was cancelled at stop


async def test_attempt_history_records_retries_and_skips_a_first_try_delivery():
    queue = FakeQueue()
    first, second = queue.add(2)
    answers = {first: iter([200]), second: iter([503, 200])}
    deliverer = ScriptedDeliverer(lambda job: outcome(next(answers[job.id])))
    async with Loop(queue, deliverer):
        await until(lambda: queue.count(JobState.DONE) == 2)
        await until(lambda: len(queue.records) == 2)
    assert [(r.job_id, r.attempt, r.reason, r.status) for r in queue.records] == [
        (second, 1, "provider_5xx", 503), (second, 2, "delivered", 200)]
    assert all(r.worker and r.duration_seconds is not None for r in queue.records)


async def test_admission_control_is_off_unless_asked_for():
    queue, deliverer = FakeQueue(), ScriptedDeliverer()
    queue.add(20)
    async with Loop(queue, deliverer) as loop:
        await until(lambda: queue.count(JobState.DONE) == 20)
    assert loop.worker.admission is None and queue.probes == 0


async def test_admission_control_samples_commit_probes_while_the_worker_drains():
    queue, deliverer = FakeQueue(), ScriptedDeliverer()
    queue.add(200)
    async with Loop(queue, deliverer, concurrency=8, admission_control=True) as loop:
        await until(lambda: queue.probes >= 2)
        await until(lambda: queue.count(JobState.DONE) == 200)
    assert loop.worker.admission is not None
    assert loop.value("receipts_db_statement_duration_seconds_count",
                      statement="commit_probe") == queue.probes
    assert loop.value("receipts_claim_rate_limit") > 0


async def test_a_commit_probe_the_database_refuses_turns_admission_control_off(caplog):
    from receipts.errors import QueueError

    queue, deliverer = FakeQueue(), ScriptedDeliverer()
    queue.probe_seconds = [QueueError("InsufficientPrivilege: permission denied")]
    queue.add(20)
    async with Loop(queue, deliverer, admission_control=True) as loop:
        await until(lambda: loop.worker.admission is None, timeout=10)
        await until(lambda: queue.count(JobState.DONE) == 20)
        queue.add(20)  # claims go on without the limiter
        await until(lambda: queue.count(JobState.DONE) == 40)
    assert queue.probes == 3
    assert loop.value("receipts_claim_rate_limit") == 0
    assert loop.value("receipts_db_errors_total", statement="commit_probe") == 3
    assert any(r.msg == "admission_control_off" for r in caplog.records)


# ------------------------------------------------- systemic rejection, probe cadence

def rejected(text: str = "forced status 400", status: int = 400) -> Outcome:
    return Outcome(Verdict.PERMANENT, Reason.REJECTED, status, None, f"{status} {text}")


#: The rules at a tenth of their default times, so that a test takes a fraction of a second.
FAST = FlowPolicy(bracket_seconds=0.15, rejecting_after_seconds=0.3, held_retry_seconds=0.05,
                  probe_interval_seconds=0.1, outage_pause_seconds=0.5)


async def test_a_provider_rejecting_everything_pauses_the_fleet_and_fails_no_job():
    queue = FakeQueue(max_attempts=2)
    queue.add(40)
    accepting = False
    deliverer = ScriptedDeliverer(lambda job: outcome(201) if accepting else rejected())
    async with Loop(queue, deliverer, concurrency=8, gate=ProviderGate(FAST)) as loop:
        await until(lambda: queue.pause_reason is PauseReason.REJECTING)
        await until(lambda: loop.value("receipts_provider_probes_total", result="failed") >= 2)
        await until(lambda: loop.worker.gate.held == 0 and not loop.worker.completer.backlog)
        assert queue.count(JobState.FAILED) == 0
        assert max(r.attempts for r in queue.rows.values()) == 0  # every attempt given back
        assert all(r.last_error is None or r.last_error.startswith("held rejection: ")
                   for r in queue.rows.values())
        assert loop.value("receipts_provider_paused", reason="rejecting") == 1
        accepting = True
        await until(lambda: queue.count(JobState.DONE) == 40)
    assert queue.count(JobState.FAILED) == 0 and queue.pause_reason is None
    assert loop.value("receipts_failures_total", reason="rejected") == 0
    assert loop.value("receipts_retries_total", reason="rejected") >= 8
    assert queue.probe_outcomes[-1] == "delivered"


async def test_a_few_bad_orders_among_good_ones_fail_after_a_confirmation():
    queue = FakeQueue()
    ids = queue.add(60)
    bad = set(ids[5:60:20])  # 3 of 60, each with good orders sent before and after it
    deliverer = ScriptedDeliverer(
        lambda job: rejected("order cannot receive a receipt", 422) if job.id in bad
        else outcome(200))
    async with Loop(queue, deliverer, concurrency=8) as loop:
        await until(lambda: queue.count(JobState.DONE) == 57)
        await until(lambda: queue.count(JobState.FAILED) == 3, timeout=5)
    assert {r.id for r in queue.rows.values() if r.state is JobState.FAILED} == bad
    # Each bad order was sent twice (the confirmation, in the same lease), no other job.
    assert queue.pauses == [] and len(deliverer.calls) == 63
    assert sorted(str(j.id) for j in deliverer.calls if j.id in bad) == sorted(
        str(i) for i in bad for _ in range(2))
    assert loop.value("receipts_failures_total", reason="rejected") == 3
    assert max(r.attempts for r in queue.rows.values()) == 1


async def test_a_lone_bad_order_in_a_quiet_queue_is_held_not_failed():
    """No other order is accepted around it: nothing says the order, not the provider,
    is at fault. It goes back to ready, its attempt given back, again and again."""
    queue = FakeQueue()
    (lone,) = queue.add(1)
    deliverer = ScriptedDeliverer(lambda job: rejected("order cannot receive a receipt", 422))
    async with Loop(queue, deliverer, gate=ProviderGate(FAST)) as loop:
        await until(lambda: len(deliverer.calls) >= 3)
        await until(lambda: loop.worker.gate.held == 0)
    row = queue.rows[lone]
    assert row.state is JobState.READY and row.attempts == 0
    assert row.last_error == "held rejection: 422 order cannot receive a receipt"
    assert queue.pauses == []  # one job is never a systemic rejection
    assert loop.value("receipts_failures_total", reason="rejected") == 0


async def test_an_idle_pod_gives_held_rejections_back_instead_of_failing_them():
    """A trickle: each job is alone in flight when answered (the old rule failed such
    rejections at once); the provider has turned to rejecting everything."""
    queue = FakeQueue()
    deliverer = ScriptedDeliverer(lambda job: rejected("bad request", 400))
    async with Loop(queue, deliverer, gate=ProviderGate(FAST)) as loop:
        for _ in range(12):
            queue.add(1)
            await until(lambda: loop.worker.gate.held == 0 and not deliverer.in_flight)
        await until(lambda: queue.pause_reason is PauseReason.REJECTING)
    assert queue.count(JobState.FAILED) == 0
    assert all(r.attempts == 0 for r in queue.rows.values())


async def test_a_long_pause_is_probed_every_interval_and_resumes_as_soon_as_the_provider_is_back():
    policy = FlowPolicy(outage_pause_seconds=60, pause_max_seconds=600,
                        probe_interval_seconds=0.05)
    queue = FakeQueue()
    queue.add(20)
    down = True
    deliverer = ScriptedDeliverer(lambda job: outcome(503 if down else 200))
    async with Loop(queue, deliverer, gate=ProviderGate(policy)) as loop:
        await until(lambda: loop.value("receipts_provider_probes_total", result="failed") >= 5)
        assert queue.paused_until - time.monotonic() > 100  # the pause itself has grown
        down = False
        back = time.monotonic()
        await until(lambda: queue.resumed == 1)
        assert time.monotonic() - back < 1.0  # not the minutes left of the pause
        await until(lambda: queue.count(JobState.DONE) == 20)
    assert queue.count(JobState.FAILED) == 0


async def test_an_operators_pause_is_honoured_without_probes_and_ends_at_its_time():
    queue, deliverer = FakeQueue(), ScriptedDeliverer()
    queue.add(3)
    queue.pause_reason, queue.paused_until = PauseReason.MANUAL, time.monotonic() + 0.3
    async with Loop(queue, deliverer) as loop:
        await until(lambda: loop.value("receipts_provider_paused", reason="manual") == 1)
        await until(lambda: queue.count(JobState.DONE) == 3)
    assert deliverer.calls and len(deliverer.calls) == 3
    assert loop.value("receipts_provider_probes_total", result="resumed") == 0


# ------------------------------------------------------------ prefetch


class Prefetching:
    """Four slots held by gated deliveries, and two jobs claimed ahead of them.

    The round-trip averages are primed so that the prefetch wants half the
    slots (a claim of 10 ms against deliveries of 20 ms: 2 × 4 × 0.5 = 4, capped
    at 2); the first claim fills the slots, the second claims two ahead.
    """

    def __init__(self, jobs: int = 20, **overrides: object) -> None:
        self.queue = FakeQueue()
        self.ids = self.queue.add(jobs)
        self.gates = {job_id: asyncio.Event() for job_id in self.ids}

        async def answer(job_id: object) -> None:
            await self.gates[job_id].wait()  # type: ignore[index]

        self.deliverer = GatedDeliverer(answer)
        self.loop = Loop(self.queue, self.deliverer, concurrency=4, **overrides)
        self.worker = self.loop.worker
        self.worker._claim_seconds, self.worker._delivery_seconds_avg = 0.010, 0.020

    async def start(self) -> None:
        await self.loop.__aenter__()
        await until(lambda: len(self.deliverer.started) == 4 and len(self.worker._prefetched) == 2)
        assert self.queue.claims[:2] == [(4, 4), (2, 2)]
        assert self.loop.value("receipts_inflight_deliveries") == 6  # the two ahead count
        assert self.worker.max_overclaim == 0

    def ahead(self) -> list[uuid.UUID]:
        return [a.job.id for a in self.worker._prefetched]

    def release(self, n: int = 1) -> None:
        for job_id in self.deliverer.started[:n]:
            self.gates[job_id].set()  # type: ignore[index]


async def test_a_slot_freed_during_a_claim_starts_a_job_claimed_ahead_without_waiting_for_it():
    p = Prefetching()
    await p.start()
    ahead = p.ahead()
    p.queue.claim_gate = asyncio.Event()  # every claim from now on waits
    p.release(1)
    await until(lambda: len(p.deliverer.started) == 5 and p.queue.claims_waiting == 1)
    # The claim loop is inside a claim (refilling the prefetch) when the next slot frees.
    p.gates[p.deliverer.started[1]].set()  # type: ignore[index]
    await until(lambda: len(p.deliverer.started) == 6)
    assert p.deliverer.started[4:] == ahead  # oldest first
    assert len(p.queue.claims) == 2 and p.queue.claims_waiting == 1  # no claim came back
    assert p.deliverer.finished == 2 and len(p.worker._inflight) == 4  # never beyond the slots
    p.queue.claim_gate.set()
    for gate in p.gates.values():
        gate.set()
    await until(lambda: p.queue.count(JobState.DONE) == 20)
    await p.loop.__aexit__()
    assert p.worker.max_overclaim == 0 and p.queue.refunds == 0


async def test_jobs_claimed_ahead_go_back_unsent_when_the_fleet_pauses():
    p = Prefetching()
    await p.start()
    ahead = p.ahead()
    for job_id in ahead:
        p.queue.rows[job_id].last_error = "an earlier attempt's 503"
    # Another pod paused the fleet (the pod learns it from a statement's flow state).
    p.queue.pause_reason, p.queue.paused_until = PauseReason.MANUAL, time.monotonic() + 60
    p.worker.gate.observe_flow(FlowState(PauseReason.MANUAL, 60.0))
    p.release(1)  # a slot frees: nothing may start while paused
    await until(lambda: all(p.queue.rows[j].state is JobState.READY for j in ahead))
    assert len(p.deliverer.started) == 4
    assert [(p.queue.rows[j].attempts, p.queue.rows[j].last_error) for j in ahead] == [
        (0, "an earlier attempt's 503")] * 2
    assert p.loop.value("receipts_retries_total", reason="internal_error") == 0
    await until(lambda: p.loop.value("receipts_claims_returned_total") == 2)
    assert p.loop.value("receipts_inflight_deliveries") == 3  # one slot freed, none refilled
    p.release(4)
    await p.loop.__aexit__()


async def test_jobs_claimed_ahead_go_back_unsent_when_the_worker_stops():
    p = Prefetching()
    await p.start()
    ahead = p.ahead()
    p.worker.stop()
    p.release(4)  # the deliveries in flight finish within the grace
    await p.loop.__aexit__()
    assert p.queue.count(JobState.DONE) == 4
    assert [(p.queue.rows[j].state, p.queue.rows[j].attempts) for j in ahead] == [
        (JobState.READY, 0)] * 2
    assert len(p.deliverer.started) == 4  # nothing claimed ahead was sent
    assert p.loop.value("receipts_claims_returned_total") == 2
    assert p.loop.value("receipts_jobs_claimed_total") == (
        p.loop.value("receipts_acks_total") + p.loop.value("receipts_claims_returned_total"))


async def test_a_job_claimed_ahead_that_waits_too_long_goes_back_and_claiming_ahead_stops(
        monkeypatch):
    import receipts.worker

    monkeypatch.setattr(receipts.worker, "PREFETCH_MAX_WAIT_SECONDS", 0.05)
    p = Prefetching()
    await p.start()
    ahead = p.ahead()
    # Every slot stays busy: the jobs claimed ahead go back, and none is claimed again.
    await until(lambda: all(p.queue.rows[j].state is JobState.READY for j in ahead))
    assert [p.queue.rows[j].attempts for j in ahead] == [0, 0]
    claims = len(p.queue.claims)
    await asyncio.sleep(0.2)  # four times the wait: a churning pod would claim again
    assert len(p.queue.claims) == claims and not p.worker._prefetched
    p.release(1)  # a delivery ends: the slots move again, and so does the prefetch
    await until(lambda: len(p.deliverer.started) == 5)
    for gate in p.gates.values():
        gate.set()
    await until(lambda: p.queue.count(JobState.DONE) == 20)
    await p.loop.__aexit__()


async def test_a_job_claimed_ahead_never_waits_past_its_lease_room_for_a_delivery():
    # A 1 s lease, a 0.25 s margin and a 0.6 s delivery timeout: a delivery that starts
    # more than 0.15 s after the claim could outlast the lease, and its ack go stale.
    p = Prefetching(lease_seconds=1.0, lease_margin_seconds=0.25, delivery_timeout_seconds=0.6)
    assert p.worker.prefetch_max_wait() == pytest.approx(0.15)
    await p.start()
    ahead = list(p.worker._prefetched)
    await until(lambda: all(p.queue.rows[a.job.id].state is JobState.READY for a in ahead))
    waited = time.monotonic() - ahead[0].claimed_at
    assert waited < 0.6, f"a job claimed ahead waited {waited:.2f} s of a 1 s lease"
    assert [p.queue.rows[a.job.id].attempts for a in ahead] == [0, 0]  # given back unsent
    assert len(p.deliverer.started) == 4
    for gate in p.gates.values():
        gate.set()
    await until(lambda: p.queue.count(JobState.DONE) == 20)
    await p.loop.__aexit__()


async def test_a_lease_with_no_room_to_wait_claims_nothing_ahead():
    # The delivery timeout takes all the lease leaves after the margin (the settings check
    # allows it): a job may start only right after its claim, so none is claimed ahead.
    queue = FakeQueue()
    ids = queue.add(12)
    gates = {job_id: asyncio.Event() for job_id in ids}

    async def answer(job_id: object) -> None:
        await gates[job_id].wait()  # type: ignore[index]

    deliverer = GatedDeliverer(answer)
    async with Loop(queue, deliverer, concurrency=4, lease_seconds=1.0,
                    lease_margin_seconds=0.25, delivery_timeout_seconds=0.75) as loop:
        worker = loop.worker
        worker._claim_seconds, worker._delivery_seconds_avg = 0.010, 0.020
        assert worker.prefetch_max_wait() == 0.0
        await until(lambda: len(deliverer.started) == 4)
        worker._backlogged = True
        assert worker.prefetch_depth() == 0
        for job_id in deliverer.started[:2]:
            gates[job_id].set()
        await until(lambda: len(deliverer.started) == 6)
        for gate in gates.values():
            gate.set()
        await until(lambda: queue.count(JobState.DONE) == 12)
    assert all(n <= 4 for n, _ in queue.claims) and not worker._prefetched
    assert loop.value("receipts_claims_returned_total") == 0


@pytest.mark.parametrize("lease,margin,timeout,wait", [
    (60.0, None, 10.0, 1.0),    # the defaults: 40 s of room, the constant decides
    (4.0, 0.3, 3.2, 0.5),       # a short lease: what is left of it
    (1.0, 0.25, 0.75, 0.0),     # no room at all
])
def test_the_prefetch_wait_is_bounded_by_the_lease_room(lease, margin, timeout, wait):
    worker = Worker(settings(lease_seconds=lease, lease_margin_seconds=margin,
                             delivery_timeout_seconds=timeout), FakeQueue(), ScriptedDeliverer(),
                    Metrics())
    assert worker.prefetch_max_wait() == pytest.approx(wait)


async def test_an_idle_queue_claims_nothing_ahead():
    queue, deliverer = FakeQueue(), ScriptedDeliverer()
    deliverer.latency_seconds = 0.005
    async with Loop(queue, deliverer) as loop:
        loop.worker._claim_seconds, loop.worker._delivery_seconds_avg = 0.010, 0.020
        for _ in range(5):  # a trickle: every claim comes back short
            queue.add(1)
            loop.worker.wake()
            await until(lambda: queue.count(JobState.DONE) == len(queue.rows))
        assert loop.worker.prefetch_depth() == 0
    assert all(limit <= 4 for limit, _ in queue.claims)


@pytest.mark.parametrize("slots,claim,rtt,depth", [
    (1, 0.010, 0.052, 1),    # a pod held to one delivery: one ahead, or it idles every claim
    (16, 0.010, 0.052, 7),   # 2 × 16 × 10/52 = 6.2, rounded up
    (16, 0.002, 0.050, 2),   # 1.3 → 2
    (32, 0.010, 0.001, 16),  # deliveries faster than claims: half the slots at most
    (200, 0.010, 0.001, 100),  # and RECEIPTS_CLAIM_BATCH_MAX (100)
    (1, 0.010, 2.0, 0),      # a slot frees every 2 s: nothing waits that long in memory
    (32, 0.010, 10.0, 0),    # 0.06 < PREFETCH_MIN_AHEAD
])
def test_the_prefetch_depth_covers_the_deliveries_ending_during_a_claim(slots, claim, rtt, depth):
    worker = Worker(settings(concurrency=slots), FakeQueue(), ScriptedDeliverer(), Metrics())
    worker._claim_seconds, worker._delivery_seconds_avg = claim, rtt
    assert worker.prefetch_depth() == 0  # the queue has shown no work yet
    worker._backlogged = True
    assert worker.prefetch_depth() == depth
    worker.gate.observe_flow(FlowState(PauseReason.MANUAL, 60.0))
    assert worker.prefetch_depth() == 0  # paused: claims take only what they can send


class _Heard:
    """What a pod's wake-ups say of the waker's announcement (for Worker.rate_choice)."""

    def __init__(self, tag: str, share: float) -> None:
        self.tag, self.shares, self.shares_at = tag, {tag: share}, time.monotonic()

    def member_age(self) -> float:
        return 60.0


def test_as_the_waker_a_pod_offers_only_what_its_throttles_let_it_claim_now():
    """The waker wakes its own pod first for what it offers; an offer above what its
    share of the rate limit lets it claim would leave the rest of the new work to wait
    150 ms for the stuck head instead of going to the other pods at once."""
    clock = [100.0]
    worker = Loop(FakeQueue(rate=20.0), ScriptedDeliverer(), concurrency=8,
                  rate_limit_per_second=20.0, provider_burst=20.0).worker
    worker.wakeups = _Heard("0000abcd", 0.25)  # type: ignore[assignment]  # 5 jobs/s
    worker.bucket = TokenBucket(5.0, 5.0, clock=lambda: clock[0])
    assert worker._waker_free_slots() == 0  # its bucket starts empty: it must wait
    clock[0] += 0.5
    assert worker._waker_free_slots() == 2  # 2.5 tokens: two jobs now, the rest to others
    assert worker._waker_free_slots() == 2  # offering takes nothing
    clock[0] += 60
    assert worker._waker_free_slots() == 5  # a full bucket: its share's burst
    worker.wakeups = _Heard("0000abcd", 1.0)  # type: ignore[assignment]  # alone: 20 jobs/s
    assert worker._waker_free_slots() == 5  # (the new share's bucket from now on)
    clock[0] += 60
    assert worker._waker_free_slots() == 8  # its free slots
    worker.stop()
    assert worker._waker_free_slots() == 0  # a stopping pod takes nothing new


def test_as_the_waker_without_a_rate_limit_a_pod_offers_its_free_slots():
    worker = Loop(FakeQueue(), ScriptedDeliverer(), concurrency=8).worker
    assert worker._waker_free_slots() == 8
