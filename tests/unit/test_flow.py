"""The provider gate's rules, on a fake clock: outage detection, pauses, probes, refunds."""

from __future__ import annotations

import itertools
import random
import uuid
from datetime import UTC, datetime

from receipts.flow import FlowPolicy, OutageDetector, ProviderGate
from receipts.model import FlowState, PauseReason
from tests.unit.fakes import outcome


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


POLICY = FlowPolicy(window_seconds=30, min_jobs=5, failure_ratio=0.8, outage_pause_seconds=5,
                    auth_pause_seconds=30, pause_max_seconds=300)


def gate(clock: Clock | None = None) -> ProviderGate:
    return ProviderGate(POLICY, clock=clock or Clock(), rng=random.Random(1))


def test_an_outage_needs_enough_distinct_failed_jobs():
    detector = OutageDetector(POLICY, Clock())
    same = uuid.uuid4()
    assert not any(detector.observe(same, failed=True) for _ in range(50))
    # The one job failing again and again counts once: 4 more distinct jobs make 5.
    assert [detector.observe(uuid.uuid4(), failed=True) for _ in range(3)] == [False] * 3
    assert detector.observe(uuid.uuid4(), failed=True)


def test_failures_must_dominate_the_answered_jobs():
    detector = OutageDetector(POLICY, Clock())
    for _ in range(5):
        detector.observe(uuid.uuid4(), failed=False)
    # 5 failed of 10 answered: a flaky provider, not an outage.
    assert [detector.observe(uuid.uuid4(), failed=True) for _ in range(5)] == [False] * 5
    # 20 failed of 25: 80 %.
    assert any(detector.observe(uuid.uuid4(), failed=True) for _ in range(15))


def test_answers_older_than_the_window_are_forgotten():
    clock = Clock()
    detector = OutageDetector(POLICY, clock)
    for _ in range(4):
        detector.observe(uuid.uuid4(), failed=True)
    clock.now += 31
    assert not detector.observe(uuid.uuid4(), failed=True)


def test_a_job_that_recovers_counts_as_answered():
    detector = OutageDetector(POLICY, Clock())
    jobs = [uuid.uuid4() for _ in range(4)]
    for job in jobs:
        detector.observe(job, failed=True)
    for job in jobs:
        detector.observe(job, failed=False)  # the same jobs delivered on retry
    assert not detector.observe(uuid.uuid4(), failed=True)


def test_an_outage_pauses_the_fleet_and_refunds_the_attempts_in_flight():
    g = gate()
    decisions = [g.judge(uuid.uuid4(), outcome(503)) for _ in range(5)]
    assert [d.pause for d in decisions[:4]] == [None] * 4
    assert not any(d.refund for d in decisions[:4])  # no outage known yet: attempts count
    reason, seconds = decisions[4].pause  # type: ignore[misc]
    assert reason is PauseReason.OUTAGE and 4.5 <= seconds <= 5.5
    assert decisions[4].refund
    g.observe_flow(FlowState(PauseReason.OUTAGE, seconds))
    later = g.judge(uuid.uuid4(), outcome(503))
    assert later.pause is None and later.refund  # in flight during the pause: refunded


def test_a_permanent_rejection_or_409_is_an_answer_not_a_failure():
    g = gate()
    for status in (422, 409, 200):
        d = g.judge(uuid.uuid4(), outcome(status))
        assert d.pause is None and not d.refund


def test_credentials_rejected_pause_once_not_per_job():
    g = gate()
    first = g.judge(uuid.uuid4(), outcome(401))
    assert first.pause == (PauseReason.AUTH, 30) and first.refund
    g.observe_flow(FlowState(PauseReason.AUTH, 30))
    again = [g.judge(uuid.uuid4(), outcome(403)) for _ in range(10)]
    assert all(d.pause is None and d.refund for d in again)


def test_retry_after_pauses_the_fleet_for_that_long_clamped():
    g = gate()
    assert g.judge(uuid.uuid4(), outcome(429, retry_after=30)).pause == (
        PauseReason.RETRY_AFTER, 30)
    assert g.judge(uuid.uuid4(), outcome(429, retry_after=10**9)).pause == (
        PauseReason.RETRY_AFTER, POLICY.retry_after_max_seconds)
    assert g.judge(uuid.uuid4(), outcome(429)).pause is None  # no Retry-After: a failure


def test_a_delivered_probe_resumes_and_a_failed_one_doubles_the_pause_up_to_the_cap():
    clock = Clock()
    g = gate(clock)
    g.observe_flow(FlowState(PauseReason.OUTAGE, 0))
    pauses = []
    length = 5.0
    for _ in range(8):
        probe, until = uuid.uuid4(), datetime.now(UTC)
        g.start_probe(probe, until, length)
        d = g.judge(probe, outcome(503))
        assert d.probe and d.refund and d.resume is None
        pauses.append(d.pause[1])  # type: ignore[index]
        length = d.pause[1]  # type: ignore[index]
    assert all(b >= a * 1.6 or b >= 270 for a, b in itertools.pairwise(pauses))
    assert max(pauses) <= 300 * 1.1
    probe, until = uuid.uuid4(), datetime.now(UTC)
    g.start_probe(probe, until, length)
    d = g.judge(probe, outcome(200))
    assert d.probe and d.resume == until and d.pause is None


def test_a_probe_answered_422_also_proves_the_provider_is_up():
    g = gate()
    g.observe_flow(FlowState(PauseReason.AUTH, 0))
    probe, until = uuid.uuid4(), datetime.now(UTC)
    g.start_probe(probe, until, 30)
    assert g.judge(probe, outcome(422)).resume == until


def test_the_local_view_follows_the_fleet_state():
    clock = Clock()
    g = gate(clock)
    g.observe_flow(FlowState(PauseReason.RETRY_AFTER, 30))
    assert g.paused and 30 <= g.pause_left() <= 33
    clock.now += 40
    assert g.paused and g.pause_left() == 0  # a probe is due
    g.observe_flow(FlowState())
    assert not g.paused


def test_a_busy_fleet_sees_an_outage_at_once_despite_earlier_successes():
    detector = OutageDetector(POLICY, Clock())
    for _ in range(500):  # a second of healthy traffic
        detector.observe(uuid.uuid4(), failed=False)
    detections = [detector.observe(uuid.uuid4(), failed=True) for _ in range(20)]
    assert detections.index(True) < 20  # within the last 20 distinct jobs, not 30 s later
