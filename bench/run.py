"""The benchmark command: ``python -m bench.run`` (or ``bench/run.sh``).

One durable embedded PostgreSQL 18, every scenario once per round, rounds
interleaved (A B C … A B C …), the median and min–max of each figure over
the rounds, one table on stdout and the same as JSON (``--out``).

``--smoke`` is the reduced version the CI test runs: one round, small sizes,
peers only when installed; its figures mean nothing, it proves the command
works end to end.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import bill, peers, raw, report, scenarios, soak
from bench.pg import Bench

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest.json"


@dataclass
class Plan:
    """Sizes of one benchmark run."""

    rounds: int = 3
    jobs: int = 100_000
    http_jobs: int = 20_000
    slow_http_jobs: int = 20_000
    pgbench_seconds: int = 4
    pgbench_batches: tuple[int, ...] = (1, 10, 100)
    pgbench_clients: tuple[int, ...] = (1, 4, 8, 16)
    receipts_processes: tuple[int, ...] = (1, 2)
    receipts_concurrency: int = 500
    pickup_jobs: int = 1_000
    pickup_rate: float = 100.0
    scale_done: int = 1_000_000
    scale_ready: int = 100_000
    claims: int = 1_000
    updated: int = 200_000
    checkout_seconds: float = 5.0
    checkout_rate: float = 100.0
    vacuum_wait_seconds: float = 75.0
    checkout_admission_seconds: float = 20.0
    checkout_admission_jobs: int = 400_000
    outage_jobs: int = 1_000
    outage_seconds: float = 60.0
    rate_limit_per_second: float = 200.0
    rate_limit_seconds: float = 20.0
    rate_limit_window_seconds: float = 5.0
    bill_jobs: int = 100_000
    bill_latency_jobs: int = 20_000
    bill_idle_seconds: float = 20.0
    bill_steady_seconds: float = 15.0
    bill_processes: tuple[int, ...] = (1, 4, 16)
    #: The bill's rows beyond raw and the plain drains (200 ms, failures,
    #: admission, maintenance); the smoke run leaves them out.
    bill_every_row: bool = True
    peers: dict[str, str | None] = field(default_factory=peers.available)

    @classmethod
    def smoke(cls) -> Plan:
        return cls(rounds=1, jobs=2_000, http_jobs=500, slow_http_jobs=800, pgbench_seconds=1,
                   pgbench_batches=(1, 100), pgbench_clients=(1, 4), receipts_processes=(1,),
                   receipts_concurrency=100, pickup_jobs=40, pickup_rate=100.0,
                   scale_done=20_000, scale_ready=2_000, claims=50, updated=2_000,
                   checkout_seconds=1.0, checkout_rate=50.0, vacuum_wait_seconds=1.0,
                   checkout_admission_seconds=2.0, checkout_admission_jobs=20_000,
                   outage_jobs=1_000, outage_seconds=5.0, rate_limit_seconds=4.0,
                   rate_limit_window_seconds=1.0, bill_jobs=4_000, bill_latency_jobs=1_000,
                   bill_idle_seconds=0.0, bill_steady_seconds=0.0, bill_processes=(1,),
                   bill_every_row=False)


def _fill_for(batch: int, seconds: int) -> int:
    """Ready jobs for one pgbench run: more than the statements can take in time."""
    per_second = {1: 6_000, 10: 25_000}.get(batch, 60_000)
    return per_second * seconds


def run_round(bench: Bench, plan: Plan, results: dict[str, list[Any]], only: set[str],
              first: bool = True) -> None:
    def record(key: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        if only and key.split(":")[0] not in only:
            return
        t0 = time.monotonic()
        print(f"  {key} …", end="", flush=True, file=sys.stderr)
        value = fn(*args, **kwargs)
        print(f" {time.monotonic() - t0:.1f}s", flush=True, file=sys.stderr)
        results.setdefault(key, []).append(value)

    for batch in plan.pgbench_batches:
        for clients in plan.pgbench_clients:
            record(f"raw:{batch}:{clients}", raw.run_pgbench, bench, batch=batch,
                   clients=clients, seconds=plan.pgbench_seconds,
                   fill=_fill_for(batch, plan.pgbench_seconds))
    # Capacity drains run with admission control off: they measure what a
    # worker can do; "admission" shows what the default allows.
    for n in plan.receipts_processes:
        record(f"receipts:noop:{n}", scenarios.receipts_drain, bench, jobs=plan.jobs,
               processes=n, concurrency=plan.receipts_concurrency, batch=100,
               admission=False)
    if plan.peers.get("pgqueuer"):
        # PgQueuer's own benchmark (tools/benchmark.py): asyncpg, uvloop, 5
        # consumers of batch 10; and the same with batch 100 (receipts' batch).
        for batch in (10, 100):
            record(f"pgqueuer:{batch}", scenarios.peer_drain, bench, "pgqueuer",
                   jobs=plan.jobs, consumers=5, batch=batch, drain=True)
    if plan.peers.get("procrastinate"):
        record("procrastinate", scenarios.peer_drain, bench, "procrastinate", jobs=plan.jobs,
               concurrency=10, drain=True, delete_jobs=True)
    record("receipts:http0", scenarios.receipts_drain, bench, jobs=plan.http_jobs,
           processes=1, concurrency=100, batch=100, provider_latency_ms=0, admission=False)
    record("connections", scenarios.receipts_drain, bench, jobs=plan.slow_http_jobs,
           processes=1, concurrency=400, batch=100, provider_latency_ms=200, admission=False)
    record("admission", scenarios.receipts_drain, bench,
           jobs=max(plan.slow_http_jobs // 4, 200), processes=1, concurrency=400, batch=100,
           provider_latency_ms=200, admission=True)
    for mode in scenarios.PICKUP_MODES:
        record(f"pickup:receipts:{mode}", scenarios.receipts_pickup,
               bench, jobs=plan.pickup_jobs, rate=plan.pickup_rate, mode=mode)
    for peer in peers.PEERS:
        if plan.peers.get(peer):
            record(f"pickup:{peer}", scenarios.peer_pickup, bench, peer,
                   jobs=plan.pickup_jobs, rate=plan.pickup_rate)
    if (not only or "claim" in only) and bench.scale_template is None:
        # Built once per run (1.1 M rows), cloned per round.
        bench.scale_template = scenarios.build_scale_template(
            bench, done=plan.scale_done, ready=plan.scale_ready)
    record("claim", scenarios.claim_cost, bench,
           template=bench.scale_template or "", claims=plan.claims,
           baseline_ready=plan.scale_ready, updated=plan.updated)
    if first:
        # Once per run: it waits one autovacuum naptime (60 s) for both clones.
        record("vacuum", scenarios.vacuum_after_update, bench,
               template=bench.scale_template or "", updated=plan.updated, claims=plan.claims,
               wait_seconds=plan.vacuum_wait_seconds)
    # Idle; full speed (the drain configuration, admission off); then the default
    # settings with admission control off and on (the checkout goal, limit traced).
    record("checkout", scenarios.checkout_impact, bench, drain_jobs=2 * max(plan.jobs, 2_000),
           seconds=plan.checkout_seconds, rate=plan.checkout_rate, processes=1,
           concurrency=plan.receipts_concurrency,
           phases=scenarios.checkout_phases(
               full_speed_concurrency=plan.receipts_concurrency,
               full_speed_seconds=plan.checkout_seconds,
               full_speed_jobs=2 * max(plan.jobs, 2_000),
               seconds=plan.checkout_admission_seconds, jobs=plan.checkout_admission_jobs))
    if first:
        # Once per run: each is a minute or more of mostly waiting (the outage,
        # the rate-limited windows); the default-settings checkout phases above
        # replace the former 32-slot row.
        record("outage", scenarios.outage, bench, jobs=plan.outage_jobs,
               outage_seconds=plan.outage_seconds)
        record("ratelimit:accuracy", scenarios.rate_limit_accuracy, bench,
               limit_per_second=plan.rate_limit_per_second, processes=2,
               seconds=plan.rate_limit_seconds, window_seconds=plan.rate_limit_window_seconds)
    record("ratelimit:overhead", scenarios.rate_limit_overhead, bench,
           seconds=plan.pgbench_seconds, batch=100, clients=8, contention_clients=(1, 8))
    # The database's bill per job (bench.bill): raw vs 1/4/16 processes, idle, steady.
    every = plan.bill_every_row
    for key, fn in bill.rows(jobs=plan.bill_jobs, processes=plan.bill_processes,
                             delay_jobs=plan.bill_latency_jobs,
                             idle_seconds=plan.bill_idle_seconds,
                             steady_seconds=plan.bill_steady_seconds,
                             admission_on=every, delay_ms=200.0 if every else 0.0,
                             fail_percent=3.0 if every else 0.0, maintenance=every):
        record(f"bill:{key}", fn, bench)


def machine() -> dict[str, Any]:
    """What the numbers were taken on."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg(),
        "commit": commit,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 3)")
    p.add_argument("--jobs", type=int, help="jobs per drain (default 100,000)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round (CI)")
    p.add_argument("--only", default="", help="comma-separated scenario keys (raw, receipts, "
                   "pgqueuer, procrastinate, connections, admission, pickup, claim, checkout, "
                   "outage, ratelimit, bill, soak)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default bench/results/latest.json; --smoke: none)")
    p.add_argument("--hours", type=float, default=2.0,
                   help="--only soak: how long the soak runs (default 2; --smoke: 5 min)")
    args = p.parse_args(argv)
    only_keys = {s for s in args.only.split(",") if s}
    if "soak" in only_keys:
        # The soak (bench/soak.py) is a run of its own: hours, its own server and folder.
        rc = soak.main(["--smoke"] if args.smoke else ["--hours", str(args.hours)])
        if only_keys == {"soak"}:
            return rc
        args.only = ",".join(sorted(only_keys - {"soak"}))
    plan = Plan.smoke() if args.smoke else Plan()
    if args.rounds:
        plan.rounds = args.rounds
    if args.jobs:
        plan.jobs = args.jobs
    only = {s for s in args.only.split(",") if s}
    out = args.out if args.out is not None else (None if args.smoke else DEFAULT_OUT)

    started = datetime.now(UTC)
    info = machine()
    bench = Bench()
    results: dict[str, list[Any]] = {}
    try:
        info["postgres"] = bench.durability()
        for n in range(plan.rounds):
            print(f"round {n + 1}/{plan.rounds}", file=sys.stderr, flush=True)
            run_round(bench, plan, results, only, first=n == 0)
    finally:
        bench.cleanup()
    info["load_average_at_end"] = os.getloadavg()
    doc = report.build(results, plan=plan.__dict__, machine=info, started=started,
                       finished=datetime.now(UTC))
    print(report.table(doc))
    if out:
        report.write_json(doc, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
