"""Adaptive concurrency against a provider of fixed capacity: pods × adaptation on/off, and
a step change of the capacity.

``python -m bench.experiments.capacity`` (``--pods 1,2,4 --capacity 16 --seconds 30
--slots 32 --latency 0.05 --step``): one embedded PostgreSQL 18, the reference provider
(``receipts provider``) with a concurrency capacity C (a request beyond it is answered
503 at once, or 429, or slowed: ``--answer``) and a latency per request, and
``--pods`` ``receipts worker`` processes of ``--slots`` slots each, with
``RECEIPTS_ADAPTIVE_CONCURRENCY`` on and then off, draining a backlog longer than the run.
``--adaptive oracle`` adds the best a static setting could do: adaptation off, and the
slots of the fleet set to exactly C (C split as evenly as the pods allow, at least one
each), which only someone who knew C could choose. Its throughput is what this machine's
pods deliver with C in flight and never a refusal, so adaptive ÷ oracle is the share
the limiter itself gives away, apart from the pods' own turnover.

For each run it reports, from ``--warmup`` seconds after the first answer to the end:
the load each request found at the provider on arrival (itself included: mean, p95,
max, as a multiple of C), receipts per second as a share of what C allows
(C ÷ latency), the share of 503s among all answers, the fleet pauses, and the pods
KEDA's signal asks for at the end with the capacity cap (ceil(sum of the live pods'
limits ÷ slots) + 1, when a limit is below the slots) and without it (the backlog
asks for the most, 10 pods).

``--step``: one more run per setting with the last pod count, C halved at a third of
the run and restored at two thirds; prints a timeline in 2 s windows and how long the
fleet took to follow (the load back within 1.1 × C/2 and the window's 503s ≤ 5 %) and
to recover (receipts/s ≥ 0.9 of what the restored C allows). Writes ``--out`` (JSON)
when given.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.pg import Bench
from receipts.embedded import free_port
from receipts.supervisor import Child, Supervisor

WINDOW_SECONDS = 2.0


def _pct(values: list[int], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))])


def _keda(dsn: str, slots: int, max_replicas: int) -> tuple[int, int]:
    """(pods with the capacity cap, pods without it) for a backlog deeper than the fleet."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT concurrency_limit FROM receipt_workers WHERE stopped_at IS NULL"
            " AND seen_at > statement_timestamp() - interval '60 seconds'"
            " AND concurrency_limit IS NOT NULL").fetchall()
    limits = [min(slots, int(n)) for (n,) in rows]
    if limits and any(n < slots for n in limits):
        return min(max_replicas, math.ceil(sum(limits) / slots) + 1), max_replicas
    return max_replicas, max_replicas


def oracle_slots(pods: int, capacity: int) -> list[int]:
    """Slots per pod that add up to *capacity* (at least 1 each): the oracle's setting."""
    return [max(1, capacity // pods + (1 if i < capacity % pods else 0)) for i in range(pods)]


def run(bench: Bench, *, pods: int, capacity: int, adaptive: bool, seconds: float,
        slots: int, latency: float, warmup: float, step: bool,
        max_replicas: int = 10, answer: str = "503", oracle: bool = False) -> dict[str, Any]:
    """One run (module doc) on a fresh database of *bench*'s server; returns its figures.

    *oracle*: adaptation off and the pods' slots from :func:`oracle_slots` (*slots*
    ignored)."""
    dsn = bench.new_database("capacity")
    try:
        backlog = int(capacity / latency * (seconds + 30))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO receipt_jobs (id, order_id) SELECT gen_random_uuid(),"
                         " 'cap-' || g FROM generate_series(1, %s) AS g", (backlog,))
        with Supervisor(stop_timeout_seconds=30.0) as sup:
            port = free_port()
            provider = sup.start("provider", ["provider", "--port", str(port)],
                                 port=port).wait_healthy()
            provider.request("PUT", "/faults", json={
                "latency_seconds": latency, "capacity": capacity,
                "capacity_answer": answer}).raise_for_status()
            workers: list[Child] = []
            per_pod = oracle_slots(pods, capacity) if oracle else [slots] * pods
            for i in range(pods):
                metrics = free_port()
                env = {"RECEIPTS_DATABASE_URL": dsn,
                       "RECEIPTS_PROVIDER_URL": provider.url("/receipts"),
                       "RECEIPTS_METRICS_PORT": str(metrics), "RECEIPTS_LOG_LEVEL": "WARNING",
                       "RECEIPTS_CONCURRENCY": str(per_pod[i]),
                       "RECEIPTS_ADAPTIVE_CONCURRENCY": "true" if adaptive else "false",
                       "RECEIPTS_RETRY_BASE_SECONDS": "0.2", "RECEIPTS_RETRY_CAP_SECONDS": "1"}
                workers.append(sup.start(f"worker-{i}", ["worker"], env, port=metrics))
            for w in workers:
                w.wait_healthy(timeout_seconds=60)
            started = time.monotonic()
            events: list[tuple[float, int]] = []
            if step:
                time.sleep(seconds / 3)
                events.append((time.monotonic(), capacity // 2))
                provider.request("PUT", "/faults", json={"capacity": capacity // 2})
                time.sleep(seconds / 3)
                events.append((time.monotonic(), capacity))
                provider.request("PUT", "/faults", json={"capacity": capacity})
                time.sleep(max(0.0, started + seconds - time.monotonic()))
            else:
                time.sleep(seconds)
            ended = time.monotonic()
            keda = _keda(dsn, slots, max_replicas)
            pauses = sum(w.scrape().total("receipts_provider_pauses_total") for w in workers)
            limits = [w.scrape().value("receipts_concurrency_limit") for w in workers]
            decreases = {signal: sum(w.scrape().value(
                "receipts_concurrency_limit_decreases_total", signal=signal) for w in workers)
                for signal in ("overload", "latency")}
            answers = [(float(t), int(s)) for t, s in provider.get_json(
                "/answers", timeout_seconds=30)]
            loads = [(float(t), int(n)) for t, n in provider.get_json(
                "/loads", timeout_seconds=30)]
    finally:
        bench.drop_database(dsn)
    first = answers[0][0] if answers else started
    start = first + warmup
    steady = [s for t, s in answers if start <= t <= ended]
    arrived = [n for t, n in loads if start <= t <= ended]
    ok = sum(1 for s in steady if s == 201)
    last = max((t for t, s in answers if s == 201), default=first)
    refused = sum(1 for s in steady if s in (429, 503))
    result: dict[str, Any] = {
        "pods": pods, "capacity": capacity, "adaptive": adaptive, "oracle": oracle,
        "slots": sum(per_pod) if oracle else slots,
        "answer": answer,
        "latency": latency, "seconds": round(ended - start, 1),
        "load_mean": statistics.fmean(arrived) if arrived else math.nan,
        "load_p95": _pct(arrived, 0.95), "load_max": max(arrived, default=0),
        "throughput": ok / max(1e-9, ended - start),
        "allowed": capacity / latency, "refused_share": refused / max(1, len(steady)),
        "answers": len(steady), "pauses": pauses, "limits_at_end": limits,
        "decreases": decreases, "last_receipt_s": round(last - first, 1),
        "run_s": round(ended - first, 1),
        "keda_pods_capped": keda[0], "keda_pods_uncapped": keda[1],
    }
    if step:
        result["timeline"] = _timeline(answers, loads, first, ended, events, capacity, latency)
    return result


def _timeline(answers: list[tuple[float, int]], loads: list[tuple[float, int]], first: float,
              ended: float, events: list[tuple[float, int]], capacity: int,
              latency: float) -> dict[str, Any]:
    """2 s windows of the step run, and the follow and recovery times (seconds)."""
    rows = []
    t = first
    while t + WINDOW_SECONDS <= ended:
        window = [s for a, s in answers if t <= a < t + WINDOW_SECONDS]
        arrived = [n for a, n in loads if t <= a < t + WINDOW_SECONDS]
        c = capacity
        for at, value in events:
            if at <= t + WINDOW_SECONDS / 2:
                c = value
        rows.append({
            "t": round(t - first, 1), "capacity": c,
            "receipts_per_second": sum(1 for s in window if s == 201) / WINDOW_SECONDS,
            "load_mean": statistics.fmean(arrived) if arrived else 0.0,
            "refused_share": sum(1 for s in window if s in (429, 503)) / max(1, len(window)),
        })
        t += WINDOW_SECONDS
    halved_at, restored_at = events[0][0] - first, events[1][0] - first
    # The steady rate before the step (after a warm-up of 4 s): what "recovered" means.
    before = [r["receipts_per_second"] for r in rows if 4 <= r["t"] < halved_at - WINDOW_SECONDS]
    steady = statistics.median(before) if before else capacity / latency
    follow = next((r["t"] + WINDOW_SECONDS - halved_at for r in rows
                   if r["t"] >= halved_at and r["receipts_per_second"] > 0
                   and r["load_mean"] <= 1.1 * capacity // 2
                   and r["refused_share"] <= 0.05), None)
    recover = next((r["t"] + WINDOW_SECONDS - restored_at for r in rows
                    if r["t"] >= restored_at and r["receipts_per_second"] >= 0.9 * steady
                    and steady > 0), None)
    return {"windows": rows, "halved_at": round(halved_at, 1),
            "steady_before": steady,
            "restored_at": round(restored_at, 1), "follow_seconds": follow,
            "recover_seconds": recover}


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f}s"


def _row(r: dict[str, Any]) -> str:
    c = r["capacity"]
    mode = "oracle" if r.get("oracle") else "on" if r["adaptive"] else "off"
    of_oracle = (f"{r['throughput'] / r['oracle_throughput']:.2f}"
                 if r.get("oracle_throughput") else "")
    return (f"| {r['pods']} | {c} | {mode} | "
            f"{r['load_mean'] / c:.2f} / {r['load_p95'] / c:.2f} / {r['load_max'] / c:.2f} | "
            f"{r['throughput']:.0f} ({r['throughput'] / r['allowed']:.2f}) | {of_oracle} | "
            f"{100 * r['refused_share']:.1f} % of {r['answers']} | {r['pauses']:g} | "
            f"{r['keda_pods_capped']} / {r['keda_pods_uncapped']} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.capacity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", default="1,2,4", help="pod counts, comma-separated")
    parser.add_argument("--capacity", type=int, default=16, help="the provider's capacity C")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each run")
    parser.add_argument("--warmup", type=float, default=8.0,
                        help="seconds after the first answer left out (convergence)")
    parser.add_argument("--slots", type=int, default=32, help="RECEIPTS_CONCURRENCY per pod")
    parser.add_argument("--latency", type=float, default=0.05,
                        help="the provider's seconds per request")
    parser.add_argument("--step", action="store_true",
                        help="also a run with C halved at a third and restored at two thirds")
    parser.add_argument("--step-seconds", type=float, default=90.0,
                        help="length of the step run")
    parser.add_argument("--adaptive", default="on,off",
                        help="comma-separated runs per pod count: on, off, oracle (module doc)")
    parser.add_argument("--answer", choices=("503", "429", "latency"), default="503",
                        help="what the provider answers beyond its capacity (capacity_answer)")
    parser.add_argument("--out", type=Path, help="write the figures here (JSON)")
    args = parser.parse_args(argv)
    try:
        pods = [int(p) for p in args.pods.split(",")]
    except ValueError:
        parser.error(f"--pods takes pod counts, comma-separated, not {args.pods!r}")
    if any(not 1 <= n <= 64 for n in pods):
        parser.error("--pods: each pod count is from 1 to 64 (worker processes on this machine)")
    if args.capacity > 1_000_000:
        parser.error("--capacity is at most 1,000,000 (the reference provider's own limit)")
    if args.out is not None and not args.out.parent.is_dir():
        parser.error(f"--out: no folder {str(args.out.parent)!r} to write into")
    for name in ("capacity", "seconds", "slots", "latency", "step_seconds"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be above 0")
    if not 0 <= args.warmup < args.seconds:
        parser.error("--warmup must be from 0 to less than --seconds")
    modes = list(dict.fromkeys(args.adaptive.split(",")))
    if not modes or any(m not in ("on", "off", "oracle") for m in modes):
        parser.error(f"--adaptive takes on, off and oracle, comma-separated, not {args.adaptive!r}")
    results: list[dict[str, Any]] = []
    # A SIGTERM (timeout, a CI job's end) unwinds like Ctrl-C: the finally blocks stop the
    # provider, the workers and the database instead of leaving them to init.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench = Bench()
    try:
        _runs(bench, args, pods, modes, results)
    finally:
        bench.cleanup()
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


def _runs(bench: Bench, args: argparse.Namespace, pods: list[int], modes: list[str],
          results: list[dict[str, Any]]) -> None:
    print("| pods | C | adaptive | load mean / p95 / max (× C) | receipts/s (× C/latency) "
          "| × oracle | 429/503 | fleet pauses | KEDA pods capped / uncapped |")
    print("|---|---|---|---|---|---|---|---|---|")
    # The oracle first, so that the other rows of the pod count can be read against it.
    ordered = sorted(modes, key=lambda m: m != "oracle")
    for n in pods:
        oracle_throughput = None
        for mode in ordered:
            r = run(bench, pods=n, capacity=args.capacity, adaptive=mode == "on",
                    seconds=args.seconds, slots=args.slots, latency=args.latency,
                    warmup=args.warmup, step=False, answer=args.answer,
                    oracle=mode == "oracle")
            if mode == "oracle":
                oracle_throughput = r["throughput"]
            elif oracle_throughput:
                r["oracle_throughput"] = oracle_throughput
            results.append(r)
            print(_row(r), flush=True)
    if args.step:
        for adaptive in (m == "on" for m in modes if m != "oracle"):
            r = run(bench, pods=pods[-1], capacity=args.capacity, adaptive=adaptive,
                    seconds=args.step_seconds, slots=args.slots, latency=args.latency,
                    warmup=args.warmup, step=True, answer=args.answer)
            results.append(r)
            tl = r["timeline"]
            print(f"\nstep, {pods[-1]} pods, adaptive {'on' if adaptive else 'off'}: C "
                  f"{args.capacity} -> {args.capacity // 2} at {tl['halved_at']}s -> "
                  f"{args.capacity} at {tl['restored_at']}s; followed in "
                  f"{_s(tl['follow_seconds'])}, recovered (0.9 of the rate before the step, "
                  f"{tl['steady_before']:.0f}/s) in {_s(tl['recover_seconds'])}")
            print("| t (s) | C | receipts/s | load mean | 429/503 |")
            print("|---|---|---|---|---|")
            for w in tl["windows"]:
                print(f"| {w['t']:.0f} | {w['capacity']} | {w['receipts_per_second']:.0f} | "
                      f"{w['load_mean']:.1f} | {100 * w['refused_share']:.0f} % |")


if __name__ == "__main__":
    sys.exit(main())
