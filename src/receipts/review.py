"""The operator's one door for review: stats, list, show, retry and discard, as data.

``receipts jobs …`` (:mod:`receipts.cli`) and the review page
(:mod:`receipts.ui.app`) both call these functions with an open
:class:`~receipts.operations.Operations` and show what they return (no
printing, no parsing here), so an operator action behaves the same from
either.

The policy lives here: ``show`` never returns a whole lease token; ``retry``
and ``discard`` of named jobs are all or nothing: one statement
(``retry_jobs``, ``discard_jobs``) changes the jobs only if every one of them
still qualifies when it runs (failed; ready or failed), else nothing changes
and the result names the jobs that did not qualify. ``retry`` of every
failed job and ``discard`` by a filter are bulk actions (:mod:`receipts.bulk`):
bounded by the moment they start, run in batches, resumable from the review
page; they report at most :data:`IDS_SHOWN` ids and the count. Every
function raises the statements' errors (``DatabaseUnavailable``,
``SchemaMissing``, ``QueueError``).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from receipts import bulk
from receipts.model import JobState
from receipts.operations import BulkStep, Operations, ReviewFilter

#: The most job ids a bulk retry or discard reports (the count says how many).
IDS_SHOWN = 1_000
TOKEN_SHOWN_CHARS = 8
#: Called after each committed batch of a bulk action (progress on the command line).
StepCallback = Callable[[BulkStep], Awaitable[None] | None]


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


async def stats(operations: Operations) -> Stats:
    """Exact counts by state plus the queue gauges (three statements)."""
    counts = await operations.state_counts()
    snapshot = await operations.queue_stats()
    return Stats(
        jobs=counts,
        ready_due=snapshot.ready_due,
        queue_lag_seconds=snapshot.lag_seconds,
        oldest_undelivered_age_seconds=snapshot.oldest_undelivered_age_seconds,
        expired_leases=snapshot.expired,
        oldest_failed_at=await operations.oldest_failed(),
        oldest_transaction_age_seconds=snapshot.oldest_transaction_age_seconds,
    )


async def list_jobs(operations: Operations, state: JobState, *, limit: int = 50,
                    since: datetime | None = None) -> list[dict[str, Any]]:
    """Jobs in *state*, newest first, at most *limit* (≥ 1), as JSON-ready dicts.

    *since* (timezone-aware) keeps jobs finished, or created while unfinished,
    at or after that time. Keys: id, order_id, state, attempts, run_at,
    lease_until, last_error, created_at, finished_at.
    """
    rows = await operations.list_jobs(state, limit=limit, since=since)
    return [{k: jsonable(v) for k, v in row.items()} for row in rows]


async def page(operations: Operations, view: ReviewFilter, *, limit: int,
               after: tuple[datetime, uuid.UUID] | None, count_seconds: float,
               count_cap: int) -> tuple[int | None, list[dict[str, Any]]]:
    """One page of the review list (the page's list) and how many jobs match.

    Returns (count: at most *count_cap*, None when counting took longer than
    *count_seconds*; rows: at most *limit*, newest first, after the keyset
    cursor *after*, as :meth:`~receipts.operations.Operations.review_jobs`
    returns them).
    """
    _, count = await operations.count_now(view, timeout_seconds=count_seconds, cap=count_cap)
    rows = await operations.review_jobs(view, limit=limit, after=after)
    return count, rows


async def job(operations: Operations, key: str) -> dict[str, Any] | None:
    """One job by id or order id, for display; None when there is none.

    The row's columns, except that the lease token is cut: ``lease_token``
    becomes ``lease_token_prefix`` (its first 8 hex digits, as log lines
    carry them: never enough to ack with) and ``holder_tag`` (its last 8:
    the tag of the worker that claimed it, :mod:`receipts.heartbeat`), both
    None without a lease. ``attempts`` is the column (attempts used);
    ``history`` its attempt records, newest first (at most the last 20).
    """
    row = await operations.show_job(key)
    if row is None:
        return None
    token: uuid.UUID | None = row["lease_token"]
    shown: dict[str, Any] = {}
    for k, v in row.items():  # the columns' order kept: the token's place included
        if k == "lease_token":
            shown["lease_token_prefix"] = token.hex[:TOKEN_SHOWN_CHARS] if token else None
            shown["holder_tag"] = token.hex[-8:] if token else None
        else:
            shown[k] = v
    shown["history"] = await operations.job_attempts(row["id"])
    return shown


async def show(operations: Operations, key: str) -> dict[str, Any] | None:
    """One job by id or order id as a JSON-ready dict (``receipts jobs show``); None
    when there is none.

    The columns of :func:`job` in the row's order, with the lease token as
    its first 8 characters followed by ``…`` (enough to match log lines,
    which carry the same 8; never enough to ack with); ``attempts`` lists
    its attempt history (in the column's place), newest first (at most the
    last 20).
    """
    row = await job(operations, key)
    if row is None:
        return None
    history = row.pop("history")
    shown: dict[str, Any] = {}
    for k, v in row.items():
        if k == "lease_token_prefix":
            shown["lease_token"] = v + "…" if v else None
        elif k == "attempts":
            shown[k] = [{name: jsonable(value) for name, value in a.items()} for a in history]
        elif k != "holder_tag":
            shown[k] = jsonable(v)
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

    ``retried``/``would_retry`` are job ids (of every failed job: at most
    :data:`IDS_SHOWN`); ``count`` is how many were (or would be) retried;
    ``refused`` is non-empty only when nothing changed because a named job
    was unknown or not failed; ``changed`` is True when named jobs changed
    between the check and the update (another operator, a worker or recovery
    acted on them): then nothing changed either, and ``refused`` names the
    jobs no longer failed. ``action_id`` names the bulk action of an
    all-failed retry.
    """

    dry_run: bool
    retried: list[str] = field(default_factory=list)
    would_retry: list[str] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    changed: bool = False
    count: int = 0
    action_id: str | None = None

    @property
    def ok(self) -> bool:
        """True when every named (or every failed) job was retried, or would be."""
        return not self.refused and not self.changed

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"dry_run", "retried", "would_retry", "count", "refused": [{id,
        state}]}``, plus ``action_id`` for a retry of every failed job."""
        data: dict[str, Any] = {
            "dry_run": self.dry_run,
            "retried": list(self.retried),
            "would_retry": list(self.would_retry),
            "count": self.count,
            "refused": [{"id": r.id, "state": r.state} for r in self.refused],
        }
        if self.action_id is not None:
            data["action_id"] = self.action_id
        return data


async def refusals(operations: Operations, ids: Sequence[uuid.UUID],
                   allowed: Sequence[JobState]) -> list[Refusal]:
    """The jobs of *ids* not in one of the *allowed* states now (``unknown`` when absent)."""
    states = await operations.job_states(ids)
    return [Refusal(str(i), str(states.get(i, "unknown"))) for i in ids
            if states.get(i) not in allowed]


async def retry(operations: Operations, ids: Sequence[uuid.UUID] | None, *,
                dry_run: bool = False, author: str = "cli",
                on_step: StepCallback | None = None,
                expected: int | None = None) -> RetryResult:
    """Move failed jobs back to ready (attempts 0, due now); *ids* None means every failed job.

    Named jobs are all or nothing: if any is unknown or not failed, nothing
    changes and the result lists the refusals; the update itself
    (``retry_jobs``, one statement that locks the rows and re-checks them)
    changes nothing unless every named job is still failed when it runs, or
    unless exactly *expected* jobs qualify (the count the operator
    confirmed; default: the number of distinct ids). Duplicated ids count
    once. Every failed job is a bulk action by *author* (failed at the
    moment it starts; *on_step* after each batch). ``last_error`` is kept,
    prefixed ``manual retry after:``.
    """
    if ids is None:
        view = ReviewFilter(state=JobState.FAILED)
        if dry_run:
            count, sample = await _would_change(operations, view)
            return RetryResult(dry_run=True, would_retry=sample, count=count)
        progress = await _bulk(operations, "retry", view, author, on_step)
        return RetryResult(dry_run=False, retried=[str(i) for i in progress.changed_ids],
                           count=progress.changed, action_id=str(progress.action_id))
    wanted = list(dict.fromkeys(ids))
    refused = await refusals(operations, wanted, (JobState.FAILED,))
    if refused:
        return RetryResult(dry_run=dry_run, refused=refused)
    targets = [str(i) for i in wanted]
    if dry_run:
        return RetryResult(dry_run=True, would_retry=targets, count=len(targets))
    confirmed = len(wanted) if expected is None else expected
    changed = [str(i) for i in await operations.retry_jobs(wanted, expected=confirmed)]
    if len(changed) != len(wanted):
        return RetryResult(dry_run=False, changed=True,
                           refused=await refusals(operations, wanted, (JobState.FAILED,)))
    return RetryResult(dry_run=False, retried=changed, count=len(changed))


async def _would_change(operations: Operations, view: ReviewFilter) -> tuple[int, list[str]]:
    """How many jobs *view* matches now, and the ids of the newest :data:`IDS_SHOWN`."""
    _, count, _ = await bulk.confirmation(operations, view, timeout_seconds=30.0,
                                          cap=10_000_000)
    rows = await operations.review_jobs(view, limit=min(IDS_SHOWN, 500))
    return count, [str(r["id"]) for r in rows]


async def _bulk(operations: Operations, action: str, view: ReviewFilter, author: str,
                on_step: StepCallback | None) -> bulk.Progress:
    """Run a bulk action over *view* from now to its end (:mod:`receipts.bulk`)."""
    cutoff, count, exact = await bulk.confirmation(operations, view)
    row, runner = await bulk.start(operations, action=action,
                                   view=dataclasses.replace(view, cutoff=cutoff),
                                   expected=count if exact else None, created_by=author)
    return await bulk.run(operations, row, runner, policy=bulk.BulkPolicy(),
                          keep_ids=IDS_SHOWN, on_step=on_step)


@dataclass(frozen=True, slots=True)
class DiscardResult:
    """What ``discard`` did (or, with ``dry_run``, would do).

    ``discarded`` holds job ids (of a filter: at most :data:`IDS_SHOWN`);
    ``expected`` is how many were (or would be) discarded; ``refused`` is
    non-empty only when nothing changed because a named job was unknown or
    not ready/failed; ``changed`` is True when named jobs changed between the
    check and the update (then nothing changed either). ``action_id`` names
    the bulk action of a filter.
    """

    dry_run: bool
    expected: int = 0
    discarded: list[str] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    changed: bool = False
    action_id: str | None = None

    @property
    def ok(self) -> bool:
        """True when every target was discarded (or would be)."""
        return not self.refused and not self.changed

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"dry_run", "discarded", "would_discard", "count", "refused"}``,
        plus ``action_id`` for a filter."""
        data: dict[str, Any] = {
            "dry_run": self.dry_run,
            "discarded": [] if self.dry_run else list(self.discarded),
            "would_discard": list(self.discarded) if self.dry_run else [],
            "count": self.expected,
            "refused": [{"id": r.id, "state": r.state} for r in self.refused],
        }
        if self.action_id is not None:
            data["action_id"] = self.action_id
        return data


async def discard(operations: Operations, target: Sequence[uuid.UUID] | ReviewFilter, *,
                  dry_run: bool = False, author: str = "cli",
                  on_step: StepCallback | None = None,
                  expected: int | None = None) -> DiscardResult:
    """Move ready or failed jobs to ``discarded`` (terminal; the row keeps the order deduplicated).

    *target* is a list of job ids (all or nothing: any unknown, running or
    finished job refuses the lot; the update, ``discard_jobs``, changes
    nothing unless exactly those jobs still qualify, or exactly *expected*
    of them when given: the count the operator confirmed) or a
    :class:`~receipts.operations.ReviewFilter` over ready or failed jobs: a
    bulk action by *author* over the jobs in the state when it starts
    (*on_step* after each batch). Running jobs are never touched.
    """
    if isinstance(target, ReviewFilter):
        if dry_run:
            count, sample = await _would_change(operations, target)
            return DiscardResult(dry_run=True, expected=count, discarded=sample)
        progress = await _bulk(operations, "discard", target, author, on_step)
        return DiscardResult(dry_run=False, expected=progress.changed,
                             discarded=[str(i) for i in progress.changed_ids],
                             action_id=str(progress.action_id))
    wanted = list(dict.fromkeys(target))
    refused = await refusals(operations, wanted, (JobState.READY, JobState.FAILED))
    if refused:
        return DiscardResult(dry_run=dry_run, refused=refused)
    found = [str(i) for i in wanted]
    if dry_run:
        return DiscardResult(dry_run=True, expected=len(wanted), discarded=found)
    confirmed = len(wanted) if expected is None else expected
    ids = [str(i) for i in await operations.discard_jobs(wanted, expected=confirmed)]
    return DiscardResult(dry_run=False, expected=len(wanted), discarded=ids,
                         changed=len(ids) != len(wanted))
