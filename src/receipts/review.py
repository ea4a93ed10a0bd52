"""Failed-job review: stats, list, show and retry, as data (no printing, no parsing).

``receipts jobs …`` (:mod:`receipts.cli`) validates its arguments, calls one of
these functions with an open :class:`~receipts.jobqueue.JobQueue`, and prints
what it returns; anything else (a web page) can call them the same way.

The policy lives here: ``show`` never returns a whole lease token; ``retry``
of named jobs is all or nothing (every named job must exist and be failed,
else nothing changes) and changes only rows still failed when it runs.
Every function raises the queue's errors (``DatabaseUnavailable``,
``SchemaMissing``, ``QueueError``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from receipts.jobqueue import JobQueue, ReviewFilter
from receipts.model import JobState

# Every failed job, when retry is given no ids (a bound, never reached in practice).
RETRY_ALL_LIMIT = 1_000_000
TOKEN_SHOWN_CHARS = 8


def jsonable(value: Any) -> Any:
    """*value* as JSON can hold it: datetimes as ISO 8601 text, UUIDs as text."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


@dataclass(frozen=True, slots=True)
class Stats:
    """The queue at a glance, for ``receipts jobs stats``.

    ``jobs`` holds exact row counts for every state; ages are seconds (0 when
    there is nothing to measure); ``oldest_failed_at`` is when the oldest
    failed job failed, or None.
    """

    jobs: dict[JobState, int]
    ready_due: int
    queue_lag_seconds: float
    oldest_undelivered_age_seconds: float
    expired_leases: int
    oldest_failed_at: datetime | None
    oldest_transaction_age_seconds: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: states as text keys, seconds rounded to milliseconds."""
        return {
            "jobs": {str(state): n for state, n in self.jobs.items()},
            "ready_due": self.ready_due,
            "queue_lag_seconds": round(self.queue_lag_seconds, 3),
            "oldest_undelivered_age_seconds": round(self.oldest_undelivered_age_seconds, 3),
            "expired_leases": self.expired_leases,
            "oldest_failed_at": jsonable(self.oldest_failed_at),
            "oldest_transaction_age_seconds": round(self.oldest_transaction_age_seconds, 3),
        }


async def stats(queue: JobQueue) -> Stats:
    """Exact counts by state plus the queue gauges (three statements)."""
    counts = await queue.state_counts()
    snapshot = await queue.queue_stats()
    return Stats(
        jobs=counts,
        ready_due=snapshot.ready_due,
        queue_lag_seconds=snapshot.lag_seconds,
        oldest_undelivered_age_seconds=snapshot.oldest_undelivered_age_seconds,
        expired_leases=snapshot.expired,
        oldest_failed_at=await queue.oldest_failed(),
        oldest_transaction_age_seconds=snapshot.oldest_transaction_age_seconds,
    )


async def list_jobs(queue: JobQueue, state: JobState, *, limit: int = 50,
                    since: datetime | None = None) -> list[dict[str, Any]]:
    """Jobs in *state*, newest first, at most *limit* (≥ 1), as JSON-ready dicts.

    *since* (timezone-aware) keeps jobs finished, or created while unfinished,
    at or after that time. Keys: id, order_id, state, attempts, run_at,
    lease_until, last_error, created_at, finished_at.
    """
    rows = await queue.list_jobs(state, limit=limit, since=since)
    return [{k: jsonable(v) for k, v in row.items()} for row in rows]


async def show(queue: JobQueue, key: str) -> dict[str, Any] | None:
    """One job by id or order id as a JSON-ready dict; None when there is none.

    ``attempts`` lists its attempt history (oldest first, at most the last 20).

    The lease token is cut to its first 8 characters followed by ``…``: enough
    to match log lines (which carry the same 8), never enough to ack with.
    """
    row = await queue.show_job(key)
    if row is None:
        return None
    shown = {k: jsonable(v) for k, v in row.items()}
    if shown.get("lease_token"):
        shown["lease_token"] = str(shown["lease_token"])[:TOKEN_SHOWN_CHARS] + "…"
    attempts = await queue.job_attempts(row["id"])
    shown["attempts"] = [{k: jsonable(v) for k, v in a.items()} for a in attempts]
    return shown


@dataclass(frozen=True, slots=True)
class Refusal:
    """A named job retry refused: ``state`` is its state, or ``unknown`` when absent."""

    id: str
    state: str

    @property
    def reason(self) -> str:
        """One line: why this job cannot be retried."""
        what = "no such job" if self.state == "unknown" else f"is {self.state}"
        return f"job {self.id} {what}; only failed jobs can be retried"

    @property
    def discard_reason(self) -> str:
        """One line: why this job cannot be discarded."""
        what = "no such job" if self.state == "unknown" else f"is {self.state}"
        return f"job {self.id} {what}; only ready or failed jobs can be discarded"


@dataclass(frozen=True, slots=True)
class RetryResult:
    """What ``retry`` did (or, with ``dry_run``, would do).

    ``retried``/``would_retry`` are job ids; ``refused`` is non-empty only when
    nothing changed because a named job was unknown or not failed; ``missed``
    lists named jobs that were failed when checked but no longer when the
    update ran (another operator or a recovery raced us).
    """

    dry_run: bool
    retried: list[str] = field(default_factory=list)
    would_retry: list[str] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every named (or every failed) job was retried, or would be."""
        return not self.refused and not self.missed

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"dry_run", "retried", "would_retry", "refused": [{id, state}]}``."""
        return {
            "dry_run": self.dry_run,
            "retried": list(self.retried),
            "would_retry": list(self.would_retry),
            "refused": [{"id": r.id, "state": r.state} for r in self.refused],
        }


async def retry(queue: JobQueue, ids: Sequence[uuid.UUID] | None, *,
                dry_run: bool = False) -> RetryResult:
    """Move failed jobs back to ready (attempts 0, due now); *ids* None means every failed job.

    Named jobs are all or nothing: if any is unknown or not failed, nothing
    changes and the result lists the refusals. Duplicated ids count once.
    ``last_error`` is kept, prefixed ``manual retry after:``.
    """
    wanted = None if ids is None else list(dict.fromkeys(ids))
    if wanted is None:
        targets = [str(r["id"]) for r in await queue.list_jobs(JobState.FAILED,
                                                              limit=RETRY_ALL_LIMIT)]
    else:
        refused: list[Refusal] = []
        for job_id in wanted:
            row = await queue.show_job(str(job_id))
            if row is None:
                refused.append(Refusal(str(job_id), "unknown"))
            elif row["state"] != JobState.FAILED:
                refused.append(Refusal(str(job_id), str(row["state"])))
        if refused:
            return RetryResult(dry_run=dry_run, refused=refused)
        targets = [str(i) for i in wanted]
    if dry_run:
        return RetryResult(dry_run=True, would_retry=targets)
    changed = [str(i) for i in await queue.retry_failed(wanted)]
    missed = [] if wanted is None else sorted(set(targets) - set(changed))
    return RetryResult(dry_run=False, retried=changed, missed=missed)


@dataclass(frozen=True, slots=True)
class DiscardResult:
    """What ``discard`` did (or, with ``dry_run``, would do).

    ``discarded`` holds job ids; ``refused`` is non-empty only when nothing
    changed because a named job was unknown or not ready/failed; ``changed``
    is True when the set of jobs changed between the count and the update
    (then nothing changed either).
    """

    dry_run: bool
    expected: int = 0
    discarded: list[str] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    changed: bool = False

    @property
    def ok(self) -> bool:
        """True when every target was discarded (or would be)."""
        return not self.refused and not self.changed

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"dry_run", "discarded", "would_discard", "refused"}``."""
        return {
            "dry_run": self.dry_run,
            "discarded": [] if self.dry_run else list(self.discarded),
            "would_discard": list(self.discarded) if self.dry_run else [],
            "refused": [{"id": r.id, "state": r.state} for r in self.refused],
        }


async def discard(queue: JobQueue, target: Sequence[uuid.UUID] | ReviewFilter, *,
                  dry_run: bool = False) -> DiscardResult:
    """Move ready or failed jobs to ``discarded`` (terminal; the row keeps the order deduplicated).

    *target* is a list of job ids (all or nothing: any unknown, running or
    finished job refuses the lot) or a :class:`~receipts.jobqueue.ReviewFilter`
    over ready or failed jobs. The update locks the rows and changes nothing
    unless exactly the counted jobs still qualify. Running jobs are never touched.
    """
    if isinstance(target, ReviewFilter):
        found = [str(r["id"]) for r in await queue.review_jobs(target, limit=500)]
        expected = await queue.review_count(target)
    else:
        wanted = list(dict.fromkeys(target))
        states = await queue.job_states(wanted)
        refused = [Refusal(str(i), str(states.get(i, "unknown"))) for i in wanted
                   if states.get(i) not in (JobState.READY, JobState.FAILED)]
        if refused:
            return DiscardResult(dry_run=dry_run, refused=refused)
        found, expected, target = [str(i) for i in wanted], len(wanted), wanted
    if dry_run:
        return DiscardResult(dry_run=True, expected=expected, discarded=found)
    ids = [str(i) for i in await queue.discard_jobs(target, expected=expected)]
    return DiscardResult(dry_run=False, expected=expected, discarded=ids,
                         changed=len(ids) != expected)
