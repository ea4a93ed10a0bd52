"""Recovery (``receipts recover``): return abandoned attempts, then prune.

:func:`run_once` is one full sweep, as the recovery CronJob runs it:

1. expired leases in batches of at most 100, each batch its own committed
   statement with ``SKIP LOCKED`` (so concurrent sweeps split the work),
   until a batch comes back short: ready again after a jittered delay, or
   failed at max attempts, ``last_error = 'lease expired'``;
2. ready rows that can never be claimed (max attempts lowered) → failed;
3. done/failed rows past retention, in bounded batches (skipped when
   retention is 0).

Safe to run concurrently with itself and with workers (two prunes at once
wait on each other's rows for a batch). Returns what it did
as a :class:`RecoveryReport`; optionally pushes the counts to a Pushgateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry, Gauge, push_to_gateway

from receipts.errors import QueueError
from receipts.jobqueue import JobQueue, RecoveryBatch
from receipts.logs import get_logger
from receipts.settings import Settings

log = get_logger("recovery")

MAX_BATCHES_PER_SWEEP = 10_000  # a bound, never reached in practice


@dataclass(slots=True)
class RecoveryReport:
    """Counts from one sweep (rows)."""

    expired_to_ready: int = 0
    expired_to_failed: int = 0
    exhausted_to_failed: int = 0
    pruned: int = 0
    duration_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """The counts as a plain dict (for JSON output)."""
        return asdict(self)

    def summary(self, *, delay_seconds: float | None = None) -> str:
        """One human-readable line.

        With *delay_seconds* (``RECEIPTS_RECOVERY_DELAY_SECONDS``) and jobs
        returned to ready, it also says when they are due again: a recovered job
        waits a jittered part of that delay, so it can look stuck for a moment.
        """
        line = (
            f"recovered {self.expired_to_ready} expired lease(s) to ready, "
            f"{self.expired_to_failed} to failed; failed {self.exhausted_to_failed} "
            f"exhausted ready job(s); pruned {self.pruned} finished row(s) "
            f"in {self.duration_seconds:.2f}s"
        )
        if self.expired_to_ready and delay_seconds:
            line += (f"; the recovered jobs are due again within {delay_seconds:g}s"
                     " (RECEIPTS_RECOVERY_DELAY_SECONDS, jittered)")
        return line


async def return_expired(queue: JobQueue, *, batch_size: int, delay_seconds: float,
                         max_batches: int = MAX_BATCHES_PER_SWEEP) -> RecoveryBatch:
    """Step 1 of a sweep: expired leases back to ready (or failed at max attempts).

    Batches of *batch_size* (at most 100: ``recover_expired``), each its own
    committed statement, until one comes back short or *max_batches* ran;
    ready rows are due after *delay_seconds* × U(0.5, 1). Returns the totals.
    This is also the review page's "recover now" (bounded by its own
    *max_batches*). Raises the queue's errors; batches committed before an
    error stay committed.
    """
    full = min(int(batch_size), 100)
    to_ready = to_failed = 0
    for _ in range(max_batches):
        result = await queue.recover_expired(batch=full, delay_seconds=delay_seconds)
        to_ready += result.to_ready
        to_failed += result.to_failed
        if result.to_ready + result.to_failed < full:
            break
    return RecoveryBatch(to_ready=to_ready, to_failed=to_failed)


async def run_once(queue: JobQueue, settings: Settings) -> RecoveryReport:
    """One sweep (expired leases, exhausted ready rows, retention); see the module doc.

    Raises the queue's errors (``DatabaseUnavailable``, ``SchemaMissing``);
    batches committed before an error stay committed.
    """
    start = time.perf_counter()
    report = RecoveryReport()
    batch = settings.recovery_batch_size
    expired = await return_expired(queue, batch_size=batch,
                                   delay_seconds=settings.recovery_delay_seconds)
    report.expired_to_ready = expired.to_ready
    report.expired_to_failed = expired.to_failed
    for _ in range(MAX_BATCHES_PER_SWEEP):
        n = await queue.fail_exhausted(batch=batch)
        report.exhausted_to_failed += n
        if n < batch:
            break
    if settings.retention_seconds > 0:
        for _ in range(MAX_BATCHES_PER_SWEEP):
            n = await queue.prune(
                retention_seconds=settings.retention_seconds, batch=settings.prune_batch_size
            )
            report.pruned += n
            if n < settings.prune_batch_size:
                break
    report.duration_seconds = time.perf_counter() - start
    log.info("recovery_sweep", extra=report.as_dict())
    return report


def report_registry(report: RecoveryReport) -> CollectorRegistry:
    """A fresh registry holding *report* as the gauges :func:`push_report` sends.

    Every figure is this sweep's alone and the next push replaces it, so all are
    gauges named for the last sweep (``max``/``last_over_time`` read them;
    ``rate()`` would be meaningless):

    * ``receipts_recovery_last_sweep_expired_leases{result="ready"|"failed"}``
      (rows), ``receipts_recovery_last_sweep_exhausted_jobs`` (rows),
      ``receipts_recovery_last_sweep_pruned_rows`` (rows),
      ``receipts_recovery_last_sweep_duration_seconds``;
    * ``receipts_recovery_last_success_timestamp_seconds``: Unix time of the push.
    """
    registry = CollectorRegistry()
    expired = Gauge("receipts_recovery_last_sweep_expired_leases",
                    "Expired leases the last sweep returned to ready, or failed at max attempts.",
                    ["result"], registry=registry)
    expired.labels("ready").set(report.expired_to_ready)
    expired.labels("failed").set(report.expired_to_failed)
    Gauge("receipts_recovery_last_sweep_exhausted_jobs",
          "Ready jobs the last sweep failed because their attempts were used up.",
          registry=registry).set(report.exhausted_to_failed)
    Gauge("receipts_recovery_last_sweep_pruned_rows",
          "Finished rows the last sweep deleted (retention).",
          registry=registry).set(report.pruned)
    Gauge("receipts_recovery_last_sweep_duration_seconds",
          "Wall time of the last sweep, seconds.",
          registry=registry).set(report.duration_seconds)
    Gauge("receipts_recovery_last_success_timestamp_seconds",
          "Unix time the last recovery sweep finished.", registry=registry).set_to_current_time()
    return registry


def push_report(report: RecoveryReport, gateway_url: str, *, job: str = "receipts-recover") -> None:
    """Push *report* (the gauges of :func:`report_registry`) to a Prometheus Pushgateway,
    replacing the group ``job``.

    Raises ``OSError`` (``urllib.error.URLError`` included) when the gateway
    cannot be reached or refuses the push.
    """
    push_to_gateway(gateway_url, job=job, registry=report_registry(report), timeout=10)


def push_if_configured(report: RecoveryReport, settings: Settings) -> bool:
    """Push *report* when ``RECEIPTS_PUSHGATEWAY_URL`` is set; True when pushed.

    A failed push is logged as ``push_failed`` and never raised: the sweep's
    work is done either way, and an unreachable Pushgateway shows as the pushed
    last-success time growing old (``ReceiptsRecoveryNotRunning``).
    """
    if not settings.pushgateway_url:
        return False
    try:
        push_report(report, settings.pushgateway_url)
    except OSError as exc:
        log.warning("push_failed", extra={"error": str(exc)[:300]})
        return False
    return True


async def run_loop(queue: JobQueue, settings: Settings, every_seconds: float,
                   stop: asyncio.Event) -> None:
    """Sweep every *every_seconds* until *stop* is set; outages are logged, not raised.

    Each successful sweep is pushed to the Pushgateway when one is configured
    (in a thread: the push is blocking HTTP).
    """
    while not stop.is_set():
        try:
            report = await run_once(queue, settings)
        except QueueError as exc:
            log.warning("recovery_failed", extra={"error": str(exc)})
        else:
            await asyncio.to_thread(push_if_configured, report, settings)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_seconds)
