"""Where a delivery slot's cycle goes: ``python -m bench.experiments.cycle``.

Runs the ``connections`` drain (one worker, 400 slots, claim batch 100,
reference provider at 200 ms, admission control off, 20,000 jobs) on a fresh
durable embedded PostgreSQL, scrapes the worker's ``/metrics`` when the queue
is empty, and prints per run:

* the drain rate and the slot cycle it implies (slots / rate, Little's law);
* the provider call as the worker timed it
  (``receipts_delivery_duration_seconds`` mean): the provider's sleep plus
  its own and the loopback's lag;
* the claim and ack statements (``receipts_db_statement_duration_seconds``
  mean and count) and jobs per claim;
* the worker's CPU per delivery.

Cycle − provider call = the time a slot waits between the end of one
delivery and the start of the next (the claim statement, the claim linger,
the drain's ramp and tail). Options: ``--runs`` (default 2), ``--jobs``,
``--slots``, ``--latency-ms``.

``--transports aiohttp,httpx`` compares HTTP clients under the deliverer
(``bench.child --transport``): each run drains once per transport, in
A B, then B A order (A B B A …, so a machine that speeds up or slows down
during the runs favours neither), and the end prints each one's median CPU
per delivery and drain rate, and their ratios to the first.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.pg import Bench
from bench.scenarios import receipts_drain


def one_run(bench: Bench, *, jobs: int, slots: int, latency_ms: float,
            transport: str | None = None) -> dict[str, Any]:
    """One drain (:func:`bench.scenarios.receipts_drain`, its ``/metrics`` scraped at
    the end); returns its figures (milliseconds where named ``_ms``)."""
    drain = receipts_drain(bench, jobs=jobs, concurrency=slots, batch=100,
                           provider_latency_ms=latency_ms, admission=False, scrape=True,
                           transport=transport)
    samples = drain["samples"]
    rate = drain["jobs_per_second"]
    call_sum = samples.total("receipts_delivery_duration_seconds_sum")
    call_count = samples.total("receipts_delivery_duration_seconds_count")
    sums = samples.by_label("receipts_db_statement_duration_seconds_sum", "statement")
    counts = samples.by_label("receipts_db_statement_duration_seconds_count", "statement")
    claims = samples.total("receipts_claims_total")
    return {
        "jobs_per_second": rate,
        "cycle_ms": slots / rate * 1000,
        "provider_call_ms": call_sum / call_count * 1000 if call_count else None,
        "jobs_per_claim": samples.total("receipts_jobs_claimed_total") / claims if claims else None,
        "statements": {name: {"mean_ms": sums[name] / n * 1000, "count": int(n)}
                       for name, n in counts.items() if n},
        "worker_cpu_us_per_job": drain["worker_cpu_us_per_job"],
        "not_done": drain["not_done"],
    }


def _line(r: dict[str, Any]) -> str:
    statements = ", ".join(f"{name} {v['mean_ms']:.2f} ms × {v['count']:,}"
                           for name, v in sorted(r["statements"].items()))
    return (f"{r['jobs_per_second']:,.0f} deliveries/s; cycle {r['cycle_ms']:.1f} ms, "
            f"provider call {r['provider_call_ms']:.1f} ms; {r['jobs_per_claim']:.1f} "
            f"jobs per claim; {statements}; worker CPU "
            f"{r['worker_cpu_us_per_job']:.0f} µs/delivery")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.cycle",
                                description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--slots", type=int, default=400)
    p.add_argument("--latency-ms", type=float, default=200.0)
    p.add_argument("--transports", default="",
                   help="comma-separated HTTP clients to compare, interleaved "
                        "(bench.child --transport); default: what `receipts worker` builds")
    args = p.parse_args(argv)
    transports: list[str | None] = [t for t in args.transports.split(",") if t] or [None]
    results: dict[str | None, list[dict[str, Any]]] = {t: [] for t in transports}
    bench = Bench()
    try:
        for run in range(args.runs):
            for transport in (transports if run % 2 == 0 else transports[::-1]):
                r = one_run(bench, jobs=args.jobs, slots=args.slots,
                            latency_ms=args.latency_ms, transport=transport)
                results[transport].append(r)
                label = f"[{transport}] " if transport else ""
                print(label + _line(r), flush=True)
    finally:
        bench.cleanup()
    if len(transports) > 1:
        first = transports[0]
        base_cpu = statistics.median(r["worker_cpu_us_per_job"] for r in results[first])
        base_rate = statistics.median(r["jobs_per_second"] for r in results[first])
        for transport in transports:
            cpu = statistics.median(r["worker_cpu_us_per_job"] for r in results[transport])
            rate = statistics.median(r["jobs_per_second"] for r in results[transport])
            print(f"{transport}: median {cpu:.0f} µs/delivery ({cpu / base_cpu:.2f}× {first}), "
                  f"{rate:,.0f} deliveries/s ({rate / base_rate:.2f}×), "
                  f"{len(results[transport])} runs", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
