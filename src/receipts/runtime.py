"""The composition root: build a worker process's parts, run them, tear them down.

:func:`worker_runtime` is the one place that wires settings into a pool, a
queue, a deliverer, metrics, the metrics server and a :class:`Worker`. The
``receipts worker`` command (:func:`run_worker`) adds only what belongs to a
whole process: signal handling and the garbage collector's tuning
(:func:`worker_gc`). Tests and the benchmark use the same root with their own
deliverer or port.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import psycopg
from psycopg_pool import AsyncConnectionPool

from receipts.db import check_encoding, connect, make_pool, statement_deadline, translate
from receipts.delivery import Deliverer, HttpDeliverer, TLSFileError, tls_context
from receipts.errors import DatabaseUnavailable
from receipts.heartbeat import LAST_BEAT_SECONDS, Heartbeat, new_tag
from receipts.jobqueue import JobQueue
from receipts.logs import LOGGER_NAME, get_logger
from receipts.metrics import Metrics, make_app, start_server
from receipts.migrate import SchemaMismatch, schema_status_async
from receipts.operations import Operations
from receipts.settings import Settings, SettingsError
from receipts.worker import STOP_CLAIM_SECONDS, Worker

log = get_logger("runtime")
T = TypeVar("T")

POOL_CLOSE_SECONDS = 5.0
#: Signals that stop a worker gracefully (drain, flush, exit 0). SIGHUP is one:
#: a worker has no configuration to reload (settings are read once at start), so
#: a hang-up from a closed terminal or a supervisor means "stop", done cleanly.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Seconds past the stop budget's phases (``Settings.stop_budget_seconds``, the
#: claim's ``STOP_CLAIM_SECONDS`` and the last heartbeat's ``LAST_BEAT_SECONDS``)
#: after which a stopping worker process ends itself (:class:`StopDeadline`).
#: Within the 5 s the chart adds to the budget for the pod's grace period.
STOP_DEADLINE_MARGIN_SECONDS = 1.0
#: The cyclic garbage collector's youngest-generation threshold in a running
#: worker (CPython's default is 700). Nearly everything a delivery allocates is
#: freed by reference counting, but one claim's burst of tasks, futures and
#: coroutines crossed 700 live objects so often that collections ran every few
#: dozen deliveries and took a visible share of each one's CPU (timed with
#: gc.callbacks; the figures are in bench/README.md). At 10,000 they run about
#: once per 10,000 deliveries and collect the same cycles.
GC_GEN0_THRESHOLD = 10_000


@dataclass(frozen=True, slots=True)
class Runtime:
    """The parts of a running worker process.

    Attributes:
        worker: the claim/deliver loop (``await runtime.worker.run()``).
        queue: its :class:`JobQueue`.
        pool: the connection pool behind the queue.
        metrics: the process's metrics.
        metrics_port: the port ``/metrics`` is served on (0 when not served).
    """

    worker: Worker
    queue: JobQueue
    pool: AsyncConnectionPool
    metrics: Metrics
    metrics_port: int


def make_queue(settings: Settings, pool: AsyncConnectionPool, *,
               worker_tag: str | None = None) -> JobQueue:
    """The :class:`JobQueue` the settings describe, on *pool*; *worker_tag* ends
    every lease token its claims write (:mod:`receipts.heartbeat`)."""
    return JobQueue(
        pool,
        lease_seconds=settings.lease_seconds,
        max_attempts=settings.max_attempts,
        rate_limit_per_second=settings.provider_rate_limit_per_second,
        burst=settings.burst,
        max_in_progress=settings.max_in_progress_answers,
        deadline_seconds=statement_deadline(settings),
        schema=settings.db_schema,
        worker_tag=worker_tag,
    )


def make_operations(settings: Settings, pool: AsyncConnectionPool, *,
                    deadline: bool = True) -> Operations:
    """The operator's :class:`Operations` the settings describe, on *pool* (its own
    pool, or the one the page shares with its :class:`JobQueue`): the queue schema,
    and the statement deadline unless *deadline* is False (``receipts jobs``, whose
    exact counts may take longer than one statement timeout's slack)."""
    return Operations(pool, schema=settings.db_schema,
                      deadline_seconds=statement_deadline(settings) if deadline else None)


def make_deliverer(settings: Settings, environ: Mapping[str, str] | None = None
                   ) -> HttpDeliverer:
    """The HTTP deliverer the settings describe (URL, timeout, token, slots, proxy,
    transport).

    The egress proxy is ``RECEIPTS_PROVIDER_PROXY``, else the standard
    ``*_PROXY``/``NO_PROXY`` variables of *environ* (default ``os.environ``,
    read here once; :mod:`receipts.proxy`). Raises
    :class:`~receipts.settings.SettingsError` naming the setting when a TLS
    file (private CA, client certificate or key) holds no usable PEM data, or
    when the proxy that applies is not a usable URL.
    """
    proxy = settings.provider_proxy_choice(os.environ if environ is None else environ)
    token = settings.provider_token.get_secret_value() if settings.provider_token else None
    # Loading the CA bundle costs CPU (bench/README.md): only an https provider needs it.
    tls = None
    if settings.provider_url.lower().startswith("https:"):
        try:
            tls = tls_context(settings.provider_ca_file, settings.provider_client_cert_file,
                              settings.provider_client_key_file)
        except TLSFileError as exc:
            names = ("RECEIPTS_PROVIDER_CA_FILE" if exc.role == "ca_file" else
                     "RECEIPTS_PROVIDER_CLIENT_CERT_FILE / RECEIPTS_PROVIDER_CLIENT_KEY_FILE")
            raise SettingsError(f"{names}: {exc}") from exc
    return HttpDeliverer(
        settings.provider_url,
        timeout_seconds=settings.delivery_timeout_seconds,
        token=token,
        max_connections=settings.concurrency,
        tls=tls,
        proxy=proxy,
        transport=settings.provider_transport,
    )


@asynccontextmanager
async def worker_runtime(
    settings: Settings,
    *,
    deliverer: Deliverer | None = None,
    metrics: Metrics | None = None,
    metrics_port: int | None = None,
) -> AsyncIterator[Runtime]:
    """Build, open and finally close a worker's parts (the worker itself is not run).

    Args:
        settings: validated settings.
        deliverer: defaults to :func:`make_deliverer`; the runtime closes it.
        metrics: defaults to a fresh :class:`Metrics`.
        metrics_port: overrides ``settings.metrics_port`` (0: no server).

    Raises ``OSError`` when the metrics port is taken. The pool opens without
    waiting: an unreachable database is the worker's to ride out.
    """
    metrics = metrics or Metrics(
        queue_stats_interval_seconds=settings.queue_stats_interval_seconds)
    pool = make_pool(settings, "worker")
    deliverer = deliverer or make_deliverer(settings)
    queue = make_queue(settings, pool, worker_tag=new_tag())
    worker = Worker(settings, queue, deliverer, metrics)
    watch_pool(pool, metrics)
    port = settings.metrics_port if metrics_port is None else metrics_port
    runner = None
    try:
        if port:
            runner = await start_server(make_app(metrics, worker.is_ready, worker.is_alive), port)
        await pool.open(wait=False)
        yield Runtime(worker, queue, pool, metrics, port)
    finally:
        await deliverer.aclose()
        with contextlib.suppress(Exception):
            await pool.close(timeout=POOL_CLOSE_SECONDS)
        if runner is not None:
            await runner.cleanup()


def loop_factory(settings: Settings) -> Callable[[], asyncio.AbstractEventLoop]:
    """The event loop ``receipts worker`` runs on, as a factory for ``asyncio.Runner``.

    ``RECEIPTS_EVENT_LOOP``: ``uvloop`` (libuv under asyncio's API: less
    worker CPU per HTTP delivery in the bench's interleaved 400-slot drains,
    bench/README.md; the extra ``uvloop``), ``asyncio`` (the standard
    library's selector loop), or ``auto`` (the default): uvloop when it can be
    imported, else asyncio. Raises :class:`~receipts.settings.SettingsError`
    for ``uvloop`` when it is not installed.
    """
    if settings.event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if settings.event_loop == "uvloop":
                raise SettingsError(
                    "RECEIPTS_EVENT_LOOP=uvloop, but uvloop is not installed "
                    "(pip install 'receipts-queue[uvloop]'), or set it to asyncio or auto"
                ) from None
        else:
            return cast("Callable[[], asyncio.AbstractEventLoop]", uvloop.new_event_loop)
    return asyncio.new_event_loop


def run_on_loop(settings: Settings, main: Coroutine[Any, Any, T]) -> T:
    """Run *main* to completion on the event loop the settings choose (:func:`loop_factory`)."""
    try:
        factory = loop_factory(settings)
    except SettingsError:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def event_loop_name() -> str:
    """The running loop's kind, for logs: ``uvloop`` or ``asyncio``."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else (
        "asyncio")


@contextlib.contextmanager
def worker_gc() -> Iterator[None]:
    """Tune the garbage collector for a running worker; restore it afterwards.

    Moves everything alive at start-up (imported modules, settings, the pool)
    out of the collector's reach with ``gc.freeze()``, so full collections
    scan only what the worker allocated since, and raises the youngest
    generation's threshold to :data:`GC_GEN0_THRESHOLD`.
    """
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def stop_deadline_seconds(settings: Settings) -> float:
    """How long after its stop signal a worker process may take at most, seconds.

    The drain's phases (``Settings.stop_budget_seconds``), the claim still in
    the database (``STOP_CLAIM_SECONDS``), the last heartbeat
    (``LAST_BEAT_SECONDS``) and :data:`STOP_DEADLINE_MARGIN_SECONDS`.
    """
    return (settings.stop_budget_seconds + STOP_CLAIM_SECONDS + LAST_BEAT_SECONDS
            + STOP_DEADLINE_MARGIN_SECONDS)


class StopDeadline:
    """Ends the process when a stop outlasts its deadline, whatever is still running.

    Every phase of a stop is bounded, but a library can still hold the exit:
    a connection attempt or a cancelled query on a half-open connection that
    does not give up when cancelled, a thread that never returns. A watchdog
    thread (the event loop may be what is stuck) is armed by the first stop
    signal; if the process is still alive *seconds* later it logs
    ``stop_deadline_exceeded`` and calls ``os._exit``: status 0 when the drain
    had finished (every outcome written or given up, so nothing is lost by not
    waiting), 1 otherwise (leases of unfinished jobs expire and recovery
    redelivers them: at-least-once). Kubernetes would kill the pod a few
    seconds later anyway; this keeps the stop within the budget the chart
    plans for.

    Args:
        seconds: the deadline after :meth:`arm`, seconds (> 0).
        drained: returns True once the worker's drain has finished.
    """

    def __init__(self, seconds: float, drained: Callable[[], bool]) -> None:
        self.seconds = seconds
        self._drained = drained
        self._timer: threading.Timer | None = None

    def arm(self) -> None:
        """Start the countdown (idempotent: later stop signals do not extend it)."""
        if self._timer is None:
            self._timer = threading.Timer(self.seconds, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        drained = self._drained()
        log.warning("stop_deadline_exceeded", extra={
            "deadline_seconds": self.seconds, "drained": drained})
        for handler in logging.getLogger().handlers + logging.getLogger(LOGGER_NAME).handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        os._exit(0 if drained else 1)


async def run_worker(settings: Settings, deliverer: Deliverer | None = None) -> None:
    """Run a worker process until SIGTERM, SIGINT or SIGHUP, then drain and return.

    While it runs, the garbage collector is tuned for it (:func:`worker_gc`)
    and its heartbeat keeps its ``receipt_workers`` row fresh
    (:class:`~receipts.heartbeat.Heartbeat`; the last one marks it stopped).

    *deliverer* defaults to HTTP to ``settings.provider_url``. Raises
    ``OSError`` when the metrics port is taken, and
    :class:`~receipts.errors.QueueError` when the database answers but cannot
    be used (:func:`check_database`).
    """
    await check_database(settings)
    async with worker_runtime(settings, deliverer=deliverer) as runtime:
        loop = asyncio.get_running_loop()
        deadline = StopDeadline(stop_deadline_seconds(settings), lambda: runtime.worker.drained)

        def stop() -> None:
            deadline.arm()
            runtime.worker.stop()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop)
        log.info("worker_started", extra={
            "concurrency": settings.concurrency, "lease_seconds": settings.lease_seconds,
            "database": settings.safe_dsn, "provider": settings.safe_provider_url,
            "metrics_port": runtime.metrics_port,
            "rate_limit_per_second": settings.provider_rate_limit_per_second,
            "admission_control": settings.admission_control,
            "adaptive_concurrency": settings.adaptive_concurrency,
            "synchronous_commit": "role setting" if settings.pgbouncer else (
                settings.synchronous_commit),
            "event_loop": event_loop_name(),
            # Which egress proxy the provider's requests take, credentials masked.
            "proxy": settings.provider_proxy_choice(os.environ).describe(),
        })
        heartbeat = Heartbeat(runtime.queue, runtime.worker, runtime.metrics,
                              tag=runtime.queue.worker_tag or new_tag())
        beating = asyncio.create_task(heartbeat.run(), name="heartbeat")
        try:
            with worker_gc():
                await runtime.worker.run()
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
            await heartbeat.stop()


async def check_database(settings: Settings) -> None:
    """Refuse, at start, a database the worker cannot use.

    Raises :class:`~receipts.errors.UnusableDatabase` for an encoding that
    cannot keep our text (:func:`receipts.db.check_encoding`) and
    :class:`~receipts.migrate.SchemaMismatch` for a schema this version does
    not know: migrations it does not ship that are not a later release's of the
    same major version, or an applied migration that differs from the shipped
    file. A later release's schema is accepted with a ``schema_newer`` warning:
    migrations only add within a major version, and a ``helm rollback`` runs
    this version on the schema the newer one left (docs/design.md). A role that
    may not read the tracking table is refused with a
    :class:`~receipts.errors.QueueError` naming ``--print-grants``.
    Pending migrations are not refused: the migration hook may still be
    running, and the worker waits (claims fail with "run receipts migrate")
    until it has. An unreachable database is not refused either: the worker
    rides out outages and reports not-ready until the database answers.
    """
    try:
        conn = await connect(settings, "worker")
    except DatabaseUnavailable:
        return
    async with conn:
        check_encoding(conn)
        try:
            status = await schema_status_async(conn, schema=settings.db_schema)
        except psycopg.errors.InsufficientPrivilege as exc:  # a grant is missing: say so now
            raise translate(exc) from exc
        except Exception as exc:  # psycopg errors reading the tracking table: judge later
            log.debug("schema_status_unread", extra={"error": str(exc)[:200]})
            return
        if status.changed or (status.unknown and not status.newer):
            raise SchemaMismatch(status.describe())
        if status.newer:
            log.warning("schema_newer", extra={"detail": status.describe()})
        if not status.applied:  # says where it looked, and where the tables are instead
            log.warning("schema_missing", extra={"detail": status.describe()})


def watch_pool(pool: AsyncConnectionPool, metrics: Metrics) -> None:
    """Expose psycopg_pool's ``get_stats()`` (never ``pop_stats()``) as gauges."""

    def stat(key: str) -> float:
        return float(pool.get_stats().get(key, 0))

    metrics.pool_connections.labels("size").set_function(lambda: stat("pool_size"))
    metrics.pool_connections.labels("in_use").set_function(
        lambda: stat("pool_size") - stat("pool_available")
    )
    metrics.pool_connections.labels("waiting").set_function(lambda: stat("requests_waiting"))
