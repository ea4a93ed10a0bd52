"""Wake-ups: pickup latency with the default settings, and what an idle fleet costs.

``python -m bench.experiments.wakeups`` (``--smoke`` for the CI size). One durable embedded
PostgreSQL 18 (``bench.pg.Bench``), a fresh database per run.

1. **pickup**: jobs enqueued one per transaction at ``--rate`` (4/s) into an
   idle queue, one worker process with the default settings (32 slots,
   polling every 1 s, five times less often while a waker is heard); latency
   from the enqueuing commit's return to the start of the delivery
   (``bench.scenarios.receipts_pickup``). Modes: ``waker`` (the defaults: no
   notification in the order's transaction, the fleet's elected waker
   notices the job) and ``notify`` (0.2.0's default: ``pg_notify`` in the
   enqueuing transaction, received by the worker's LISTEN at commit),
   interleaved over ``--rounds``.
2. **idle**: 1, 4 and 16 worker processes with the default settings on an
   empty queue; after they have settled, for ``--idle-seconds``: the
   database's transactions per second (``xact_commit + xact_rollback`` of
   ``pg_stat_database``, the bench's own two reads taken off) and the whole
   server's CPU (``Bench.server_cpu_seconds``), as % of one core. With
   ``--baseline-src DIR`` (the ``src`` folder of an earlier release, e.g.
   ``git archive <rev> src | tar -x -C /tmp/base``) the same fleets run that
   release's worker too, for the figure before.

Prints the tables and writes every run to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from bench.document import write_json
from bench.pg import Bench, wait_until
from bench.procs import Children
from bench.run import machine
from bench.scenarios import (
    DEFAULT_BATCH,
    DEFAULT_CONCURRENCY,
    PROBE,
    _sessions,
    receipts_argv,
    receipts_pickup,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "wakeups.json"


def _transactions(probe: psycopg.Connection[Any]) -> int:
    row = probe.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database"
                        " WHERE datname = current_database()").fetchone()
    return int(row[0]) if row else 0


def idle_fleet(bench: Bench, *, pods: int, seconds: float, settle_seconds: float,
               src: Path | None = None) -> dict[str, Any]:
    """*pods* default-settings workers idling on an empty queue: transactions/s, DB CPU %."""
    with bench.database("idle") as dsn:
        argvs = [receipts_argv(dsn, concurrency=DEFAULT_CONCURRENCY, batch=DEFAULT_BATCH)
                 for _ in range(pods)]
        children = Children(argvs, src=src)
        try:
            children.go()
            with psycopg.connect(dsn, **PROBE) as probe:
                wait_until(lambda: _sessions(probe) >= pods, timeout_seconds=60)
                time.sleep(settle_seconds)
                x0, cpu0, t0 = _transactions(probe), bench.server_cpu_seconds(), time.monotonic()
                time.sleep(seconds)
                x1, cpu1, t1 = _transactions(probe), bench.server_cpu_seconds(), time.monotonic()
                sessions = _sessions(probe)
            alive = children.alive()
        finally:
            children.stop()
    if not alive:
        raise RuntimeError("an idle worker exited")
    elapsed = t1 - t0
    return {"pods": pods, "seconds": round(elapsed, 1), "sessions": sessions,
            "release": "baseline" if src else "this",
            "transactions_per_second": round((x1 - x0 - 1) / elapsed, 2),
            "db_cpu_percent": round((cpu1 - cpu0) / elapsed * 100, 2)}


@dataclass
class Plan:
    """Sizes of one run (``--smoke``: CI sizes, figures meaningless)."""

    rounds: int = 2
    pickup_jobs: int = 200
    rate: float = 4.0
    pickup_modes: tuple[str, ...] = ("waker", "notify")
    pods: tuple[int, ...] = (1, 4, 16)
    idle_seconds: float = 60.0
    settle_seconds: float = 15.0

    @classmethod
    def smoke(cls) -> Plan:
        return cls(rounds=1, pickup_jobs=8, rate=8.0, pods=(1, 2), idle_seconds=2.0,
                   settle_seconds=1.0)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.wakeups",
                                description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CI); figures meaningless")
    p.add_argument("--rounds", type=int)
    p.add_argument("--pickup-jobs", type=int)
    p.add_argument("--idle-seconds", type=float)
    p.add_argument("--parts", default="pickup,idle", help="comma-separated: pickup,idle")
    p.add_argument("--baseline-src", type=Path, help="an earlier release's src folder")
    p.add_argument("--out", type=Path, help=f"JSON output (default {DEFAULT_OUT}; --smoke: none)")
    args = p.parse_args(argv)
    plan = Plan.smoke() if args.smoke else Plan()
    if args.rounds:
        plan.rounds = args.rounds
    if args.pickup_jobs:
        plan.pickup_jobs = args.pickup_jobs
    if args.idle_seconds:
        plan.idle_seconds = args.idle_seconds
    parts = set(args.parts.split(","))
    out = args.out if args.out is not None else (None if args.smoke else DEFAULT_OUT)
    started = datetime.now(UTC)
    info = machine()
    bench = Bench()
    pickup: list[dict[str, Any]] = []
    idle: list[dict[str, Any]] = []
    try:
        info["postgres"] = bench.durability()
        for r in range(plan.rounds):
            modes = plan.pickup_modes if r % 2 == 0 else tuple(reversed(plan.pickup_modes))
            for mode in modes if "pickup" in parts else ():
                run = receipts_pickup(bench, jobs=plan.pickup_jobs, rate=plan.rate, mode=mode)
                pickup.append({"round": r, **run})
                print(f"  pickup {mode}: p50 {run['p50_ms']:.1f} p99 {run['p99_ms']:.1f} ms",
                      file=sys.stderr, flush=True)
            for pods in plan.pods if "idle" in parts else ():
                for src in (None, args.baseline_src) if args.baseline_src else (None,):
                    run = idle_fleet(bench, pods=pods, seconds=plan.idle_seconds,
                                     settle_seconds=plan.settle_seconds, src=src)
                    idle.append({"round": r, **run})
                    print(f"  idle {pods} pods ({run['release']}): "
                          f"{run['transactions_per_second']} txn/s, "
                          f"{run['db_cpu_percent']} % CPU", file=sys.stderr, flush=True)
    finally:
        bench.cleanup()
    info["load_average_at_end"] = os.getloadavg()
    summary: dict[str, Any] = {"pickup": {}, "idle": {}}
    for mode in plan.pickup_modes:
        runs = [x for x in pickup if x["mode"] == mode]
        if runs:
            summary["pickup"][mode] = {k: _median([x[k] for x in runs])
                                       for k in ("p50_ms", "p99_ms", "max_ms")}
            summary["pickup"][mode]["runs"] = [round(x["p99_ms"], 1) for x in runs]
    for run in idle:
        key = f"{run['release']}:{run['pods']}"
        summary["idle"].setdefault(key, []).append(run)
    summary["idle"] = {key: {"pods": runs[0]["pods"], "release": runs[0]["release"],
                             "transactions_per_second": _median(
                                 [x["transactions_per_second"] for x in runs]),
                             "db_cpu_percent": _median([x["db_cpu_percent"] for x in runs]),
                             "runs": [x["transactions_per_second"] for x in runs]}
                       for key, runs in summary["idle"].items()}
    doc = {"started": started.isoformat(timespec="seconds"),
           "finished": datetime.now(UTC).isoformat(timespec="seconds"), "machine": info,
           "plan": plan.__dict__, "summary": summary, "pickup": pickup, "idle": idle}
    print(f"\npickup at {plan.rate:g}/s, one per transaction, {plan.pickup_jobs} jobs "
          f"(median over {plan.rounds} rounds)")
    for mode, v in summary["pickup"].items():
        print(f"  {mode:8} p50 {v['p50_ms']:7.1f} ms  p99 {v['p99_ms']:7.1f} ms  "
              f"max {v['max_ms']:7.1f} ms")
    print("\nidle fleet: transactions/s and DB server CPU (% of one core)")
    for v in summary["idle"].values():
        print(f"  {v['release']:8} {v['pods']:3} pods  {v['transactions_per_second']:7.2f} txn/s"
              f"  {v['db_cpu_percent']:6.2f} %")
    if out:
        write_json(doc, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
