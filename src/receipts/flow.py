"""Provider flow control as a pod sees it: outage detection, rejection verdicts
judged on evidence, the pause, the probe.

Pure decisions, no I/O (docs/design.md §11). The worker feeds every delivery
outcome to a :class:`ProviderGate` and every claim's :class:`FlowState` to
it; the gate answers what the fleet-wide state in ``receipt_flow`` should
become (extend the pause, or resume after a probe), whether a failed
attempt gives its attempt back, and whether a rejection is a verdict about
the order (the job fails), needs confirming, or is held (the job goes back
to ready, its attempt given back). The shell in :mod:`receipts.gate` carries
those answers out.

The rules:

* **Outage.** Over the last ``window_jobs`` distinct jobs answered within
  ``window_seconds``, take each job's latest outcome. When at least
  ``min_jobs`` distinct jobs failed with a provider failure (5xx, 429,
  timeout, connection lost, connect error) and they are at least
  ``failure_ratio`` of the distinct jobs answered, the provider is in an
  outage: pause the fleet for ``outage_pause_seconds``.
  One job failing again and again counts once, so a single poisoned order
  cannot pause the fleet.
* **A rejection is a verdict only on evidence.** A 4xx other than 408, 409
  and 429 (classified ``rejected``) says something about the order only when
  the provider is seen accepting *other* orders around it (a *bracket*): an
  acceptance (2xx, or 409 "in progress") of another job whose request was
  sent at most ``bracket_seconds`` before the rejected one, and one whose
  request was *sent* at most ``bracket_seconds`` after the rejection's answer
  arrived (this pod's own deliveries, on its monotonic clock). The second is
  causal: the provider decided it after it had rejected ours, whatever the
  latencies, so a provider that has just turned to rejecting everything
  brackets nothing. A provider flapping between rejecting and accepting
  everything in phases of *L* seconds brackets a rejection only at the end
  of a rejecting phase (the latencies may reorder the first side), and then
  the confirmation below lands in the accepting phase and is delivered.
  Whatever the bodies and statuses say, they do not enter the judgement.
* **Two strikes.** A bracketed rejection is the first strike: the job is
  sent again at once, within the same lease (same idempotency key and body:
  the *confirmation*). It fails for good when the confirmation is rejected
  too while the provider still accepts others: an acceptance answered at
  most ``bracket_seconds`` before the confirmation was sent, and this pod
  sees no run of unexplained rejections (below); or, later, a bracket of
  its own. An order
  the provider accepted on the second try is delivered.
* **Held.** A rejection without that evidence is *held*: its slot is free,
  its lease kept, for at most ``2 × bracket_seconds`` (an acceptance sent
  after it may still be answered; a pod with nothing else in flight holds
  it too: nothing fails for being idle). Then, or at once when the worker
  stops, it goes back to ready with its attempt given back (a delay per job
  from ``held_retry_seconds``, doubled while no acceptance comes near it)
  and ``last_error`` saying it is a held rejection.
  Nothing fails without evidence.
* **Systemic rejection.** A rejection, or a TLS failure (:func:`tls_failure`),
  sent more than ``bracket_seconds`` after the latest acceptance sent is
  *unexplained*. When at least ``min_jobs`` distinct jobs are unexplained
  and the oldest of them was sent ``rejecting_after_seconds`` ago with no
  acceptance sent since (less ``bracket_seconds``), the provider is
  rejecting everything, not judging orders: pause the fleet with reason
  ``rejecting`` (a TLS failure, which no invalid order causes, does not
  wait: ``min_jobs`` unexplained jobs suffice). Each acceptance explains the
  rejections sent up to ``bracket_seconds`` after it. Meanwhile the pod keeps at most
  ``probe_jobs`` deliveries in flight (:meth:`ProviderGate.inflight_cap`) and
  starts at most ``suspect_sends_per_second`` new ones a second
  (:meth:`ProviderGate.suspect_allowance`), as it does after
  ``suspect_streak`` rejections answered in a row with no acceptance among
  them (sooner than the bracket can explain anything): enough that among orders 95 %
  invalid an acceptance shows up within the wait (60 sends, 95 % of the
  time), few enough that a provider rejecting everything gets a few dozen
  requests per pod before the pause, not the hundreds a second a fast
  provider would otherwise answer.
  The acceptances are never forgotten on a pause or a resume: after a
  resume, a few rejections in a row cannot pause again before
  ``rejecting_after_seconds`` without an acceptance.
* **Credentials.** A 401/403 pauses the fleet for ``auth_pause_seconds``: a
  bad token must not burn every job's attempts.
* **Retry-After.** A 429 carrying ``Retry-After`` pauses the fleet for that
  long (clamped to ``retry_after_max_seconds``): the provider asked all of
  us, not one job, to wait.
* **Probe.** While an outage, auth or rejecting pause runs, one pod (the
  winner of ``begin_probe``) claims one job every ``probe_interval_seconds``,
  or up to ``probe_jobs`` jobs for a ``rejecting`` pause, where one order's
  rejection says nothing about the provider (after the last failure, whatever the pause
  has grown to); a ``Retry-After`` or operator's pause simply ends when its
  time is up. The pause ends as soon as the provider accepts one probe job
  (or, for an outage or auth pause, answers one with a definite 4xx), or
  any other delivery of this pod is accepted meanwhile. It doubles
  (jittered, capped at ``pause_max_seconds``) only when *every* probe job
  failed or was rejected: one invalid order among the probes cannot grow it.
* **Refund.** A provider failure or rejection while the pod knows the fleet
  is paused (or the failure that starts a pause) gives its attempt back: jobs
  in flight when the provider went down keep their attempt.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import re
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
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
#: Answers that show the provider accepting an order: the evidence of a verdict.
ACCEPTED = frozenset({Reason.DELIVERED, Reason.IN_PROGRESS})
#: ``last_error`` of a held rejection starts with this (``receipts jobs list --held``).
HELD_PREFIX = "held rejection: "
#: Held rejections remembered per pod for their growing retry delay.
_HELD_MEMORY = 10_000
#: Longest delay of a held rejection's retry, seconds.
HELD_RETRY_MAX_SECONDS = 30.0

#: ``[SSL: CODE]`` in an error text: OpenSSL's reason code, as Python's ssl
#: module, httpx and aiohttp all spell it.
_SSL_CODE = re.compile(r"\[SSL: ([A-Z0-9_]+)\]")


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


def is_rejection(outcome: Outcome) -> bool:
    """True for an answer that may be a verdict about the order: a permanent 4xx
    (``rejected``: not 408, 409 or 429, see :func:`receipts.delivery.classify`)."""
    return outcome.reason is Reason.REJECTED and outcome.verdict is Verdict.PERMANENT


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

    Attributes:
        window_seconds: how far back outage detection looks.
        window_jobs: how many of the most recent distinct jobs it looks at.
        min_jobs: distinct failed jobs needed before an outage can be declared;
            distinct unexplained rejections before a systemic rejection can.
        failure_ratio: share of distinct answered jobs that must have failed (0–1].
        outage_pause_seconds: first pause after an outage or systemic rejection.
        auth_pause_seconds: first pause after a 401/403.
        pause_max_seconds: cap of a pause doubled by failed probes.
        retry_after_max_seconds: cap of a pause asked for by ``Retry-After``.
        probe_interval_seconds: while a probed pause runs, the next probe may
            start this long after the last failure, however long the pause.
        bracket_seconds: how close acceptances of other jobs must be, before
            the rejected request and after its answer, to make it a verdict
            about the order; with the confirmation, a flapping provider whose
            phases are longer than this plus two latencies fails no valid
            order (docs/design.md §11).
        rejecting_after_seconds: how long unexplained rejections of
            ``min_jobs`` distinct jobs must go on with no acceptance before
            the fleet pauses for ``rejecting``.
        probe_jobs: most jobs one probe of a pause claims.
        suspect_sends_per_second: most new deliveries a pod starts a second
            while ``min_jobs`` or more rejections are unexplained, or after
            ``suspect_streak`` rejections in a row (module doc).
        suspect_streak: rejections answered in a row, no acceptance among them,
            that start the pace before any is unexplained.
        outage_quiet_seconds: with adaptive concurrency (None: off), an outage
            is declared only after this pod has seen failures for this long with
            no acceptance among them: a provider that refuses some requests but
            accepts others is at its capacity, not down, and the limit
            (receipts.capacity) answers that. The time counts from the first
            failure after the last acceptance, so a pod that just joined, or one
            that was idle, does not take a full provider's first refusals for
            an outage.
        held_retry_seconds: first delay of a held rejection's retry; it doubles
            each time this pod holds the same job again (≤ 30 s).
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
    bracket_seconds: float = 1.0
    rejecting_after_seconds: float = 3.0
    probe_jobs: int = 5
    suspect_sends_per_second: float = 20.0
    suspect_streak: int = 50
    outage_quiet_seconds: float | None = None
    held_retry_seconds: float = 1.0


@dataclass(frozen=True, slots=True)
class Decision:
    """What the gate decided about one outcome.

    Attributes:
        pause: (reason, seconds) to extend the fleet-wide pause with, or None.
        resume: the probe's deadline to resume with (``JobQueue.resume``), or None.
        refund: give this attempt back (the provider, not the job, failed).
        probe: the outcome decided the probe (resumed, or the pause grows).
        requeue: a rejection that must not fail the job: write it as a
            retry (a held rejection), with ``refund`` and ``delay_seconds``.
        hold_seconds: hold this rejection (slot free, lease kept) for at most
            this long, then write what :meth:`ProviderGate.settle` says; None:
            decided now.
        delay_seconds: the retry delay of a requeued rejection, seconds.
    """

    pause: tuple[PauseReason, float] | None = None
    resume: datetime | None = None
    refund: bool = False
    probe: bool = False
    requeue: bool = False
    hold_seconds: float | None = None
    delay_seconds: float = 0.0


#: The decision of most outcomes: nothing to do for the fleet (shared, immutable).
NO_DECISION = Decision()


@dataclass(slots=True)
class Settlement:
    """What :meth:`ProviderGate.settle` decided about held rejections.

    Attributes:
        requeue: (job id, retry delay in seconds): back to ready, attempt given back.
        confirm: job ids with a first strike: send again now, same lease.
        fail: job ids whose confirmation was rejected on evidence: fail them.
        pause: (``rejecting``, seconds) when a systemic rejection is declared, else None.
    """

    requeue: list[tuple[uuid.UUID, float]] = field(default_factory=list)
    confirm: list[uuid.UUID] = field(default_factory=list)
    fail: list[uuid.UUID] = field(default_factory=list)
    pause: tuple[PauseReason, float] | None = None

    def __bool__(self) -> bool:
        return bool(self.requeue or self.confirm or self.fail or self.pause)


class OutageDetector:
    """Distinct-job outage detection over a sliding window (module doc).

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
        #: job id → (time, failed) of its latest answer.
        self._latest: OrderedDict[uuid.UUID, tuple[float, bool]] = OrderedDict()
        self._failures = 0  # failed answers in the window

    def observe(self, job_id: uuid.UUID, failed: bool = False) -> PauseReason | None:
        """Record *job_id*'s latest answer: a provider failure (*failed*), or else
        an answer (delivered, 409 in progress, a 4xx).

        Returns ``OUTAGE`` when the window now shows one (module doc), else None.
        """
        now: float = self._clock()  # type: ignore[operator]
        previous = self._latest.pop(job_id, None)
        if previous is not None and previous[1]:
            self._failures -= 1
        self._latest[job_id] = (now, failed)
        self._failures += failed
        horizon = now - self.policy.window_seconds
        while self._latest:
            first = next(iter(self._latest.values()))
            if first[0] >= horizon and len(self._latest) <= self.policy.window_jobs:
                break
            _, (_, old) = self._latest.popitem(last=False)
            self._failures -= old
        if not failed:
            return None
        count = self._failures
        if count >= self.policy.min_jobs and count >= self.policy.failure_ratio * len(self._latest):
            return PauseReason.OUTAGE
        return None

    def reset(self) -> None:
        """Forget the window (after a pause: the next outage is judged afresh)."""
        self._latest.clear()
        self._failures = 0


class _Times:
    """Monotonic times in order, the last ``keep_seconds`` of them; O(log n) queries."""

    def __init__(self, keep_seconds: float) -> None:
        self.keep_seconds = keep_seconds
        self._times: list[float] = []
        self._head = 0  # entries before it are expired (trimmed in bulk)

    def add(self, at: float) -> None:
        times = self._times
        if not times or at >= times[-1]:
            times.append(at)
        else:
            bisect.insort(times, at, lo=self._head)
        horizon = times[-1] - self.keep_seconds
        if times[self._head] < horizon:
            self._head = bisect.bisect_left(times, horizon, lo=self._head)
            if self._head > 1024 and self._head * 2 > len(times):
                del times[:self._head]
                self._head = 0

    def any_in(self, low: float, high: float, *, low_open: bool = False) -> bool:
        """True when a time lies in [*low*, *high*] (or (*low*, *high*] with *low_open*)."""
        times = self._times
        find = bisect.bisect_right if low_open else bisect.bisect_left
        i = find(times, low, lo=self._head)
        return i < len(times) and times[i] <= high


class Evidence:
    """This pod's acceptances: does the provider accept other orders around a request?

    Keeps, for the accepted deliveries of the last ``keep_seconds``, when each
    request was sent and when its answer arrived (monotonic seconds), and the
    latest send time ever. The questions are causal, so that the spread of
    latencies cannot fake an order: an acceptance *answered* before a request
    was sent was decided by the provider before it saw that request; one
    *sent* after a rejection's answer arrived was decided after the provider
    rejected.

    Args:
        keep_seconds: how long a time is kept (at least the longest hold plus a
            bracket).
    """

    def __init__(self, keep_seconds: float) -> None:
        self._sent = _Times(keep_seconds)
        self._answered = _Times(keep_seconds)
        #: The latest send time of an acceptance ever seen, or None.
        self.latest: float | None = None

    def add(self, sent_at: float, answered_at: float) -> None:
        """Record an acceptance of a request sent at *sent_at*, answered at *answered_at*."""
        self._sent.add(sent_at)
        self._answered.add(answered_at)
        if self.latest is None or sent_at > self.latest:
            self.latest = sent_at

    def answered_before(self, sent_at: float, within: float) -> bool:
        """True when an acceptance was answered in the *within* seconds before *sent_at*."""
        return self._answered.any_in(sent_at - within, sent_at)

    def sent_before(self, sent_at: float, within: float) -> bool:
        """True when an acceptance's request was sent in the *within* seconds up to
        *sent_at*."""
        return self._sent.any_in(sent_at - within, sent_at)

    def after(self, answered_at: float, within: float) -> bool:
        """True when an acceptance's request was sent in the *within* seconds after
        *answered_at* (strictly after it)."""
        return self._sent.any_in(answered_at, answered_at + within, low_open=True)

    def answered_since(self, since: float) -> bool:
        """True when an acceptance was answered at or after *since* (within the
        ``keep_seconds`` kept)."""
        return self._answered.any_in(since, math.inf)

    def near(self, low: float, high: float) -> bool:
        """True when an acceptance's request was sent in [*low*, *high*]."""
        return self._sent.any_in(low, high)


@dataclass(slots=True)
class _Held:
    """A held rejection: its request's send time, its answer's arrival, its deadline
    (monotonic seconds), whether it is the confirmation (second strike)."""

    sent_at: float
    answered_at: float
    deadline: float
    confirming: bool


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
        self.evidence = Evidence(keep_seconds=max(
            4 * policy.bracket_seconds + policy.rejecting_after_seconds,
            policy.outage_quiet_seconds or 0.0))
        self.reason: PauseReason | None = None
        self._resume_at = 0.0  # monotonic: when a probe may be tried
        #: The jobs of the probe this pod runs (not answered yet), or empty.
        self.probe_jobs: set[uuid.UUID] = set()
        self.probe_until: datetime | None = None
        self.probe_pause_seconds = 0.0
        self.probe_reason: PauseReason | None = None
        self._probe_rejected = False  # a probe job was rejected (for the cause)
        self._probe_failure: Outcome | None = None  # a probe job's provider failure
        self._held: dict[uuid.UUID, _Held] = {}
        #: Unexplained rejections: job id → send time (module doc).
        self._unexplained: dict[uuid.UUID, float] = {}
        #: How often this pod held each job lately (its retry delay doubles).
        self._held_count: OrderedDict[uuid.UUID, int] = OrderedDict()
        #: When this pod started deliveries during the last second while suspect.
        self._suspect_sends: deque[float] = deque()
        #: Rejections answered since the last acceptance answered.
        self._streak = 0
        #: When the first provider failure since the last acceptance was answered
        #: (monotonic; None: none since): the quiet rule of an outage counts from it.
        self._failing_since: float | None = None

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

    @property
    def probe_job(self) -> uuid.UUID | None:
        """One job of the probe still out, or None when no probe of this pod is out."""
        return next(iter(self.probe_jobs), None)

    @property
    def unexplained(self) -> int:
        """Distinct jobs rejected with no acceptance sent near or after them."""
        return len(self._unexplained)

    def inflight_cap(self) -> int | None:
        """Most deliveries this pod should have in flight now, or None for no cap.

        While at least ``min_jobs`` distinct jobs are unexplained (module doc)
        the provider may be rejecting everything: the pod keeps ``probe_jobs``
        deliveries going (enough for an acceptance to show up among orders that
        are mostly invalid) instead of sending its whole share of the queue to
        be rejected before the pause is declared.
        """
        return self.policy.probe_jobs if len(self._unexplained) >= self.policy.min_jobs else None

    def suspect_allowance(self, want: int) -> tuple[int, float]:
        """How many of *want* new deliveries this pod may start now, and, when none,
        how long to wait (seconds) for the next.

        While fewer than ``min_jobs`` rejections are unexplained: all of them.
        Otherwise at most ``suspect_sends_per_second`` in any one second (module
        doc), counted by :meth:`sent`.
        """
        if not self._suspect():
            self._suspect_sends.clear()
            return want, 0.0
        now = self._now()
        sends = self._suspect_sends
        while sends and sends[0] <= now - 1.0:
            sends.popleft()
        left = math.floor(self.policy.suspect_sends_per_second) - len(sends)
        if left <= 0:
            return 0, max(0.01, sends[0] + 1.0 - now) if sends else 0.01
        return min(want, left), 0.0

    def sent(self, n: int) -> None:
        """This pod started *n* deliveries just now (counted while suspect only)."""
        if n > 0 and self._suspect():
            now = self._now()
            self._suspect_sends.extend([now] * n)

    def _suspect(self) -> bool:
        return (len(self._unexplained) >= self.policy.min_jobs
                or self._streak >= self.policy.suspect_streak)

    def pause_left(self) -> float:
        """Seconds until a probe may be tried, or a pause ends (0 when due or not paused)."""
        return max(0.0, self._resume_at - self._now()) if self.paused else 0.0

    def observe_flow(self, flow: FlowState) -> None:
        """Adopt the fleet-wide state a statement returned."""
        if flow.pause_reason is None:
            if self.paused:
                self.detector.reset()
                # The fleet resumed on evidence (a probe accepted): rejections from
                # before it no longer count towards the next systemic rejection.
                self._unexplained.clear()
            self.reason = None
            return
        self.reason = flow.pause_reason
        left = max(0.0, flow.pause_left_seconds or 0.0)
        # Spread the pods' probe attempts a little; only one wins anyway.
        self._resume_at = self._now() + left * self._rng.uniform(1.0, 1.1)

    def probe_size(self, free: int) -> int:
        """How many jobs a probe claims with *free* slots (≥ 1).

        Several (``probe_jobs``) only for a ``rejecting`` pause, where one order's
        rejection says nothing about the provider; an outage or credentials pause
        probes with one job, since one answer decides and the provider is spared.
        """
        if self.reason is not PauseReason.REJECTING:
            return 1
        return max(1, min(free, self.policy.probe_jobs))

    def start_probe(self, job_ids: list[uuid.UUID] | uuid.UUID, probe_until: datetime,
                    pause_seconds: float, reason: PauseReason | None = None) -> None:
        """This pod won ``begin_probe`` and claimed *job_ids* as the probe of a pause
        of *reason* (default: the reason this pod knows) and length *pause_seconds*."""
        ids = [job_ids] if isinstance(job_ids, uuid.UUID) else list(job_ids)
        self.probe_jobs = set(ids)
        self.probe_until = probe_until
        self.probe_pause_seconds = pause_seconds
        self.probe_reason = reason or self.reason
        self._probe_rejected = False
        self._probe_failure = None

    # ------------------------------------------------------------ judging

    def judge(self, job_id: uuid.UUID, outcome: Outcome, *, hold_seconds: float | None = None,
              sent_at: float | None = None, confirming: bool = False,
              order_id: str = "") -> Decision:
        """Decide what *outcome* of *job_id* means (see the module doc).

        *hold_seconds* bounds how long a rejection may be held (the time its
        lease still allows; default ``2 × bracket_seconds``); *sent_at* is when
        the request was sent, on this gate's clock (default: now);
        *confirming*: the answer is the confirmation of a first strike.
        *order_id* is accepted for compatibility and not used: a verdict is
        judged on evidence, not on the answer's text.
        """
        del order_id
        now = self._now()
        sent = now if sent_at is None else sent_at
        reason = outcome.reason
        if reason in ACCEPTED:
            self._accepted(sent, now)
            if job_id in self.probe_jobs or (self.probe_jobs and self.probe_until is not None):
                return self._probe_accepted(job_id)
            self.detector.observe(job_id)
            return NO_DECISION
        rejection = is_rejection(outcome)
        tls = not rejection and tls_failure(outcome)
        if rejection or tls:
            self._rejected(job_id, sent)
        if job_id in self.probe_jobs and self.probe_until is None:
            self.probe_jobs.discard(job_id)  # the probe was decided: an answer like any other
        if job_id in self.probe_jobs:
            return self._probe_answer(job_id, outcome, sent, rejection, tls, hold_seconds,
                                      confirming)
        if rejection:
            return self._judge_rejection(job_id, sent, hold_seconds, confirming)
        provider_failed = tls or reason in PROVIDER_FAILURES or reason is Reason.AUTH_REJECTED
        if not provider_failed:
            if reason in PROVIDER_ANSWERS:
                self.detector.observe(job_id)
            return NO_DECISION
        if tls:
            # No order is judged by a TLS failure: retried with its attempt given
            # back, and counted towards a systemic rejection, which needs no wait:
            # no invalid order fails a TLS handshake.
            pause = None if self.paused else self._systemic(now, wait=False)
            return Decision(pause=pause, refund=True)
        pause = self._pause_for(job_id, outcome)
        return Decision(pause=pause, refund=self.paused or pause is not None)

    def _judge_rejection(self, job_id: uuid.UUID, sent: float, hold_seconds: float | None,
                         confirming: bool) -> Decision:
        if self.reason is PauseReason.REJECTING:
            # The fleet is paused for this very reason: not this job's fault.
            self._held.pop(job_id, None)
            return self._requeue(job_id)
        self.detector.observe(job_id)  # an answer: the provider is up
        pause = None if self.paused else self._systemic(self._now())
        if pause is not None:  # this rejection completes a systemic one
            self._held.pop(job_id, None)
            return dataclasses.replace(self._requeue(job_id), pause=pause)
        bracket = self.policy.bracket_seconds
        if confirming and self.evidence.answered_before(sent, bracket) and (
                len(self._unexplained) < self.policy.min_jobs):
            return NO_DECISION  # the second strike: the verdict stands, fail the job
        hold = 2 * bracket if hold_seconds is None else min(hold_seconds, 2 * bracket)
        if hold <= 0:
            return self._requeue(job_id)
        now = self._now()
        self._held[job_id] = _Held(sent, now, now + hold, confirming)
        return Decision(hold_seconds=hold)

    def _requeue(self, job_id: uuid.UUID) -> Decision:
        return Decision(refund=True, requeue=True, delay_seconds=self._held_delay(job_id))

    def _held_delay(self, job_id: uuid.UUID, *, grow: bool = True) -> float:
        """The next retry delay of a held rejection of *job_id*, seconds (jittered):
        ``held_retry_seconds``, doubled for each time this pod held it with no
        acceptance near it (*grow*; with one, the count starts again), at most
        ``HELD_RETRY_MAX_SECONDS``. It does not grow while the fleet is paused: the
        pause explains the silence, and the job should be due when traffic resumes
        (the resumed backlog's acceptances are what can bracket it)."""
        count = self._held_count.pop(job_id, 0) if grow and not self.paused else 0
        self._held_count[job_id] = count + 1
        if len(self._held_count) > _HELD_MEMORY:
            self._held_count.popitem(last=False)
        base = self.policy.held_retry_seconds * 2 ** min(count, 16)
        return float(min(HELD_RETRY_MAX_SECONDS, base) * self._rng.uniform(0.75, 1.25))

    def _accepted(self, sent: float, answered: float) -> None:
        self.evidence.add(sent, answered)
        self._streak = 0
        self._failing_since = None
        if self._unexplained:
            # An acceptance explains the rejections sent up to a bracket after it.
            limit = sent + self.policy.bracket_seconds
            for job_id in [j for j, s in self._unexplained.items() if s <= limit]:
                del self._unexplained[job_id]

    def _rejected(self, job_id: uuid.UUID, sent: float) -> None:
        self._streak += 1
        latest = self.evidence.latest
        if latest is None or sent > latest + self.policy.bracket_seconds:
            self._unexplained[job_id] = min(sent, self._unexplained.get(job_id, sent))

    def _systemic(self, now: float, *, wait: bool = True) -> tuple[PauseReason, float] | None:
        """A ``rejecting`` pause when the unexplained rejections make one (module doc);
        without *wait*, as soon as there are ``min_jobs`` of them (a TLS failure)."""
        if len(self._unexplained) < self.policy.min_jobs:
            return None
        if wait and now - min(self._unexplained.values()) < self.policy.rejecting_after_seconds:
            return None
        self._unexplained.clear()  # declared: the next one needs a new run
        return PauseReason.REJECTING, self._jitter(self.policy.outage_pause_seconds)

    # ------------------------------------------------------------- probe

    def _probe_accepted(self, job_id: uuid.UUID) -> Decision:
        """An acceptance while this pod's probe is out: the provider works."""
        until, self.probe_until = self.probe_until, None
        self.probe_jobs.discard(job_id)
        self.detector.reset()
        if until is None:
            return NO_DECISION
        return Decision(resume=until, probe=True)

    def _probe_answer(self, job_id: uuid.UUID, outcome: Outcome, sent: float, rejection: bool,
                      tls: bool, hold_seconds: float | None, confirming: bool) -> Decision:
        self.probe_jobs.discard(job_id)
        until = self.probe_until
        reason = outcome.reason
        permanent_answer = rejection and self.probe_reason is not PauseReason.REJECTING
        if until is not None and permanent_answer:
            # An outage or auth pause probed with a definite 4xx: the provider is
            # back; the verdict itself is judged like any other rejection.
            self.probe_until = None
            self.detector.reset()
            decision = self._judge_rejection(job_id, sent, hold_seconds, confirming)
            return Decision(resume=until, probe=True, hold_seconds=decision.hold_seconds,
                            requeue=decision.requeue, refund=decision.refund,
                            delay_seconds=decision.delay_seconds)
        failed = rejection or tls or reason in PROVIDER_FAILURES or (
            reason is Reason.AUTH_REJECTED)
        if rejection:
            self._probe_rejected = True
        elif failed:
            self._probe_failure = outcome
        if rejection:
            self._held.pop(job_id, None)
            answer = self._requeue(job_id)
        else:
            answer = Decision(refund=failed)
        if until is None or self.probe_jobs:
            return answer  # decided already, or other probe jobs still out
        self.probe_until = None
        if not (self._probe_rejected or self._probe_failure is not None):
            return Decision(probe=True, refund=answer.refund, requeue=answer.requeue,
                            delay_seconds=answer.delay_seconds)  # our own trouble: inconclusive
        # Every probe job failed or was rejected, and nothing was accepted meanwhile.
        seconds = self._jitter(min(self.policy.pause_max_seconds,
                                   max(self.probe_pause_seconds, 0.01) * 2))
        failure = self._probe_failure
        if failure is not None and failure.retry_after_seconds is not None:
            seconds = max(seconds, min(failure.retry_after_seconds,
                                       self.policy.retry_after_max_seconds))
        if self._probe_rejected and self.probe_reason is PauseReason.REJECTING:
            cause = PauseReason.REJECTING
        elif failure is not None:
            cause = PauseReason.REJECTING if tls_failure(failure) else self._pause_reason(failure)
        else:
            cause = self.probe_reason or PauseReason.REJECTING
        return Decision(pause=(cause, seconds), refund=True, requeue=answer.requeue,
                        delay_seconds=answer.delay_seconds, probe=True)

    # ------------------------------------------------------------ settling

    def settle(self, *, final: bool = False) -> Settlement:
        """Decide held rejections and whether the unexplained ones make a systemic
        rejection; ids not returned stay held.

        A held first rejection with a bracket (acceptances of other jobs sent
        within ``bracket_seconds`` before and after it) is confirmed (sent
        again); a held confirmation with a bracket fails. Every other held
        rejection goes back to ready with its attempt given back at its
        deadline, at once when *final* (the worker stops), or while the fleet
        is paused for ``rejecting``. A pod with nothing else in flight keeps
        holding until the deadline (a delivery claimed meanwhile may still
        bracket it); it never fails anything for being idle.
        """
        now = self._now()
        result = Settlement()
        if not self.paused:
            result.pause = self._systemic(now)
        if not self._held:
            return result
        bracket = self.policy.bracket_seconds
        everything = final or self.reason is PauseReason.REJECTING or result.pause is not None
        for job_id, h in list(self._held.items()):
            if not everything and self.evidence.sent_before(h.sent_at, bracket) and (
                    self.evidence.after(h.answered_at, bracket)):
                (result.fail if h.confirming else result.confirm).append(job_id)
            elif everything or now >= h.deadline:
                # The provider accepting others near it: retry soon (the other side
                # of the bracket may come next time); else a growing delay.
                near = self.evidence.near(h.sent_at - bracket, h.answered_at + bracket)
                result.requeue.append((job_id, self._held_delay(job_id, grow=not near)))
            else:
                continue
            del self._held[job_id]
        return result

    def forget(self, job_id: uuid.UUID) -> None:
        """Drop *job_id* from what is held (its outcome was written elsewhere)."""
        self._held.pop(job_id, None)

    # ------------------------------------------------------------- pauses

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
        now = self._now()
        if self._failing_since is None:
            self._failing_since = now
        if self.detector.observe(job_id, failed=True) is PauseReason.OUTAGE:
            quiet = self.policy.outage_quiet_seconds
            if quiet is not None and (now - self._failing_since < quiet
                                      or self.evidence.answered_since(now - quiet)):
                # Accepted just now, or failing for less than that: at capacity (or a
                # pod that just joined a full provider), not down.
                return None
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
