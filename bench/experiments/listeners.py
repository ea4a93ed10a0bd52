"""What a LISTEN session costs the database for each notifying commit, on its channel or not.

``python -m bench.experiments.listeners`` (``--rounds``, ``--commits``).

Every pod keeps a LISTEN session (:mod:`receipts.waker`) and the waker
notifies pods on their own channels, so a pod is told only of the work meant
for it. This measures what each listening backend pays for the commits that
notify: one session listens on channel ``mine``; another commits
``--commits`` ``pg_notify`` calls one by one, each in its own transaction,
either on ``mine`` (delivered) or on ``other`` (never delivered to the
listener). The listener's backend CPU comes from ``/proc`` before and after.

Prints the listener's CPU per notifying commit (µs) for both channels,
median of ``--rounds`` interleaved runs, and the notifications delivered.
If PostgreSQL signalled only the backends listening on the channel, the
``other`` figure would be near 0; it is not (bench/README.md, "Where the
backends' CPU goes"). Writes every run to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from bench.checkout import interleaved
from bench.pg import Bench
from bench.report import write_json
from bench.run import machine

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "results" / "listeners.json"
CHANNELS = ("mine", "other")


def backend_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process *pid* (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(bench: Bench, channel: str, *, commits: int) -> dict[str, Any]:
    """One run: *commits* notifying commits on *channel*; the listener's CPU per commit."""
    with bench.database("listeners") as dsn, \
            psycopg.connect(dsn, autocommit=True) as listener, \
            psycopg.connect(dsn, autocommit=True) as sender:
        listener.execute("LISTEN mine")
        row = listener.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        pid = int(row[0])
        before = backend_cpu_seconds(pid)
        for _ in range(commits):
            sender.execute("SELECT pg_notify(%s, 'x')", (channel,), prepare=True)
        # Let the listener handle the last signals before its CPU is read again.
        time.sleep(0.5)
        delivered = sum(1 for _ in listener.notifies(timeout=0.5))
        spent = backend_cpu_seconds(pid) - before
    return {"us_per_commit": round(spent * 1e6 / commits, 2), "delivered": delivered}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.listeners",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--commits", type=int, default=20_000,
                   help="notifying commits per run (20,000; /proc counts CPU in 10 ms ticks)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="JSON file (results/listeners.json)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.commits < 1:
        p.error("--rounds and --commits must be at least 1")
    started = datetime.now(UTC)
    bench = Bench()
    runs: list[dict[str, Any]] = []
    try:
        for r, channel in interleaved(list(CHANNELS), args.rounds):
            run = run_once(bench, channel, commits=args.commits)
            runs.append({"channel": channel, "round": r, **run})
            print(f"  {channel}: {run}", flush=True)
    finally:
        bench.cleanup()
    summary = {c: {"us_per_commit": statistics.median(x["us_per_commit"] for x in runs
                                                      if x["channel"] == c),
                   "delivered": statistics.median(x["delivered"] for x in runs
                                                  if x["channel"] == c)}
               for c in CHANNELS}
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK") / args.commits  # /proc counts whole ticks
    print(f"\n{args.commits} notifying commits, median of {args.rounds}: the listener's CPU"
          f" (read in clock ticks: ±{tick_us:.2f} us per commit)")
    for channel in CHANNELS:
        print(f"on {channel:6} {summary[channel]['us_per_commit']:7.2f} us per commit,"
              f" {summary[channel]['delivered']:.0f} delivered")
    write_json({"started": started.isoformat(timespec="seconds"),
                "finished": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": machine(), "args": vars(args) | {"out": str(args.out)},
                "summary": summary, "resolution_us_per_commit": round(tick_us, 3),
                "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
