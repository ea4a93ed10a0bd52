"""The provider gate's rules, on a fake clock: outage and systemic-rejection detection,
pauses, probes, refunds and held verdicts."""

from __future__ import annotations

import itertools
import random
import uuid
from datetime import UTC, datetime

import httpx

from receipts.delivery import classify
from receipts.flow import (
    FlowPolicy,
    OutageDetector,
    ProviderGate,
    rejection_signature,
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


def test_a_rejection_shape_ignores_the_order_id_numbers_and_ids():
    a = rejection_signature(rejected(422, "order A-17 not found (request 9f3c2a1b7e)"), "A-17")
    b = rejection_signature(rejected(422, "order B-2 not found (request 01ab77ce3f)"), "B-2")
    assert a == b
    assert a != rejection_signature(rejected(400, "order B-2 not found (request 1)"), "B-2")
    assert a != rejection_signature(rejected(422, "order total is negative"), "C")
    assert rejection_signature(outcome(503)) is None and rejection_signature(outcome(200)) is None


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


def test_the_same_rejection_of_most_distinct_jobs_pauses_and_fails_none_of_them():
    g = gate()
    jobs = [uuid.uuid4() for _ in range(5)]
    decisions = [g.judge(job, rejected()) for job in jobs]
    assert all(d.hold_seconds == 30 and d.pause is None for d in decisions[:4])
    assert g.held == 4
    reason, seconds = decisions[4].pause  # type: ignore[misc]
    assert reason is PauseReason.REJECTING and 4.5 <= seconds <= 5.5
    assert decisions[4].requeue and decisions[4].refund
    requeue, fail = g.settle()
    assert sorted(requeue) == sorted(jobs[:4]) and fail == [] and g.held == 0
    # In flight when the pause began: given back, not failed.
    g.observe_flow(FlowState(PauseReason.REJECTING, seconds))
    late = g.judge(uuid.uuid4(), rejected())
    assert late.requeue and late.refund and late.hold_seconds is None


def test_rejections_of_different_shapes_do_not_add_up():
    g = gate()
    for i in range(10):
        d = g.judge(uuid.uuid4(), rejected(422, f"reason number {'abcdefghij'[i]}"))
        assert d.pause is None and d.hold_seconds is not None


def test_a_bad_order_fails_once_a_few_deliveries_sent_after_its_rejection_are_accepted():
    clock = Clock()
    g = gate(clock)
    bad = uuid.uuid4()
    sent_before = clock.now - 0.05
    clock.now += 0.1  # the rejection arrives
    assert g.judge(bad, rejected(422, "order cannot receive a receipt")).hold_seconds
    # Requests already in flight when it arrived prove nothing: the provider may have
    # turned to rejecting everything between them and it.
    for _ in range(3 * POLICY.min_jobs):
        g.judge(uuid.uuid4(), outcome(200), sent_at=sent_before)
    assert g.settle() == ([], [])
    for _ in range(POLICY.min_jobs - 1):
        clock.now += 0.01
        g.judge(uuid.uuid4(), outcome(200), sent_at=clock.now)
        assert g.settle() == ([], [])
    clock.now += 0.01
    g.judge(uuid.uuid4(), outcome(200), sent_at=clock.now)
    assert g.settle() == ([], [bad])


def test_later_failures_and_other_rejections_do_not_fail_a_held_rejection():
    clock = Clock()
    g = gate(clock)
    bad = uuid.uuid4()
    g.judge(bad, rejected(422, "order cannot receive a receipt"))
    for i in range(2 * POLICY.window_jobs):  # 4xx of other shapes and failures: no acceptance
        clock.now += 0.01
        g.judge(uuid.uuid4(), rejected(400, f"bad field {'abcdefghijklmnopqrstuvwxyz'[i % 26]}")
                if i % 2 else outcome(503))
        assert g.settle() == ([], [])


def test_a_held_rejection_fails_at_its_deadline_when_too_few_answers_come():
    clock = Clock()
    g = gate(clock)
    bad = uuid.uuid4()
    assert g.judge(bad, rejected(), hold_seconds=12).hold_seconds == 12  # the lease's bound
    clock.now += 11.9
    assert g.settle() == ([], [])
    clock.now += 0.2
    assert g.settle() == ([], [bad])
    assert g.judge(uuid.uuid4(), rejected(), hold_seconds=0).hold_seconds is None  # no time


def test_held_rejections_fail_when_no_further_answer_can_come():
    g = gate()
    held = [uuid.uuid4() for _ in range(3)]
    for job in held:
        g.judge(job, rejected())
    assert g.settle() == ([], [])
    assert g.settle(idle=True) == ([], held)  # three could never make a systemic rejection


def test_stopping_gives_the_held_rejections_back():
    g = gate()
    held = [uuid.uuid4() for _ in range(2)]
    for job in held:
        g.judge(job, rejected())
    assert g.settle(final=True) == (held, [])


def test_tls_failures_of_most_jobs_pause_with_reason_rejecting_not_outage():
    g = gate()
    decisions = [g.judge(uuid.uuid4(), tls()) for _ in range(5)]
    assert [d.pause for d in decisions[:4]] == [None] * 4
    assert all(d.hold_seconds is None and not d.requeue for d in decisions)  # retries anyway
    assert decisions[4].pause[0] is PauseReason.REJECTING  # type: ignore[index]
    plain = gate()
    resets = [plain.judge(uuid.uuid4(), tls("ReadError: ConnectionResetError",
                                            Reason.CONNECTION_LOST)) for _ in range(5)]
    assert resets[4].pause[0] is PauseReason.OUTAGE  # type: ignore[index]


def test_a_rejecting_pause_ends_only_when_a_probe_is_accepted():
    g = gate()
    g.observe_flow(FlowState(PauseReason.REJECTING, 0))
    probe, until = uuid.uuid4(), datetime.now(UTC)
    g.start_probe(probe, until, 5)
    again = g.judge(probe, rejected())
    assert again.probe and again.requeue and again.refund and again.resume is None
    assert again.pause[0] is PauseReason.REJECTING and again.pause[1] >= 9  # type: ignore[index]
    probe, until = uuid.uuid4(), datetime.now(UTC)
    g.start_probe(probe, until, 10)
    assert g.judge(probe, outcome(201)).resume == until


def test_an_outage_probe_answered_4xx_resumes_and_its_verdict_is_held():
    g = gate()
    g.observe_flow(FlowState(PauseReason.OUTAGE, 0))
    probe, until = uuid.uuid4(), datetime.now(UTC)
    g.start_probe(probe, until, 5)
    d = g.judge(probe, rejected(422, "order cannot receive a receipt"))
    assert d.resume == until and d.probe and d.hold_seconds is not None and not d.requeue


#: What nginx 1.22 answers when `ssl_verify_client on` gets no client certificate.
NGINX_NO_CERTIFICATE = (
    b"<html>\r\n<head><title>400 No required SSL certificate was sent</title></head>\r\n"
    b"<body>\r\n<center><h1>400 Bad Request</h1></center>\r\n<center>No required SSL "
    b"certificate was sent</center>\r\n<hr><center>nginx/1.22.1</center>\r\n</body>\r\n"
    b"</html>\r\n")


def test_nginx_refusing_a_missing_client_certificate_is_a_systemic_rejection():
    answer = classify(400, httpx.Headers({"content-type": "text/html"}), NGINX_NO_CERTIFICATE)
    assert answer.verdict is Verdict.PERMANENT  # alone, it would fail the job
    g = gate()
    decisions = [g.judge(uuid.uuid4(), answer, order_id=f"order-{i}") for i in range(5)]
    assert all(d.hold_seconds for d in decisions[:4])
    assert decisions[4].pause[0] is PauseReason.REJECTING  # type: ignore[index]
    assert len(g.settle()[0]) == 4
