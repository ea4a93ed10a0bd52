"""Properties of the provider gate over random interleavings of valid and invalid orders
and provider phases, driven on a fake clock (hypothesis).

A small simulation stands in for one pod: slots, a ready queue, requests answered
after a random latency by a provider whose behaviour changes by phases (reject
everything, accept everything, or judge the orders), the gate's decisions carried
out as the shell does (hold, requeue with the attempt given back, confirm in the
lease, fail, pause and probe). A steady trickle of valid orders stands for the
shop's ordinary traffic. The properties:

* no valid order fails (a provider rejecting everything for phases of 5 s or more
  never accepts others around a rejection: the bracket is shorter than half a phase);
* no invalid order stays ready for ever while the provider accepts others: after a
  minute of a provider that judges orders, every invalid order has failed.
"""

from __future__ import annotations

import heapq
import itertools
import random
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from receipts.flow import FlowPolicy, ProviderGate
from receipts.model import FlowState, Outcome, PauseReason, Reason, Verdict

TICK = 0.05
SLOTS = 8
REJECT, ACCEPT, JUDGE = "reject", "accept", "judge"
ACCEPTED = Outcome(Verdict.DELIVERED, Reason.DELIVERED, 201)


def rejected(status: int) -> Outcome:
    return Outcome(Verdict.PERMANENT, Reason.REJECTED, status, None, f"{status} {uuid.uuid4()}")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Order:
    id: uuid.UUID
    valid: bool
    state: str = "ready"  # ready, running, held, done, failed
    due: float = 0.0
    attempts: int = 0


@dataclass
class Pod:
    """One pod driving a ProviderGate as the worker and its gate shell do."""

    phases: list[tuple[float, str]]  # (end time, behaviour), in order
    latency_max: float
    rng: random.Random
    clock: Clock = field(default_factory=Clock)
    orders: dict[uuid.UUID, Order] = field(default_factory=dict)
    ready: set[uuid.UUID] = field(default_factory=set)
    inflight: int = 0
    answers: list[tuple[float, int, uuid.UUID, float, bool]] = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)  # type: ignore[type-arg]
    paused_until: float = -1.0  # the fleet's pause (one pod: this one), a probe due at
    probe_out: bool = False
    gate: ProviderGate = field(init=False)

    def __post_init__(self) -> None:
        self.gate = ProviderGate(FlowPolicy(), clock=self.clock, rng=self.rng)

    def behaviour(self, t: float) -> str:
        for end, what in self.phases:
            if t < end:
                return what
        return JUDGE

    def add(self, valid: bool) -> None:
        order = Order(uuid.uuid4(), valid, due=self.clock.now)
        self.orders[order.id] = order
        self.ready.add(order.id)

    def send(self, order: Order, confirming: bool = False) -> None:
        now = self.clock.now
        if not confirming:
            order.state, order.attempts = "running", order.attempts + 1
            self.ready.discard(order.id)
        self.inflight += 1
        answer_at = now + self.rng.uniform(0.002, self.latency_max)
        heapq.heappush(self.answers, (answer_at, next(self.seq), order.id, now, confirming))

    def answer(self, order: Order, sent_at: float, confirming: bool) -> None:
        self.inflight -= 1
        what = self.behaviour(self.clock.now)  # the provider decides when the request arrives
        ok = what == ACCEPT or (what == JUDGE and order.valid)
        outcome = ACCEPTED if ok else rejected(self.rng.choice((400, 404, 422)))
        decision = self.gate.judge(order.id, outcome, sent_at=sent_at, confirming=confirming,
                                   hold_seconds=30)
        if decision.pause is not None:
            self.pause(decision.pause[1])
        if decision.resume is not None:
            self.resume()
        if ok:
            order.state = "done"
        elif decision.hold_seconds is not None:
            order.state = "held"
        elif decision.requeue:
            self.requeue(order, decision.delay_seconds)
        else:
            order.state = "failed"

    def requeue(self, order: Order, delay: float) -> None:
        order.state, order.due = "ready", self.clock.now + delay
        self.ready.add(order.id)
        order.attempts -= 1  # given back

    def pause(self, seconds: float) -> None:
        self.paused_until = self.clock.now + min(seconds, 5.0)  # the next probe
        self.probe_out = False
        self.gate.observe_flow(FlowState(PauseReason.REJECTING, self.paused_until - self.clock.now))

    def resume(self) -> None:
        self.paused_until = -1.0
        self.probe_out = False
        self.gate.observe_flow(FlowState())

    def settle(self) -> None:
        result = self.gate.settle()
        if result.pause is not None:
            self.pause(result.pause[1])
        for job_id, delay in result.requeue:
            self.requeue(self.orders[job_id], delay)
        for job_id in result.confirm:
            self.send(self.orders[job_id], confirming=True)
        for job_id in result.fail:
            self.orders[job_id].state = "failed"

    def due(self) -> list[Order]:
        now = self.clock.now
        return sorted((o for o in map(self.orders.__getitem__, self.ready) if o.due <= now),
                      key=lambda o: o.due)

    def claim(self) -> None:
        free = SLOTS - self.inflight
        if free <= 0:
            return
        if self.gate.paused:
            if self.probe_out or self.clock.now < self.paused_until:
                return
            jobs = self.due()[:self.gate.probe_size(free)]
            if jobs:
                self.gate.start_probe([o.id for o in jobs], datetime.now(UTC), 5.0)
                self.probe_out = True
            for order in jobs:
                self.send(order)
            return
        for order in self.due()[:free]:
            self.send(order)

    def run_until(self, end: float, traffic_per_second: float) -> None:
        while self.clock.now < end:
            step_end = self.clock.now + TICK
            while self.answers and self.answers[0][0] <= step_end:
                at, _, job_id, sent_at, confirming = heapq.heappop(self.answers)
                self.clock.now = max(self.clock.now, at)
                self.answer(self.orders[job_id], sent_at, confirming)
            self.clock.now = step_end
            if self.rng.random() < traffic_per_second * TICK:
                self.add(valid=True)
            self.settle()
            self.claim()


phases = st.lists(st.tuples(st.sampled_from([REJECT, ACCEPT, JUDGE]), st.floats(5.0, 30.0)),
                  min_size=1, max_size=5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(phases=phases, batch=st.lists(st.booleans(), max_size=60),
       traffic=st.floats(1.0, 20.0), latency=st.floats(0.01, 0.3), seed=st.integers(0, 2**32))
def test_no_valid_order_fails_and_no_invalid_one_waits_for_ever(phases, batch, traffic,
                                                                latency, seed):
    ends = list(itertools.accumulate(d for _, d in phases))
    pod = Pod([(end, what) for end, (what, _) in zip(ends, phases, strict=True)], latency,
              random.Random(seed))
    for valid in batch:
        pod.add(valid)
    pod.run_until(ends[-1], traffic)
    valid_failed = [o for o in pod.orders.values() if o.valid and o.state == "failed"]
    assert valid_failed == []
    # A minute of a provider that judges orders, with the shop's ordinary traffic.
    pod.run_until(ends[-1] + 60, traffic)
    assert [o for o in pod.orders.values() if o.valid and o.state == "failed"] == []
    waiting = [o for o in pod.orders.values() if not o.valid and o.state not in ("failed", "done")]
    assert waiting == []
    assert all(o.attempts <= 2 for o in pod.orders.values())
