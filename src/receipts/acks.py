"""Coalesced acks: many delivered attempts completed by one guarded statement.

A single flusher task takes everything submitted since its last statement
(up to ``max_batch``) and runs one ``ack`` for all of it, so batches grow by
themselves under load and stay at one job when the queue is quiet; no timer
adds latency. Measured on this kind of machine, a batched ack is 2.6–7× faster
than one ack per job (docs/design.md §10).

Acks are independent of the delivery tasks that submit them: cancelling a
delivery task (shutdown, abandon) does not cancel its ack, and :meth:`close`
flushes what is pending. When the database is unreachable, pending acks are
retried until the lease they belong to has certainly expired (more than
``lease_seconds`` of this process's monotonic clock since the claim returned:
the lease was counted by the database from an earlier instant), after which
they are dropped as lost leases: recovery owns those jobs now.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field

from receipts.errors import DatabaseUnavailable, QueueError
from receipts.jobqueue import JobQueue
from receipts.logs import get_logger, job_fields
from receipts.metrics import Metrics
from receipts.model import Job

log = get_logger("acks")


@dataclass(slots=True)
class _Pending:
    job: Job
    claimed_at: float  # time.monotonic() when the claim returned
    result: asyncio.Future[bool] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class AckBatcher:
    """Queue delivered attempts and complete them in batches.

    Args:
        queue: the :class:`JobQueue` whose ``ack`` statement is used.
        metrics: counters for acks, stale acks and lost leases.
        lease_seconds: the lease length, seconds (bounds retries, see module doc).
        max_batch: most pairs in one statement.
    """

    def __init__(
        self, queue: JobQueue, metrics: Metrics, *, lease_seconds: float, max_batch: int = 500
    ) -> None:
        self.queue = queue
        self.metrics = metrics
        self.lease_seconds = lease_seconds
        self.max_batch = max_batch
        self._pending: list[_Pending] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self.healthy = True

    def start(self) -> None:
        """Start the flusher task (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="ack-flusher")

    def submit(self, job: Job, claimed_at: float) -> asyncio.Future[bool]:
        """Queue *job* for ack; the future resolves True (done) or False (stale/lost).

        *claimed_at* is ``time.monotonic()`` when its claim returned.
        """
        item = _Pending(job, claimed_at)
        self._pending.append(item)
        self._wake.set()
        return item.result

    @property
    def pending(self) -> int:
        """Acks waiting for a statement."""
        return len(self._pending)

    async def close(self, timeout_seconds: float) -> None:
        """Flush what is pending (for at most *timeout_seconds*), then stop."""
        self._closing = True
        self._wake.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_seconds)
        except TimeoutError:
            log.warning("acks_abandoned", extra={"pending": len(self._pending)})
            self._task.cancel()
            for item in self._pending:
                if not item.result.done():
                    item.result.set_result(False)

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._pending[: self.max_batch]
            del self._pending[: len(batch)]
            try:
                start = time.perf_counter()
                done = await self.queue.ack([(p.job.id, p.job.token) for p in batch])
                self.metrics.statement_duration.labels("ack").observe(time.perf_counter() - start)
                self.healthy = True
                backoff = 0.05
            except (DatabaseUnavailable, QueueError) as exc:
                self.healthy = False
                self.metrics.db_errors.labels("ack").inc()
                keep = self._expire(batch)
                self._pending[:0] = keep
                log.warning("ack_failed", extra={"error": str(exc), "retrying": len(keep)})
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, 5.0)
                continue
            self._settle(batch, done)

    def _expire(self, batch: list[_Pending]) -> list[_Pending]:
        """Drop items whose lease has certainly expired; return the rest."""
        now = time.monotonic()
        keep = []
        for item in batch:
            if now - item.claimed_at > self.lease_seconds:
                self.metrics.leases_lost.inc()
                log.warning("lease_lost", extra=job_fields(item.job, "ack_unconfirmed"))
                if not item.result.done():
                    item.result.set_result(False)
            else:
                keep.append(item)
        return keep

    def _settle(self, batch: list[_Pending], done: set[uuid.UUID]) -> None:
        acked = 0
        for item in batch:
            ok = item.job.id in done
            if ok:
                acked += 1
            else:
                # A refused ack means our lease expired (and maybe a newer
                # attempt holds the row): the lease was lost either way.
                self.metrics.stale_acks.inc()
                self.metrics.leases_lost.inc()
                log.warning("stale_ack", extra=job_fields(item.job, "stale"))
            if not item.result.done():
                item.result.set_result(ok)
        self.metrics.acks.inc(acked)

