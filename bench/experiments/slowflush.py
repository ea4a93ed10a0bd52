"""Checkout under a drain where the WAL flush is slow: does admission control earn its place?

``python -m bench.experiments.slowflush [--flush-us 1000] [--processes 4]
[--synchronous-commit on]``.
The benchmark's durable server started with an ``LD_PRELOAD`` shim
(``bench/slowsync.c``, built with ``cc`` as ``bench.checkout`` builds it) that sleeps ``--flush-us``
before every ``fsync``/``fdatasync``: a cloud volume's flush on a local disk.
Then the checkout phases of ``bench.scenarios.checkout_impact`` — insert an
order and enqueue its receipt in one transaction at ``--rate`` per second —
with *processes* workers at the default settings (32 slots, claim batch 100)
idle, draining with admission control off, and draining with it on, each
phase with a fresh database; rounds interleaved (idle, off, on; then on, off,
idle). The workers' sessions commit as ``--synchronous-commit`` says (the
setting's default is ``off``).

Per phase: checkout p50/p99 (ms), the drain rate over the window, and the
commit probe's latency as a fresh session sees it before the phase. The
targets: p99 with admission on ≤ 1.5 × idle, with the drain on ≥ 0.5 × off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.checkout import start_server
from bench.document import write_json
from bench.pg import Bench
from bench.report import per_second
from bench.scenarios import CheckoutPhase, checkout_impact


def slow_bench(flush_us: int) -> Bench:
    """The benchmark server with every WAL flush *flush_us* µs slower (``bench/slowsync.c``).

    Raises ``RuntimeError`` without a C compiler or when the server did not load the shim.
    """
    bench, _ = start_server("slow", flush_us / 1000)
    return bench


def commit_latency_ms(dsn: str, n: int = 50) -> float:
    """Median latency of a small durable commit (the commit probe's statement), ms."""
    with psycopg.connect(dsn, autocommit=True, application_name="bench-probe") as conn:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            conn.execute("BEGIN; SET LOCAL synchronous_commit TO on;"
                         " SELECT pg_logical_emit_message(true, 'bench', ''); COMMIT")
            times.append((time.perf_counter() - t) * 1000)
    return float(statistics.median(times))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.slowflush",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--flush-us", type=int, default=1000, help="added to every flush (µs)")
    p.add_argument("--processes", type=int, default=4, help="worker processes (pods)")
    p.add_argument("--synchronous-commit", choices=["on", "off"], default="on",
                   help="the workers' own commits (default on: the worst case)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=20.0, help="checkout window per phase")
    p.add_argument("--rate", type=float, default=100.0, help="checkout transactions per second")
    p.add_argument("--jobs", type=int, default=400_000, help="backlog of each drain")
    p.add_argument("--out", type=Path, help="write every phase as JSON")
    args = p.parse_args(argv)
    phases = [
        CheckoutPhase("idle", seconds=args.seconds),
        CheckoutPhase("drain_off", drain=True, admission=False, seconds=args.seconds,
                      jobs=args.jobs, synchronous_commit=args.synchronous_commit),
        CheckoutPhase("drain_on", drain=True, admission=True, seconds=args.seconds,
                      jobs=args.jobs, synchronous_commit=args.synchronous_commit, trace=True),
    ]
    runs: dict[str, list[dict[str, Any]]] = {}
    load = [os.getloadavg()[0]]
    bench = slow_bench(args.flush_us)
    try:
        for n in range(args.rounds):
            order = phases if n % 2 == 0 else list(reversed(phases))
            for phase in order:
                with bench.database("probe") as dsn:
                    commit_ms = commit_latency_ms(dsn)
                result = checkout_impact(bench, drain_jobs=args.jobs, seconds=args.seconds,
                                         rate=args.rate, processes=args.processes,
                                         phases=[phase])[phase.name]
                result["idle_commit_ms"] = commit_ms
                runs.setdefault(phase.name, []).append(result)
                rate = result.get("drain_jobs_per_second")
                print(f"round {n + 1} {phase.name}: checkout p50 {result['p50_ms']:.2f} p99 "
                      f"{result['p99_ms']:.2f} ms"
                      + (f", drain {rate:,.0f} jobs/s" if rate else "")
                      + f", durable commit {commit_ms:.2f} ms, load "
                      f"{os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
                if result.get("limit_trace"):
                    print("  first worker's claim-rate limit, jobs/s per second: "
                          + " ".join(f"{v:,.0f}" for _, v in per_second(
                              result["limit_trace"])), file=sys.stderr, flush=True)
    finally:
        bench.cleanup()
    load.append(os.getloadavg()[0])

    def med(name: str, key: str) -> float:
        return float(statistics.median(float(r[key]) for r in runs[name]))

    idle = med("idle", "p99_ms")
    summary = {
        "flush_us": args.flush_us, "processes": args.processes,
        "synchronous_commit": args.synchronous_commit, "rounds": args.rounds,
        "load_average": load,
        **{name: {"p50_ms": med(name, "p50_ms"), "p99_ms": med(name, "p99_ms"),
                  "p99_vs_idle": round(med(name, "p99_ms") / idle, 2),
                  **({"drain_jobs_per_second": med(name, "drain_jobs_per_second")}
                     if name != "idle" else {})}
           for name in runs},
    }
    if "drain_on" in runs and "drain_off" in runs:
        summary["drain_on_vs_off"] = round(
            med("drain_on", "drain_jobs_per_second")
            / max(med("drain_off", "drain_jobs_per_second"), 1e-9), 2)
    print(json.dumps(summary, indent=1))
    if args.out:
        write_json({"summary": summary, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
