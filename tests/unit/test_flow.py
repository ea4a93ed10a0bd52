"""The provider gate's rules, on a fake clock: outage detection, rejections judged on
evidence, systemic rejection, pauses, probes, refunds and held verdicts."""

from __future__ import annotations

import dataclasses
import itertools
import random
import uuid
from datetime import UTC, datetime

import httpx
import pytest

from receipts.delivery import classify
from receipts.flow import (
    NO_DECISION,
    FlowPolicy,
    OutageDetector,
    ProviderGate,
    tls_failure,
)
from receipts.model import FlowState, Outcome, PauseReason, Reason, Verdict
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
    assert [detector.observe(uuid.uuid4(), failed=True) for _ in range(3)] == [None] * 3
    assert detector.observe(uuid.uuid4(), failed=True) is PauseReason.OUTAGE


def test_failures_must_dominate_the_answered_jobs():
    detector = OutageDetector(POLICY, Clock())
    for _ in range(5):
        detector.observe(uuid.uuid4(), failed=False)
    # 5 failed of 10 answered: a flaky provider, not an outage.
    assert [detector.observe(uuid.uuid4(), failed=True) for _ in range(5)] == [None] * 5
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
    # within the last 20 distinct jobs, not 30 s later
    assert detections.index(PauseReason.OUTAGE) < 20


# ------------------------------------------------------------ systemic rejection

def rejected(status: int = 400, text: str = "forced status 400") -> Outcome:
    return Outcome(Verdict.PERMANENT, Reason.REJECTED, status, None, f"{status} {text}")


def tls(detail: str = "ConnectError: SSLError: [SSL: SSLV3_ALERT_HANDSHAKE_FAILURE] sslv3 "
                      "alert handshake failure (_ssl.c:1006)",
        reason: Reason = Reason.CONNECT_ERROR) -> Outcome:
    return Outcome(Verdict.RETRY, reason, None, None, detail)


def test_tls_failures_are_told_from_connection_failures():
    assert tls_failure(tls())
    assert tls_failure(tls("ConnectError: SSLCertVerificationError: [SSL: "
                           "CERTIFICATE_VERIFY_FAILED] certificate verify failed"))
    # aiohttp's words for a TLS 1.3 peer that wanted a client certificate.
    assert tls_failure(tls("ReadError: [Errno 1] [SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] "
                           "tlsv13 alert certificate required", Reason.CONNECTION_LOST))
    assert not tls_failure(tls("ConnectError: [SSL: UNEXPECTED_EOF_WHILE_READING] EOF "
                               "occurred in violation of protocol"))
    assert not tls_failure(tls("ConnectError: Cannot connect to host x:443 ssl:default "
                               "[Connect call failed ('10.0.0.1', 443)]"))
    assert not tls_failure(tls("ReadError: ConnectionResetError", Reason.CONNECTION_LOST))


B = POLICY.bracket_seconds


def accept(g: ProviderGate, sent_at: float) -> None:
    assert g.judge(uuid.uuid4(), outcome(201), sent_at=sent_at).pause is None


def test_a_rejection_bracketed_by_acceptances_of_other_jobs_is_a_first_strike():
    clock = Clock()
    g = gate(clock)
    bad, sent = uuid.uuid4(), clock.now
    accept(g, sent - B / 2)
    clock.now += 0.05
    d = g.judge(bad, rejected(422, "order cannot receive a receipt"), sent_at=sent)
    assert d.hold_seconds == 2 * B and not d.requeue and d.pause is None
    assert not g.settle()  # an acceptance sent after it may still come
    accept(g, sent + B / 2)
    assert g.settle().confirm == [bad] and g.held == 0


def test_a_confirmation_rejected_while_others_are_accepted_fails_the_job():
    clock = Clock()
    g = gate(clock)
    bad = uuid.uuid4()
    accept(g, clock.now - 0.2)
    d = g.judge(bad, rejected(422), sent_at=clock.now, confirming=True)
    assert d == NO_DECISION  # the verdict stands: written as failed


def test_a_confirmation_without_evidence_is_held_like_any_rejection():
    clock = Clock()
    g = gate(clock)
    d = g.judge(uuid.uuid4(), rejected(422), sent_at=clock.now, confirming=True)
    assert d.hold_seconds == 2 * B


def test_acceptances_on_one_side_only_make_no_verdict():
    clock = Clock()
    g = gate(clock)
    bad, sent = uuid.uuid4(), clock.now
    for k in range(20):  # acceptances of requests sent before it: the provider may
        accept(g, sent - 0.01 * k)  # have turned to rejecting everything since
    g.judge(bad, rejected(), sent_at=sent)
    clock.now += 2 * B
    s = g.settle()
    assert s.confirm == [] and s.fail == [] and [j for j, _ in s.requeue] == [bad]
    g2 = gate(clock)
    g2.judge(bad, rejected(), sent_at=clock.now)
    for k in range(20):  # acceptances more than a bracket later
        accept(g2, clock.now + B + 0.01 * (k + 1))
    clock.now += 2 * B
    assert [j for j, _ in g2.settle().requeue] == [bad]


def test_a_held_rejection_goes_back_to_ready_with_a_growing_delay_never_failed():
    clock = Clock()
    g = gate(clock)
    job = uuid.uuid4()
    delays = []
    for _ in range(4):
        assert g.judge(job, rejected(), sent_at=clock.now).hold_seconds
        clock.now += 2 * B
        s = g.settle()
        assert s.fail == [] and s.confirm == []
        ((held, delay),) = s.requeue
        assert held == job
        delays.append(delay)
    assert all(b > a * 1.2 for a, b in itertools.pairwise(delays)), delays
    clock.now += 10
    assert g.settle().pause is None  # one job is never a systemic rejection


def test_a_held_rejection_requeued_while_the_fleet_is_paused_keeps_its_first_delay():
    # The pause explains the silence: the job must be due when the fleet resumes,
    # amid the backlog whose acceptances can bracket it, not 30 s later.
    clock = Clock()
    g = gate(clock)
    job = uuid.uuid4()
    for _ in range(5):  # grown while the fleet runs: 1, 2, 4, 8, 16 s
        assert g.judge(job, rejected(), sent_at=clock.now).hold_seconds
        clock.now += 2 * B
        ((_, grown),) = g.settle().requeue
    assert grown > 8 * POLICY.held_retry_seconds
    g.observe_flow(FlowState(PauseReason.OUTAGE, 30))
    for _ in range(3):
        d = g.judge(job, rejected(), sent_at=clock.now)
        delay = d.delay_seconds if d.requeue else g.settle(final=True).requeue[0][1]
        assert delay <= 1.25 * POLICY.held_retry_seconds


def test_the_deadline_and_a_stop_give_held_rejections_back():
    clock = Clock()
    g = gate(clock)
    held = [uuid.uuid4() for _ in range(3)]
    for job in held:
        g.judge(job, rejected(), sent_at=clock.now)
    assert not g.settle()
    clock.now += 2 * B
    assert sorted(j for j, _ in g.settle().requeue) == sorted(held)
    for job in held:
        g.judge(job, rejected(), sent_at=clock.now)
    assert sorted(j for j, _ in g.settle(final=True).requeue) == sorted(held)


def test_a_rejection_with_a_short_lease_left_is_given_back_at_once():
    d = gate().judge(uuid.uuid4(), rejected(), hold_seconds=0)
    assert d.requeue and d.refund and d.hold_seconds is None


BODIES = [
    "request req_8Fh2KxQ9zLmN3pA1 rejected at 2026-12-05T13:21:47.123Z",
    "<html><head><title>400 Bad Request</title></head><body>cf-ray 7d1e5a</body></html>",
    "validation failed (trace 0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9, 1733404907)",
]


def test_rejections_of_several_jobs_without_acceptance_pause_whatever_the_bodies_and_statuses():
    clock = Clock()
    g = gate(clock)
    accept(g, clock.now)  # the provider worked until now
    clock.now += 2 * B
    pauses = []
    for i in range(40):
        status = (400, 404, 422)[i % 3]
        d = g.judge(uuid.uuid4(), rejected(status, BODIES[i % 3] + str(i)), sent_at=clock.now)
        assert d.hold_seconds and d.pause is None and not d.requeue
        clock.now += 0.1
        s = g.settle()
        assert s.fail == [] and s.confirm == []
        if s.pause is not None:
            pauses.append((clock.now, s.pause))
    (when, (reason, seconds)), *_ = pauses
    assert reason is PauseReason.REJECTING and 4.5 <= seconds <= 5.5
    # After rejecting_after_seconds of unexplained rejections (of at least min_jobs jobs).
    assert when - 1000 - 2 * B == pytest.approx(POLICY.rejecting_after_seconds, abs=0.15)
    g.observe_flow(FlowState(PauseReason.REJECTING, seconds))
    s = g.settle()
    assert s.fail == [] and len(s.requeue) > 0 and g.held == 0
    late = g.judge(uuid.uuid4(), rejected(), sent_at=clock.now)  # in flight when paused
    assert late.requeue and late.refund and late.hold_seconds is None


def test_one_acceptance_explains_the_rejections_around_it():
    clock = Clock()
    g = gate(clock)
    for _ in range(10):
        g.judge(uuid.uuid4(), rejected(), sent_at=clock.now)
        clock.now += 0.2
    accept(g, clock.now)
    assert g.unexplained == 0
    clock.now += POLICY.rejecting_after_seconds
    assert g.settle().pause is None


def test_a_resume_does_not_let_the_first_answers_after_it_pause_again():
    clock = Clock()
    g = gate(clock)
    g.observe_flow(FlowState(PauseReason.REJECTING, 5))
    for _ in range(10):
        g.judge(uuid.uuid4(), rejected(), sent_at=clock.now)
    g.observe_flow(FlowState())  # resumed (another pod's probe was accepted)
    for _ in range(6):  # a few invalid orders in a row right after the resume
        g.judge(uuid.uuid4(), rejected(), sent_at=clock.now)
        clock.now += 0.1
    assert g.settle().pause is None  # not before rejecting_after_seconds without acceptance
    accept(g, clock.now)
    clock.now += 5
    assert g.settle().pause is None


def test_a_flapping_provider_brackets_no_rejection():
    """Phases of 5 s: reject everything, accept everything. A request every 50 ms."""
    clock = Clock()
    g = gate(clock)
    failed, confirmed = [], []
    start = clock.now
    while clock.now < start + 60:
        rejecting = int((clock.now - start) // 5) % 2 == 0
        job = uuid.uuid4()
        d = g.judge(job, rejected() if rejecting else outcome(200), sent_at=clock.now)
        if d == NO_DECISION and rejecting:
            failed.append(job)
        s = g.settle()
        failed += s.fail
        confirmed += s.confirm
        clock.now += 0.05
    assert failed == [] and confirmed == []


def test_tls_failures_of_several_jobs_pause_with_reason_rejecting_not_outage():
    clock = Clock()
    g = gate(clock)
    decisions = []
    for _ in range(8):
        decisions.append(g.judge(uuid.uuid4(), tls(), sent_at=clock.now))
        clock.now += 0.1
    assert all(d.hold_seconds is None and not d.requeue and d.refund for d in decisions)
    # At the fifth distinct job (no invalid order fails a handshake: no wait), and once.
    assert [i for i, d in enumerate(decisions) if d.pause] == [4]
    assert decisions[4].pause[0] is PauseReason.REJECTING  # type: ignore[index]
    plain = gate()
    resets = [plain.judge(uuid.uuid4(), tls("ReadError: ConnectionResetError",
                                            Reason.CONNECTION_LOST)) for _ in range(5)]
    assert resets[4].pause[0] is PauseReason.OUTAGE  # type: ignore[index]


def probe(g: ProviderGate, n: int, length: float = 5) -> tuple[list[uuid.UUID], datetime]:
    jobs, until = [uuid.uuid4() for _ in range(n)], datetime.now(UTC)
    g.start_probe(jobs, until, length)
    return jobs, until


def test_a_rejecting_pause_grows_only_when_every_probe_job_is_rejected():
    g = gate()
    g.observe_flow(FlowState(PauseReason.REJECTING, 0))
    jobs, _ = probe(g, 5)
    decisions = [g.judge(job, rejected()) for job in jobs]
    assert all(d.requeue and d.refund for d in decisions)
    assert [d.pause for d in decisions[:4]] == [None] * 4
    assert decisions[4].probe and decisions[4].pause[0] is PauseReason.REJECTING  # type: ignore[index]
    assert decisions[4].pause[1] >= 9  # type: ignore[index]


def test_one_accepted_probe_job_resumes_whatever_the_others_answer():
    g = gate()
    g.observe_flow(FlowState(PauseReason.REJECTING, 0))
    (bad, good, other), until = probe(g, 3, 10)
    d = g.judge(bad, rejected(422, "order cannot receive a receipt"))
    assert d.pause is None and d.requeue  # an invalid order in the probe: no doubling
    assert g.judge(good, outcome(201)).resume == until
    g.observe_flow(FlowState())
    later = g.judge(other, rejected(422))
    assert later.pause is None and later.hold_seconds  # judged like any other answer


def test_an_acceptance_of_another_job_during_the_probe_resumes_too():
    g = gate()
    g.observe_flow(FlowState(PauseReason.REJECTING, 0))
    _, until = probe(g, 2)
    assert g.judge(uuid.uuid4(), outcome(200)).resume == until  # in flight since before


def test_an_outage_probe_answered_4xx_resumes_and_its_verdict_is_held():
    g = gate()
    g.observe_flow(FlowState(PauseReason.OUTAGE, 0))
    (job,), until = probe(g, 1)
    d = g.judge(job, rejected(422, "order cannot receive a receipt"))
    assert d.resume == until and d.probe and d.hold_seconds is not None and not d.requeue


#: What nginx 1.22 answers when `ssl_verify_client on` gets no client certificate.
NGINX_NO_CERTIFICATE = (
    b"<html>\r\n<head><title>400 No required SSL certificate was sent</title></head>\r\n"
    b"<body>\r\n<center><h1>400 Bad Request</h1></center>\r\n<center>No required SSL "
    b"certificate was sent</center>\r\n<hr><center>nginx/1.22.1</center>\r\n</body>\r\n"
    b"</html>\r\n")


def test_nginx_refusing_a_missing_client_certificate_is_a_systemic_rejection():
    answer = classify(400, httpx.Headers({"content-type": "text/html"}), NGINX_NO_CERTIFICATE)
    assert answer.verdict is Verdict.PERMANENT  # a verdict only on evidence
    clock = Clock()
    g = gate(clock)
    decisions = []
    for _ in range(8):
        decisions.append(g.judge(uuid.uuid4(), answer, sent_at=clock.now))
        clock.now += 0.5
    # Held, until the one that makes 3 s of unexplained rejections: it pauses the fleet.
    assert all(d.hold_seconds and d.pause is None for d in decisions[:6])
    assert decisions[6].pause[0] is PauseReason.REJECTING  # type: ignore[index]
    assert decisions[6].requeue and decisions[6].refund
    g.observe_flow(FlowState(PauseReason.REJECTING, 5))
    s = g.settle()
    assert len(s.requeue) == 7 and s.fail == [] and s.confirm == []  # one more held meanwhile


def test_a_408_is_a_timeout_not_a_verdict():
    answer = classify(408, httpx.Headers(), b"request timeout")
    assert answer.verdict is Verdict.RETRY and answer.reason is Reason.TIMEOUT


def test_while_rejections_go_unexplained_new_deliveries_are_paced_and_an_acceptance_ends_it():
    clock = Clock()
    g = gate(clock)
    per_second = int(POLICY.suspect_sends_per_second)
    assert g.suspect_allowance(32) == (32, 0.0)  # nothing unexplained: no pace
    for _ in range(POLICY.min_jobs):
        g.judge(uuid.uuid4(), rejected(), sent_at=clock.now)
    assert g.unexplained == POLICY.min_jobs
    started = 0
    for _ in range(3 * per_second):  # three seconds of a claim loop asking for 32 at a time
        n, wait = g.suspect_allowance(32)
        assert (n > 0) != (wait > 0)
        g.sent(n)
        started += n
        clock.now += wait if n == 0 else 0.01
        if clock.now >= 1003.0:
            break
    assert started <= 3 * per_second + per_second  # about suspect_sends_per_second a second
    assert started >= 2 * per_second
    accept(g, clock.now)  # the provider works: the pace is gone at once
    assert g.unexplained == 0 and g.suspect_allowance(32) == (32, 0.0)


def test_a_long_run_of_rejections_starts_the_pace_before_the_bracket_can_explain_them():
    clock = Clock()
    g = gate(clock)
    accept(g, clock.now)
    for _ in range(POLICY.suspect_streak - 1):
        g.judge(uuid.uuid4(), rejected(), sent_at=clock.now)  # all within the bracket
    assert g.unexplained == 0 and g.suspect_allowance(32) == (32, 0.0)
    g.judge(uuid.uuid4(), rejected(), sent_at=clock.now)
    n, _ = g.suspect_allowance(32)
    assert n == 20 and n == POLICY.suspect_sends_per_second
    g.sent(n)
    assert g.suspect_allowance(32)[0] == 0
    accept(g, clock.now)  # one acceptance ends the streak
    assert g.suspect_allowance(32) == (32, 0.0)


def test_with_adaptive_concurrency_an_outage_waits_for_acceptances_to_stop():
    """A provider at its capacity refuses most requests of a pod at its floor but still
    accepts some: that is the limit's to answer. Only a provider that has failed this
    pod for outage_quiet_seconds, with no acceptance among the failures, is down."""
    clock = Clock()
    g = ProviderGate(dataclasses.replace(POLICY, outage_quiet_seconds=5.0), clock=clock,
                     rng=random.Random(1))
    accept(g, clock.now)
    for _ in range(30):  # refused 30 times in 3 s, accepted once among them
        clock.now += 0.1
        assert g.judge(uuid.uuid4(), outcome(503)).pause is None
    accept(g, clock.now)
    clock.now += 0.1
    first = clock.now
    while clock.now < first + 4.9:  # failing since `first`, nothing accepted
        assert g.judge(uuid.uuid4(), outcome(503)).pause is None
        clock.now += 0.25
    clock.now = first + 5.1  # five seconds of failures without an acceptance: down
    reason, _ = g.judge(uuid.uuid4(), outcome(503)).pause  # type: ignore[misc]
    assert reason is PauseReason.OUTAGE


@pytest.mark.parametrize("history", ["new", "idle"])
def test_a_pod_new_to_a_full_provider_does_not_take_its_first_refusals_for_an_outage(history):
    """A pod that just joined (no answer seen yet) or that was idle for minutes (its last
    acceptance long gone) sends its first requests into a provider the fleet keeps at
    its capacity, and they are refused: that is no outage until they have kept failing
    for outage_quiet_seconds. (Counting from the last acceptance, the joining pod
    paused the whole fleet for 5 s at once.)"""
    clock = Clock()
    g = ProviderGate(dataclasses.replace(POLICY, outage_quiet_seconds=5.0), clock=clock,
                     rng=random.Random(1))
    if history == "idle":
        accept(g, clock.now)
        clock.now += 300.0
    start = clock.now
    for _ in range(20):  # a burst of refusals as the pod starts
        assert g.judge(uuid.uuid4(), outcome(503)).pause is None
    clock.now += 0.05
    accept(g, clock.now)  # one got through: at capacity, and the count starts again
    paused_at = None
    while paused_at is None and clock.now < start + 9.0:
        clock.now += 0.2
        if g.judge(uuid.uuid4(), outcome(503)).pause is not None:
            paused_at = clock.now
    # It kept failing from start + 0.25 on: down after all, five seconds later.
    assert paused_at is not None and start + 5.2 <= paused_at <= start + 5.6, paused_at


    # Off (the default): the same answers pause as soon as they make an outage.
    plain = gate(Clock())
    accept(plain, 1000.0)
    assert any(plain.judge(uuid.uuid4(), outcome(503)).pause for _ in range(5))
