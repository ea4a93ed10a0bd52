"""Provider flow control as a pod sees it: outage detection, the pause, the probe.

Pure decisions, no I/O (docs/design.md §11). The worker feeds every delivery
outcome to a :class:`ProviderGate` and every claim's :class:`FlowState` to
it; the gate answers what the fleet-wide state in ``receipt_flow`` should
become (extend the pause, or resume after a probe) and whether a failed
attempt gives its attempt back. The worker carries those answers out with
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
* **Credentials.** A 401/403 pauses the fleet for ``auth_pause_seconds``: a
  bad token must not burn every job's attempts.
* **Retry-After.** A 429 carrying ``Retry-After`` pauses the fleet for that
  long (clamped to ``retry_after_max_seconds``): the provider asked all of
  us, not one job, to wait.
* **Probe.** When an outage or auth pause runs out, one pod (the winner of
  ``begin_probe``) claims one job; a ``Retry-After`` pause simply ends when
  its time is up (the provider said when). If the provider answers it properly (delivered, or a
  definite 4xx, or 409 in progress), the pause ends; if it fails again, the
  pause doubles (jittered, capped at ``pause_max_seconds``).
* **Refund.** A provider failure while the pod knows the fleet is paused (or
  the failure that starts a pause) gives its attempt back: jobs in flight
  when the provider went down keep their attempt.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime

from receipts.model import FlowState, Outcome, PauseReason, Reason

#: Outcomes that say the provider, not the job, is failing.
PROVIDER_FAILURES = frozenset({
    Reason.PROVIDER_5XX, Reason.RATE_LIMITED, Reason.TIMEOUT, Reason.CONNECTION_LOST,
    Reason.CONNECT_ERROR,
})
#: Outcomes that prove the provider is up and answering (a probe of these resumes).
PROVIDER_ANSWERS = frozenset({Reason.DELIVERED, Reason.REJECTED, Reason.IN_PROGRESS})


@dataclass(frozen=True, slots=True)
class FlowPolicy:
    """The knobs of :class:`ProviderGate`, all durations in seconds.

    Attributes:
        window_seconds: how far back outage detection looks.
        window_jobs: how many of the most recent distinct jobs it looks at.
        min_jobs: distinct failed jobs needed before an outage can be declared.
        failure_ratio: share of distinct answered jobs that must have failed (0–1].
        outage_pause_seconds: first pause after an outage is detected.
        auth_pause_seconds: first pause after a 401/403.
        pause_max_seconds: cap of a pause doubled by failed probes.
        retry_after_max_seconds: cap of a pause asked for by ``Retry-After``.
    """

    window_seconds: float = 30.0
    window_jobs: int = 20
    min_jobs: int = 5
    failure_ratio: float = 0.8
    outage_pause_seconds: float = 5.0
    auth_pause_seconds: float = 30.0
    pause_max_seconds: float = 300.0
    retry_after_max_seconds: float = 3600.0


@dataclass(frozen=True, slots=True)
class Decision:
    """What the gate decided about one outcome.

    Attributes:
        pause: (reason, seconds) to extend the fleet-wide pause with, or None.
        resume: the probe's deadline to resume with (``JobQueue.resume``), or None.
        refund: give this attempt back (the provider, not the job, failed).
        probe: the outcome was the probe's answer.
    """

    pause: tuple[PauseReason, float] | None = None
    resume: datetime | None = None
    refund: bool = False
    probe: bool = False


#: The decision of most outcomes: nothing to do for the fleet (shared, immutable).
NO_DECISION = Decision()


class OutageDetector:
    """Distinct-job outage detection over a sliding window (see the module doc).

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
        self._latest: OrderedDict[uuid.UUID, tuple[float, bool]] = OrderedDict()
        self._failures = 0  # failed answers in the window

    def observe(self, job_id: uuid.UUID, failed: bool) -> bool:
        """Record *job_id*'s latest answer; True when the window now shows an outage."""
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
            _, (_, bad) = self._latest.popitem(last=False)
            self._failures -= bad
        return (self._failures >= self.policy.min_jobs
                and self._failures >= self.policy.failure_ratio * len(self._latest))

    def reset(self) -> None:
        """Forget the window (after a pause: the next outage is judged afresh)."""
        self._latest.clear()
        self._failures = 0


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

    def _now(self) -> float:
        return self._clock()  # type: ignore[operator,no-any-return]

    @property
    def paused(self) -> bool:
        """True while this pod believes the fleet is paused."""
        return self.reason is not None

    def pause_left(self) -> float:
        """Seconds until a probe may be tried (0 when due or not paused)."""
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

    def start_probe(self, job_id: uuid.UUID, probe_until: datetime, pause_seconds: float) -> None:
        """This pod won ``begin_probe`` and claimed *job_id* as the probe."""
        self.probe_job, self.probe_until = job_id, probe_until
        self.probe_pause_seconds = pause_seconds

    def judge(self, job_id: uuid.UUID, outcome: Outcome) -> Decision:
        """Decide what *outcome* of *job_id* means for the fleet (see the module doc)."""
        reason = outcome.reason
        provider_failed = reason in PROVIDER_FAILURES or reason is Reason.AUTH_REJECTED
        if job_id == self.probe_job and self.probe_until is not None:
            until, self.probe_job, self.probe_until = self.probe_until, None, None
            if reason in PROVIDER_ANSWERS:
                self.detector.reset()
                return Decision(resume=until, probe=True)
            if provider_failed:
                seconds = self._jitter(min(self.policy.pause_max_seconds,
                                           max(self.probe_pause_seconds, 0.01) * 2))
                if outcome.retry_after_seconds is not None:
                    seconds = max(seconds, min(outcome.retry_after_seconds,
                                               self.policy.retry_after_max_seconds))
                return Decision(pause=(self._pause_reason(outcome), seconds),
                                refund=True, probe=True)
            return Decision(probe=True)  # our own trouble (internal error): probe again later
        if not provider_failed:
            if reason in PROVIDER_ANSWERS:
                self.detector.observe(job_id, failed=False)
            return NO_DECISION
        pause = self._pause_for(job_id, outcome)
        return Decision(pause=pause, refund=self.paused or pause is not None)

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
        if self.detector.observe(job_id, failed=True):
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
