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
* The chart's history is those readings, kept in memory, and one of them a
  minute is also kept in ``receipt_ui_samples`` (the first page to write a
  minute wins; two hours are kept), so a page that restarts draws the last
  hour again (:meth:`Monitor.load_history`). Prometheus keeps the long
  history (``receipts_jobs{state}``).
* Throughput and latency (:class:`Rates`: deliveries per minute, the
  median and 95th percentile attempt time over the last hour) come from
  ``receipt_attempts``, so they too survive a restart. The minutes already
  read are kept; a reading asks only for the last two minutes again, at most
  every :data:`RATES_SECONDS`.
* Exact done rows would need a count over every done row; the summary counts
  them fully every ``done_count_seconds`` while the table statistics say
  there are fewer than :data:`DONE_EXACT_BELOW` (an estimate above that,
  rounded, and labelled as one), and between two full counts adds the rows
  finished since the last one (a range of the done index), so the count
  moves with every reading.

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
from datetime import datetime, timedelta
from typing import Any

from receipts.errors import QueueError
from receipts.heartbeat import HEARTBEAT_SECONDS
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
#: A worker not heard from for longer than this (seconds) no longer counts as live: the
#: longest gap between two heartbeats (20 s × 1.2, jittered) and a few seconds of slack.
LIVE_SECONDS = HEARTBEAT_SECONDS * 1.2 + 6.0
#: How often (seconds) the throughput and latency of the last hour are read again.
RATES_SECONDS = 15.0


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
        """Workers that have not stopped and were heard from within :data:`LIVE_SECONDS`."""
        return [w for w in self.workers if is_live(w)]


def is_live(worker: dict[str, Any]) -> bool:
    """Whether a ``workers_seen`` row is a live worker: not stopped, and heard from within
    :data:`LIVE_SECONDS` (a killed worker drops out after at most that long)."""
    return worker["stopped_at"] is None and worker["age_seconds"] <= LIVE_SECONDS


@dataclass(frozen=True, slots=True)
class Rates:
    """Throughput and latency of the last hour, from ``receipt_attempts``.

    Attributes:
        minutes: per minute (oldest first): dicts of ``minute`` (datetime),
            ``attempts``, ``delivered``, ``p50`` and ``p95`` (seconds, None
            without a timed attempt).
        delivered, attempts: over the last hour.
        p50, p95: attempt time over the last hour, seconds (None: no attempt).
    """

    minutes: list[dict[str, Any]] = field(default_factory=list)
    delivered: int = 0
    attempts: int = 0
    p50: float | None = None
    p95: float | None = None

    def per_minute(self, now: datetime, minutes: int = 5) -> float:
        """Deliveries per minute over the last *minutes* minutes up to *now*."""
        recent = [int(m["delivered"]) for m in self.minutes
                  if (now - m["minute"]).total_seconds() < minutes * 60]
        return sum(recent) / minutes


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
        self._done_base: tuple[datetime, int] | None = None  # (database time, exact count)
        self._sampled_minute: datetime | None = None
        self.rates = Rates()
        self._rates_at = -1e9
        self._minutes: dict[datetime, dict[str, Any]] = {}
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
        """Read now, done rows and rates included (one reading for whoever waits on the
        lock meanwhile)."""
        async with self._lock:
            self._done_at = -1e9
            self._rates_at = -1e9
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
            await self._count_done(stats, flow.now)
            await self._read_rates()
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
        await self._keep_sample(self.history[-1])
        return snapshot

    async def _count_done(self, stats: QueueStats, now: datetime) -> None:
        """Done rows: a full count every ``done_count_seconds`` (below
        :data:`DONE_EXACT_BELOW`), and in between the full count plus the rows
        finished since it (one range of the done index)."""
        clock = self._clock()
        if clock - self._done_at >= self.done_count_seconds or self._done_base is None:
            self._done_at = clock
            self._done = None
            self._done_base = None
            if stats.done_estimate < DONE_EXACT_BELOW:
                counted = await self.operations.review_count(ReviewFilter(state=JobState.DONE),
                                                             cap=DONE_EXACT_BELOW)
                if counted < DONE_EXACT_BELOW:
                    self._done = counted
                    # Rows finished at the count's moment are in it: count from just after.
                    self._done_base = (now, counted)
            return
        at, base = self._done_base
        since = await self.operations.review_count(
            ReviewFilter(state=JobState.DONE, since=at + timedelta(microseconds=1)),
            cap=DONE_EXACT_BELOW)
        self._done = base + since

    async def _read_rates(self) -> None:
        """Throughput and latency of the last hour (:class:`Rates`), at most every
        :data:`RATES_SECONDS`: the whole hour once, then the last two minutes."""
        clock = self._clock()
        if clock - self._rates_at < RATES_SECONDS:
            return
        self._rates_at = clock
        since = max(self._minutes) - timedelta(minutes=1) if self._minutes else None
        for row in await self.operations.attempt_rates(since=since):
            self._minutes[row["minute"]] = row
        hour = await self.operations.attempt_percentiles()
        if self._minutes:
            newest = max(self._minutes)
            for minute in [m for m in self._minutes if (newest - m).total_seconds() >= 3600]:
                del self._minutes[minute]
        self.rates = Rates(minutes=[self._minutes[m] for m in sorted(self._minutes)],
                           delivered=int(hour["delivered"] or 0),
                           attempts=int(hour["attempts"] or 0), p50=hour["p50"], p95=hour["p95"])

    async def _keep_sample(self, sample: Sample) -> None:
        """Keep one sample a minute in ``receipt_ui_samples`` (best effort: the chart in
        memory does not depend on it)."""
        minute = sample.at.replace(second=0, microsecond=0)
        if minute == self._sampled_minute:
            return
        try:
            await self.operations.ui_sample(at=sample.at, ready=sample.ready,
                                            running=sample.running, failed=sample.failed)
        except QueueError as exc:
            log.warning("ui_sample_failed", extra={"error": str(exc)})
        self._sampled_minute = minute

    async def load_history(self) -> int:
        """Draw the chart's last hour from the kept samples (a page that just started);
        returns how many samples were loaded. Raises the queue's errors."""
        rows = await self.operations.ui_samples()
        kept = [Sample(r["minute"], int(r["ready"]), int(r["running"]), int(r["failed"]), True)
                for r in rows]
        first = self.history[0].at if self.history else None
        older = [s for s in kept if first is None or s.at < first]
        self.history.extendleft(reversed(older))
        if kept:
            self._sampled_minute = kept[-1].at
        return len(older)

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
