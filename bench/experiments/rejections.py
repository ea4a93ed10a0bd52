"""Rejections judged on evidence, as a shop meets providers and order batches: the case
table of docs/design.md §11 ("Verdicts on evidence"), rerun with real processes.

Each case gets a fresh database, one reference provider process (``receipts
provider``, its behaviour switched at run time with ``PUT /faults``) and two
``receipts worker`` processes with the default settings (ports aside). Orders
whose id starts with ``bad-`` are genuinely invalid (the provider answers them
422 whenever it judges orders); the others are valid. The script prints one
line per case and writes the figures as JSON.

    python -m bench.experiments.rejections [--only NAME,...] [--out FILE]
    python -m bench.experiments.rejections --rates [--shares 0,10,60,95]
        [--latencies-ms 0,50] [--runs 3] [--orders N]

``--rates`` measures the price of invalid orders instead (:func:`rates`): a
batch of N orders at once, a share of them invalid, the provider answering
after a fixed latency; the valid orders' delivery rate against the rate of a
batch with none invalid, median of the interleaved runs.

What each figure means: ``failed_valid`` valid receipts failed for good (must be
0), ``failed_invalid`` invalid orders failed with their reason, ``held`` jobs
ready with a held rejection at the end, ``pauses`` rejecting pauses declared
(``receipts_provider_pauses_total{reason="rejecting"}`` over the workers),
``resumed_s`` first receipt after the provider healed, ``valid_s`` enqueue to
the last valid receipt, ``invalid_fail_s`` the slowest invalid order's enqueue
to failure.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg

from bench.pg import Bench
from bench.report import write_json
from receipts.embedded import free_port
from receipts.enqueue import enqueue_many
from receipts.supervisor import Child, Supervisor

WORKERS = 2
INVALID = "^bad-"


@dataclass
class Run:
    """One case's processes, database and observations."""

    dsn: str
    sup: Supervisor
    provider: Child
    workers: list[Child] = field(default_factory=list)
    paused_seen: float = 0.0  # seconds any worker reported a rejecting pause
    healed_at: float | None = None
    stopped: threading.Event = field(default_factory=threading.Event)

    def faults(self, **faults: Any) -> None:
        self.provider.request("PUT", "/faults", json=faults).raise_for_status()

    def enqueue(self, orders: list[str]) -> float:
        with psycopg.connect(self.dsn) as conn:
            enqueue_many(conn, orders)
        return time.monotonic()

    def trickle(self, orders: list[str], per_second: float) -> threading.Thread:
        def run() -> None:
            start = time.monotonic()
            for i, order in enumerate(orders):
                if self.stopped.wait(max(0.0, start + i / per_second - time.monotonic())):
                    return
                self.enqueue([order])
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def start_workers(self) -> None:
        for i in range(WORKERS):
            port = free_port()
            env = {"RECEIPTS_DATABASE_URL": self.dsn,
                   "RECEIPTS_PROVIDER_URL": self.provider.url("/receipts"),
                   "RECEIPTS_METRICS_PORT": str(port)}
            self.workers.append(self.sup.start(f"worker-{i}", ["worker"], env, port=port))
        for w in self.workers:
            w.wait_healthy()

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return conn.execute(sql).fetchall()

    def watch(self, seconds: float, until: Callable[[], bool] | None = None) -> None:
        """Observe for *seconds* (or until *until*), counting rejecting-pause time."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            step = time.monotonic()
            if any(w.scrape().value("receipts_provider_paused", reason="rejecting") == 1
                   for w in self.workers):
                self.paused_seen += 0.25
            if until is not None and until():
                return
            time.sleep(max(0.0, 0.25 - (time.monotonic() - step)))

    def heal(self) -> None:
        self.faults(reject_statuses=None, flap_seconds=0)
        self.healed_at = time.monotonic()

    def figures(self, enqueued_at: float | None = None) -> dict[str, Any]:
        (counts,) = self.rows(
            "SELECT count(*) FILTER (WHERE state = 'done' AND order_id NOT LIKE 'bad-%'),"
            " count(*) FILTER (WHERE state = 'failed' AND order_id NOT LIKE 'bad-%'),"
            " count(*) FILTER (WHERE state = 'failed' AND order_id LIKE 'bad-%'),"
            " count(*) FILTER (WHERE state = 'ready' AND last_error LIKE 'held rejection:%'),"
            " count(*) FILTER (WHERE state IN ('ready', 'running')),"
            " extract(epoch FROM max(finished_at - created_at) FILTER"
            "   (WHERE state = 'done' AND order_id NOT LIKE 'bad-%')),"
            " extract(epoch FROM max(finished_at - created_at) FILTER"
            "   (WHERE state = 'failed' AND order_id LIKE 'bad-%'))"
            " FROM receipt_jobs")
        done, failed_valid, failed_invalid, held, pending, valid_s, invalid_s = counts
        pauses = sum(w.scrape().value("receipts_provider_pauses_total", reason="rejecting")
                     for w in self.workers)
        out: dict[str, Any] = {
            "delivered_valid": done, "failed_valid": failed_valid,
            "failed_invalid": failed_invalid, "held": held, "pending": pending,
            "pauses": int(pauses), "paused_s": round(self.paused_seen, 1),
            "valid_s": None if valid_s is None else round(float(valid_s), 2),
            "invalid_fail_s": None if invalid_s is None else round(float(invalid_s), 2),
        }
        if self.healed_at is not None:
            after = [t for t, s in self.provider.get_json("/answers")
                     if s < 300 and t > self.healed_at]
            out["resumed_s"] = round(min(after) - self.healed_at, 2) if after else None
        return out


def _orders(n: int, invalid_share: float, rng: random.Random, prefix: str = "") -> list[str]:
    bad = set(rng.sample(range(n), round(n * invalid_share)))
    return [f"{'bad' if i in bad else 'ok'}-{prefix}{i}" for i in range(n)]


def reject_all(statuses: list[int], body: str) -> Callable[[Run], dict[str, Any]]:
    """200 orders queued; the provider rejects everything for 25 s, then heals."""
    def case(run: Run) -> dict[str, Any]:
        run.faults(reject_statuses=statuses, reject_body=body)
        run.enqueue([f"ok-{i}" for i in range(200)])
        run.start_workers()
        run.watch(25)
        during = run.figures()
        run.heal()
        run.watch(60, until=lambda: run.rows(
            "SELECT count(*) FROM receipt_jobs WHERE state IN ('ready', 'running')")[0][0] == 0)
        after = run.figures()
        return {"failed_while_rejecting": during["failed_valid"], **after}
    return case


def flapping(phase_seconds: float) -> Callable[[Run], dict[str, Any]]:
    """600 valid orders at 10/s while the provider rejects everything (bodies with ids
    and times) and accepts everything in turns of *phase_seconds*."""
    def case(run: Run) -> dict[str, Any]:
        run.faults(reject_statuses=[422], reject_body="json_ids", flap_seconds=phase_seconds)
        run.start_workers()
        thread = run.trickle([f"ok-{i}" for i in range(600)], 10.0)
        run.watch(62)
        thread.join()
        run.heal()
        run.watch(60, until=lambda: run.figures()["pending"] == 0)
        return run.figures()
    return case


def batch(invalid_share: float, traffic: float = 0.0) -> Callable[[Run], dict[str, Any]]:
    """400 orders at once, *invalid_share* of them invalid; with *traffic* > 0, the shop's
    ordinary valid orders keep coming at that rate (per second) beside the batch."""
    def case(run: Run) -> dict[str, Any]:
        rng = random.Random(7)
        run.faults(invalid_pattern=INVALID)
        run.start_workers()
        background = None
        if traffic:
            background = run.trickle([f"ok-t{i}" for i in range(int(traffic * 70))], traffic)
            time.sleep(2)
        orders = _orders(400, invalid_share, rng)
        run.enqueue(orders)
        n_bad = sum(o.startswith("bad-") for o in orders)

        def settled() -> bool:
            f = run.figures()
            return bool(f["failed_invalid"] == n_bad and f["delivered_valid"] >= 400 - n_bad)
        run.watch(60, until=settled)
        if background is not None:
            background.join(timeout=1)
        out = run.figures()
        valid = run.rows("SELECT extract(epoch FROM max(finished_at) - min(created_at))"
                         " FROM receipt_jobs WHERE state = 'done' AND order_id LIKE 'ok-%'"
                         " AND order_id NOT LIKE 'ok-t%'")[0][0]
        out["batch_valid_s"] = None if valid is None else round(float(valid), 2)
        out["invalid"] = n_bad
        return out
    return case


def trickle_onset(run: Run) -> dict[str, Any]:
    """2 orders/s over 2 pods; after 8 s the provider rejects everything (one body),
    for 20 s, then heals."""
    run.start_workers()
    thread = run.trickle([f"ok-{i}" for i in range(120)], 2.0)
    run.watch(8)
    run.faults(reject_statuses=[422], reject_body="json")
    run.watch(20)
    during = run.figures()
    run.heal()
    thread.join()
    run.watch(30, until=lambda: run.figures()["pending"] == 0)
    return {"failed_while_rejecting": during["failed_valid"], **run.figures()}


def _cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    """User + system CPU seconds so far of each group of processes (gone ones: 0)."""
    out: dict[str, float] = {}
    for group, members in pids.items():
        total = 0.0
        for pid in members:
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        out[group] = total
    return out


def drain(run: Run, orders: list[str], latency_seconds: float,
          server_pid: int | None = None) -> dict[str, Any]:
    """One batch of *orders* enqueued at once, the provider answering after
    *latency_seconds*; the figures once every valid order is delivered (at most
    300 s). The batch's time runs from the provider's first answer to its last
    acceptance (the enqueue and the invalid tail left out: the tail waits for
    orders after the batch, docs/design.md §11)."""
    run.faults(invalid_pattern=INVALID, latency_seconds=latency_seconds)
    run.start_workers()
    n_bad = sum(o.startswith("bad-") for o in orders)
    n_ok = len(orders) - n_bad
    run.enqueue(orders)
    pids = {"workers": [w.pid for w in run.workers], "provider": [run.provider.pid]}
    if server_pid is not None:
        pids["postgres"] = [p.pid for p in psutil.Process(server_pid).children()]
    cpu_before = _cpu_seconds(pids)
    run.watch(300, until=lambda: run.rows(
        "SELECT count(*) FROM receipt_jobs WHERE state = 'done'")[0][0] >= n_ok)
    cpu = {k: round(v - cpu_before[k], 2) for k, v in _cpu_seconds(pids).items()}
    out = run.figures()
    out["cpu_s"] = cpu
    answers = run.provider.get_json("/answers")
    first = min(t for t, _ in answers)
    last_ok = max(t for t, s in answers if s < 300)
    batch_s = last_ok - first
    out.update(orders=len(orders), invalid=n_bad, batch_s=round(batch_s, 3),
               requests=len(answers), valid_per_second=round(n_ok / batch_s, 1))
    return out


def rates(bench: Bench, shares: list[float], latencies: list[float], runs: int,
          orders: int | list[int]) -> dict[str, Any]:
    """The valid orders' delivery rate with a share of invalid orders beside them.

    For each provider latency (seconds) and invalid share (0–1), *runs* batches
    of *orders* orders (interleaved: run 1 of every pair, then run 2, ...; a
    fresh database and processes each). Returns, per latency and share, the
    runs and their medians: ``valid_per_second`` (valid orders over enqueue to
    the last valid receipt), ``ratio`` (that over the rate per order of the
    batch with none invalid), ``cost`` (what one invalid order costs, in valid
    deliveries: the drain's extra time over the time per order of the clean
    batch, per invalid order), ``requests`` (provider requests per batch),
    ``cpu_ms_per_order`` (each process group's CPU per order of the batch).
    *orders* is one count, or one per latency. Raises RuntimeError when a
    valid order failed.
    """
    import statistics
    rng = random.Random(7)
    table: dict[str, dict[str, Any]] = {}
    for r in range(runs):
        for i, latency in enumerate(latencies):
            n = orders[i] if isinstance(orders, list) else orders
            for share in shares:
                key = f"{round(latency * 1000)}ms/{round(share * 100)}pct"
                batch_orders = _orders(n, share, rng, prefix=f"{r}-")
                logs = Path(tempfile.mkdtemp(prefix=f"rejections-rate-{r}-"))
                with bench.database("rejections") as dsn, Supervisor(logs) as sup:
                    port = free_port()
                    provider = sup.start("provider", ["provider", "--port", str(port)],
                                         port=port)
                    provider.wait_healthy()
                    run = Run(dsn, sup, provider)
                    try:
                        figures = drain(run, batch_orders, latency, bench.server_pid())
                    finally:
                        run.stopped.set()
                if figures["failed_valid"]:
                    raise RuntimeError(f"{key} run {r} did not settle: {figures}; logs in {logs}")
                table.setdefault(key, {"latency_ms": latency * 1000, "share": share,
                                       "runs": []})["runs"].append(figures)
                print(f"{key:12s} run {r}: {json.dumps(figures)}", flush=True)
    cpu_key = "median_cpu_ms_per_order_"
    for key, entry in table.items():
        clean = table.get(f"{round(entry['latency_ms'])}ms/0pct")
        for figures in entry["runs"]:
            if clean is not None:
                n = figures["orders"]
                per_order = statistics.median(f["batch_s"] / f["orders"] for f in clean["runs"])
                figures["ratio"] = round(figures["valid_per_second"] * per_order, 3)
                n_bad = figures["invalid"]
                figures["cost"] = None if not n_bad else round(
                    (figures["batch_s"] / per_order - (n - n_bad)) / n_bad, 2)
            figures["cpu_ms_per_order"] = {
                k: round(v * 1000 / figures["orders"], 3) for k, v in figures["cpu_s"].items()}
        for group in entry["runs"][0]["cpu_ms_per_order"]:
            entry[f"median_cpu_ms_per_order_{group}"] = round(statistics.median(
                f["cpu_ms_per_order"][group] for f in entry["runs"]), 3)
        for name in ("valid_per_second", "ratio", "cost", "requests", "pauses", "batch_s",
                     "failed_invalid", "held"):
            values = [f[name] for f in entry["runs"] if f.get(name) is not None]
            if values:
                entry[f"median_{name}"] = round(statistics.median(values), 3)
        print(f"{key:12s} median valid/s {entry.get('median_valid_per_second')}"
              f" ratio {entry.get('median_ratio')} cost {entry.get('median_cost')}"
              f" requests {entry.get('median_requests')} pauses {entry.get('median_pauses')}"
              f" cpu ms/order {[(k, v) for k, v in entry.items() if k.startswith(cpu_key)]}",
              flush=True)
    return table


CASES: dict[str, Callable[[Run], dict[str, Any]]] = {
    "reject_all_422_ids_and_times": reject_all([422], "json_ids"),
    "reject_all_rotating_400_404_422": reject_all([400, 404, 422], "json"),
    "reject_all_html_pages": reject_all([400], "html"),
    "reject_all_rotating_400_401_403": reject_all([400, 401, 403], "json"),
    "flapping_10s": flapping(10.0),
    "flapping_5s": flapping(5.0),
    "batch_0pct_invalid": batch(0.0),
    "batch_10pct_invalid": batch(0.10),
    "batch_30pct_invalid": batch(0.30),
    "batch_60pct_invalid": batch(0.60),
    "batch_90pct_invalid": batch(0.90),
    "batch_95pct_invalid": batch(0.95),
    "batch_60pct_invalid_with_traffic": batch(0.60, traffic=5.0),
    "batch_90pct_invalid_with_traffic": batch(0.90, traffic=5.0),
    "batch_95pct_invalid_with_traffic": batch(0.95, traffic=5.0),
    "trickle_then_reject_all": trickle_onset,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--out", default=f"bench/results/rejections-{time.strftime('%Y-%m-%d')}"
                        ".json")
    parser.add_argument("--rates", action="store_true",
                        help="measure the valid orders' rate beside invalid ones")
    parser.add_argument("--shares", default="0,10,60,95", help="invalid shares, percent")
    parser.add_argument("--latencies-ms", default="0,50", help="provider latencies, ms")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--orders", default="12000,6000",
                        help="orders per batch, one count or one per latency")
    args = parser.parse_args()
    if args.rates:
        bench = Bench()
        try:
            table = rates(bench, [float(x) / 100 for x in args.shares.split(",")],
                          [float(x) / 1000 for x in args.latencies_ms.split(",")],
                          args.runs, [int(x) for x in args.orders.split(",")])
        finally:
            bench.cleanup()
        out = args.out.replace("rejections-", "rejections-rates-")
        write_json({"workers": WORKERS, "settings": "defaults", "orders": args.orders,
                    "shares_pct": args.shares, "latencies_ms": args.latencies_ms,
                    "rates": table}, Path(out))
        return
    names = args.only.split(",") if args.only else list(CASES)
    bench = Bench()
    results: dict[str, Any] = {}
    try:
        for name in names:
            logs = Path(tempfile.mkdtemp(prefix=f"rejections-{name}-"))
            with bench.database("rejections") as dsn, Supervisor(logs) as sup:
                port = free_port()
                provider = sup.start("provider", ["provider", "--port", str(port)], port=port)
                provider.wait_healthy()
                started = time.monotonic()
                run = Run(dsn, sup, provider)
                try:
                    results[name] = CASES[name](run)
                except Exception:
                    print(f"{name} failed; the processes' logs are in {logs}", file=sys.stderr)
                    raise
                finally:
                    run.stopped.set()
                results[name]["case_s"] = round(time.monotonic() - started, 1)
                print(f"{name:36s} {json.dumps(results[name])}", flush=True)
    finally:
        bench.cleanup()
    write_json({"workers": WORKERS, "settings": "defaults", "cases": results}, Path(args.out))


if __name__ == "__main__":
    main()
