"""The measured scenarios. Each function runs one measurement and returns a dict.

All run against the one durable server of :class:`bench.pg.Bench`, each in a
fresh database, so rounds can interleave them freely.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import psycopg

from bench import peers
from bench.pg import Bench, execute, fill_ready, remaining_jobs, settle, wait_until
from bench.procs import Children, ConnectionSampler, Provider
from receipts.db import make_pool
from receipts.enqueue import enqueue
from receipts.jobqueue import JobQueue
from receipts.settings import load_settings

PROBE: dict[str, Any] = {"autocommit": True, "application_name": "bench-probe"}


def percentile(values: Sequence[float], q: float) -> float:
    """The *q*-th percentile (0–100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _receipts_argv(dsn: str, **opts: Any) -> list[str]:
    argv = ["receipts", "--dsn", dsn]
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
           timeout_seconds: float) -> dict[str, Any]:
    children = Children(argvs)
    try:
        with psycopg.connect(dsn, **PROBE) as probe, ConnectionSampler(dsn) as sampler:
            start = children.go()
            end = wait_until(lambda: left(probe) == 0 or not children.alive(),
                             timeout_seconds=timeout_seconds)
            unfinished = left(probe)
    finally:
        tails = children.stop()
    if unfinished:
        raise RuntimeError(f"drain stopped with {unfinished} jobs left: {tails}")
    seconds = end - start
    cpu = children.cpu_seconds(tails)
    return {
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
                   listen: bool = True, admission: bool = True, uvloop: bool = False,
                   profile: str | None = None, profile_seconds: float = 6.0) -> dict[str, Any]:
    """receipts worker processes draining *jobs* pre-enqueued jobs.

    No-op in-process deliverer, or the reference HTTP provider at
    *provider_latency_ms* when given. *admission* False turns admission control
    off (capacity figures: what a worker can do, not what it allows itself).
    *uvloop* runs the workers on uvloop instead of asyncio's own loop.
    *profile*: a py-spy raw profile of the (first) worker to this file.
    """
    provider = Provider(provider_latency_ms) if provider_latency_ms is not None else None
    try:
        with bench.database("rcpt") as dsn:
            fill_ready(dsn, jobs)
            settle(dsn, "receipt_jobs")
            argv = _receipts_argv(dsn, concurrency=concurrency, batch=batch,
                                  provider_url=provider.url if provider else None,
                                  no_listen=not listen, no_admission=not admission,
                                  uvloop=uvloop)
            argvs = [argv] * processes
            if profile:
                argvs[0] = [*argv, "--profile", profile, "--profile-seconds",
                            str(profile_seconds)]
            result = _drain(dsn, argvs, jobs, remaining_jobs,
                            timeout_seconds=max(120.0, jobs / 100.0))
            stale = execute(dsn, "SELECT count(*) FROM receipt_jobs WHERE state <> 'done'")
            result["not_done"] = int(stale[0][0])
    finally:
        if provider:
            provider.stop()
    result.update(processes=processes, concurrency=concurrency, batch=batch,
                  provider_latency_ms=provider_latency_ms, admission_control=admission,
                  uvloop=uvloop)
    return result


def peer_drain(bench: Bench, peer: str, *, jobs: int, **opts: Any) -> dict[str, Any]:
    """A peer draining *jobs* no-op jobs (its best documented configuration)."""
    with bench.database(peer[:5]) as dsn:
        peers.install(peer, dsn)
        peers.fill(peer, dsn, jobs)
        settle(dsn, *peers.tables(peer))
        argv = [peer, "--dsn", dsn]
        for key, value in opts.items():
            flag = "--" + key.replace("_", "-")
            argv += [flag] if value is True else [flag, str(value)]
        result = _drain(dsn, [argv], jobs, lambda c: peers.remaining(peer, c),
                        timeout_seconds=max(300.0, jobs / 100.0))
    result.update(opts)
    return result


# ------------------------------------------------------------ pickup latency


def _schedule(n: int, rate: float) -> list[float]:
    return [i / rate for i in range(n)]


def receipts_pickup(bench: Bench, *, jobs: int, rate: float, listen: bool,
                    poll_seconds: float = 1.0) -> dict[str, Any]:
    """Enqueue-commit → delivery-start for *jobs* enqueued one per transaction."""
    with bench.database("pick") as dsn, tempfile.TemporaryDirectory() as tmp:
        record = os.path.join(tmp, "record.json")
        argv = _receipts_argv(dsn, concurrency=32, batch=100, no_listen=not listen,
                              poll_seconds=poll_seconds, record=record)
        children = Children([argv])
        committed: dict[str, float] = {}
        try:
            children.go()
            with psycopg.connect(dsn, application_name="bench-enqueue") as conn, \
                    psycopg.connect(dsn, **PROBE) as probe:
                # Measure from a running worker: a warm-up job done (and its LISTEN up).
                with conn.transaction():
                    enqueue(conn, "warm-up", notify=listen)
                wait_until(lambda: remaining_jobs(probe) == 0
                           and (not listen or _sessions(probe, listening=True) > 0),
                           timeout_seconds=30)
                t0 = time.monotonic()
                for i, at in enumerate(_schedule(jobs, rate)):
                    delay = t0 + at - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    order = f"p-{i}"
                    with conn.transaction():
                        enqueue(conn, order, notify=listen)
                    committed[order] = time.time()
            with psycopg.connect(dsn, **PROBE) as probe:
                wait_until(lambda: remaining_jobs(probe) == 0, timeout_seconds=60)
        finally:
            children.stop()
        with open(record) as fh:
            started = json.load(fh)
    return _latencies(committed, started, listen=listen)


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
                {"max_attempts": 5, "lease_seconds": 60.0, "probe": False},
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
        execute(dsn, "UPDATE receipt_jobs SET state = 'done', finished_at = now(),"
                     " attempts = 1 WHERE state = 'ready' AND run_at < now() - interval '30 s'")
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


def _workers_started(probe: psycopg.Connection[Any], processes: int,
                     jobs: int | None) -> bool:
    """Every worker process connected and, given the *jobs* they drain, claiming."""
    return _sessions(probe) >= processes and (jobs is None or remaining_jobs(probe) < jobs)


def checkout_impact(bench: Bench, *, drain_jobs: int, seconds: float, rate: float,
                    processes: int = 1, concurrency: int = 200, batch: int = 100,
                    ) -> dict[str, Any]:
    """Checkout p50/p99 with the workers idle vs. draining at full speed."""
    out: dict[str, Any] = {"rate": rate, "seconds": seconds, "processes": processes,
                           "concurrency": concurrency, "batch": batch}
    for phase in ("idle", "drain"):
        with bench.database("chk") as dsn:
            if phase == "drain":
                fill_ready(dsn, drain_jobs)
            settle(dsn, "receipt_jobs", "bench_orders")
            argv = _receipts_argv(dsn, concurrency=concurrency, batch=batch)
            children = Children([argv] * processes)
            try:
                children.go()
                with psycopg.connect(dsn, **PROBE) as probe:
                    wait_until(partial(_workers_started, probe, processes,
                                       drain_jobs if phase == "drain" else None),
                               timeout_seconds=30)
                lat = _checkout(dsn, seconds, rate)
                with psycopg.connect(dsn, **PROBE) as probe:
                    left = remaining_jobs(probe)
            finally:
                children.stop()
        out[phase] = {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                      "samples": len(lat), "jobs_left_at_end": left}
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
            execute(dsn, "UPDATE receipt_jobs SET state = 'done', finished_at = now(),"
                         " attempts = 1 WHERE state = 'ready'"
                         " AND run_at < now() - interval '30 s'")
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
