"""Every metric of the service on one registry, and the HTTP endpoint that serves it.

Names are fixed by docs/design.md §9 (dashboards and alerts depend on them): one
``receipts_`` prefix, base units (seconds), ``_total`` on counters, and
low-cardinality labels whose values are the queue's own vocabulary.

The endpoint (aiohttp) serves ``/metrics``, ``/healthz`` (the process is
alive) and ``/readyz`` (the database answered recently). A scrape only reads
values already in memory: it never queries the database nor borrows a pool
connection. Queue gauges are refreshed in the background by the worker, at
most once per ``queue_stats_interval_seconds``, and exported only while fresh:
once the last successful read is older than ``QUEUE_STATS_STALE_INTERVALS``
intervals (the database is unreachable, say), they leave the scrape, so no
alert fires on a frozen value; ``receipts_queue_stats_timestamp_seconds``
stays and tells when they were last read (docs/design.md §5).

``_created`` series are off: :class:`Metrics` calls prometheus-client's
``disable_created_metrics()``, which is process-global (it also affects any
other registry in the same process). They carried nothing a dashboard or alert
reads and were a fifth of every scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    Metric,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from receipts.model import FAILURE_REASONS, RETRY_REASONS, JobState, PauseReason, QueueStats
from receipts.settings import package_version

DELIVERY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 1, 2, 5, 10, 30, 60)
STATEMENT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)
# Enqueue → delivered: sub-second when healthy, minutes through retries, hours
# through a provider outage (the retry cap is 15 min, a provider pause up to 5 by default).
TIME_TO_RECEIPT_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800,
                           3600, 7200, 14400, 28800, 86400)
#: The queue gauges leave the scrape once their last successful read is older
#: than this many stats intervals (the alert rules rely on exactly this rule).
QUEUE_STATS_STALE_INTERVALS = 3


class _FreshOnly:
    """A collector that yields its gauges only while *fresh()* says so.

    The queue gauges are registered through it, not on the registry itself.
    """

    def __init__(self, gauges: Iterable[Gauge], fresh: Callable[[], bool]) -> None:
        #: The gauges it guards (for tools that document the registry).
        self.gauges = tuple(gauges)
        self._fresh = fresh

    def describe(self) -> Iterator[Metric]:
        """Every gauge's description (for the registry's duplicate-name check)."""
        for gauge in self.gauges:
            yield from gauge.describe()

    def collect(self) -> Iterator[Metric]:
        """The gauges' samples while fresh, nothing otherwise."""
        if self._fresh():
            for gauge in self.gauges:
                yield from gauge.collect()


class Metrics:
    """The service's metrics, registered on a private :class:`CollectorRegistry`.

    One instance per process; pass it to the worker and the HTTP server.
    Pass ``registry=None`` to get a fresh registry (tests create many).
    Creating one turns ``_created`` series off process-wide (see the module doc).

    Args:
        registry: the registry to register on (default: a new one).
        queue_stats_interval_seconds: how often the queue gauges are read,
            seconds (``RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS``); they are
            exported only while their last read is at most
            ``QUEUE_STATS_STALE_INTERVALS`` intervals old.
        clock: monotonic seconds, for that age (tests pass their own).
    """

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 queue_stats_interval_seconds: float = 15.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # process-global
        self.registry = registry or CollectorRegistry()
        #: Queue gauges older than this are not exported, seconds.
        self.queue_stats_max_age_seconds = (QUEUE_STATS_STALE_INTERVALS
                                            * queue_stats_interval_seconds)
        self._clock = clock
        self._queue_read_at: float | None = None  # clock() of the last successful read
        r = self.registry
        ProcessCollector(registry=r)
        Info("receipts_build", "The running receipts version (value always 1).",
             registry=r).info({"version": package_version()})
        self.claims = Counter("receipts_claims", "Claim statements run.", registry=r)
        self.jobs_claimed = Counter("receipts_jobs_claimed", "Jobs claimed.", registry=r)
        self.claim_batch = Histogram(
            "receipts_claim_batch_size", "Jobs returned per claim statement.",
            buckets=BATCH_BUCKETS, registry=r,
        )
        self.acks = Counter("receipts_acks", "Acks that completed a job.", registry=r)
        self.stale_acks = Counter(
            "receipts_stale_acks",
            "Acks or reschedules refused by the token/lease guard (token replaced or lease "
            "expired); the row was left untouched.",
            registry=r,
        )
        self.claims_returned = Counter(
            "receipts_claims_returned",
            "Jobs claimed ahead of the free slots (the prefetch) and given back unsent, "
            "their attempts returned: the fleet paused, the worker stopped, or one waited "
            "its most for a slot.",
            registry=r,
        )
        self.retries = Counter(
            "receipts_retries", "Jobs rescheduled after a failed attempt, by reason.",
            ["reason"], registry=r,
        )
        self.failures = Counter(
            "receipts_failures", "Jobs moved to failed, by reason.", ["reason"], registry=r
        )
        self.leases_lost = Counter(
            "receipts_leases_lost",
            "This process's leases that expired before it could ack or reschedule.",
            registry=r,
        )
        # A database crash may undo the last asynchronously committed writes
        # (docs/design.md §2, "What a database crash may undo").
        self.writes_undone = Counter(
            "receipts_writes_undone",
            "Attempts whose outcome could not be recorded because a database crash undid a "
            "write of theirs after it had returned (asynchronous commit): statement=claim (the "
            "claim was undone; another attempt delivers the job again) or ack/reschedule (undone, "
            "and writing it again was refused). Counted instead of a stale ack.",
            ["statement"], registry=r,
        )
        self.writes_rewritten = Counter(
            "receipts_writes_rewritten",
            "Outcome writes a database crash undid after they had returned, written again "
            "under the same lease (no delivery repeated), by statement.",
            ["statement"], registry=r,
        )
        self.delivery_duration = Histogram(
            "receipts_delivery_duration_seconds", "Provider call duration by outcome.",
            ["outcome"], buckets=DELIVERY_BUCKETS, registry=r,
        )
        self.inflight = Gauge(
            "receipts_inflight_deliveries",
            "Deliveries in progress, rejections held before their verdict is written, and "
            "jobs claimed ahead waiting for a slot.",
            registry=r,
        )
        self.slots = Gauge(
            "receipts_concurrency_slots", "Configured delivery slots.", registry=r
        )
        self.statement_duration = Histogram(
            "receipts_db_statement_duration_seconds",
            "Queue statement latency as seen by the worker.",
            ["statement"], buckets=STATEMENT_BUCKETS, registry=r,
        )
        self.db_errors = Counter(
            "receipts_db_errors", "Queue statements that failed, by statement.",
            ["statement"], registry=r,
        )
        self.time_to_receipt = Histogram(
            "receipts_time_to_receipt_seconds",
            "Seconds from enqueue to the ack of the delivered receipt (what the customer feels).",
            buckets=TIME_TO_RECEIPT_BUCKETS, registry=r,
        )
        self.provider_paused = Gauge(
            "receipts_provider_paused",
            "1 while this pod honours a fleet-wide provider pause, by reason.",
            ["reason"], registry=r,
        )
        self.provider_pauses = Counter(
            "receipts_provider_pauses",
            "Fleet-wide provider pauses this pod started or extended, by reason.",
            ["reason"], registry=r,
        )
        self.provider_probes = Counter(
            "receipts_provider_probes",
            "Probe deliveries after a pause, by result (resumed, failed, inconclusive).",
            ["result"], registry=r,
        )
        self.claim_rate_limit = Gauge(
            "receipts_claim_rate_limit",
            "Admission control's current claim-rate limit, jobs/s (0 while it is off).",
            registry=r,
        )
        self.concurrency_limit = Gauge(
            "receipts_concurrency_limit",
            "Adaptive concurrency's current limit on this worker's deliveries in flight "
            "(0 while it is off; compare receipts_inflight_deliveries).",
            registry=r,
        )
        self.concurrency_ceiling = Gauge(
            "receipts_concurrency_ceiling",
            "The highest limit adaptive concurrency may reach on this worker: the smaller of "
            "its ceiling setting and its slots (0 while it is off).",
            registry=r,
        )
        self.concurrency_decreases = Counter(
            "receipts_concurrency_limit_decreases",
            "Multiplicative decreases of the adaptive concurrency limit, by signal: overload "
            "(a 429, a 5xx, a timeout, a lost or refused connection) or latency.",
            ["signal"], registry=r,
        )
        for signal in ("overload", "latency"):  # exported at 0 from the start
            self.concurrency_decreases.labels(signal)
        self.provider_tokens = Gauge(
            "receipts_provider_tokens",
            "Tokens left in the fleet-wide rate-limit bucket after this pod's last claim "
            "(-1 when no rate limit is set).",
            registry=r,
        )
        self.waker_elected = Gauge(
            "receipts_waker_elected",
            "1 while this pod is its fleet's elected waker (it probes the ready index and "
            "wakes the fleet with NOTIFY receipts_ready).",
            registry=r,
        )
        self.waker_wakes = Counter(
            "receipts_waker_wakes",
            "Wake-ups this pod made as the fleet's waker (new due work appeared or waited):"
            " its own pod woken in-process, or other pods notified.",
            registry=r,
        )
        self.pool_connections = Gauge(
            "receipts_pool_connections",
            "Database pool connections: size, in_use, waiting (requests queued).",
            ["state"], registry=r,
        )
        # Queue gauges, read from the database: exported only while fresh
        # (_FreshOnly, registered below), so they are not given the registry.
        self.expired_leases = Gauge(
            "receipts_expired_leases",
            "Running jobs whose lease has expired (awaiting recovery).", registry=None,
        )
        self.ready_jobs = Gauge(
            "receipts_ready_jobs", "Ready jobs that are due now (the autoscaling signal).",
            registry=None,
        )
        self.queue_lag = Gauge(
            "receipts_queue_lag_seconds",
            "Age of the oldest due ready job in seconds (0 when none).", registry=None,
        )
        self.oldest_undelivered = Gauge(
            "receipts_oldest_undelivered_age_seconds",
            "Seconds since the oldest ready or running job was enqueued (0 when none); "
            "unlike the lag, a retry does not restart it.", registry=None,
        )
        self.oldest_finished = Gauge(
            "receipts_oldest_finished_age_seconds",
            "Seconds since the oldest done, failed or discarded row finished (0 when none); "
            "pruning keeps it within the retention.", registry=None,
        )
        self.jobs = Gauge("receipts_jobs", "Rows by state.", ["state"], registry=None)
        self.xmin_horizon_age = Gauge(
            "receipts_xmin_horizon_age_transactions",
            "How far each kind of holder (transaction, prepared, replication_slot) holds back "
            "this database's xmin horizon, in transaction IDs (cleanup of receipt_jobs waits).",
            ["holder"], registry=None,
        )
        self.oldest_transaction = Gauge(
            "receipts_oldest_transaction_age_seconds",
            "Age of the oldest open transaction in the database (xmin horizon threat).",
            registry=None,
        )
        self.dead_tuples = Gauge(
            "receipts_table_dead_tuples", "Dead tuples in receipt_jobs (pg_stat_user_tables).",
            registry=None,
        )
        r.register(_FreshOnly(
            (self.expired_leases, self.ready_jobs, self.queue_lag, self.oldest_undelivered,
             self.oldest_finished, self.jobs, self.xmin_horizon_age, self.oldest_transaction,
             self.dead_tuples),
            self.queue_stats_fresh))
        self.queue_stats_timestamp = Gauge(
            "receipts_queue_stats_timestamp_seconds",
            "Unix time of the last successful queue gauge refresh.", registry=r,
        )
        self.ready = Gauge(
            "receipts_database_ready", "1 while the database answers this process.", registry=r
        )
        # Pre-create the label values operators alert on, so series exist at 0.
        for reason in RETRY_REASONS:
            self.retries.labels(reason)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)
        for state in JobState:
            self.jobs.labels(str(state))
        for holder in ("transaction", "prepared", "replication_slot"):
            self.xmin_horizon_age.labels(holder)
        for pause in PauseReason:
            self.provider_paused.labels(pause)
            self.provider_pauses.labels(pause)
        for result in ("resumed", "failed", "inconclusive"):
            self.provider_probes.labels(result)
        for statement in ("claim", "ack", "reschedule"):
            self.writes_undone.labels(statement)
        for statement in ("ack", "reschedule"):
            self.writes_rewritten.labels(statement)
        self.provider_tokens.set(-1)

    def observe_pause(self, reason: PauseReason | None) -> None:
        """Set ``receipts_provider_paused``: 1 for *reason*, 0 for the others."""
        for holder in ("transaction", "prepared", "replication_slot"):
            self.xmin_horizon_age.labels(holder)
        for pause in PauseReason:
            self.provider_paused.labels(pause).set(1 if pause is reason else 0)

    def queue_stats_fresh(self) -> bool:
        """True while the queue gauges' last successful read is at most
        ``queue_stats_max_age_seconds`` old (never before the first read)."""
        read_at = self._queue_read_at
        return read_at is not None and self._clock() - read_at <= self.queue_stats_max_age_seconds

    def observe_queue(self, stats: QueueStats) -> None:
        """Set the queue gauges from a :class:`QueueStats` snapshot (a successful read)."""
        self.ready_jobs.set(stats.ready_due)
        self.queue_lag.set(stats.lag_seconds)
        self.expired_leases.set(stats.expired)
        self.jobs.labels(JobState.READY).set(stats.ready)
        self.jobs.labels(JobState.RUNNING).set(stats.running)
        self.jobs.labels(JobState.DONE).set(stats.done_estimate)
        self.jobs.labels(JobState.FAILED).set(stats.failed)
        self.jobs.labels(JobState.DISCARDED).set(stats.discarded)
        self.oldest_transaction.set(stats.oldest_transaction_age_seconds)
        self.oldest_undelivered.set(stats.oldest_undelivered_age_seconds)
        self.oldest_finished.set(stats.oldest_finished_age_seconds)
        for holder, age in stats.xmin_age_by_holder.items():
            self.xmin_horizon_age.labels(holder).set(age)
        self.dead_tuples.set(stats.dead_tuples)
        self.queue_stats_timestamp.set(time.time())
        self._queue_read_at = self._clock()

    def observe_time_to_receipt(self, seconds: float) -> None:
        """Record one delivered job's enqueue → ack time, in seconds (negative clock skew → 0)."""
        self.time_to_receipt.observe(max(0.0, seconds))

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)


def make_app(metrics: Metrics, is_ready: Callable[[], bool],
             is_alive: Callable[[], bool] = lambda: True) -> web.Application:
    """The aiohttp app serving ``/metrics``, ``/healthz`` and ``/readyz``.

    *is_ready* is called per ``/readyz`` request, *is_alive* per ``/healthz``
    request (503 when it is false: the liveness probe restarts the pod); both
    must only read memory.
    """

    async def metrics_view(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        if is_alive():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "wedged: a database statement hangs"}, status=503)

    async def readyz(_: web.Request) -> web.Response:
        if is_ready():
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "database unavailable"}, status=503)

    app = web.Application()
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def start_server(app: web.Application, port: int, host: str = "0.0.0.0") -> web.AppRunner:
    """Start serving *app* on *host*:*port*; returns the runner (``await runner.cleanup()``).

    Raises ``OSError`` when the port is taken, after undoing the setup (the
    application's startup hooks and background contexts end with it, so a failed
    start leaves no task behind to keep the process alive).
    """
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
