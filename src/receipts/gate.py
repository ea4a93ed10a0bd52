"""The provider gate's imperative shell: carry the :class:`~receipts.flow.ProviderGate`'s
decisions out (docs/design.md §11).

The gate decides (pure, in :mod:`receipts.flow`); this shell acts, for one
worker: it holds a rejection (the job's lease kept, its slot free, a timer at
its deadline), settles what the gate decided about held ones (back to ready
with the attempt given back, a confirmation sent, or failed), writes failed
attempts through the :class:`~receipts.completion.Completer`, and writes the
fleet-wide pause, probe and resume to ``receipt_flow`` (one statement each).

Log events: ``rejection_held`` (a rejection without evidence yet),
``rejection_requeued`` (back to ready, attempt given back), ``rejection_confirming``
(a first strike: the job is sent again in its lease), ``rejection_confirmed``
(the second strike: the job fails), ``provider_paused``/``provider_resumed``
(this pod's view changed), ``provider_pause_extended``, ``flow_update_failed``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from datetime import datetime

from receipts.completion import Completer
from receipts.errors import QueueError
from receipts.flow import ACCEPTED, HELD_PREFIX, Decision, ProviderGate
from receipts.jobqueue import WorkerQueue
from receipts.logs import get_logger, job_fields
from receipts.metrics import Metrics
from receipts.model import Attempt, FlowState, Outcome, PauseReason, Reschedule, Verdict
from receipts.retry import BackoffPolicy

log = get_logger("worker")


class GateShell:
    """One worker's hands for its :class:`ProviderGate`.

    Args:
        gate: the pure gate whose decisions this shell carries out.
        queue: the worker's queue (``extend_pause``, ``resume``).
        completer: where outcome writes go.
        metrics: the process's :class:`Metrics`.
        backoff: the retry policy of ordinary failures.
        lease_seconds: the lease, seconds.
        lease_margin: seconds an outcome write needs before the lease ends.
        delivery_seconds: the delivery timeout, seconds (a confirmation needs it).
        redeliver: starts a delivery of an attempt again (the confirmation of a
            first strike), as a task of the worker; called synchronously.
    """

    def __init__(self, gate: ProviderGate, queue: WorkerQueue, completer: Completer,
                 metrics: Metrics, backoff: BackoffPolicy, *, lease_seconds: float,
                 lease_margin: float, delivery_seconds: float,
                 redeliver: Callable[[Attempt], None]) -> None:
        self.gate = gate
        self.queue = queue
        self.completer = completer
        self.metrics = metrics
        self.backoff = backoff
        self.lease_seconds = lease_seconds
        self.lease_margin = lease_margin
        self.delivery_seconds = delivery_seconds
        self.redeliver = redeliver
        #: Rejections the gate holds: job id → (attempt, outcome, its deadline timer).
        self.held: dict[uuid.UUID, tuple[Attempt, Outcome, asyncio.TimerHandle]] = {}
        #: Monotonic time the fleet's flow state was last read.
        self.flow_read_at = 0.0
        #: Set when the worker stops: no confirmation starts any more (a first
        #: strike goes back to ready, its attempt given back).
        self.closing = False
        self._tasks: set[asyncio.Task[None]] = set()

    # ----------------------------------------------------------- outcomes

    def lease_left(self, attempt: Attempt) -> float:
        """Seconds this attempt's lease still allows before its write's margin."""
        return attempt.claimed_at + self.lease_seconds - self.lease_margin - time.monotonic()

    async def judge(self, attempt: Attempt, outcome: Outcome, *, sent_at: float,
                    confirming: bool = False) -> None:
        """Judge *attempt*'s *outcome* (sent at *sent_at*, monotonic seconds) and hand its
        write to the completer: ack, failure, retry, or held for later evidence.

        *confirming*: the answer to a first strike's confirmation.
        """
        job = attempt.job
        # A rejection may be held until evidence comes; never past the lease.
        hold = self.lease_left(attempt) if outcome.verdict is Verdict.PERMANENT else None
        decision = self.gate.judge(job.id, outcome, hold_seconds=hold, sent_at=sent_at,
                                   confirming=confirming)
        if decision.hold_seconds is not None:  # before any await: settle() may run meanwhile
            self._hold(attempt, outcome, decision.hold_seconds)
        if decision.probe or decision.pause is not None:
            await self.act_on_flow(attempt, outcome, decision.pause, decision.resume,
                                   decision.probe)
        if outcome.verdict is Verdict.DELIVERED:
            self.completer.ack(attempt)
        elif decision.hold_seconds is None:
            if confirming and outcome.verdict is Verdict.PERMANENT and not decision.requeue:
                log.warning("rejection_confirmed", extra=job_fields(job, outcome.reason))
            self.write_failure(attempt, outcome, decision)
        if self.held and outcome.reason in ACCEPTED:  # new evidence: held ones may be decided
            self.settle()

    def write_failure(self, attempt: Attempt, outcome: Outcome, decision: Decision) -> None:
        """Hand a failed attempt to the completer: failed when permanent (unless the
        decision requeues it: a held rejection, back to ready with its attempt given
        back after ``decision.delay_seconds``), else ready after its backoff."""
        if decision.requeue:
            detail = outcome.detail if outcome.detail.startswith(HELD_PREFIX) else (
                HELD_PREFIX + (outcome.detail or str(outcome.reason)))
            outcome = dataclasses.replace(outcome, verdict=Verdict.RETRY, detail=detail)
            delay = decision.delay_seconds
            log.info("rejection_requeued", extra={**job_fields(attempt.job, outcome.reason),
                                                  "delay_seconds": round(delay, 3)})
        elif outcome.verdict is Verdict.PERMANENT:
            delay = 0.0
        else:
            delay = self.backoff.delay(attempt.job.attempt,
                                       retry_after_seconds=outcome.retry_after_seconds)
        self.completer.reschedule(Reschedule(attempt, outcome, delay,
                                             decision.refund or decision.requeue))

    def _hold(self, attempt: Attempt, outcome: Outcome, seconds: float) -> None:
        """Keep a rejection (and the job's lease) for at most *seconds*, slot freed."""
        timer = asyncio.get_running_loop().call_later(seconds, self.settle)
        self.held[attempt.job.id] = (attempt, outcome, timer)
        # DEBUG, as rejection_confirming: steps of one verdict, not the verdict
        # (rejection_requeued or rejection_confirmed says that); at INFO the two took
        # 15-19 % of a worker's CPU per invalid order (bench/README.md).
        log.debug("rejection_held", extra={**job_fields(attempt.job, outcome.reason),
                                           "hold_seconds": round(seconds, 3)})

    def settle(self, *, final: bool = False) -> None:
        """Carry out what the gate decided about held rejections (see
        :meth:`ProviderGate.settle`): requeue, confirm, fail; and a systemic
        rejection's pause."""
        result = self.gate.settle(final=final)
        if result.pause is not None:
            self._spawn(self.act_on_flow(None, None, result.pause, None, False))
        for job_id, delay in result.requeue:
            entry = self._pop(job_id)
            if entry is not None:
                attempt, outcome = entry
                self.write_failure(attempt, outcome, Decision(requeue=True, refund=True,
                                                              delay_seconds=delay))
        for job_id in result.confirm:
            entry = self._pop(job_id)
            if entry is None:
                continue
            attempt, outcome = entry
            if final or self.closing or self.lease_left(attempt) < self.delivery_seconds:
                # No time left in the lease for a confirmation: try again later.
                self.write_failure(attempt, outcome, Decision(
                    requeue=True, refund=True, delay_seconds=self.gate.policy.held_retry_seconds))
                continue
            log.debug("rejection_confirming", extra=job_fields(attempt.job, outcome.reason))
            self.redeliver(attempt)
        for job_id in result.fail:
            entry = self._pop(job_id)
            if entry is not None:
                attempt, outcome = entry
                log.warning("rejection_confirmed", extra=job_fields(attempt.job, outcome.reason))
                self.write_failure(attempt, outcome, Decision())

    def _pop(self, job_id: uuid.UUID) -> tuple[Attempt, Outcome] | None:
        entry = self.held.pop(job_id, None)
        if entry is None:
            return None
        attempt, outcome, timer = entry
        timer.cancel()
        return attempt, outcome

    def _spawn(self, coroutine: object) -> None:
        task = asyncio.ensure_future(coroutine)  # type: ignore[call-overload]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --------------------------------------------------------- fleet state

    def observe_flow(self, flow: FlowState) -> None:
        """Adopt the fleet-wide state a statement returned; log and count a change."""
        self.flow_read_at = time.monotonic()
        gate = self.gate
        was = gate.reason
        gate.observe_flow(flow)
        if gate.reason is not was:
            self.metrics.observe_pause(gate.reason)
            if gate.reason is None:
                log.info("provider_resumed")
            else:
                log.warning("provider_paused", extra={
                    "reason": str(gate.reason), "pause_seconds": round(gate.pause_left(), 3)})
        if self.held:
            self.settle()

    async def act_on_flow(self, attempt: Attempt | None, outcome: Outcome | None,
                          pause: tuple[PauseReason, float] | None, resume: datetime | None,
                          probe: bool) -> None:
        """Carry a gate decision into ``receipt_flow`` (one statement; errors logged).

        *attempt* and *outcome* name the answer that decided it (None for a
        systemic rejection, decided over many answers).
        """
        fields = job_fields(attempt.job, outcome.reason) if (
            attempt is not None and outcome is not None) else {}
        probe_outcome = str(outcome.reason) if probe and outcome is not None else None
        try:
            if pause is not None:
                reason, seconds = pause
                flow = await self.queue.extend_pause(
                    reason, seconds,
                    next_probe_seconds=min(seconds, self.gate.policy.probe_interval_seconds),
                    probe_outcome=probe_outcome)
                self.metrics.provider_pauses.labels(reason).inc()
                log.warning("provider_pause_extended", extra={
                    **fields, "reason": str(reason), "pause_seconds": round(seconds, 3)})
                self.observe_flow(flow)
                if probe:
                    self.metrics.provider_probes.labels("failed").inc()
            elif resume is not None:
                resumed = await self.queue.resume(
                    resume, probe_outcome=probe_outcome or "delivered")
                self.metrics.provider_probes.labels("resumed").inc()
                self.observe_flow(FlowState() if resumed else self.state())
            elif probe:
                self.metrics.provider_probes.labels("inconclusive").inc()
        except QueueError as exc:
            # The local view still holds; the next claim reads the fleet's.
            self.metrics.db_errors.labels("flow").inc()
            log.warning("flow_update_failed", extra={**fields, "error": str(exc)})

    def state(self) -> FlowState:
        """The gate's current view as a :class:`FlowState` (left unchanged)."""
        return FlowState(self.gate.reason, self.gate.pause_left())
