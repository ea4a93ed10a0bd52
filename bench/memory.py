"""A worker's memory by slot count: ``python -m bench.memory``.

For each slot count (``--slots``, default 32, 400 and 1,000) one worker process
(``bench.child receipts``: ``run_worker`` with the HTTP deliverer ``make_deliverer``
builds, claim batch 100, admission control off) drains ``--jobs-per-slot`` (3) × slots
jobs from the reference provider at ``--latency-ms`` (2,000 ms), so every slot holds a
delivery in flight for seconds at a time. The child's resident set (``VmRSS`` of
``/proc/<pid>/status``) is sampled every 20 ms from its release to the end of the
drain: ``idle_mib`` is the first sample (interpreter, imports, pool, metrics server,
before its first claim), ``peak_mib`` the largest. Rounds interleave the slot counts
(A B C, then C B A, …) so the machine's load weighs on each alike.

Prints one line per run and the medians, and writes ``bench/results/memory.json``:
the runs, the load average, and ``summary``: per slot count the median (min–max) idle
and peak MiB, and the least-squares line peak = base + per_slot × slots over the
medians, which :mod:`receipts.planner` uses (``WORKER_RSS_BASE_BYTES``,
``WORKER_RSS_PER_SLOT_BYTES``; a unit test keeps the two equal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from bench.pg import Bench, fill_ready, remaining_jobs, settle, wait_until
from bench.procs import Children, Provider
from bench.scenarios import receipts_argv

RESULTS = Path(__file__).resolve().parent / "results" / "memory.json"
MIB = 1024 * 1024


def rss_bytes(pid: int) -> int:
    """Resident set of *pid* in bytes (``VmRSS``); 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


class RssSampler:
    """Samples one process's resident set in a thread every *interval_seconds*."""

    def __init__(self, pid: int, interval_seconds: float = 0.02) -> None:
        self.pid, self.interval = pid, interval_seconds
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            if value := rss_bytes(self.pid):
                self.samples.append(value)
            self._stop.wait(self.interval)


def one_run(bench: Bench, provider: Provider, *, slots: int, jobs: int,
            prefix: str) -> dict[str, Any]:
    """One drain of *jobs* by one worker with *slots* slots; its memory figures.

    *prefix* makes the run's order ids new to the provider, which answers a key it has
    seen at once (a replay) instead of after its latency."""
    import psycopg

    with bench.database("mem") as dsn:
        fill_ready(dsn, jobs, prefix=prefix)
        settle(dsn, "receipt_jobs")
        argv = receipts_argv(dsn, concurrency=slots, batch=100, provider_url=provider.url,
                             no_admission=True)
        children = Children([argv])
        try:
            pid = children.procs[0].pid
            before = rss_bytes(pid)
            with psycopg.connect(dsn, autocommit=True,
                                 application_name="bench-probe") as probe, \
                    RssSampler(pid) as sampler:
                start = children.go()
                end = wait_until(lambda: remaining_jobs(probe) == 0 or not children.alive(),
                                 timeout_seconds=max(120.0, jobs))
                left = remaining_jobs(probe)
        finally:
            children.stop()
    if left or not sampler.samples:
        raise RuntimeError(f"the {slots}-slot drain stopped with {left} jobs left")
    return {
        "slots": slots, "jobs": jobs, "seconds": round(end - start, 2),
        "ready_mib": round(before / MIB, 1),
        "idle_mib": round(sampler.samples[0] / MIB, 1),
        "peak_mib": round(max(sampler.samples) / MIB, 1),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 1), "min": min(values),
            "max": max(values), "n": len(values)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median (min–max) per slot count, and the line through the peak medians."""
    by_slots: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        by_slots.setdefault(run["slots"], []).append(run)
    table = {str(slots): {"idle_mib": _spread([r["idle_mib"] for r in rs]),
                          "peak_mib": _spread([r["peak_mib"] for r in rs])}
             for slots, rs in sorted(by_slots.items())}
    xs = [float(s) for s in sorted(by_slots)]
    ys = [table[str(int(x))]["peak_mib"]["median"] * MIB for x in xs]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
             / sum((x - mean_x) ** 2 for x in xs)) if len(xs) > 1 else 0.0
    return {"by_slots": table,
            "model": {"base_bytes": round(mean_y - slope * mean_x),
                      "per_slot_bytes": round(slope)}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", default="32,400,1000", help="slot counts, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--jobs-per-slot", type=int, default=3)
    p.add_argument("--latency-ms", type=float, default=2000.0)
    p.add_argument("--out", default=str(RESULTS), help="where to write the JSON ('-': nowhere)")
    args = p.parse_args(argv)
    counts = [int(s) for s in args.slots.split(",")]
    bench = Bench()
    provider = Provider(args.latency_ms)
    runs = []
    try:
        for round_no in range(args.rounds):
            for slots in counts if round_no % 2 == 0 else list(reversed(counts)):
                run = one_run(bench, provider, slots=slots, jobs=slots * args.jobs_per_slot,
                              prefix=f"m{round_no}-{slots}")
                run["round"] = round_no
                runs.append(run)
                print(f"round {round_no} {slots:>5} slots: ready {run['ready_mib']:6.1f} MiB,"
                      f" idle {run['idle_mib']:6.1f}, peak {run['peak_mib']:6.1f}"
                      f" ({run['jobs']} jobs in {run['seconds']} s)", flush=True)
    finally:
        provider.stop()
        bench.cleanup()
    summary = summarise(runs)
    for slots, row in summary["by_slots"].items():
        peak, idle = row["peak_mib"], row["idle_mib"]
        print(f"{slots:>5} slots: peak {peak['median']} MiB ({peak['min']}–{peak['max']}),"
              f" idle {idle['median']} MiB")
    model = summary["model"]
    print(f"peak ≈ {model['base_bytes'] / MIB:.1f} MiB + {model['per_slot_bytes'] / 1024:.1f}"
          " KiB × slots")
    if args.out != "-":
        Path(args.out).write_text(json.dumps({
            "what": "python -m bench.memory " + " ".join(argv or []),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average": os.getloadavg(), "latency_ms": args.latency_ms,
            "runs": runs, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
