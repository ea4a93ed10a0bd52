"""Profile one receipts worker during a benchmark drain: ``python -m bench.experiments.profile``.

Runs one drain scenario (default: ``connections``, 400 slots against the
reference provider at 200 ms, admission control off) on a fresh embedded
PostgreSQL, samples the worker process with py-spy (200 Hz, non-blocking,
from "go" for ``--seconds``), and writes a table of where its CPU went:
self time by file, self time by function, and inclusive time by function
(the share of samples with that frame anywhere on the stack). py-spy counts
only samples in which the thread was running, so idle waits are not in it.

    python -m bench.experiments.profile                                   # connections
    python -m bench.experiments.profile --scenario http0 --jobs 20000     # provider at 0 ms
    python -m bench.experiments.profile --scenario noop --jobs 100000     # no-op deliverer

py-spy comes with the bench extra (``bench/run.sh`` installs it).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import scenarios
from bench.pg import Bench

RESULTS = Path(__file__).resolve().parent / "results"

#: scenario → receipts_drain arguments (the same shapes as bench.run's rows).
SCENARIOS: dict[str, dict[str, Any]] = {
    "connections": {"concurrency": 400, "batch": 100, "provider_latency_ms": 200},
    "http0": {"concurrency": 100, "batch": 100, "provider_latency_ms": 0},
    "noop": {"concurrency": 500, "batch": 100},
}

_FILE = re.compile(r"\((?P<file>[^()]+):\d+\)$")


#: Areas of the worker, by the file a sample's innermost frame is in (first match).
AREAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("database: psycopg, pool, queue statements",
     ("psycopg/", "psycopg_pool/", "receipts/jobqueue.py", "receipts/db.py")),
    ("HTTP client: aiohttp (incl. the socket send), multidict, yarl",
     ("aiohttp/", "multidict/", "yarl/", "aiohappyeyeballs/", "propcache/")),
    ("HTTP: our adapter, deliverer and deadlines, httpx models, JSON",
     ("receipts/transport.py", "receipts/delivery.py", "receipts/deadlines.py", "httpx/",
      "json/")),
    ("event loop, sockets, timers: asyncio, selectors", ("asyncio/", "selectors.py")),
    ("worker: loop, completer, flow gate, metrics",
     ("receipts/worker.py", "receipts/completion.py", "receipts/flow.py",
      "receipts/admission.py", "receipts/metrics.py", "prometheus_client/", "receipts/model.py")),
)


def _area_of(file: str) -> str:
    for name, prefixes in AREAS:
        if file.startswith(prefixes):
            return name
    return "other"


def _file_of(frame: str) -> str:
    """``'f (httpx/_models.py:12)'`` → ``'httpx/_models.py'``."""
    match = _FILE.search(frame)
    return match.group("file") if match else frame


def summarize(raw: str, *, self_rows: int = 30, inclusive_rows: int = 60,
              file_rows: int = 20) -> tuple[int, str]:
    """The py-spy raw (collapsed) profile *raw* as text tables; returns (samples, text)."""
    own: collections.Counter[str] = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        files[_file_of(frames[-1])] += n
        for frame in set(frames):
            inclusive[frame] += n
    out = [f"samples {total}"]
    areas: collections.Counter[str] = collections.Counter()
    for file, n in files.items():
        areas[_area_of(file)] += n
    for title, counter, rows in (("self, by area", areas, len(AREAS) + 1),
                                 ("self, by file", files, file_rows),
                                 ("self, by function", own, self_rows),
                                 ("inclusive", inclusive, inclusive_rows)):
        out.append(f"== {title}")
        out += [f"{100 * n / max(total, 1):5.1f}% {name}" for name, n in counter.most_common(rows)]
    return total, "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.profile",
                                description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="connections")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--seconds", type=float, default=6.0, help="sampling time from go")
    p.add_argument("--admission", action="store_true", help="admission control on")
    p.add_argument("--transport", help="the HTTP client under the deliverer (bench.child "
                                       "--transport; default: what `receipts worker` builds)")
    p.add_argument("--out", type=Path, help="default bench/results/profile_<scenario>.txt")
    args = p.parse_args(argv)
    out = args.out or RESULTS / f"profile_{args.scenario}.txt"
    load = os.getloadavg()
    bench = Bench()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            raw_path = os.path.join(tmp, "profile.raw")
            result = scenarios.receipts_drain(
                bench, jobs=args.jobs, processes=1, admission=args.admission,
                profile=raw_path, profile_seconds=args.seconds, transport=args.transport,
                **SCENARIOS[args.scenario])
            raw = Path(raw_path).read_text() if os.path.exists(raw_path) else ""
    finally:
        bench.cleanup()
    samples, table = summarize(raw)
    header = [
        f"# py-spy (200 Hz, non-blocking, {args.seconds:g} s from go) of one receipts worker: "
        f"scenario {args.scenario} {SCENARIOS[args.scenario]}, {args.jobs:,} jobs, admission "
        f"control {'on' if args.admission else 'off'}.",
        f"# python -m bench.experiments.profile --scenario {args.scenario} --jobs {args.jobs}"
        f"{' --admission' if args.admission else ''}"
        f"{f' --transport {args.transport}' if args.transport else ''}",
        f"# {result['jobs_per_second']:,.0f} jobs/s, {result['worker_cpu_us_per_job']:.0f} µs of "
        f"worker CPU per job over the whole drain; load average at start "
        f"{tuple(round(x, 2) for x in load)}",
        "# 'inclusive' = share of samples with the frame anywhere on the stack.",
    ]
    text = "\n".join(header) + "\n" + table + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out} ({samples} samples)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
