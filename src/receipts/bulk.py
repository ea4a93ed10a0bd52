"""Bulk actions at any size: retry or discard every job a filter matches, in batches.

"Retry all 1,000,000 failed jobs" used to be one statement, which ran past
the statement timeout (and held its row locks for as long), and counted the
matching jobs again when it ran, so one failure between confirmation and
action made it refuse ("the jobs changed"). Here (docs/design.md, "Bulk
actions"):

* **Bounded by the confirmation.** The operator confirms a count taken at a
  moment, the action's ``cutoff``; only jobs in the state at that moment
  (``finished_at``, for ready jobs ``created_at``, ≤ cutoff) are ever
  touched, so later failures never make it stale, and jobs that left the
  state meanwhile are skipped.
* **Bounded batches.** Each batch is one statement (``bulk_step``) that walks
  at most ``batch`` jobs of the state in keyset order from the action's
  cursor, whatever the filter's selectivity. The batch size adapts so a batch
  takes about :attr:`BulkPolicy.target_seconds` (well under the statement
  timeout); a batch the server stops is retried at half the size.
* **Exact progress, resumable, idempotent.** A batch changes its jobs and
  advances the action's counts and cursor in one commit. A crashed runner
  loses nothing; another takes over the action (``bulk_take``) once it has
  been idle for ``stale_seconds`` and continues from the cursor; repeating a
  batch changes nothing (each UPDATE states the state it expects).
* **Kind to the checkout.** After each batch the runner rests for
  ``pace`` × the batch's time, so a bulk action uses at most about half of
  one database session's time.

:func:`start` records a confirmed action and :func:`run` drives it;
:func:`resume` takes over a stopped or abandoned one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from receipts.errors import DatabaseUnavailable, QueueError, StatementTimeout
from receipts.logs import get_logger
from receipts.operations import BulkStep, Operations, ReviewFilter

log = get_logger("bulk")


@dataclass(frozen=True, slots=True)
class BulkPolicy:
    """How a bulk action is paced (sizes in jobs, times in seconds).

    Attributes:
        first_batch: the first batch's size.
        min_batch, max_batch: bounds of the adapted size.
        target_seconds: the time one batch should take.
        pace: rest after each batch, as a multiple of its time (0: none).
        stale_seconds: an action idle this long may be taken over.
        retries: consecutive failed batches before the action is marked failed.
    """

    first_batch: int = 1_000
    min_batch: int = 100
    max_batch: int = 20_000
    target_seconds: float = 0.5
    pace: float = 1.0
    stale_seconds: float = 60.0
    retries: int = 5

    def next_batch(self, batch: int, took_seconds: float) -> int:
        """The next size: scaled toward ``target_seconds`` (at most ×2 or ÷2 a step)."""
        if took_seconds <= 0:
            return min(self.max_batch, batch * 2)
        scaled = batch * self.target_seconds / took_seconds
        return int(max(self.min_batch, min(self.max_batch, batch * 2, max(batch / 2, scaled))))


@dataclass(slots=True)
class Progress:
    """What a run did: the action's totals, its final status, the batches this
    run committed and (when asked) up to ``keep_ids`` of the changed job ids."""

    action_id: uuid.UUID
    status: str = "running"
    examined: int = 0
    changed: int = 0
    batches: int = 0
    seconds: float = 0.0
    changed_ids: list[uuid.UUID] = field(default_factory=list)


async def confirmation(operations: Operations, view: ReviewFilter, *, timeout_seconds: float = 2.0,
                       cap: int = 100_000) -> tuple[datetime, int, bool]:
    """The moment of a confirmation and the count the operator confirms.

    Returns (cutoff: the database's time now, count, exact). The count is
    exact when it finishes within *timeout_seconds*; otherwise it counts up
    to *cap* and ``exact`` is False ("at least *count*").
    """
    cutoff, count = await operations.count_now(view, timeout_seconds=timeout_seconds)
    if count is not None:
        return cutoff, count, True
    bounded = dataclasses.replace(view, cutoff=cutoff)
    return cutoff, await operations.review_count(bounded, cap=cap), False


async def start(operations: Operations, *, action: str, view: ReviewFilter,
                expected: int | None, created_by: str) -> tuple[dict[str, Any], uuid.UUID]:
    """Record a confirmed action (``view.cutoff`` set); returns its row and the runner token."""
    runner = uuid.uuid4()
    row = await operations.bulk_create(action=action, view=view, expected=expected,
                                       runner=runner, created_by=created_by)
    log.info("bulk_action_started", extra={
        "action_id": str(row["id"]), "action": action, "resumed": False,
        "filter": describe_filter(view), "expected": expected, "by": created_by})
    return row, runner


async def resume(operations: Operations, action_id: uuid.UUID, *,
                 policy: BulkPolicy) -> tuple[dict[str, Any], uuid.UUID] | None:
    """Take over a stopped, failed or abandoned action; (its row, the new runner) or None."""
    runner = uuid.uuid4()
    row = await operations.bulk_take(action_id, runner=runner,
                                     stale_seconds=policy.stale_seconds)
    if row is None:
        return None
    log.info("bulk_action_started", extra={
        "action_id": str(action_id), "action": row["action"], "resumed": True,
        "examined": row["examined"], "changed": row["changed"]})
    return row, runner


async def run(operations: Operations, action: dict[str, Any], runner: uuid.UUID, *,
              policy: BulkPolicy, keep_ids: int = 0,
              on_step: Callable[[BulkStep], Awaitable[None] | None] | None = None,
              sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> Progress:
    """Drive *action* (its row) batch by batch until it is done, stopped or taken over.

    *on_step* is called after every committed batch. A batch the server
    stops (:class:`StatementTimeout`) is retried at half the size; a database
    outage is waited out with backoff. After ``policy.retries`` failures in a
    row the action is marked failed (resumable). Raises nothing but
    cancellation; the returned :class:`Progress` says how it ended.
    """
    progress = Progress(action["id"], examined=int(action["examined"]),
                        changed=int(action["changed"]))
    cursor: tuple[datetime, uuid.UUID] | None = (
        (action["cursor_at"], action["cursor_id"]) if action["cursor_at"] is not None else None)
    batch = policy.first_batch
    failures = 0
    began = time.perf_counter()
    while True:
        started = time.perf_counter()
        try:
            step = await operations.bulk_step(action, runner=runner, batch=batch, after=cursor,
                                              want_ids=len(progress.changed_ids) < keep_ids)
        except StatementTimeout as exc:
            failures += 1
            batch = max(policy.min_batch, batch // 2)
            log.warning("bulk_batch_failed", extra={"action_id": str(action["id"]),
                                                    "slow": True, "next_batch": batch,
                                                    "error": str(exc)})
        except (DatabaseUnavailable, QueueError) as exc:
            failures += 1
            log.warning("bulk_batch_failed", extra={"action_id": str(action["id"]),
                                                    "slow": False, "next_batch": batch,
                                                    "error": str(exc)})
            await sleep(min(30.0, 0.5 * 2 ** failures))
        else:
            failures = 0
            if step is None:  # stopped, or another runner took over
                progress.status = "stopped"
                break
            took = time.perf_counter() - started
            progress.batches += 1
            progress.examined, progress.changed = step.examined, step.changed
            progress.status = step.status
            progress.changed_ids.extend(step.changed_ids[:keep_ids - len(progress.changed_ids)])
            if step.cursor_at is not None and step.cursor_id is not None:
                cursor = (step.cursor_at, step.cursor_id)
            if on_step is not None:
                result = on_step(step)
                if result is not None:
                    await result
            if step.status != "running":
                break
            batch = policy.next_batch(batch, took)
            if policy.pace > 0:
                await sleep(took * policy.pace)
            continue
        if failures >= policy.retries:
            progress.status = "failed"
            # If even this fails, the action shows as abandoned after stale_seconds.
            with contextlib.suppress(QueueError):
                await operations.bulk_fail(action["id"], runner=runner,
                                           error=f"{failures} batches failed in a row")
            break
    progress.seconds = time.perf_counter() - began
    log.info("bulk_action_ended", extra={
        "action_id": str(action["id"]), "status": progress.status,
        "examined": progress.examined, "changed": progress.changed,
        "batches": progress.batches, "seconds": round(progress.seconds, 3)})
    return progress


def describe_filter(view: ReviewFilter) -> str:
    """The filter as one line of ``name=value`` pairs (for logs and pages)."""
    parts = [f"state={view.state}"]
    for name in ("reason", "status", "since", "until", "order_contains", "cutoff"):
        value = getattr(view, name)
        if value is not None:
            parts.append(f"{name}={value.isoformat() if isinstance(value, datetime) else value}")
    return " ".join(parts)
