"""Asynchronous versus durable worker commits, side by side: ``python -m bench.experiments.commit``.

What ``RECEIPTS_SYNCHRONOUS_COMMIT=off`` (the default) buys, measured the way
the checkout rows of ``bench/run.sh`` are (:func:`bench.scenarios.checkout_impact`):
one durable embedded PostgreSQL 18, a fresh database per phase, one worker
process with the default settings (32 slots, claim batch 100; admission
control as ``--admission`` says, on by default as in the service, off to see
the drain's own cost without the limiter) draining a backlog with a no-op
deliverer, while "insert order + enqueue receipt" transactions run at 100/s.
Per phase: the drain rate over the window, checkout p50/p99 and the server's
WAL fsyncs per second (``pg_stat_io``: every flush a commit waited for, the
drain's and checkout's; what asynchronous commits remove).

Each round runs idle, then ``off on on off`` (A B B A), so a drift of the
shared machine during a round weighs on both sides alike; the table gives each
mode's median (min–max) over its phases, the ratios off/on, and the load
average before and after. ``--rounds`` (3), ``--seconds`` per window (20),
``--jobs`` per drain (150,000), ``--json FILE`` for the raw phases.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from bench.pg import Bench
from bench.scenarios import CheckoutPhase, checkout_impact

MODES = ("off", "on")


def one_round(bench: Bench, *, seconds: float, jobs: int,
              admission: bool = True) -> list[dict[str, Any]]:
    """idle, off, on, on, off: one checkout window each; the phases' results in order."""
    phases = [CheckoutPhase("idle", seconds=seconds)]
    for i, mode in enumerate(("off", "on", "on", "off")):
        phases.append(CheckoutPhase(f"{mode}-{i}", drain=True, seconds=seconds, jobs=jobs,
                                    admission=admission, synchronous_commit=mode))
    out = checkout_impact(bench, drain_jobs=jobs, seconds=seconds, rate=100.0, phases=phases)
    return [out[p.name] | {"mode": p.synchronous_commit if p.drain else "idle"}
            for p in phases]


def _cell(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.commit",
                                description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--jobs", type=int, default=150_000)
    p.add_argument("--admission", choices=["on", "off"], default="on",
                   help="admission control of the draining worker (default on, as the service)")
    p.add_argument("--json", help="write every phase's result to this file")
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    bench = Bench()
    phases: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            for phase in one_round(bench, seconds=args.seconds, jobs=args.jobs,
                                   admission=args.admission == "on"):
                phase["round"] = r
                phases.append(phase)
                rate = phase.get("drain_jobs_per_second")
                print(f"round {r} {phase['name']:<6} p50 {phase['p50_ms']:.2f} ms, p99 "
                      f"{phase['p99_ms']:.2f} ms, {phase['wal_fsyncs_per_second']:,.0f} WAL "
                      "fsyncs/s" + (f", drain {rate:,.0f} jobs/s" if rate else ""), flush=True)
    finally:
        bench.cleanup()
    load_after = os.getloadavg()
    by_mode = {m: [ph for ph in phases if ph["mode"] == m] for m in ("idle", *MODES)}
    print(f"\n{started}, {args.rounds} rounds × (idle, off, on, on, off), {args.seconds:g} s "
          f"windows, {args.jobs:,} jobs per drain, admission control {args.admission}; "
          "load average before "
          f"{load_before[0]:.2f}/{load_before[1]:.2f}, after {load_after[0]:.2f}/"
          f"{load_after[1]:.2f}")
    print("mode   drain jobs/s            checkout p50 ms       checkout p99 ms"
          "       WAL fsyncs/s")
    for mode, rows in by_mode.items():
        rate = _cell([r["drain_jobs_per_second"] for r in rows], ",.0f") if mode != "idle" else "–"
        print(f"{mode:<6} {rate:<23} {_cell([r['p50_ms'] for r in rows], '.2f'):<21} "
              f"{_cell([r['p99_ms'] for r in rows], '.2f'):<21} "
              f"{_cell([r['wal_fsyncs_per_second'] for r in rows], ',.0f')}")
    # Ratios within each round (the same minutes of the shared machine), then their median.
    ratios: dict[str, list[float]] = {"drain off/on": [], "p99 off/on": [], "p99 off/idle": [],
                                      "p99 on/idle": []}
    for r in range(args.rounds):
        rows = [ph for ph in phases if ph["round"] == r]
        idle = next(ph for ph in rows if ph["mode"] == "idle")
        med = {m: {k: statistics.median(ph[k] for ph in rows if ph["mode"] == m)
                   for k in ("drain_jobs_per_second", "p99_ms")} for m in MODES}
        ratios["drain off/on"].append(med["off"]["drain_jobs_per_second"]
                                      / med["on"]["drain_jobs_per_second"])
        ratios["p99 off/on"].append(med["off"]["p99_ms"] / med["on"]["p99_ms"])
        ratios["p99 off/idle"].append(med["off"]["p99_ms"] / idle["p99_ms"])
        ratios["p99 on/idle"].append(med["on"]["p99_ms"] / idle["p99_ms"])
    for name, values in ratios.items():
        print(f"{name:<14} {_cell(values, '.2f')}  per round: "
              + ", ".join(f"{v:.2f}" for v in values))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"started": started, "load_before": load_before, "load_after": load_after,
                       "args": vars(args), "phases": phases, "ratios": ratios}, fh, indent=1,
                      default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
