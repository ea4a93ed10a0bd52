"""Rejections judged on evidence, as a shop meets providers and order batches: the case
table of docs/design.md §11 ("Verdicts on evidence"), rerun with real processes.

Each case gets a fresh database, one reference provider process (``receipts
provider``, its behaviour switched at run time with ``PUT /faults``) and two
``receipts worker`` processes with the default settings (ports aside). Orders
whose id starts with ``bad-`` are genuinely invalid (the provider answers them
422 whenever it judges orders); the others are valid. The script prints one
line per case and writes the figures as JSON.

    python -m bench.experiments.rejections [--only NAME,...] [--out FILE]

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
    args = parser.parse_args()
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
