"""One shared reading of the queue for every viewer of the review page.

The page's database is the shop's checkout database, so what the page reads
again and again must cost the same for one viewer as for fifty:

* The summary, the provider's flow state, the workers, the bulk actions and
  the signed-out sessions are read by **one** :meth:`Monitor.refresh` (five
  small statements on one connection), at most once per
  ``refresh_seconds`` however many viewers ask; concurrent viewers wait for
  the same reading.
* While nobody has looked for ``idle_seconds``, the monitor samples only every
  ``idle_refresh_seconds`` (the chart keeps its hour at a coarser grain).
* A reading never takes more than a tenth of one database session's time:
  when one takes longer than a tenth of the interval (the gauges count a
  million failed rows, say), the interval stretches to ten times the reading
  (:data:`MAX_DUTY`).
* The chart's history is those readings, kept **in memory** (no table, no
  extra statement); a page that has just started shows what it has seen so
  far and says since when. Prometheus keeps the long history
  (``receipts_jobs{state}``).
* Exact done rows would need a count over every done row; the summary counts
  them only every ``done_count_seconds`` and only while the table statistics
  say there are fewer than :data:`DONE_EXACT_BELOW` (an estimate above that,
  rounded, and labelled as one).

When the database does not answer, the last reading stays on the page with the
time it was taken and the error, instead of an error page.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from receipts.errors import QueueError
from receipts.jobqueue import JobQueue
from receipts.logs import get_logger
from receipts.model import JobState, QueueStats
from receipts.operations import FleetFlow, Operations, ReviewFilter
from receipts.ui.chart import Sample
from receipts.ui.session import Sessions

log = get_logger("ui")

#: Below this many done rows (by the table statistics) the summary counts them exactly.
DONE_EXACT_BELOW = 100_000
#: Workers heard from within this many seconds are listed.
WORKERS_SECONDS = 900.0
#: Bulk actions created within this many seconds (or still running) are listed.
BULK_SECONDS = 86_400.0
#: The most of one database session's time the shared reading may take.
MAX_DUTY = 0.1


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One reading of the queue (times are the database's).

    Attributes:
        as_of: when it was read.
        stats: the queue gauges (exact counts by state but done).
        flow: the fleet-wide provider state.
        workers: rows of ``workers_seen``.
        bulk: rows of ``bulk_recent``.
        done: done rows, exact, or None when only the estimate is known.
    """

    as_of: datetime
    stats: QueueStats
    flow: FleetFlow
    workers: list[dict[str, Any]] = field(default_factory=list)
    bulk: list[dict[str, Any]] = field(default_factory=list)
    done: int | None = None

    @property
    def live_workers(self) -> list[dict[str, Any]]:
        """Workers that have not stopped and were heard from within two heartbeats' time."""
        return [w for w in self.workers if w["stopped_at"] is None and w["age_seconds"] <= 60]


class Monitor:
    """The shared reading behind every page (see the module doc).

    Args:
        queue: the page's :class:`JobQueue`.
        operations: the page's :class:`Operations` (same pool).
        refresh_seconds: the freshest a reading needs to be while viewed.
        rate, burst: the fleet's rate limit (jobs/s, jobs), for its tokens.
        sessions: told the revoked session ids at every reading (None: no sessions).
        idle_seconds: without a viewer this long, sample every *idle_refresh_seconds*.
        history_seconds: how much history the chart keeps.
        done_count_seconds: how often done rows are counted exactly.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, queue: JobQueue, operations: Operations, *, refresh_seconds: float,
                 rate: float = 0.0, burst: float = 1.0, sessions: Sessions | None = None,
                 idle_seconds: float = 120.0, idle_refresh_seconds: float = 60.0,
                 history_seconds: float = 3600.0, done_count_seconds: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.queue = queue
        self.operations = operations
        self.refresh_seconds = refresh_seconds
        self.rate, self.burst = rate, burst
        self.sessions = sessions
        self.idle_seconds = idle_seconds
        self.idle_refresh_seconds = idle_refresh_seconds
        self.history_seconds = history_seconds
        self.done_count_seconds = done_count_seconds
        self._clock = clock
        self.snapshot: Snapshot | None = None
        self.history: deque[Sample] = deque()
        self.readings = 0
        self.error: str | None = None
        self._read_at: float | None = None  # monotonic: the last successful reading
        self.reading_seconds = 0.0  # how long the last reading took
        self._viewed_at = -1e9
        self._done: int | None = None
        self._done_at = -1e9
        self._lock = asyncio.Lock()

    def viewed(self) -> None:
        """A viewer asked for a page: sample at the full rate for a while."""
        self._viewed_at = self._clock()

    def answered_within(self, seconds: float) -> bool:
        """True when the database answered a reading within the last *seconds*."""
        return self._read_at is not None and self._clock() - self._read_at <= seconds

    def interval(self) -> float:
        """Seconds between readings while viewed: ``refresh_seconds``, or longer when a
        reading is slow (at most :data:`MAX_DUTY` of the time is spent reading)."""
        return max(self.refresh_seconds, self.reading_seconds / MAX_DUTY)

    def _fresh(self) -> bool:
        return self._read_at is not None and (
            self._clock() - self._read_at < self.interval() * 0.9)

    async def current(self) -> Snapshot:
        """A reading at most ``refresh_seconds`` old, shared with concurrent callers.

        When the database does not answer, the last reading is returned (its
        ``as_of`` says how old; :attr:`error` says why). Raises the queue's
        error only when there has never been a reading.
        """
        self.viewed()
        if not self._fresh():
            async with self._lock:
                if not self._fresh():
                    with contextlib.suppress(QueueError):
                        await self._refresh()
        if self.snapshot is None:
            await self._refresh()  # raises the reason
        assert self.snapshot is not None
        return self.snapshot

    async def refresh(self) -> Snapshot:
        """Read now, done rows included (one reading for whoever waits on the lock meanwhile)."""
        async with self._lock:
            self._done_at = -1e9
            return await self._refresh()

    async def _refresh(self) -> Snapshot:
        began = time.perf_counter()
        try:
            stats = await self.queue.queue_stats()
            flow = await self.operations.fleet_flow(rate=self.rate, burst=self.burst)
            workers = await self.operations.workers_seen(seconds=WORKERS_SECONDS)
            bulk = await self.operations.bulk_recent(seconds=BULK_SECONDS)
            if self.sessions is not None:
                self.sessions.update_revoked(await self.operations.revoked_sessions())
            now = self._clock()
            if now - self._done_at >= self.done_count_seconds:
                self._done_at = now
                self._done = None
                if stats.done_estimate < DONE_EXACT_BELOW:
                    counted = await self.operations.review_count(
                        ReviewFilter(state=JobState.DONE), cap=DONE_EXACT_BELOW)
                    self._done = counted if counted < DONE_EXACT_BELOW else None
        except QueueError as exc:
            if self.error != str(exc):
                log.warning("ui_database_error", extra={"error": str(exc), "path": "(summary)"})
            self.error = str(exc)
            raise
        self.error = None
        self._read_at = self._clock()
        self.reading_seconds = time.perf_counter() - began
        self.readings += 1
        snapshot = Snapshot(flow.now, stats, flow, workers, bulk, self._done)
        self.snapshot = snapshot
        self.history.append(Sample(flow.now, stats.ready, stats.running, stats.failed))
        while self.history and (flow.now - self.history[0].at).total_seconds() > (
                self.history_seconds):
            self.history.popleft()
        return snapshot

    def next_sample_in(self) -> float:
        """Seconds until the background loop should read again."""
        viewed = self._clock() - self._viewed_at <= self.idle_seconds
        every = self.interval() if viewed else max(self.idle_refresh_seconds, self.interval())
        if self._read_at is None:
            return 0.0
        return max(0.0, self._read_at + every - self._clock())

    async def run(self) -> None:
        """Sample in the background until cancelled (the chart's history)."""
        while True:
            if self.queue.pool.closed:  # `receipts ui` binds its port before it opens the pool
                await asyncio.sleep(0.2)
                continue
            wait = self.next_sample_in()
            if wait > 0:
                await asyncio.sleep(min(wait, 1.0))
                continue
            with contextlib.suppress(QueueError):
                async with self._lock:
                    await self._refresh()
            if self._read_at is None or self.error is not None:
                await asyncio.sleep(self.refresh_seconds)  # the database is away: no tight loop
