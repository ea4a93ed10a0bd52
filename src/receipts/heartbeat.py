"""A worker process's heartbeat: its row in ``receipt_workers``, upserted now and then.

The review page lists the workers seen in the last minutes (pod, version,
slots, deliveries in flight, jobs claimed, last claim) from these rows, and
names the holder of a running job's lease by the tag its token ends in
(:func:`receipts.statements.claim_query`). Why a table rather than
``pg_stat_activity``: docs/design.md, "Workers: a heartbeat, not
pg_stat_activity".

Cost: one upsert of one small row (a HOT update) per process every
``HEARTBEAT_SECONDS`` × U(0.8, 1.2), never per claim: 16 idle pods write
< 1 row a second, against the 16 claims a second their polling already
costs. A heartbeat that fails (the database is down, migration 0007 is not
applied yet) is logged at debug level and tried again next time; it never
stops the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import time
from collections.abc import Callable

from receipts.errors import QueueError
from receipts.jobqueue import JobQueue
from receipts.logs import get_logger
from receipts.metrics import Metrics
from receipts.settings import package_version
from receipts.worker import Worker

log = get_logger("heartbeat")

#: Mean seconds between two heartbeats of one process.
HEARTBEAT_SECONDS = 20.0
#: Rows not seen for this long (seconds) are deleted when a worker starts.
FORGET_AFTER_SECONDS = 86_400.0
#: How long a stopping worker spends on its last heartbeat at most, seconds.
LAST_BEAT_SECONDS = 1.0


def new_tag() -> str:
    """A fresh worker tag: 8 random lower-case hex digits (``receipt_workers.tag``)."""
    return secrets.token_hex(4)


class Heartbeat:
    """Upserts one worker process's ``receipt_workers`` row.

    Args:
        queue: the worker's :class:`~receipts.jobqueue.JobQueue` (its pool, its
            schema, its statement deadline).
        worker: the running :class:`Worker` (slots, deliveries in flight, last claim).
        metrics: its :class:`Metrics` (``receipts_jobs_claimed_total``).
        tag: the process's tag, the one *queue* writes into lease tokens.
        interval_seconds: mean seconds between heartbeats (jittered ×0.8–1.2).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, queue: JobQueue, worker: Worker, metrics: Metrics, *, tag: str,
                 interval_seconds: float = HEARTBEAT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.queue = queue
        self.worker = worker
        self.metrics = metrics
        self.tag = tag
        self.interval_seconds = interval_seconds
        self._clock = clock
        self._started = clock()
        self.beats = 0
        self._refusal_logged = False

    async def beat(self, *, stopped: bool = False) -> bool:
        """One upsert of this process's row; True when it was written."""
        claimed = self.metrics.registry.get_sample_value("receipts_jobs_claimed_total") or 0.0
        last = self.worker.last_claim_at
        now = self._clock()
        try:
            await self.queue.heartbeat(
                tag=self.tag, pod=self.worker.name, pid=os.getpid(), version=package_version(),
                slots=self.worker.settings.concurrency, inflight=self.worker.inflight,
                claimed_total=int(claimed), uptime_seconds=now - self._started,
                since_claim_seconds=None if last is None else now - last, stopped=stopped,
                concurrency_limit=self.worker.concurrency_limit())
        except QueueError as exc:
            if "--print-grants" in str(exc) and not self._refusal_logged:
                # A role without the heartbeat's rights (grants not applied after an
                # upgrade): the workers list stays empty, so say it once, loudly.
                self._refusal_logged = True
                log.warning("heartbeat_refused", extra={"error": str(exc)})
            else:
                log.debug("heartbeat_failed", extra={"error": str(exc)})
            return False
        self.beats += 1
        read = getattr(self.queue, "fleet_concurrency_limit", None)
        if self.worker.capacity is not None and read is not None:
            # Adaptive concurrency shares its increase among the live pods: count them
            # (the fallback when no waker announces the fleet; receipts.capacity).
            try:
                _, count = await read()
            except QueueError as exc:
                log.debug("fleet_limit_unread", extra={"error": str(exc)})
            else:
                self.worker.fleet_heard = max(1, count)
        return True

    async def run(self) -> None:
        """Forget long-gone workers once, then beat every interval until cancelled."""
        with contextlib.suppress(QueueError):
            await self.queue.forget_workers(seconds=FORGET_AFTER_SECONDS)
        while True:
            await self.beat()
            await asyncio.sleep(self.interval_seconds * random.uniform(0.8, 1.2))

    async def stop(self) -> None:
        """The last heartbeat, marking the process stopped: best effort, at most
        :data:`LAST_BEAT_SECONDS`, and only while the database answers the worker
        (a stop during an outage must not wait for it; the row then ages out)."""
        if not self.worker.is_ready():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LAST_BEAT_SECONDS):
                await self.beat(stopped=True)
