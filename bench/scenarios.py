"""The measured scenarios. Each function runs one measurement and returns a dict.

All run against the one durable server of :class:`bench.pg.Bench`, each in a
fresh database, so rounds can interleave them freely.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psycopg

from bench import peers, raw
from bench.pg import Bench, execute, fill_ready, remaining_jobs, settle, wait_until
from bench.procs import Children, ConnectionSampler, Provider
from receipts.db import make_pool
from receipts.embedded import free_port
from receipts.enqueue import NOTIFY_CHANNEL, enqueue
from receipts.jobqueue import JobQueue
from receipts.settings import Settings, load_settings

#: The head of the queue worked off in one statement (ready -> done, leaving dead entries
#: in the ready index). The bench's superuser session bypasses the trigger that holds
#: `done` to the ack's lease guard (session_replication_role = replica): no lease here.
WORKED_OFF = ("SET session_replication_role = replica;"
              " UPDATE receipt_jobs SET state = 'done', finished_at = now(), attempts = 1"
              " WHERE state = 'ready' AND run_at < now() - interval '30 s'")

PROBE: dict[str, Any] = {"autocommit": True, "application_name": "bench-probe"}
#: The service's defaults (settings.py): "default settings" scenarios run with these.
DEFAULT_CONCURRENCY: int = Settings.model_fields["concurrency"].default
DEFAULT_BATCH: int = Settings.model_fields["claim_batch_max"].default


def percentile(values: Sequence[float], q: float) -> float:
    """The *q*-th percentile (0–100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def receipts_argv(dsn: str, **opts: Any) -> list[str]:
    """``bench.child receipts`` arguments (:func:`child_argv`)."""
    return child_argv("receipts", dsn, **opts)


def child_argv(kind: str, dsn: str, **opts: Any) -> list[str]:
    """``bench.child KIND`` arguments: each keyword becomes ``--its-name value``
    (True: the bare flag; None or False: left out)."""
    argv = [kind, "--dsn", dsn]
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value not in (None, False):
            argv += [flag, str(value)]
    return argv


def _sessions(probe: psycopg.Connection[Any], *, listening: bool = False) -> int:
    """Sessions of this database other than the benchmark's own (``bench-*``); with
    *listening*, only those whose last statement was a LISTEN."""
    row = probe.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND application_name NOT LIKE 'bench-%%'"
        " AND (NOT %s OR query ILIKE 'LISTEN%%')", (listening,)).fetchone()
    return int(row[0]) if row else 0


def _drain(dsn: str, argvs: list[list[str]], jobs: int,
           left: Callable[[psycopg.Connection[Any]], int],
           timeout_seconds: float,
           server_cpu: Callable[[], float] | None = None,
           metrics_port: int | None = None) -> dict[str, Any]:
    """Release *argvs* together and wait until *left* reports nothing left.

    *server_cpu*: a reading of the database server's CPU seconds
    (:meth:`bench.pg.Bench.server_cpu_seconds`), taken at the release and at the
    end, for ``db_cpu_us_per_job`` (it includes the probe's and sampler's own
    small statements). *metrics_port*: the first child serves ``/metrics``
    there; it is scraped once the drain is done, as ``samples`` (not JSON).
    """
    children = Children(argvs, ports=[metrics_port] + [None] * (len(argvs) - 1))
    samples = None
    try:
        with psycopg.connect(dsn, **PROBE) as probe, ConnectionSampler(dsn) as sampler:
            db_before = server_cpu() if server_cpu else 0.0
            start = children.go()
            end = wait_until(lambda: left(probe) == 0 or not children.alive(),
                             timeout_seconds=timeout_seconds)
            db_seconds = server_cpu() - db_before if server_cpu else None
            unfinished = left(probe)
        if metrics_port is not None and not unfinished:
            samples = children.procs[0].scrape()
    finally:
        tails = children.stop()
    if unfinished:
        raise RuntimeError(f"drain stopped with {unfinished} jobs left: {tails}")
    seconds = end - start
    cpu = children.cpu_seconds(tails)
    return {
        **({"db_cpu_us_per_job": round(db_seconds / jobs * 1e6, 1)}
           if db_seconds is not None else {}),
        **({"samples": samples} if samples is not None else {}),
        "worker_cpu_us_per_job": round(cpu / jobs * 1e6, 1),
        "jobs": jobs,
        "seconds": round(seconds, 3),
        "jobs_per_second": jobs / seconds,
        "max_connections": sampler.peak_total,
        "connections_by_application": sampler.peak,
    }


# ------------------------------------------------------------------- drains


def receipts_drain(bench: Bench, *, jobs: int, processes: int = 1, concurrency: int = 200,
                   batch: int = 100, provider_latency_ms: float | None = None,
                   listen: bool = True, admission: bool = True, event_loop: str = "auto",
                   profile: str | None = None, profile_seconds: float = 6.0,
                   scrape: bool = False, transport: str | None = None) -> dict[str, Any]:
    """receipts worker processes draining *jobs* pre-enqueued jobs.

    No-op in-process deliverer, or the reference HTTP provider at
    *provider_latency_ms* when given. *admission* False turns admission control
    off (capacity figures: what a worker can do, not what it allows itself).
    *event_loop*: ``RECEIPTS_EVENT_LOOP`` of the workers (``auto``: uvloop when
    installed, as ``receipts worker`` does).
    *profile*: a py-spy raw profile of the (first) worker to this file.
    *scrape*: the first worker's ``/metrics`` at the end, as ``samples``
    (a :class:`~receipts.supervisor.MetricSamples`, for ``bench.experiments.cycle``).
    *transport*: the HTTP client under the deliverer (``bench.child --transport``;
    None: what ``receipts worker`` builds).
    """
    provider = Provider(provider_latency_ms) if provider_latency_ms is not None else None
    try:
        with bench.database("rcpt") as dsn:
            fill_ready(dsn, jobs)
            settle(dsn, "receipt_jobs")
            argv = receipts_argv(dsn, concurrency=concurrency, batch=batch,
                                 provider_url=provider.url if provider else None,
                                 no_listen=not listen, admission="on" if admission else "off",
                                 event_loop=event_loop, transport=transport)
            argvs = [argv] * processes
            port = free_port() if scrape else None
            if port is not None:
                argvs[0] = [*argvs[0], "--metrics-port", str(port)]
            if profile:
                argvs[0] = [*argv, "--profile", profile, "--profile-seconds",
                            str(profile_seconds)]
            result = _drain(dsn, argvs, jobs, remaining_jobs,
                            timeout_seconds=max(120.0, jobs / 100.0),
                            server_cpu=bench.server_cpu_seconds, metrics_port=port)
            stale = execute(dsn, "SELECT count(*) FROM receipt_jobs WHERE state <> 'done'")
            result["not_done"] = int(stale[0][0])
    finally:
        if provider:
            provider.stop()
    result.update(processes=processes, concurrency=concurrency, batch=batch,
                  provider_latency_ms=provider_latency_ms, admission_control=admission,
                  event_loop=event_loop, transport=transport)
    return result


def peer_drain(bench: Bench, peer: str, *, jobs: int, **opts: Any) -> dict[str, Any]:
    """A peer draining *jobs* no-op jobs (its best documented configuration)."""
    with bench.database(peer[:5]) as dsn:
        peers.install(peer, dsn)
        peers.fill(peer, dsn, jobs)
        settle(dsn, *peers.tables(peer))
        argv = child_argv(peer, dsn, **opts)
        result = _drain(dsn, [argv], jobs, lambda c: peers.remaining(peer, c),
                        timeout_seconds=max(300.0, jobs / 100.0),
                        server_cpu=bench.server_cpu_seconds)
    result.update(opts)
    return result


# ------------------------------------------------------------ pickup latency


def _schedule(n: int, rate: float, seed: int | None = None) -> list[float]:
    """*n* arrival times (seconds from the start) at *rate*/s: evenly spaced, or
    a Poisson process (exponential gaps) when a *seed* is given."""
    if seed is None:
        return [i / rate for i in range(n)]
    rng = random.Random(seed)
    return list(itertools.accumulate((rng.expovariate(rate) for _ in range(n)), initial=0.0))[:n]


#: receipts_pickup modes: how idle workers learn of a new job.
PICKUP_MODES = ("waker", "notify", "poll")


def _waker_elected(probe: psycopg.Connection[Any]) -> bool:
    """A worker of this database holds the waker's session advisory lock."""
    row = probe.execute(
        "SELECT count(*) FROM pg_locks AS l JOIN pg_database AS d ON d.oid = l.database"
        " AND d.datname = current_database() WHERE l.locktype = 'advisory' AND l.granted"
    ).fetchone()
    return bool(row and row[0])


def receipts_pickup(bench: Bench, *, jobs: int, rate: float, mode: str = "waker",
                    poll_seconds: float = 1.0, processes: int = 1, rate_limit: float = 0.0,
                    delay_ms: float = 0.0, seed: int | None = None,
                    src: Path | None = None) -> dict[str, Any]:
    """Enqueue-commit → delivery-start for *jobs* enqueued one per transaction at *rate*/s.

    *mode*: ``waker`` (the defaults: the enqueue sends no notification, the
    fleet's elected waker notices the job); ``notify`` (0.2.0's default: the
    enqueuing transaction also runs ``pg_notify``, which listening workers
    receive at its commit); ``poll`` (no LISTEN session at all: polling every
    *poll_seconds* ± 25 %). *processes* workers (32 slots, claim batch 100),
    with a fleet-wide *rate_limit* (jobs/s; 0: none) and deliveries of
    *delay_ms* × U(0.5, 1.5) when given; arrivals evenly spaced, or Poisson
    with a *seed*; *src*: an older worker's ``src`` folder (``bench.procs``).
    """
    if mode not in PICKUP_MODES:
        raise ValueError(f"mode must be one of {PICKUP_MODES}")
    listen = mode != "poll"
    with bench.database("pick") as dsn, tempfile.TemporaryDirectory() as tmp:
        records = [os.path.join(tmp, f"record-{i}.json") for i in range(processes)]
        argvs = [receipts_argv(dsn, concurrency=DEFAULT_CONCURRENCY, batch=DEFAULT_BATCH,
                               no_listen=not listen, poll_seconds=poll_seconds, record=record,
                               rate_limit=rate_limit or None, delay_ms=delay_ms or None)
                 for record in records]
        children = Children(argvs, src=src)
        committed: dict[str, float] = {}
        try:
            children.go()
            with psycopg.connect(dsn, application_name="bench-enqueue") as conn, \
                    psycopg.connect(dsn, **PROBE) as probe:
                # Measure from running workers: a warm-up job done (and a waker elected).
                with conn.transaction():
                    enqueue(conn, "warm-up")
                wait_until(lambda: remaining_jobs(probe) == 0
                           and (not listen or _waker_elected(probe)), timeout_seconds=30)
                t0 = time.monotonic()
                for i, at in enumerate(_schedule(jobs, rate, seed)):
                    delay = t0 + at - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    order = f"p-{i}"
                    with conn.transaction():
                        enqueue(conn, order)
                        if mode == "notify":
                            conn.execute("SELECT pg_notify(%s, '')", (NOTIFY_CHANNEL,))
                    committed[order] = time.time()
            with psycopg.connect(dsn, **PROBE) as probe:
                wait_until(lambda: remaining_jobs(probe) == 0, timeout_seconds=60)
        finally:
            children.stop()
        started: dict[str, float] = {}
        for record in records:
            with open(record) as fh:
                for order, at in json.load(fh).items():
                    started[order] = min(at, started.get(order, at))
    return {**_latencies(committed, started, listen=listen), "mode": mode, "rate": rate,
            "processes": processes}


def peer_pickup(bench: Bench, peer: str, *, jobs: int, rate: float) -> dict[str, Any]:
    """The same pickup measurement for a peer (both use LISTEN/NOTIFY)."""
    with bench.database(peer[:5]) as dsn, tempfile.TemporaryDirectory() as tmp:
        peers.install(peer, dsn)
        record = os.path.join(tmp, "record.json")
        opts = ["--record", record]
        if peer == "procrastinate":
            opts += ["--concurrency", "10"]
        children = Children([[peer, "--dsn", dsn, *opts]])
        committed: dict[str, float] = {}
        try:
            children.go()

            async def produce() -> None:
                handle, close = await peers.open_enqueuer(peer, dsn)
                try:
                    # Measure from a running consumer: a warm-up job done first.
                    await peers.enqueue_one(peer, handle, "warm-up")
                    with psycopg.connect(dsn, **PROBE) as probe:
                        await asyncio.to_thread(
                            wait_until, lambda: peers.remaining(peer, probe) == 0,
                            timeout_seconds=30)
                    t0 = time.monotonic()
                    for i, at in enumerate(_schedule(jobs, rate)):
                        delay = t0 + at - time.monotonic()
                        if delay > 0:
                            await asyncio.sleep(delay)
                        await peers.enqueue_one(peer, handle, str(i))
                        committed[str(i)] = time.time()
                finally:
                    await close()

            asyncio.run(produce())
            with psycopg.connect(dsn, **PROBE) as probe:
                wait_until(lambda: peers.remaining(peer, probe) == 0, timeout_seconds=60)
        finally:
            children.stop()
        with open(record) as fh:
            started = json.load(fh)
    return _latencies(committed, started, listen=True)


def _latencies(committed: dict[str, float], started: dict[str, float],
               *, listen: bool) -> dict[str, Any]:
    lat = [max(0.0, started[k] - committed[k]) * 1000 for k in committed if k in started]
    return {
        "listen": listen,
        "jobs": len(committed),
        "measured": len(lat),
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat, default=0.0),
    }


# ------------------------------------------------------------- claim cost

SCALE_TEMPLATE = "bench_scale"


def build_scale_template(bench: Bench, *, done: int, ready: int) -> str:
    """A database with *done* finished and *ready* due jobs, used as a template."""
    bench._ensure_template()
    with psycopg.connect(bench.server.dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{SCALE_TEMPLATE}"')
        conn.execute(f'CREATE DATABASE "{SCALE_TEMPLATE}" TEMPLATE bench_template')
    dsn = bench.server.dsn_for(SCALE_TEMPLATE)
    step = 250_000
    for start in range(0, done, step):
        fill_ready(dsn, min(step, done - start), prefix=f"d{start}", state="done",
                   run_at_offset_seconds=-3600)
    fill_ready(dsn, ready, prefix="r")
    settle(dsn, "receipt_jobs")
    return SCALE_TEMPLATE


async def _claim_latencies(dsn: str, claims: int, batch: int) -> list[float]:
    settings = load_settings(database_url=dsn, metrics_port=0, application_name="bench-claim")
    pool = make_pool(settings, "claim", max_size=1)
    await pool.open(wait=True)
    try:
        queue = JobQueue(pool, lease_seconds=60, max_attempts=5)
        out = []
        for _ in range(claims):
            t = time.perf_counter()
            claimed = await queue.claim(batch)
            out.append((time.perf_counter() - t) * 1000)
            if claimed.attempts:
                await queue.ack([(a.job.id, a.job.token) for a in claimed.attempts])
        return out
    finally:
        await pool.close()


def _explain(dsn: str, batch: int) -> str:
    from receipts.statements import claim_query

    with psycopg.connect(dsn, **PROBE) as conn:
        text = claim_query(batch).as_string(conn)
        with conn.transaction(force_rollback=True):
            rows = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS) " + text,
                {"max_attempts": 5, "lease_seconds": 60.0, "probe": False,
                 "after_run_at": None, "after_id": None},
            ).fetchall()
    return "\n".join(r[0] for r in rows)


def claim_cost(bench: Bench, *, template: str, claims: int, batch: int = 10,
               baseline_ready: int = 100_000, updated: int = 200_000) -> dict[str, Any]:
    """Claim p50/p99 (ms): no history vs. scale vs. right after *updated* rows changed."""
    out: dict[str, Any] = {"batch": batch, "claims": claims}
    with bench.database("empty") as dsn:
        fill_ready(dsn, baseline_ready)
        settle(dsn, "receipt_jobs")
        lat = asyncio.run(_claim_latencies(dsn, claims, batch))
        out["empty"] = {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}
    with bench.database("scale", template=template) as dsn:
        lat = asyncio.run(_claim_latencies(dsn, claims, batch))
        out["scale"] = {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}
        plan = _explain(dsn, batch)
        out["scale"]["plan"] = plan
        out["scale"]["uses_ready_index"] = "receipt_jobs_ready" in plan
        # The jobs at the head of the queue were just worked off: *updated* rows
        # ready -> done in one statement, leaving dead entries in the ready index.
        fill_ready(dsn, updated, prefix=f"u{uuid.uuid4().hex[:6]}", run_at_offset_seconds=-60)
        execute(dsn, "VACUUM (ANALYZE) receipt_jobs")
        execute(dsn, WORKED_OFF)
        lat = asyncio.run(_claim_latencies(dsn, claims, batch))
        out["after_update"] = {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                               "first_claim_ms": lat[0]}
        stats = execute(dsn, "SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables"
                             " WHERE relname = 'receipt_jobs'")
        out["after_update"]["dead_tuples"] = int(stats[0][0]) if stats else None
    return out


# ------------------------------------------------------------ checkout impact


def _checkout(dsn: str, seconds: float, rate: float) -> list[float]:
    """'insert order + enqueue receipt' transactions at *rate*/s; latencies, ms."""
    out = []
    with psycopg.connect(dsn, application_name="bench-checkout") as conn:
        t0 = time.monotonic()
        i = 0
        while time.monotonic() - t0 < seconds:
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            order = f"c-{uuid.uuid4().hex}"
            t = time.perf_counter()
            with conn.transaction():
                conn.execute("INSERT INTO bench_orders (id, total_cents) VALUES (%s, %s)",
                             (order, 1999))
                enqueue(conn, order)
            out.append((time.perf_counter() - t) * 1000)
            i += 1
    return out


def wal_fsyncs(probe: psycopg.Connection[Any]) -> float:
    """The server's WAL fsyncs so far, every process (``pg_stat_io``, PostgreSQL 16+;
    0 where it has no WAL rows): each one is a flush some commit waited for."""
    row = probe.execute("SELECT coalesce(sum(fsyncs), 0) FROM pg_stat_io"
                        " WHERE object = 'wal'").fetchone()
    return float(row[0]) if row else 0.0


def _workers_started(probe: psycopg.Connection[Any], processes: int,
                     jobs: int | None) -> bool:
    """Every worker process connected and, given the *jobs* they drain, claiming."""
    return _sessions(probe) >= processes and (jobs is None or remaining_jobs(probe) < jobs)


@dataclass(frozen=True)
class CheckoutPhase:
    """One phase of :func:`checkout_impact`: the workers' settings while checkout runs.

    Attributes:
        name: its key in the result (``idle``, ``drain``, ``drain_off``, ``drain_on``).
        drain: the workers drain a backlog (else they idle on an empty queue).
        concurrency: delivery slots per worker.
        batch: claim batch.
        admission: admission control on (the service's default) or off.
        trace: sample the worker's ``receipts_claim_rate_limit`` every
            ``TRACE_INTERVAL_SECONDS`` from its release to the window's end.
        seconds: the checkout window, seconds (None: the call's *seconds*).
        jobs: the backlog of a drain (None: the call's *drain_jobs*).
        synchronous_commit: ``RECEIPTS_SYNCHRONOUS_COMMIT`` of the workers.
    """

    name: str
    drain: bool = False
    concurrency: int = DEFAULT_CONCURRENCY
    batch: int = DEFAULT_BATCH
    admission: bool = True
    trace: bool = False
    seconds: float | None = None
    jobs: int | None = None
    synchronous_commit: str = Settings.model_fields["synchronous_commit"].default


#: How often the admission-on phase scrapes the claim-rate limit, seconds.
TRACE_INTERVAL_SECONDS = 0.5


def checkout_phases(*, full_speed_concurrency: int, full_speed_seconds: float,
                    full_speed_jobs: int, seconds: float, jobs: int) -> list[CheckoutPhase]:
    """The bench's checkout phases: idle; a full-speed drain (*full_speed_concurrency*
    slots, admission off, a *full_speed_seconds* window); and, for the admission
    target, the default settings (slots, claim batch) with admission control off,
    then on (traced), over a *seconds* window with *jobs* queued."""
    return [
        CheckoutPhase("idle", seconds=seconds),
        CheckoutPhase("drain", drain=True, concurrency=full_speed_concurrency,
                      admission=False, seconds=full_speed_seconds, jobs=full_speed_jobs),
        CheckoutPhase("drain_off", drain=True, admission=False, seconds=seconds, jobs=jobs),
        CheckoutPhase("drain_on", drain=True, admission=True, trace=True, seconds=seconds,
                      jobs=jobs),
    ]


def _trace_limit(port: int, start: float, interval_seconds: float,
                 stop: Any, points: Any) -> None:
    """Child process of :class:`_LimitTrace`: scrape, parse, send (seconds, jobs/s)."""
    import re
    import urllib.request

    pattern = re.compile(r"^receipts_claim_rate_limit ([0-9.e+-]+)$", re.MULTILINE)
    tick = start
    while not stop.is_set():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1.0) as r:
                match = pattern.search(r.read().decode())
            if match:
                points.put((round(time.monotonic() - start, 2), float(match.group(1))))
        except OSError:
            pass  # the metrics server is not up yet
        tick += interval_seconds
        stop.wait(max(0.0, tick - time.monotonic()))


class _LimitTrace:
    """Scrapes one worker's ``receipts_claim_rate_limit`` from a separate process.

    ``points``: (seconds since *start*, jobs/s) every *interval_seconds*; a
    scrape that fails (the metrics server not up yet) is skipped. A process,
    not a thread: a scraping thread in the benchmark process took the GIL
    from the checkout loop it shares the process with and raised the very
    p99 it was there to explain (drain with admission on, checkout p99 18 ms
    traced vs 11–13 ms untraced, same settings).
    """

    def __init__(self, port: int, start: float,
                 interval_seconds: float = TRACE_INTERVAL_SECONDS) -> None:
        import multiprocessing

        self.points: list[tuple[float, float]] = []
        self._stop = multiprocessing.Event()
        self._queue: Any = multiprocessing.Queue()
        self._proc = multiprocessing.Process(
            target=_trace_limit, args=(port, start, interval_seconds, self._stop, self._queue),
            daemon=True)
        self._proc.start()

    def stop(self) -> list[tuple[float, float]]:
        import queue as queue_module

        self._stop.set()
        self._proc.join(5)  # a few dozen points: the pipe never fills
        while True:
            try:
                self.points.append(self._queue.get(timeout=0.2))
            except queue_module.Empty:
                return self.points


def checkout_impact(bench: Bench, *, drain_jobs: int, seconds: float, rate: float,
                    processes: int = 1, concurrency: int = 200, batch: int = 100,
                    phases: Sequence[CheckoutPhase] | None = None) -> dict[str, Any]:
    """Checkout p50/p99 (ms) at *rate*/s for *seconds* while the workers idle or drain.

    Without *phases*: ``idle`` and ``drain`` (*drain_jobs* at full speed) with
    *concurrency* slots and claim *batch*, admission control at its default.
    Each phase gets a fresh database and its own workers. For a drain phase
    also ``drain_jobs_per_second``: jobs done during the checkout window (the
    ready + running count at its start, plus the receipts checkout enqueued,
    minus the count at its end) per second of the window. A traced phase adds
    ``limit_trace``: [seconds since the workers' release, claim-rate limit
    (jobs/s)] every 0.5 s, and ``window_start_seconds`` on the same clock.
    """
    if phases is None:
        phases = [CheckoutPhase("idle", concurrency=concurrency, batch=batch),
                  CheckoutPhase("drain", drain=True, concurrency=concurrency, batch=batch)]
    out: dict[str, Any] = {"rate": rate, "seconds": seconds, "processes": processes,
                           "concurrency": concurrency, "batch": batch}
    for phase in phases:
        window = phase.seconds if phase.seconds is not None else seconds
        jobs = (phase.jobs if phase.jobs is not None else drain_jobs) if phase.drain else None
        result: dict[str, Any] = {**asdict(phase), "seconds": window, "jobs": jobs}
        with bench.database("chk") as dsn:
            if jobs:
                fill_ready(dsn, jobs)
            settle(dsn, "receipt_jobs", "bench_orders")
            ports = [free_port() if phase.trace else None for _ in range(processes)]
            argvs = [receipts_argv(dsn, concurrency=phase.concurrency, batch=phase.batch,
                                    admission="on" if phase.admission else "off", metrics_port=port,
                                    synchronous_commit=phase.synchronous_commit)
                     for port in ports]
            children = Children(argvs, ports=ports)
            trace: _LimitTrace | None = None
            try:
                started = children.go()
                if phase.trace and ports[0] is not None:
                    trace = _LimitTrace(ports[0], started)
                with psycopg.connect(dsn, **PROBE) as probe:
                    wait_until(partial(_workers_started, probe, processes, jobs),
                               timeout_seconds=30)
                    left_at_start = remaining_jobs(probe)
                    syncs_at_start = wal_fsyncs(probe)
                    window_start = time.monotonic()
                    lat = _checkout(dsn, window, rate)
                    elapsed = time.monotonic() - window_start
                    left = remaining_jobs(probe)
                    syncs = wal_fsyncs(probe) - syncs_at_start
                points = trace.stop() if trace else None
            finally:
                if trace:
                    trace.stop()
                children.stop()
        result.update(p50_ms=percentile(lat, 50), p99_ms=percentile(lat, 99),
                      samples=len(lat), jobs_left_at_end=left,
                      wal_fsyncs_per_second=syncs / elapsed)
        if jobs:
            done = left_at_start + len(lat) - left
            result.update(jobs_done_in_window=done, drain_jobs_per_second=done / elapsed)
        if points is not None:
            result.update(limit_trace=points,
                          window_start_seconds=round(window_start - started, 2))
        out[phase.name] = result
    return out


# ------------------------------------------------------- dead tuples, vacuum

STORAGE_OPTIONS = ("autovacuum_vacuum_scale_factor", "autovacuum_vacuum_threshold",
                   "autovacuum_vacuum_insert_scale_factor",
                   "autovacuum_vacuum_insert_threshold", "autovacuum_analyze_scale_factor",
                   "autovacuum_vacuum_cost_delay")


def vacuum_after_update(bench: Bench, *, template: str, updated: int, claims: int,
                        wait_seconds: float = 75.0) -> dict[str, Any]:
    """Dead tuples after *updated* jobs were worked off: migration 0002 vs. defaults.

    Two clones of the scale database, one with 0002's table settings, one with
    them RESET. Both get the same *updated* jobs worked off (ready -> done);
    then, for *wait_seconds* (one autovacuum naptime is 60 s), their dead
    tuples and autovacuum runs are sampled; finally claim p50/p99 is measured.
    """
    out: dict[str, Any] = {"updated": updated, "wait_seconds": wait_seconds}
    dsns = {"migration_0002": bench.new_database("vac", template=template),
            "defaults": bench.new_database("vac", template=template)}
    try:
        execute(dsns["defaults"],
                f"ALTER TABLE receipt_jobs RESET ({', '.join(STORAGE_OPTIONS)})")
        for dsn in dsns.values():
            fill_ready(dsn, updated, prefix="v", run_at_offset_seconds=-60)
            execute(dsn, "VACUUM (ANALYZE) receipt_jobs")
            execute(dsn, WORKED_OFF)
        t0 = time.monotonic()
        first: dict[str, float | None] = dict.fromkeys(dsns)
        dead0: dict[str, int] = {}
        while True:
            for name, dsn in dsns.items():
                n_dead, runs = execute(
                    dsn, "SELECT n_dead_tup, autovacuum_count FROM pg_stat_user_tables"
                         " WHERE relname = 'receipt_jobs'")[0]
                dead0.setdefault(name, int(n_dead))
                if runs and first[name] is None:
                    first[name] = round(time.monotonic() - t0, 1)
            if time.monotonic() - t0 >= wait_seconds or all(first.values()):
                break
            time.sleep(1.0)
        for name, dsn in dsns.items():
            n_dead = execute(dsn, "SELECT n_dead_tup FROM pg_stat_user_tables"
                                  " WHERE relname = 'receipt_jobs'")[0][0]
            lat = asyncio.run(_claim_latencies(dsn, claims, 10))
            out[name] = {"dead_tuples_at_update": dead0[name],
                         "autovacuum_after_seconds": first[name],
                         "dead_tuples_at_end": int(n_dead),
                         "claim_p50_ms": percentile(lat, 50),
                         "claim_p99_ms": percentile(lat, 99)}
    finally:
        for dsn in dsns.values():
            bench.drop_database(dsn)
    return out


# ------------------------------------------------------------ provider outage


def _states(probe: psycopg.Connection[Any]) -> dict[str, int]:
    rows = probe.execute("SELECT state, count(*) FROM receipt_jobs GROUP BY state").fetchall()
    return {str(state): int(n) for state, n in rows}


def outage(bench: Bench, *, jobs: int = 1_000, outage_seconds: float = 60.0,
           timeout_seconds: float = 600.0) -> dict[str, Any]:
    """A provider outage: every POST answered 503 for *outage_seconds*, then healthy.

    *jobs* queued, one worker process with the default settings (slots,
    claim batch, admission control, flow control), the reference provider at
    0 ms. The outage starts when the worker is released and ends after
    *outage_seconds* (the one fixed wait: the outage itself); then the run
    waits until no job is ready or running (≤ *timeout_seconds*).

    Returns the jobs ``failed`` and ``done`` at the end; ``requests_during_outage``
    (503 answers, from the provider's ``/answers``); ``resume_seconds``: the
    provider's recovery → its first 2xx answer; ``drained_seconds``: recovery →
    its last 2xx answer; ``wall_seconds``: release → every job done or failed;
    ``probes`` (the worker's ``receipts_provider_probes_total``) and the most
    attempts of any job. Times in seconds.
    """
    provider = Provider(0)
    try:
        provider.set_faults(status=503)
        with bench.database("outage") as dsn:
            fill_ready(dsn, jobs)
            settle(dsn, "receipt_jobs")
            port = free_port()
            argv = receipts_argv(dsn, concurrency=DEFAULT_CONCURRENCY, batch=DEFAULT_BATCH,
                                  provider_url=provider.url, metrics_port=port)
            children = Children([argv], ports=[port])
            try:
                with psycopg.connect(dsn, **PROBE) as probe:
                    start = children.go()
                    wait_until(lambda: bool(provider.answers()) or not children.alive(),
                               timeout_seconds=60, interval_seconds=0.1)
                    time.sleep(max(0.0, start + outage_seconds - time.monotonic()))
                    provider.set_faults(status=None)
                    recovered = time.monotonic()
                    end = wait_until(lambda: remaining_jobs(probe) == 0 or not children.alive(),
                                     timeout_seconds=timeout_seconds)
                    states = _states(probe)
                    row = probe.execute("SELECT max(attempts) FROM receipt_jobs").fetchone()
                    max_attempts = int(row[0]) if row and row[0] is not None else 0
                try:
                    probes: float | None = children.procs[0].scrape().total(
                        "receipts_provider_probes_total")
                except (httpx.HTTPError, RuntimeError):
                    probes = None
            finally:
                tails = children.stop()
        answers = provider.answers()
    finally:
        provider.stop()
    if states.get("ready", 0) + states.get("running", 0):
        raise RuntimeError(f"outage run ended with jobs left {states}: {tails}")
    ok = [t for t, status in answers if status < 300]
    after = [t for t in ok if t >= recovered]
    return {
        "jobs": jobs,
        "outage_seconds": outage_seconds,
        "concurrency": DEFAULT_CONCURRENCY,
        "batch": DEFAULT_BATCH,
        "failed": states.get("failed", 0),
        "done": states.get("done", 0),
        "states": states,
        "requests_during_outage": sum(1 for _, status in answers if status == 503),
        "requests_total": len(answers),
        "resume_seconds": round(after[0] - recovered, 3) if after else None,
        "drained_seconds": round(after[-1] - recovered, 3) if after else None,
        "wall_seconds": round(end - start, 3),
        "probes": probes,
        "max_attempts": max_attempts,
    }


# ------------------------------------------------------------- rate limit


def _window_counts(times: Sequence[float], start: float, window_seconds: float,
                   windows: int) -> list[int]:
    return [sum(1 for t in times if start + k * window_seconds <= t
                < start + (k + 1) * window_seconds) for k in range(windows)]


def rate_limit_accuracy(bench: Bench, *, limit_per_second: float = 200.0, processes: int = 2,
                        seconds: float = 20.0, window_seconds: float = 5.0,
                        ) -> dict[str, Any]:
    """Requests/s at the provider under the fleet-wide limit (*limit_per_second*).

    *processes* workers (default slots and batch, admission control on,
    ``--rate-limit``, burst: the default, one second's worth), the reference
    provider at 0 ms, a backlog three times what the limit lets through. From
    the provider's first answer: one window of *window_seconds* (the initial
    burst; not counted), then *seconds* measured in windows of *window_seconds*.
    Returns each window's requests/s, their mean and the worst deviation from
    the limit (relative), and ``flow_row``: ``receipt_flow``'s update
    statistics once the workers' sessions have ended.
    """
    windows = max(1, round(seconds / window_seconds))
    jobs = int(3 * limit_per_second * (windows + 1) * window_seconds)
    provider = Provider(0)
    try:
        with bench.database("rlim") as dsn:
            fill_ready(dsn, jobs)
            settle(dsn, "receipt_jobs")
            argv = receipts_argv(dsn, concurrency=DEFAULT_CONCURRENCY, batch=DEFAULT_BATCH,
                                  provider_url=provider.url, rate_limit=limit_per_second)
            children = Children([argv] * processes)
            try:
                children.go()
                wait_until(lambda: bool(provider.answers()) or not children.alive(),
                           timeout_seconds=60, interval_seconds=0.1)
                first = provider.answers()[0][0]
                end = first + (windows + 1) * window_seconds
                # The measured interval itself (the provider's clock is this machine's).
                time.sleep(max(0.0, end - time.monotonic()) + 0.2)
                alive = children.alive()
            finally:
                tails = children.stop()
            if not alive:
                raise RuntimeError(f"a rate-limited worker exited: {tails}")
            flow = raw.flow_row_stats(dsn)
        times = sorted(t for t, _ in provider.answers())
    finally:
        provider.stop()
    counts = _window_counts(times, first + window_seconds, window_seconds, windows)
    rates = [n / window_seconds for n in counts]
    deviations = [r / limit_per_second - 1.0 for r in rates]
    return {
        "limit_per_second": limit_per_second,
        "processes": processes,
        "window_seconds": window_seconds,
        "first_window_per_second": _window_counts(times, first, window_seconds, 1)[0]
        / window_seconds,
        "window_rates": rates,
        "mean_per_second": statistics.fmean(rates),
        "mean_deviation": statistics.fmean(rates) / limit_per_second - 1.0,
        "worst_deviation": max(deviations, key=abs),
        "jobs_queued": jobs,
        "flow_row": flow,
    }


def rate_limit_overhead(bench: Bench, *, seconds: float, batch: int = 100, clients: int = 8,
                        contention_clients: Sequence[int] = (1, 8),
                        never_binding: float = 1e9, pairs: int = 2) -> dict[str, Any]:
    """What the flow machinery costs the claim, measured with pgbench (``bench.raw``).

    ``claim`` (with its one-row pause check on ``receipt_flow``) vs. the same
    statement with the check removed (:func:`bench.raw.strip_flow_check`),
    each claim *batch* + ack with *clients* for *seconds*, *pairs* times in
    A B B A order (so a machine that drifts faster or slower during the
    round favours neither); ``with_check``/``without_check`` are the runs of
    the median rate, ``ratio`` the ratio of the two medians, ``pairs_jobs_per_second``
    every (with, without) pair. Then
    ``claim_limited`` at a limit and burst of *never_binding* jobs/s (it never
    binds: what remains is the locked, updated bucket row) with each of
    *contention_clients*. jobs/s each; ``flow_row``: ``receipt_flow``'s update
    statistics after the last ``claim_limited`` run.
    """
    fill = 60_000 * max(1, int(seconds))

    def run(clients: int, flow_stats: bool = False, **script: Any) -> dict[str, Any]:
        return raw.run_pgbench(bench, batch=batch, clients=clients, seconds=seconds,
                               fill=fill, script=script, flow_stats=flow_stats)

    out: dict[str, Any] = {"batch": batch, "clients": clients, "seconds": seconds,
                           "pairs": pairs}
    with_runs: list[dict[str, Any]] = []
    without_runs: list[dict[str, Any]] = []
    for i in range(max(1, pairs)):
        order = (False, True) if i % 2 == 0 else (True, False)
        for strip in order:
            (without_runs if strip else with_runs).append(run(clients, strip_flow=strip))

    def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
        return sorted(runs, key=lambda r: float(r["jobs_per_second"]))[(len(runs) - 1) // 2]

    out["with_check"] = median_run(with_runs)
    out["without_check"] = median_run(without_runs)
    out["pairs_jobs_per_second"] = [
        [a["jobs_per_second"], b["jobs_per_second"]]
        for a, b in zip(with_runs, without_runs, strict=True)]
    out["ratio"] = (out["with_check"]["jobs_per_second"]
                    / max(out["without_check"]["jobs_per_second"], 1e-9))
    out["limited"] = {}
    for n in contention_clients:
        out["limited"][str(n)] = run(n, flow_stats=True, name="claim_limited",
                                     rate_per_second=never_binding, burst=never_binding)
    last = out["limited"][str(contention_clients[-1])]
    out["flow_row"] = last.pop("flow_row")
    for r in out["limited"].values():
        r.pop("flow_row", None)
    return out
