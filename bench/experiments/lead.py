"""Pickup under a fleet rate limit that binds each pod's share: the waker's leading share.

``python -m bench.experiments.lead --baseline-src DIR`` (``--rounds``, ``--jobs``,
``--rates``, ``--pods``, ``--limit``, ``--delay-ms``; ``--smoke``).

The waker's pod leads with a larger share of the rate limit while its slots' share
alone would hand new work to the other pods (docs/design.md, "A leading share"). A
limit that binds each pod's share, but not the fleet's, is where that rule could
hurt pickup: the pods the waker wakes for the rest hold smaller shares. The case a
new user's trial found for an earlier rule: 4 worker processes, a fleet limit of
20 jobs/s (5/s each by slots), deliveries of 20 ms × U(0.5, 1.5), jobs enqueued one
per transaction as a Poisson process at 8 and 12 per second
(:func:`bench.scenarios.receipts_pickup`: enqueue commit → delivery start).

Each run gets a fresh database; this checkout's worker and the one in
``--baseline-src`` (an older checkout's ``src``) alternate, A B B A, with the same
arrival times per round. Prints p50 and p99 per rate and
worker (medians of the rounds); writes every run to ``--out`` (JSON). ``--smoke``: 40
jobs, one round, whatever ``--jobs`` and ``--rounds`` say.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.pg import Bench
from bench.report import write_json
from bench.run import machine
from bench.scenarios import receipts_pickup

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "results" / "lead.json"


def _positive_rates(text: str) -> list[float]:
    """``--rates``: comma-separated arrival rates, each a positive number of jobs/s."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not rates or any(not 0 < r < 10_000 for r in rates):
        raise argparse.ArgumentTypeError("each rate must be above 0 and below 10,000 jobs/s")
    return rates


def _at_least(low: float, kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a number of *kind* that is at least *low*."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low:g}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.lead",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--baseline-src", type=Path, help="an older checkout's src folder (B)")
    p.add_argument("--rounds", type=_at_least(1, int), default=2)
    p.add_argument("--jobs", type=_at_least(1, int), default=600, help="jobs per run")
    p.add_argument("--rates", type=_positive_rates, default=[8.0, 12.0],
                   help="arrival rates, jobs/s, comma-separated (default 8,12)")
    p.add_argument("--pods", type=_at_least(1, int), default=4)
    p.add_argument("--limit", type=_at_least(0.1, float), default=20.0,
                   help="the fleet's rate limit, jobs/s")
    p.add_argument("--delay-ms", type=_at_least(0, float), default=20.0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes; figures meaningless")
    p.add_argument("--out", type=Path, help=f"JSON output (default {DEFAULT_OUT}; --smoke: none)")
    args = p.parse_args(argv)
    if args.baseline_src and not (args.baseline_src / "receipts" / "__init__.py").is_file():
        p.error(f"--baseline-src {args.baseline_src}: no receipts package there"
                " (give an older checkout's src folder)")
    jobs, rounds = (40, 1) if args.smoke else (int(args.jobs), int(args.rounds))
    rates: list[float] = args.rates
    workers: list[tuple[str, Path | None]] = [("this", None)]
    if args.baseline_src:
        workers.append(("baseline", args.baseline_src))
    bench = Bench()
    runs: list[dict[str, Any]] = []
    try:
        for n in range(rounds):
            for rate in rates:
                order = workers if n % 2 == 0 else list(reversed(workers))
                for name, src in order:
                    t = time.monotonic()
                    out = receipts_pickup(bench, jobs=jobs, rate=rate, processes=int(args.pods),
                                          rate_limit=args.limit, delay_ms=args.delay_ms,
                                          seed=1000 * n + int(rate), src=src)
                    out.update(worker=name, round=n + 1)
                    runs.append(out)
                    print(f"  round {n + 1} {rate:g}/s {name:<8} p50 {out['p50_ms']:6.1f} ms"
                          f"  p99 {out['p99_ms']:6.1f} ms  ({time.monotonic() - t:.0f} s)",
                          flush=True)
    finally:
        bench.cleanup()
    print(f"\n{'rate':>6} {'worker':<9}{'p50 ms':>8}{'p99 ms':>8}  runs")
    for rate in rates:
        for name, _ in workers:
            rs = [r for r in runs if r["rate"] == rate and r["worker"] == name]
            print(f"{rate:>6g} {name:<9}{statistics.median(r['p50_ms'] for r in rs):>8.1f}"
                  f"{statistics.median(r['p99_ms'] for r in rs):>8.1f}  {len(rs)}")
    if args.out or not args.smoke:
        write_json({"at": datetime.now(UTC).isoformat(timespec="seconds"),
                    "machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                    "runs": runs}, args.out or DEFAULT_OUT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
