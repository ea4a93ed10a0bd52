"""The queue's vocabulary as value types: job states, a claimed attempt, outcomes.

One spelling everywhere: the SQL states, these enums, the metric label values
and the docs use the same words (ready, running, done, failed; the outcome
reasons below). No I/O and no dependency beyond the standard library.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class JobState(enum.StrEnum):
    """The states of a receipt job, spelled as in the table's CHECK.

    ``ready → running → done | failed``; an operator may move a ready or
    failed job to ``discarded`` (terminal, like done and failed: the row and
    its order id stay until retention prunes them).
    """

    READY = "ready"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    DISCARDED = "discarded"


@dataclass(frozen=True, slots=True)
class Job:
    """One claimed attempt.

    Attributes:
        id: the job's UUID.
        order_id: the order it delivers a receipt for.
        token: this attempt's lease token (new on every claim).
        attempt: 1-based attempt number (the row's ``attempts`` after claim).
        traceparent: the W3C ``traceparent`` stored at enqueue (migration 0004), or
            None; untrusted text, checked by :mod:`receipts.tracing` before use.
    """

    id: uuid.UUID
    order_id: str
    token: uuid.UUID
    attempt: int
    traceparent: str | None = None

    @property
    def idempotency_key(self) -> str:
        """``receipt:<order_id>``: the same on every attempt (docs/design.md §3)."""
        return f"receipt:{self.order_id}"

    @property
    def token_prefix(self) -> str:
        """First 8 hex characters of the token: enough to correlate logs."""
        return self.token.hex[:8]


class Reason(enum.StrEnum):
    """Why an attempt ended as it did: the ``reason``/``outcome`` label of every metric.

    The delivery table of docs/design.md §3 maps provider answers to these;
    ``internal_error`` is a deliverer bug, ``max_attempts`` and
    ``lease_expired`` are the queue's own reasons for failing or returning a job.
    """

    DELIVERED = "delivered"
    IN_PROGRESS = "in_progress"
    RATE_LIMITED = "rate_limited"
    PROVIDER_5XX = "provider_5xx"
    AUTH_REJECTED = "auth_rejected"
    REJECTED = "rejected"
    UNEXPECTED_STATUS = "unexpected_status"
    TIMEOUT = "timeout"
    CONNECTION_LOST = "connection_lost"
    CONNECT_ERROR = "connect_error"
    INTERNAL_ERROR = "internal_error"
    MAX_ATTEMPTS = "max_attempts"
    LEASE_EXPIRED = "lease_expired"


#: Reasons a failed attempt is rescheduled with (``receipts_retries_total{reason}``).
RETRY_REASONS = (
    Reason.PROVIDER_5XX, Reason.RATE_LIMITED, Reason.TIMEOUT, Reason.CONNECTION_LOST,
    Reason.CONNECT_ERROR, Reason.IN_PROGRESS, Reason.AUTH_REJECTED,
    Reason.UNEXPECTED_STATUS, Reason.INTERNAL_ERROR,
)
#: Reasons a job is moved to failed with (``receipts_failures_total{reason}``).
FAILURE_REASONS = (Reason.REJECTED, Reason.MAX_ATTEMPTS)


class Verdict(enum.StrEnum):
    """What the worker does with an attempt: ack it, retry later, or fail the job."""

    DELIVERED = "delivered"
    RETRY = "retry"
    PERMANENT = "permanent"


@dataclass(frozen=True, slots=True)
class Outcome:
    """The classified result of one delivery attempt.

    Attributes:
        verdict: delivered / retry / permanent.
        reason: low-cardinality label for metrics and logs (see the module table).
        status: HTTP status, or None when no response arrived.
        retry_after_seconds: the provider's parsed ``Retry-After``, seconds, or None.
        detail: a short human-readable reason, stored as ``last_error``.
        replayed: a success the provider answered from its idempotency store
            (``Idempotent-Replayed: true``, the Stripe convention): its round trip
            is no measure of the provider's pace (:mod:`receipts.capacity`).
    """

    verdict: Verdict
    reason: Reason
    status: int | None = None
    retry_after_seconds: float | None = None
    detail: str = ""
    replayed: bool = False


class PauseReason(enum.StrEnum):
    """Why the fleet stopped claiming (``receipts_provider_paused{reason}``): the
    *effective* reason of the pause (docs/design.md §11).

    ``auth``: the provider refused our credentials (401/403); ``outage``:
    retryable failures dominated recent deliveries; ``retry_after``: the
    provider asked us to wait (a 429 with ``Retry-After``); ``rejecting``:
    most recent distinct jobs got the same permanent answer (the same 4xx and
    body shape) or a TLS failure; ``manual``: an operator paused the fleet.

    ``rejecting`` is stored as ``pause_reason = 'outage'`` and ``manual`` as
    ``'retry_after'``, with the cause beside them (migration 0006), so a
    released worker honours both: probed like an outage, and ending by itself
    at its time, respectively.
    """

    AUTH = "auth"
    OUTAGE = "outage"
    RETRY_AFTER = "retry_after"
    REJECTING = "rejecting"
    MANUAL = "manual"

    @property
    def probed(self) -> bool:
        """True for pauses a probe ends (auth, outage, rejecting); False for those that
        end at their time (retry_after, manual)."""
        return self in (PauseReason.AUTH, PauseReason.OUTAGE, PauseReason.REJECTING)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One claimed attempt as it travels from claim to its outcome write.

    Attributes:
        job: the claimed :class:`Job` (id, order, token, attempt number).
        claimed_at: ``time.monotonic()`` when the claim statement returned;
            the lease was counted by the database from an earlier instant, so
            ``claimed_at + lease_seconds`` is a safe upper bound of its end.
        enqueued_age_seconds: seconds from enqueue to the claim (None when
            unknown), for the time-to-receipt histogram.
        claim_sent_at: ``time.monotonic()`` just before the claim statement was
            sent (None when unknown): the database started the lease after
            it, so less than a lease after it the lease still holds.
    """

    job: Job
    claimed_at: float
    enqueued_age_seconds: float | None = None
    claim_sent_at: float | None = None

    @property
    def lease_start(self) -> float:
        """When the lease began at the latest, on ``time.monotonic()``: just before
        the claim was sent (the database starts the lease while the claim runs), or
        when the claim came back when that is unknown."""
        return self.claim_sent_at if self.claim_sent_at is not None else self.claimed_at


@dataclass(frozen=True, slots=True)
class FlowState:
    """The fleet-wide provider state as one statement saw it.

    Attributes:
        pause_reason: why the fleet is paused (the effective reason), or None
            when it is not.
        pause_left_seconds: for a probed pause (:attr:`PauseReason.probed`),
            seconds until the next probe may start (≤ 0 when one is due); for
            the others, until the pause ends; None when not paused.
        tokens: tokens in the rate-limit bucket after this statement, or None
            when the statement did not use the bucket.
    """

    pause_reason: PauseReason | None = None
    pause_left_seconds: float | None = None
    tokens: float | None = None

    @property
    def paused(self) -> bool:
        """True while the fleet must not claim (a pause, or a probe due)."""
        return self.pause_reason is not None


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What one claim statement returned: the attempts and the flow state.

    ``acked`` is the job ids that the acks the claim carried completed (a
    :class:`receipts.jobqueue.Acked`, with the WAL positions the statement
    read), or None when it carried none.
    """

    attempts: list[Attempt]
    flow: FlowState
    acked: set[uuid.UUID] | None = None


@dataclass(frozen=True, slots=True)
class Reschedule:
    """A failed attempt to write back: ready after *delay_seconds*, or failed.

    Attributes:
        attempt: the attempt that failed.
        outcome: its classified :class:`Outcome` (``detail`` becomes ``last_error``).
        delay_seconds: backoff before the job is due again, seconds.
        refund: give the attempt back (a fleet-wide provider outage, not the job's fault).
        unsent: the attempt was claimed ahead and never sent (the worker's prefetch,
            given back on a pause, a stop or a wait too long): its attempt is given
            back, ``last_error`` keeps the job's earlier error, and no retry is
            counted.
    """

    attempt: Attempt
    outcome: Outcome
    delay_seconds: float
    refund: bool = False
    unsent: bool = False


#: Attempt records kept per job (the ring of ``receipt_attempts``, migration 0005).
ATTEMPT_HISTORY = 20


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One ended attempt, for the job's attempt history (``JobQueue.record_attempts``).

    Attributes:
        job_id: the job's UUID.
        attempt: the attempt number (:attr:`Job.attempt`).
        reason: the outcome's reason (a :class:`Reason`; ``delivered`` too).
        status: the provider's HTTP status, or None when no answer arrived.
        error: a short error (stored up to 500 characters; empty for none).
        duration_seconds: how long the attempt took, seconds (None: unknown).
        worker: who made it: the pod name or application name (up to 100 characters).

    The time of the record is the database's, taken when it is written.
    """

    job_id: uuid.UUID
    attempt: int
    reason: Reason
    status: int | None = None
    error: str = ""
    duration_seconds: float | None = None
    worker: str = ""

    @classmethod
    def of(cls, job: Job, outcome: Outcome, *, duration_seconds: float | None,
           worker: str) -> AttemptRecord:
        """The record of *job*'s attempt that ended with *outcome*."""
        return cls(job_id=job.id, attempt=job.attempt, reason=outcome.reason,
                   status=outcome.status, error=outcome.detail,
                   duration_seconds=duration_seconds, worker=worker)


@dataclass(frozen=True, slots=True)
class QueueStats:
    """A snapshot of the queue (the ``queue_stats`` statement): the worker's gauges
    (:meth:`receipts.jobqueue.JobQueue.queue_stats`) and the operator's view
    (:meth:`receipts.operations.Operations.queue_stats`) read the same one.

    Counts are rows; ``done_estimate`` comes from table statistics, not a
    count. Ages are seconds, 0 when there is nothing to measure:
    ``lag_seconds`` is the age of the oldest *due* ready job (since its
    ``run_at``, so every retry restarts it); ``oldest_undelivered_age_seconds``
    the time since the oldest ready or running job was enqueued (its
    ``created_at``: retries do not restart it, so a provider outage that keeps
    rescheduling shows here and not in the lag);
    ``oldest_transaction_age_seconds`` the age of the oldest open transaction in
    the database (the xmin horizon that slows claims, docs/design.md §10);
    ``oldest_finished_age_seconds`` the time since the oldest done, failed or
    discarded row finished (pruning keeps it within the retention).
    """

    ready_due: int
    ready: int
    running: int
    expired: int
    failed: int
    lag_seconds: float
    done_estimate: int
    dead_tuples: int
    oldest_transaction_age_seconds: float
    oldest_undelivered_age_seconds: float
    discarded: int = 0
    xmin_age_by_holder: dict[str, int] = field(default_factory=dict)
    oldest_finished_age_seconds: float = 0.0

    @classmethod
    def from_row(cls, r: Sequence[Any]) -> QueueStats:
        """The snapshot from one row of the ``queue_stats`` statement (its 15 columns)."""
        return cls(
            ready_due=int(r[0]),
            ready=int(r[1]),
            running=int(r[2]),
            expired=int(r[3]),
            failed=int(r[4]),
            lag_seconds=float(r[5]),
            done_estimate=int(r[6]),
            dead_tuples=int(r[7]),
            oldest_transaction_age_seconds=float(r[8]),
            oldest_undelivered_age_seconds=float(r[9]),
            discarded=int(r[10]),
            xmin_age_by_holder={"transaction": int(r[11]), "prepared": int(r[12]),
                                "replication_slot": int(r[13])},
            oldest_finished_age_seconds=float(r[14]),
        )
