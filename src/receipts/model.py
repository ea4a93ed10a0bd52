"""The queue's vocabulary as value types: job states, a claimed attempt, outcomes.

One spelling everywhere: the SQL states, these enums, the metric label values
and the docs use the same words (ready, running, done, failed; the outcome
reasons below). No I/O and no dependency beyond the standard library.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass


class JobState(enum.StrEnum):
    """The four states of a receipt job, spelled as in the table's CHECK."""

    READY = "ready"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


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
    """

    verdict: Verdict
    reason: Reason
    status: int | None = None
    retry_after_seconds: float | None = None
    detail: str = ""
