"""The worker loop (``receipts worker``): claim only for free slots, deliver, ack.

Shape (docs/design.md §4):

* ``concurrency`` delivery slots. The claim loop claims at most the number of
  free slots (capped at ``claim_batch_max``) and only when one is free, so a
  claimed job starts its delivery at once and no lease ticks while it waits.
* One statement per pool connection borrow: claim, ack (coalesced, see
  :mod:`receipts.acks`), reschedule. No connection is held across a provider
  call; two connections serve any slot count.
* A short claim means the queue looked empty: sleep a jittered poll interval,
  cut short by a LISTEN/NOTIFY wake-up (one extra direct connection, off
  behind PgBouncer transaction pooling). Polling is always the safety net.
* A 401/403 from the provider opens a breaker: claiming pauses (doubling up to
  10 minutes), then one job probes; a bad token thus costs a few attempts,
  not every job's.
* Database outage: the loop backs off (jittered, ≤ 30 s), ``/readyz`` says
  not ready, and it resumes by itself.
* Stop (SIGTERM): claim nothing more, let in-flight deliveries finish for up
  to ``shutdown_grace_seconds``, abandon the rest (their leases expire and
  recovery returns them), flush acks, return.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from dataclasses import dataclass

from receipts.acks import AckBatcher
from receipts.db import notifications
from receipts.delivery import Deliverer
from receipts.errors import DatabaseUnavailable, QueueError, SchemaMissing
from receipts.jobqueue import JobQueue
from receipts.logs import get_logger, job_fields
from receipts.metrics import Metrics
from receipts.model import Job, JobState, Outcome, Reason, Verdict
from receipts.retry import BackoffPolicy
from receipts.settings import Settings

log = get_logger("worker")

OUTAGE_BACKOFF_MAX_SECONDS = 30.0
AUTH_PAUSE_MAX_SECONDS = 600.0


@dataclass(slots=True)
class _Breaker:
    """Claim pause after the provider rejected our credentials (401/403).

    Closed while ``pause_seconds`` is 0. The first rejection opens it for
    ``first_pause_seconds``; when the pause ends, one *probe* job is claimed:
    its rejection doubles the pause (up to ``AUTH_PAUSE_MAX_SECONDS``), any
    other answer from it closes the breaker, and so does any delivered job.
    Answers of jobs claimed before the pause neither compound nor close it.
    """

    first_pause_seconds: float
    pause_seconds: float = 0.0
    open_until: float = 0.0  # monotonic
    probe: uuid.UUID | None = None  # the probe job in flight, if any

    @property
    def is_open(self) -> bool:
        return self.pause_seconds > 0

    def remaining(self) -> float:
        return max(0.0, self.open_until - time.monotonic())

    def rejected(self, job_id: uuid.UUID) -> float | None:
        """A 401/403 for *job_id*; returns the new pause, or None when nothing changes."""
        if self.is_open and job_id != self.probe:
            return None
        self.pause_seconds = (
            min(AUTH_PAUSE_MAX_SECONDS, self.pause_seconds * 2)
            if self.is_open else self.first_pause_seconds
        )
        self.open_until = time.monotonic() + self.pause_seconds * random.uniform(0.9, 1.1)
        self.probe = None
        return self.pause_seconds

    def answered(self, job_id: uuid.UUID, delivered: bool) -> bool:
        """Another answer for *job_id*; True when it closed the breaker."""
        if self.is_open and (delivered or job_id == self.probe):
            self.pause_seconds, self.open_until, self.probe = 0.0, 0.0, None
            return True
        return False


class Worker:
    """One worker process's delivery loop.

    Args:
        settings: validated :class:`Settings` (slots, lease, timeouts, backoff).
        queue: the :class:`JobQueue` (an open pool inside).
        deliverer: what delivers a job (normally :class:`receipts.delivery.HttpDeliverer`).
        metrics: the process's :class:`Metrics`.
    """

    def __init__(
        self, settings: Settings, queue: JobQueue, deliverer: Deliverer, metrics: Metrics
    ) -> None:
        self.settings = settings
        self.queue = queue
        self.deliverer = deliverer
        self.metrics = metrics
        self.policy = BackoffPolicy(
            base_seconds=settings.retry_base_seconds,
            cap_seconds=settings.retry_cap_seconds,
            retry_after_max_seconds=settings.retry_after_max_seconds,
        )
        self.acks = AckBatcher(queue, metrics, lease_seconds=settings.lease_seconds)
        self._inflight: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._breaker = _Breaker(settings.auth_pause_seconds)
        self._db_ok = False
        self._last_db_ok = 0.0
        metrics.slots.set(settings.concurrency)

    # ------------------------------------------------------------ state

    @property
    def inflight(self) -> int:
        """Deliveries in progress."""
        return len(self._inflight)

    def is_ready(self) -> bool:
        """True while the database answered this worker's last statement."""
        return self._db_ok and self.acks.healthy

    def wake(self) -> None:
        """Cut the current poll sleep short (a NOTIFY arrived)."""
        self._wake.set()

    def stop(self) -> None:
        """Ask :meth:`run` to stop claiming and drain (signal-handler safe)."""
        self._stop.set()
        self._wake.set()
        self._slot_freed.set()

    def _db_state(self, ok: bool) -> None:
        if ok != self._db_ok:
            log.info("database_ready" if ok else "database_unavailable")
        self._db_ok = ok
        self.metrics.ready.set(1 if ok else 0)

    # ------------------------------------------------------------- loop

    async def run(self) -> None:
        """Claim and deliver until :meth:`stop`, then drain; never raises for outages."""
        self.acks.start()
        helpers = [asyncio.create_task(self._stats_loop(), name="queue-stats")]
        if self.settings.listen_notify and not self.settings.pgbouncer:
            helpers.append(asyncio.create_task(self._listen_loop(), name="listen"))
        try:
            await self._claim_loop()
        finally:
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            await self._drain()

    async def _claim_loop(self) -> None:
        outage_backoff = 0.1
        while not self._stop.is_set():
            free = self.settings.concurrency - len(self._inflight)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            breaker = self._breaker
            limit = min(free, self.settings.claim_batch_max)
            if breaker.is_open:
                self.metrics.breaker_open.set(1)
                if breaker.remaining() > 0:
                    await self._sleep(breaker.remaining(), wakeable=False)
                    continue
                if breaker.probe is not None:  # half-open: wait for the probe's answer
                    self._slot_freed.clear()
                    await self._slot_freed.wait()
                    continue
                limit = 1
            try:
                jobs = await self.claim_once(limit)
            except (DatabaseUnavailable, SchemaMissing, QueueError) as exc:
                self._db_state(False)
                self.metrics.db_errors.labels("claim").inc()
                log.warning("claim_failed", extra={"error": str(exc)})
                await self._sleep(outage_backoff * random.uniform(0.5, 1.0), wakeable=False)
                outage_backoff = min(outage_backoff * 2, OUTAGE_BACKOFF_MAX_SECONDS)
                continue
            outage_backoff = 0.1
            if breaker.is_open and jobs:
                breaker.probe = jobs[0].id
                continue
            if len(jobs) < limit:
                poll = self.settings.poll_interval_seconds
                await self._sleep(poll * random.uniform(0.75, 1.25), wakeable=True)

    async def claim_once(self, limit: int) -> list[Job]:
        """Claim up to *limit* jobs and start their deliveries; returns the jobs.

        Raises the queue's errors (the caller backs off).
        """
        self._wake.clear()
        start = time.perf_counter()
        jobs = await self.queue.claim(limit)
        claimed_at = time.monotonic()
        self.metrics.statement_duration.labels("claim").observe(time.perf_counter() - start)
        self._db_state(True)
        self.metrics.claims.inc()
        self.metrics.claim_batch.observe(len(jobs))
        if jobs:
            self.metrics.jobs_claimed.inc(len(jobs))
        for job in jobs:
            task = asyncio.create_task(self._deliver(job, claimed_at))
            self._inflight.add(task)
            task.add_done_callback(self._delivery_done)
        self.metrics.inflight.set(len(self._inflight))
        return jobs

    def _delivery_done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self.metrics.inflight.set(len(self._inflight))
        self._slot_freed.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("delivery_crashed", exc_info=task.exception())

    async def _sleep(self, seconds: float, *, wakeable: bool) -> None:
        events = [self._stop.wait()]
        if wakeable:
            events.append(self._wake.wait())
        waiters = [asyncio.ensure_future(e) for e in events]
        try:
            await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    # --------------------------------------------------------- delivery

    async def _deliver(self, job: Job, claimed_at: float) -> None:
        start = time.perf_counter()
        try:
            outcome = await self.deliverer.deliver(job)
        except Exception as exc:
            # A deliverer bug must not strand the job until its lease expires.
            log.exception("delivery_error", extra=job_fields(job, Reason.INTERNAL_ERROR))
            detail = f"internal error: {exc!r}"[:200]
            outcome = Outcome(Verdict.RETRY, Reason.INTERNAL_ERROR, detail=detail)
        self.metrics.delivery_duration.labels(outcome.reason).observe(time.perf_counter() - start)
        self._observe_breaker(job, outcome)
        if outcome.verdict is Verdict.DELIVERED:
            # The batcher owns the ack once submitted: cancelling this task (abandon
            # at stop) cancels only our wait for the answer, never the ack itself,
            # so no shield (one fewer future and callback pair per job).
            done = await self.acks.submit(job, claimed_at)
            if done and log.isEnabledFor(10):
                log.debug("delivered", extra=job_fields(job, Reason.DELIVERED))
            return
        await self._reschedule(job, outcome, claimed_at)

    def _observe_breaker(self, job: Job, outcome: Outcome) -> None:
        if outcome.reason is Reason.AUTH_REJECTED:
            pause = self._breaker.rejected(job.id)
            if pause is not None:
                self.metrics.breaker_open.set(1)
                log.error("provider_auth_rejected",
                          extra={**job_fields(job, outcome.reason), "pause_seconds": pause})
        elif self._breaker.answered(job.id, outcome.verdict is Verdict.DELIVERED):
            self.metrics.breaker_open.set(0)
            log.info("provider_auth_accepted", extra=job_fields(job, outcome.reason))

    async def _reschedule(self, job: Job, outcome: Outcome, claimed_at: float) -> None:
        permanent = outcome.verdict is Verdict.PERMANENT
        delay = 0.0 if permanent else self.policy.delay(
            job.attempt, retry_after_seconds=outcome.retry_after_seconds
        )
        error = outcome.detail or outcome.reason
        backoff = 0.05
        while True:
            try:
                start = time.perf_counter()
                state = await self.queue.reschedule(
                    job, delay_seconds=delay, error=error, permanent=permanent
                )
                self.metrics.statement_duration.labels("reschedule").observe(
                    time.perf_counter() - start
                )
                break
            except QueueError as exc:
                self.metrics.db_errors.labels("reschedule").inc()
                if time.monotonic() - claimed_at > self.settings.lease_seconds:
                    self.metrics.leases_lost.inc()
                    log.warning("lease_lost", extra={**job_fields(job, outcome.reason),
                                                     "error": str(exc)})
                    return
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, 5.0)
        fields = {**job_fields(job, outcome.reason), "status": outcome.status,
                  "error": error}
        if state is None:
            self.metrics.stale_acks.inc()
            self.metrics.leases_lost.inc()
            log.warning("stale_reschedule", extra=fields)
        elif state is JobState.FAILED:
            reason = outcome.reason if permanent else Reason.MAX_ATTEMPTS
            self.metrics.failures.labels(reason).inc()
            log.warning("job_failed", extra={**fields, "failure": reason})
        else:
            self.metrics.retries.labels(outcome.reason).inc()
            log.info("job_retry", extra={**fields, "delay_seconds": round(delay, 3)})

    # ---------------------------------------------------------- helpers

    async def _stats_loop(self) -> None:
        """Refresh the queue gauges at most once per interval (jittered)."""
        interval = self.settings.queue_stats_interval_seconds
        while True:
            try:
                self.metrics.observe_queue(await self.queue.queue_stats())
            except QueueError as exc:
                log.debug("queue_stats_failed", extra={"error": str(exc)})
            await asyncio.sleep(interval * random.uniform(0.8, 1.2))

    async def _listen_loop(self) -> None:
        """LISTEN for enqueue notifications on a dedicated connection; reconnects."""
        backoff = 0.5
        while True:
            try:
                async for _ in notifications(self.settings):
                    backoff = 0.5
                    self.wake()
            except QueueError as exc:
                log.debug("listen_failed", extra={"error": str(exc)})
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, OUTAGE_BACKOFF_MAX_SECONDS)

    async def _drain(self) -> None:
        grace = self.settings.shutdown_grace_seconds
        pending = set(self._inflight)
        log.info("draining", extra={"inflight": len(pending), "grace_seconds": grace})
        if pending:
            _, left = await asyncio.wait(pending, timeout=grace)
            for task in left:
                task.cancel()
            if left:
                log.warning("deliveries_abandoned", extra={"count": len(left)})
                await asyncio.gather(*left, return_exceptions=True)
        await self.acks.close(timeout_seconds=max(5.0, min(grace, 30.0)))
        log.info("stopped")


async def run_worker(settings: Settings, deliverer: Deliverer | None = None) -> None:
    """Run a worker process until SIGTERM/SIGINT: pool, metrics server, loop.

    *deliverer* defaults to an :class:`~receipts.delivery.HttpDeliverer` for
    ``settings.provider_url``. Raises ``OSError`` when the metrics port is taken.
    """
    import signal

    from receipts.db import make_pool
    from receipts.delivery import HttpDeliverer
    from receipts.metrics import make_app, start_server

    metrics = Metrics()
    pool = make_pool(settings, "worker")
    token = settings.provider_token.get_secret_value() if settings.provider_token else None
    deliverer = deliverer or HttpDeliverer(
        settings.provider_url,
        timeout_seconds=settings.delivery_timeout_seconds,
        token=token,
        max_connections=settings.concurrency,
    )
    queue = JobQueue(pool, lease_seconds=settings.lease_seconds,
                     max_attempts=settings.max_attempts)
    worker = Worker(settings, queue, deliverer, metrics)
    _watch_pool(pool, metrics)
    runner = None
    if settings.metrics_port:
        runner = await start_server(make_app(metrics, worker.is_ready), settings.metrics_port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    log.info("worker_started", extra={
        "concurrency": settings.concurrency, "lease_seconds": settings.lease_seconds,
        "database": settings.safe_dsn, "provider": settings.provider_url,
        "metrics_port": settings.metrics_port,
    })
    try:
        await pool.open(wait=False)
        await worker.run()
    finally:
        await deliverer.aclose()
        with contextlib.suppress(Exception):
            await pool.close(timeout=5.0)
        if runner is not None:
            await runner.cleanup()


def _watch_pool(pool: object, metrics: Metrics) -> None:
    """Expose psycopg_pool's ``get_stats()`` (never ``pop_stats()``) as gauges."""

    def stat(key: str) -> float:
        return float(pool.get_stats().get(key, 0))  # type: ignore[attr-defined]

    metrics.pool_connections.labels("size").set_function(lambda: stat("pool_size"))
    metrics.pool_connections.labels("in_use").set_function(
        lambda: stat("pool_size") - stat("pool_available")
    )
    metrics.pool_connections.labels("waiting").set_function(lambda: stat("requests_waiting"))
