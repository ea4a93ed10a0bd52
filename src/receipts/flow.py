"""Provider flow control as a pod sees it: outage and rejection detection, the
pause, the probe, held verdicts.

Pure decisions, no I/O (docs/design.md §11). The worker feeds every delivery
outcome to a :class:`ProviderGate` and every claim's :class:`FlowState` to
it; the gate answers what the fleet-wide state in ``receipt_flow`` should
become (extend the pause, or resume after a probe), whether a failed
attempt gives its attempt back, and whether a permanent verdict is written
now, held, or turned into a retry. The worker carries those answers out with
one statement each.

The rules:

* **Outage.** Over the last ``window_jobs`` distinct jobs answered within
  ``window_seconds``, take each job's latest outcome. When at least
  ``min_jobs`` distinct jobs failed with a provider failure (5xx, 429,
  timeout, connection lost, connect error) and they are at least
  ``failure_ratio`` of the distinct jobs answered, the provider is in an
  outage: pause the fleet for ``outage_pause_seconds``.
  One job failing again and again counts once, so a single poisoned order
  cannot pause the fleet.
* **Systemic rejection.** The same rule over *the same permanent answer*: when
  at least ``min_jobs`` distinct jobs in the window got the same rejection
  (the same 4xx status with the same body shape, see
  :func:`rejection_signature`, or a TLS failure, see :func:`tls_failure`)
  and they are at least ``failure_ratio`` of the distinct jobs answered, the
  provider is rejecting everything, not judging orders: pause the fleet with
  reason ``rejecting`` and probe, as for an outage.
* **Held verdicts.** A 4xx rejection that is not (yet) part of a systemic
  rejection is *held* instead of failing the job at once: it fails when the
  provider has accepted ``min_jobs`` deliveries *sent after the rejection
  arrived* (so it is not rejecting everything now; answers to requests
  already in flight prove nothing), or when the pod has nothing more in
  flight and nothing more to claim (no answer is coming), or after
  ``window_seconds`` (bounded by the lease); it becomes a retry with its
  attempt given back if a systemic rejection is declared meanwhile. So the
  first rejections of a systemic one fail no job, and a genuine bad order
  fails as soon as a few later deliveries show the provider accepting
  others, or at once in a quiet queue.
* **Credentials.** A 401/403 pauses the fleet for ``auth_pause_seconds``: a
  bad token must not burn every job's attempts.
* **Retry-After.** A 429 carrying ``Retry-After`` pauses the fleet for that
  long (clamped to ``retry_after_max_seconds``): the provider asked all of
  us, not one job, to wait.
* **Probe.** While an outage, auth or rejecting pause runs, one pod (the
  winner of ``begin_probe``) claims one job every ``probe_interval_seconds``
  (after the last failure, whatever the pause has grown to); a
  ``Retry-After`` or operator's pause simply ends when its time is up. If the
  provider answers the probe properly (delivered, 409 in progress, or — for an
  outage or auth pause — a definite 4xx), the pause ends; if it fails again
  (for a rejecting pause: if it is rejected again), the pause doubles
  (jittered, capped at ``pause_max_seconds``) and the next probe follows the
  interval.
* **Refund.** A provider failure or rejection while the pod knows the fleet
  is paused (or the failure that starts a pause) gives its attempt back: jobs
  in flight when the provider went down keep their attempt.
"""

from __future__ import annotations

import heapq
import random
import re
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass
from datetime import datetime

from receipts.model import FlowState, Outcome, PauseReason, Reason, Verdict
from receipts.retry import RETRY_AFTER_MAX_SECONDS

#: Outcomes that say the provider, not the job, is failing.
PROVIDER_FAILURES = frozenset({
    Reason.PROVIDER_5XX, Reason.RATE_LIMITED, Reason.TIMEOUT, Reason.CONNECTION_LOST,
    Reason.CONNECT_ERROR,
})
#: Outcomes that prove the provider is up and answering (a probe of these resumes).
PROVIDER_ANSWERS = frozenset({Reason.DELIVERED, Reason.REJECTED, Reason.IN_PROGRESS})
#: Answers that show the provider accepting an order (evidence against a held rejection).
_ACCEPTED = frozenset({Reason.DELIVERED, Reason.IN_PROGRESS})
#: The rejection signature of every TLS failure (:func:`tls_failure`).
TLS_SIGNATURE = "tls"

#: The kind of a provider failure in the detector's window (compared by
#: identity; no signature starts with a NUL).
_FAILED = "\x00failed"

#: ``[SSL: CODE]`` in an error text: OpenSSL's reason code, as Python's ssl
#: module, httpx and aiohttp all spell it.
_SSL_CODE = re.compile(r"\[SSL: ([A-Z0-9_]+)\]")
#: Variable parts of a rejection's text: numbers and hex ids (with a digit).
_VARIABLE = re.compile(r"\b(?=[0-9a-f-]*[0-9])[0-9a-f]+(?:-[0-9a-f]+)*\b")


def tls_failure(outcome: Outcome) -> bool:
    """True when *outcome* is a TLS failure: nothing was delivered because the
    TLS exchange itself failed, so the connection, not the order, is at fault.

    That is a connect error or lost connection whose detail carries OpenSSL's
    reason code (``[SSL: CODE]``: a peer's alert such as
    ``TLSV13_ALERT_CERTIFICATE_REQUIRED`` or ``SSLV3_ALERT_HANDSHAKE_FAILURE``,
    ``CERTIFICATE_VERIFY_FAILED``, ``WRONG_VERSION_NUMBER``…) or names a
    certificate verification error. An end of file during the handshake
    (``UNEXPECTED_EOF_WHILE_READING``) is not one: a load balancer with no
    healthy backend closes that way, which is an outage. A peer that resets
    the connection without an alert cannot be told from a crash, and counts
    as a connection lost (an outage) too.
    """
    if outcome.reason not in (Reason.CONNECT_ERROR, Reason.CONNECTION_LOST):
        return False
    detail = outcome.detail
    code = _SSL_CODE.search(detail)
    if code is not None:
        return "EOF" not in code.group(1)
    return "SSLCertVerificationError" in detail or "CertificateError" in detail


def rejection_signature(outcome: Outcome, order_id: str = "") -> str | None:
    """What makes two rejections "the same answer", or None for an outcome that is
    no rejection.

    A 4xx rejection (``rejected``) gives its status and the shape of its
    reason text (``Outcome.detail``: the JSON ``error``/``detail``/
    ``message`` or the text of the body, docs/design.md §3), lower-cased,
    with the job's *order_id* and every number or hex id replaced, so "order
    123 not found" and "order 456 not found" are one shape. A TLS failure
    (:func:`tls_failure`) gives :data:`TLS_SIGNATURE`.
    """
    if outcome.reason is Reason.REJECTED:
        text = outcome.detail
        if order_id:
            text = text.replace(order_id, "<order>")
        return f"{outcome.status} {_VARIABLE.sub('#', text.lower())}"
    if tls_failure(outcome):
        return TLS_SIGNATURE
    return None


#: The defaults of :class:`FlowPolicy` that are settings (seconds, jobs, a ratio);
#: ``Settings`` takes ``RECEIPTS_OUTAGE_*``, ``RECEIPTS_AUTH_PAUSE_SECONDS`` and
#: ``RECEIPTS_PAUSE_MAX_SECONDS``'s defaults from these, so the two cannot drift.
WINDOW_SECONDS = 30.0
MIN_JOBS = 5
FAILURE_RATIO = 0.8
OUTAGE_PAUSE_SECONDS = 5.0
AUTH_PAUSE_SECONDS = 30.0
PAUSE_MAX_SECONDS = 300.0


@dataclass(frozen=True, slots=True)
class FlowPolicy:
    """The knobs of :class:`ProviderGate`, all durations in seconds.

    The systemic-rejection rule uses the outage rule's window, minimum and
    ratio (docs/design.md §11 says why).

    Attributes:
        window_seconds: how far back outage and rejection detection look; also
            the longest a rejection is held.
        window_jobs: how many of the most recent distinct jobs they look at.
        min_jobs: distinct failed (or identically rejected) jobs needed before
            an outage (or a systemic rejection) can be declared.
        failure_ratio: share of distinct answered jobs that must have failed (0–1].
        outage_pause_seconds: first pause after an outage or systemic rejection.
        auth_pause_seconds: first pause after a 401/403.
        pause_max_seconds: cap of a pause doubled by failed probes.
        retry_after_max_seconds: cap of a pause asked for by ``Retry-After``.
        probe_interval_seconds: while a probed pause runs, the next probe may
            start this long after the last failure, however long the pause.
    """

    window_seconds: float = WINDOW_SECONDS
    window_jobs: int = 20
    min_jobs: int = MIN_JOBS
    failure_ratio: float = FAILURE_RATIO
    outage_pause_seconds: float = OUTAGE_PAUSE_SECONDS
    auth_pause_seconds: float = AUTH_PAUSE_SECONDS
    pause_max_seconds: float = PAUSE_MAX_SECONDS
    retry_after_max_seconds: float = RETRY_AFTER_MAX_SECONDS
    probe_interval_seconds: float = 5.0


@dataclass(frozen=True, slots=True)
class Decision:
    """What the gate decided about one outcome.

    Attributes:
        pause: (reason, seconds) to extend the fleet-wide pause with, or None.
        resume: the probe's deadline to resume with (``JobQueue.resume``), or None.
        refund: give this attempt back (the provider, not the job, failed).
        probe: the outcome was the probe's answer.
        requeue: a permanent verdict that must not fail the job (a systemic
            rejection): write it as a retry, with ``refund``.
        hold_seconds: hold this permanent verdict for at most this long, then
            write what :meth:`ProviderGate.settle` says; None: write it now.
    """

    pause: tuple[PauseReason, float] | None = None
    resume: datetime | None = None
    refund: bool = False
    probe: bool = False
    requeue: bool = False
    hold_seconds: float | None = None


#: The decision of most outcomes: nothing to do for the fleet (shared, immutable).
NO_DECISION = Decision()


class OutageDetector:
    """Distinct-job outage and rejection detection over a sliding window (module doc).

    The window holds each distinct job's latest answer, at most
    ``policy.window_jobs`` of the most recent jobs and none older than
    ``policy.window_seconds``: at high throughput the last few dozen jobs
    decide (an outage is seen within a fraction of a second, not after the
    successes of the last 30 s have aged out), at low throughput the time
    bound keeps stale answers from counting. O(1) per answer.

    Args:
        policy: the window, minimum sample and ratio.
        clock: a monotonic clock in seconds (tests pass their own).
    """

    def __init__(self, policy: FlowPolicy, clock: object = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        #: job id → (time, kind): kind None for a proper answer, _FAILED for a
        #: provider failure, else the rejection's signature.
        self._latest: OrderedDict[uuid.UUID, tuple[float, str | None]] = OrderedDict()
        self._failures = 0  # failed answers in the window
        self._rejections: Counter[str] = Counter()  # rejections in the window, by signature

    def observe(self, job_id: uuid.UUID, failed: bool = False, *,
                rejection: str | None = None) -> PauseReason | None:
        """Record *job_id*'s latest answer: a provider failure (*failed*), a
        rejection with signature *rejection*, or else an acceptance (delivered,
        409 in progress).

        Returns ``OUTAGE`` or ``REJECTING`` when the window now shows one (see
        the module doc), else None.
        """
        now: float = self._clock()  # type: ignore[operator]
        kind = _FAILED if failed else rejection
        previous = self._latest.pop(job_id, None)
        if previous is not None:
            self._forget(previous[1])
        self._latest[job_id] = (now, kind)
        if kind is _FAILED:
            self._failures += 1
        elif kind is not None:
            self._rejections[kind] += 1
        horizon = now - self.policy.window_seconds
        while self._latest:
            first = next(iter(self._latest.values()))
            if first[0] >= horizon and len(self._latest) <= self.policy.window_jobs:
                break
            _, (_, old) = self._latest.popitem(last=False)
            self._forget(old)
        if kind is None:
            return None
        count = self._failures if kind is _FAILED else self._rejections[kind]
        if count >= self.policy.min_jobs and count >= self.policy.failure_ratio * len(self._latest):
            return PauseReason.OUTAGE if kind is _FAILED else PauseReason.REJECTING
        return None

    def _forget(self, kind: str | None) -> None:
        if kind is _FAILED:
            self._failures -= 1
        elif kind is not None:
            self._rejections[kind] -= 1
            if not self._rejections[kind]:
                del self._rejections[kind]

    def reset(self) -> None:
        """Forget the window (after a pause: the next outage is judged afresh)."""
        self._latest.clear()
        self._failures = 0
        self._rejections.clear()


@dataclass(slots=True)
class _Held:
    """A held rejection: when it was held, and its deadline (monotonic seconds)."""

    since: float
    deadline: float


class ProviderGate:
    """One pod's view of the fleet-wide provider pause, and its decisions.

    Args:
        policy: a :class:`FlowPolicy`.
        clock: monotonic seconds (tests pass their own).
        rng: randomness for jitter (tests pass a seeded one).
    """

    def __init__(self, policy: FlowPolicy, *, clock: object = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.policy = policy
        self._clock = clock
        self._rng = rng or random.Random()
        self.detector = OutageDetector(policy, clock)
        self.reason: PauseReason | None = None
        self._resume_at = 0.0  # monotonic: when a probe may be tried
        self.probe_job: uuid.UUID | None = None
        self.probe_until: datetime | None = None
        self.probe_pause_seconds = 0.0
        self.probe_reason: PauseReason | None = None
        self._held: dict[uuid.UUID, _Held] = {}
        self._systemic = False  # a systemic rejection was just declared here
        #: Send times of the latest accepted deliveries (a min-heap of at most
        #: min_jobs), the evidence that fails a held rejection.
        self._accepted: list[float] = []

    def _now(self) -> float:
        return self._clock()  # type: ignore[operator,no-any-return]

    @property
    def paused(self) -> bool:
        """True while this pod believes the fleet is paused."""
        return self.reason is not None

    @property
    def held(self) -> int:
        """Rejections held now (see :meth:`settle`)."""
        return len(self._held)

    def pause_left(self) -> float:
        """Seconds until a probe may be tried, or a pause ends (0 when due or not paused)."""
        return max(0.0, self._resume_at - self._now()) if self.paused else 0.0

    def observe_flow(self, flow: FlowState) -> None:
        """Adopt the fleet-wide state a statement returned."""
        if flow.pause_reason is None:
            if self.paused:
                self.detector.reset()
            self.reason = None
            return
        self.reason = flow.pause_reason
        left = max(0.0, flow.pause_left_seconds or 0.0)
        # Spread the pods' probe attempts a little; only one wins anyway.
        self._resume_at = self._now() + left * self._rng.uniform(1.0, 1.1)

    def start_probe(self, job_id: uuid.UUID, probe_until: datetime, pause_seconds: float,
                    reason: PauseReason | None = None) -> None:
        """This pod won ``begin_probe`` and claimed *job_id* as the probe of a pause
        of *reason* (default: the reason this pod knows) and length *pause_seconds*."""
        self.probe_job, self.probe_until = job_id, probe_until
        self.probe_pause_seconds = pause_seconds
        self.probe_reason = reason or self.reason

    def judge(self, job_id: uuid.UUID, outcome: Outcome, *, order_id: str = "",
              hold_seconds: float | None = None, sent_at: float | None = None) -> Decision:
        """Decide what *outcome* of *job_id* means for the fleet (see the module doc).

        *order_id* is the job's order (masked out of a rejection's shape);
        *hold_seconds* bounds how long a rejection may be held (the time its
        lease still allows; default ``window_seconds``); *sent_at* is when the
        delivery began, on this gate's clock (default: now).
        """
        reason = outcome.reason
        if reason in _ACCEPTED:
            if self._held:  # an acceptance answered while none is held proves nothing later
                self._accept(self._now() if sent_at is None else sent_at)
            if reason is Reason.DELIVERED and job_id != self.probe_job:  # the common case
                self.detector.observe(job_id)
                return NO_DECISION
        rejection = rejection_signature(outcome, order_id)
        permanent = outcome.verdict is Verdict.PERMANENT
        provider_failed = rejection is None and (
            reason in PROVIDER_FAILURES or reason is Reason.AUTH_REJECTED)
        if job_id == self.probe_job and self.probe_until is not None:
            until, self.probe_job, self.probe_until = self.probe_until, None, None
            rejected_again = rejection is not None and (
                rejection == TLS_SIGNATURE or self.probe_reason is PauseReason.REJECTING)
            if provider_failed or rejected_again:
                seconds = self._jitter(min(self.policy.pause_max_seconds,
                                           max(self.probe_pause_seconds, 0.01) * 2))
                if outcome.retry_after_seconds is not None:
                    seconds = max(seconds, min(outcome.retry_after_seconds,
                                               self.policy.retry_after_max_seconds))
                cause = PauseReason.REJECTING if rejected_again else self._pause_reason(outcome)
                return Decision(pause=(cause, seconds), refund=True, requeue=permanent,
                                probe=True)
            if reason not in PROVIDER_ANSWERS:
                return Decision(probe=True)  # our own trouble (internal error): probe again later
            self.detector.reset()
            if rejection is None:
                return Decision(resume=until, probe=True)
            # The provider judged this order (an outage probe answered 4xx): it is
            # back; the verdict itself is judged like any other rejection.
            return self._judge_rejection(job_id, rejection, permanent, hold_seconds,
                                         resume=until, paused=False)
        if rejection is not None:
            return self._judge_rejection(job_id, rejection, permanent, hold_seconds,
                                         resume=None, paused=self.paused)
        if not provider_failed:
            if reason in PROVIDER_ANSWERS:
                self.detector.observe(job_id)
            return NO_DECISION
        pause = self._pause_for(job_id, outcome)
        return Decision(pause=pause, refund=self.paused or pause is not None)

    def _judge_rejection(self, job_id: uuid.UUID, rejection: str, permanent: bool,
                         hold_seconds: float | None, *, resume: datetime | None,
                         paused: bool) -> Decision:
        probe = resume is not None
        if paused and self.reason is PauseReason.REJECTING:
            # The fleet is paused for this very reason: not this job's fault.
            return Decision(refund=True, requeue=permanent)
        if not paused and self.detector.observe(
                job_id, rejection=rejection) is PauseReason.REJECTING:
            self.detector.reset()
            self._systemic = True  # settle() turns what is held into retries
            pause = (PauseReason.REJECTING, self._jitter(self.policy.outage_pause_seconds))
            return Decision(pause=pause, refund=True, requeue=permanent, resume=resume,
                            probe=probe)
        if not permanent:  # a TLS failure: a failure like a 5xx
            return Decision(refund=paused, resume=resume, probe=probe)
        hold = self.policy.window_seconds if hold_seconds is None else min(
            hold_seconds, self.policy.window_seconds)
        if hold <= 0:
            return Decision(resume=resume, probe=probe)
        now = self._now()
        self._held[job_id] = _Held(now, now + hold)
        return Decision(hold_seconds=hold, resume=resume, probe=probe)

    def settle(self, *, final: bool = False, idle: bool = False
               ) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
        """Decide held rejections: returns (ids to retry with the attempt given back,
        ids to fail now); ids not returned stay held.

        Every held rejection becomes a retry once a systemic rejection is declared
        (here, or in the fleet state this pod read), or when *final* (the worker
        stops: too little evidence to fail anything). One fails once the
        provider has accepted ``min_jobs`` deliveries sent after it was held
        (it judges orders, it does not reject everything now), or at its
        deadline; every one fails when *idle* (the pod has nothing in flight
        and the queue gave it nothing more: no further answer will come to
        decide, and fewer than ``min_jobs`` could not make a systemic
        rejection anyway).
        """
        if not self._held:
            self._systemic = False
            return [], []
        if final or self._systemic or self.reason is PauseReason.REJECTING:
            ids = list(self._held)
            self._held.clear()
            self._systemic = False
            return ids, []
        now = self._now()
        # The min_jobs-th latest send time of an accepted delivery: every held
        # rejection before it has seen min_jobs acceptances sent after it.
        proof = self._accepted[0] if len(self._accepted) >= self.policy.min_jobs else None
        due = [job_id for job_id, h in self._held.items()
               if idle or now >= h.deadline or (proof is not None and proof >= h.since)]
        for job_id in due:
            del self._held[job_id]
        return [], due

    def _accept(self, sent_at: float) -> None:
        """Count an accepted delivery sent at *sent_at* (keeps the latest min_jobs)."""
        accepted = self._accepted
        if len(accepted) < self.policy.min_jobs:
            heapq.heappush(accepted, sent_at)
        elif sent_at > accepted[0]:
            heapq.heapreplace(accepted, sent_at)

    def _pause_for(self, job_id: uuid.UUID, outcome: Outcome) -> tuple[PauseReason, float] | None:
        if outcome.reason is Reason.AUTH_REJECTED:
            if self.reason is PauseReason.AUTH:
                return None  # already paused for it: answers of older jobs do not compound
            return PauseReason.AUTH, self.policy.auth_pause_seconds
        if outcome.reason is Reason.RATE_LIMITED and outcome.retry_after_seconds is not None:
            seconds = min(outcome.retry_after_seconds, self.policy.retry_after_max_seconds)
            if seconds > 0:
                return PauseReason.RETRY_AFTER, seconds
        if self.paused:
            return None
        if self.detector.observe(job_id, failed=True) is PauseReason.OUTAGE:
            self.detector.reset()
            return PauseReason.OUTAGE, self._jitter(self.policy.outage_pause_seconds)
        return None

    def _pause_reason(self, outcome: Outcome) -> PauseReason:
        if outcome.reason is Reason.AUTH_REJECTED:
            return PauseReason.AUTH
        if outcome.reason is Reason.RATE_LIMITED and outcome.retry_after_seconds is not None:
            return PauseReason.RETRY_AFTER
        return PauseReason.OUTAGE

    def _jitter(self, seconds: float) -> float:
        return seconds * self._rng.uniform(0.9, 1.1)
