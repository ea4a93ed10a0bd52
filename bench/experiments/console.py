"""What the operator console costs the checkout database, and what the worker's tag costs a claim.

Runs alone, from the project's virtualenv (the ``dev`` extra: embedded PostgreSQL)::

    .venv/bin/python -m bench.experiments.console                  # the defaults below
    .venv/bin/python -m bench.experiments.console --rounds 3 --drain-jobs 20000 --bulk-rows 200000

One embedded PostgreSQL 18 with default durability (``bench/pg.py``). Four
measurements, each printed with the machine's load average:

1. **Tagged lease tokens** (the claim writes the worker's 8 hex digits into the
   token's tail, ``claim_query(tag=…)``) against plain random tokens: a drain of
   ``--drain-jobs`` ready jobs by claim(100) + ack on one connection, in fresh
   databases, interleaved A B B A for ``--rounds`` rounds; median jobs/s, and
   the server's CPU and WAL per job.
2. **The console's shared reading** (``Monitor``: queue gauges, flow state,
   workers, bulk actions, revoked sessions) on 1,000,000 failed + 100,000 done
   + 1,000 ready rows (``--reading-rows``): median milliseconds and server CPU per reading — the
   whole recurring cost of the console, paid once per interval whatever the
   number of viewers.
3. **Heartbeats**: 16 workers' upserts, 50 each: median milliseconds, WAL
   bytes per heartbeat, the share of HOT updates.
4. **A bulk retry** of ``--bulk-rows`` failed jobs in adaptive batches
   (pace 0): seconds, jobs/s, batches, the slowest batch, WAL per job.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time
from typing import Any

from bench.pg import Bench, execute, fill_ready, settle
from receipts import bulk
from receipts.db import make_pool
from receipts.jobqueue import JobQueue
from receipts.model import JobState
from receipts.operations import Operations, ReviewFilter
from receipts.settings import load_settings
from receipts.ui.monitor import Monitor


def wal_lsn(dsn: str) -> int:
    """The server's current WAL position, bytes."""
    return int(execute(dsn, "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")[0][0])


async def drain(dsn: str, *, tag: str | None) -> int:
    """Claim(100) + ack until the queue is empty, on one connection; jobs drained."""
    settings = load_settings(database_url=dsn, metrics_port=0, application_name="bench-console")
    pool = make_pool(settings, "worker", max_size=1)
    await pool.open(wait=True)
    try:
        queue = JobQueue(pool, lease_seconds=60, max_attempts=5, worker_tag=tag)
        done = 0
        while True:
            result = await queue.claim(100)
            if not result.attempts:
                return done
            acked = await queue.ack([(a.job.id, a.job.token) for a in result.attempts])
            done += len(acked)
    finally:
        await pool.close()


def tagged_tokens(bench: Bench, rounds: int, jobs: int) -> dict[str, Any]:
    """Drain throughput and server cost, plain (A) vs tagged (B) tokens, A B B A per round."""
    out: dict[str, list[dict[str, float]]] = {"plain": [], "tagged": []}
    for _ in range(rounds):
        for variant in ("plain", "tagged", "tagged", "plain"):
            with bench.database("drain") as dsn:
                fill_ready(dsn, jobs)
                settle(dsn, "receipt_jobs")
                wal, cpu = wal_lsn(dsn), bench.server_cpu_seconds()
                began = time.perf_counter()
                drained = asyncio.run(drain(dsn, tag="0badcafe" if variant == "tagged"
                                            else None))
                seconds = time.perf_counter() - began
                out[variant].append({
                    "jobs_per_second": drained / seconds,
                    "server_cpu_us_per_job": (bench.server_cpu_seconds() - cpu) / drained * 1e6,
                    "wal_bytes_per_job": (wal_lsn(dsn) - wal) / drained})
    return {variant: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            for variant, runs in out.items()} | {"runs_each": 2 * rounds, "jobs": jobs}


def shared_reading(bench: Bench, readings: int, failed: int) -> dict[str, Any]:
    """Milliseconds and server CPU of one console reading on *failed* failed rows, a tenth
    as many done and 1,000 ready."""
    with bench.database("reading") as dsn:
        execute(dsn, "INSERT INTO receipt_jobs (id, order_id, state, attempts, last_error,"
                     " finished_at) SELECT gen_random_uuid(), 'f-' || g, 'failed', 5, 'x',"
                     " now() - make_interval(secs => g) FROM generate_series(1, %(n)s) g",
                {"n": failed})
        fill_ready(dsn, failed // 10, prefix="d", state="done")
        fill_ready(dsn, 1_000, prefix="r")
        settle(dsn, "receipt_jobs")

        async def measure() -> tuple[list[float], float]:
            settings = load_settings(database_url=dsn, metrics_port=0)
            pool = make_pool(settings, "ui", max_size=2)
            await pool.open(wait=True)
            try:
                queue = JobQueue(pool, lease_seconds=60, max_attempts=5)
                monitor = Monitor(queue, Operations(pool), refresh_seconds=5.0,
                                  done_count_seconds=1e9)
                await monitor.refresh()  # warm: plans, buffers, the one done count
                times = []
                cpu = bench.server_cpu_seconds()
                for _ in range(readings):
                    began = time.perf_counter()
                    async with monitor._lock:
                        await monitor._refresh()
                    times.append((time.perf_counter() - began) * 1000)
                return times, (bench.server_cpu_seconds() - cpu) / readings * 1000
            finally:
                await pool.close()

        times, cpu_ms = asyncio.run(measure())
    return {"median_ms": statistics.median(times), "max_ms": max(times),
            "server_cpu_ms_per_reading": cpu_ms, "readings": readings,
            "rows": f"{failed:,} failed + {failed // 10:,} done + 1,000 ready"}


def heartbeats(bench: Bench, workers: int = 16, beats: int = 50) -> dict[str, Any]:
    """Cost of the heartbeat upsert: median ms, WAL bytes per beat, HOT share."""
    with bench.database("heartbeat") as dsn:
        async def measure() -> list[float]:
            settings = load_settings(database_url=dsn, metrics_port=0)
            pool = make_pool(settings, "worker", max_size=1)
            await pool.open(wait=True)
            try:
                queue = JobQueue(pool, lease_seconds=60, max_attempts=5)
                times = []
                for beat in range(beats):
                    for w in range(workers):
                        began = time.perf_counter()
                        await queue.heartbeat(tag=f"{w:08x}", pod=f"receipts-worker-{w}", pid=w,
                                              version="0.3.0", slots=32, inflight=beat % 32,
                                              claimed_total=beat * 100,
                                              uptime_seconds=beat * 20, since_claim_seconds=1.0)
                        times.append((time.perf_counter() - began) * 1000)
                return times
            finally:
                await pool.close()

        wal = wal_lsn(dsn)
        times = asyncio.run(measure())
        wal_per_beat = (wal_lsn(dsn) - wal) / (workers * beats)
        deadline = time.monotonic() + 30  # the backend flushes its statistics as it exits
        row: tuple[Any, ...] = (0, 0)
        while time.monotonic() < deadline:
            row = execute(dsn, "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
                               " WHERE relname = 'receipt_workers'")[0]
            if row[0] >= workers * (beats - 1):
                break
            time.sleep(0.2)
    return {"median_ms": statistics.median(times), "wal_bytes_per_beat": wal_per_beat,
            "hot_share": row[1] / row[0] if row[0] else None, "workers": workers,
            "beats_each": beats}


def bulk_retry(bench: Bench, rows: int) -> dict[str, Any]:
    """A bulk retry of *rows* failed jobs with pace 0: seconds, jobs/s, batches, WAL/job."""
    with bench.database("bulk") as dsn:
        execute(dsn, "INSERT INTO receipt_jobs (id, order_id, state, attempts, last_error,"
                     " finished_at) SELECT gen_random_uuid(), 'f-' || g, 'failed', 5, 'x',"
                     " now() - make_interval(secs => g / 100.0)"
                     " FROM generate_series(1, %(n)s) g", {"n": rows})
        settle(dsn, "receipt_jobs")

        async def run() -> tuple[bulk.Progress, list[float]]:
            settings = load_settings(database_url=dsn, metrics_port=0)
            pool = make_pool(settings, "ui", max_size=2)
            await pool.open(wait=True)
            try:
                ops = Operations(pool)
                cutoff, count, _ = await bulk.confirmation(
                    ops, ReviewFilter(state=JobState.FAILED))
                row, runner = await bulk.start(ops, action="retry", view=ReviewFilter(
                    state=JobState.FAILED, cutoff=cutoff), expected=count, created_by="bench")
                stamps = [time.perf_counter()]
                progress = await bulk.run(ops, row, runner, policy=bulk.BulkPolicy(pace=0.0),
                                          on_step=lambda _: stamps.append(time.perf_counter()))
                return progress, [b - a for a, b in itertools.pairwise(stamps)]
            finally:
                await pool.close()

        wal = wal_lsn(dsn)
        progress, batch_seconds = asyncio.run(run())
        wal_per_job = (wal_lsn(dsn) - wal) / max(1, progress.changed)
    return {"rows": rows, "seconds": progress.seconds,
            "jobs_per_second": progress.changed / progress.seconds,
            "batches": progress.batches, "slowest_batch_seconds": max(batch_seconds),
            "wal_bytes_per_job": wal_per_job}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="A B B A rounds of the drain (3)")
    parser.add_argument("--drain-jobs", type=int, default=50_000, help="jobs per drain (50000)")
    parser.add_argument("--readings", type=int, default=20, help="console readings (20)")
    parser.add_argument("--reading-rows", type=int, default=1_000_000,
                        help="failed rows under the console's reading (1000000)")
    parser.add_argument("--bulk-rows", type=int, default=1_000_000,
                        help="failed jobs of the bulk retry (1000000; 0 skips it)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    bench = Bench()
    results: dict[str, Any] = {"load_average_before": os.getloadavg()}
    try:
        results["tagged_tokens"] = tagged_tokens(bench, args.rounds, args.drain_jobs)
        print("tagged tokens:", json.dumps(results["tagged_tokens"]), flush=True)
        results["shared_reading"] = shared_reading(bench, args.readings, args.reading_rows)
        print("shared reading:", json.dumps(results["shared_reading"]), flush=True)
        results["heartbeats"] = heartbeats(bench)
        print("heartbeats:", json.dumps(results["heartbeats"]), flush=True)
        if args.bulk_rows:
            results["bulk_retry"] = bulk_retry(bench, args.bulk_rows)
            print("bulk retry:", json.dumps(results["bulk_retry"]), flush=True)
    finally:
        bench.cleanup()
    results["load_average_after"] = os.getloadavg()
    print("load average before/after:", results["load_average_before"],
          results["load_average_after"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


