"""The fleet-wide rate limit's accuracy with many pods, pods joining and pods killed.

``python -m bench.fleet_rate`` (``--pods 16 --limit 200 --seconds 60``): one
embedded PostgreSQL 18, the reference provider (``receipts provider``) and
``--pods`` ``receipts worker`` processes with
``RECEIPTS_PROVIDER_RATE_LIMIT_PER_SECOND`` = ``--limit`` and a backlog far
longer than the run, so the limit binds throughout. Each pod claims from its
own token bucket at the share the elected waker announces
(:mod:`receipts.ratelimit`). After a third of the run one more pod joins;
after two thirds one pod that is not the waker is killed with SIGKILL, and
with ``--kill-waker`` the waker is killed too (its failover: the others hear
nothing for ``receipts.waker.SILENT_SECONDS``, then elect a new one).

Reports what the provider received in every 10 s window from 2 s after the
first request (the first second spends the bucket's burst), as a share of
``--limit`` × 10, and ``receipt_flow``'s updates during the run (0 when every
claim charged a pod's own bucket). Writes ``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.pg import Bench
from receipts.embedded import free_port
from receipts.migrate import apply_migrations
from receipts.supervisor import Child, Supervisor


def _windows(times: list[float], start: float, end: float) -> list[int]:
    out, t = [], start
    while t + 10 <= end:
        out.append(sum(1 for x in times if t <= x < t + 10))
        t += 10
    return out


def _waker(workers: list[Child]) -> Child | None:
    for worker in workers:
        if worker.running and worker.scrape().value("receipts_waker_elected") == 1:
            return worker
    return None


def _flow_updates(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT n_tup_upd FROM pg_stat_user_tables"
                           " WHERE relname = 'receipt_flow'").fetchone()
    return int(row[0]) if row else 0


def run(*, pods: int, limit: float, seconds: float, kill_waker: bool,
        log: Any = print) -> dict[str, Any]:
    """One run (module doc); returns the windows and events."""
    bench = Bench()
    events: list[tuple[float, str]] = []
    try:
        dsn = bench.server.create_database("fleetrate")
        apply_migrations(dsn)
        backlog = int(limit * (seconds + 30))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO receipt_jobs (id, order_id) SELECT gen_random_uuid(),"
                         " 'rate-' || g FROM generate_series(1, %s) AS g", (backlog,))
        with Supervisor(stop_timeout_seconds=30.0) as sup:
            port = free_port()
            provider = sup.start("provider", ["provider", "--port", str(port)],
                                 port=port).wait_healthy()

            def start(i: int) -> Child:
                metrics = free_port()
                env = {"RECEIPTS_DATABASE_URL": dsn,
                       "RECEIPTS_PROVIDER_URL": provider.url("/receipts"),
                       "RECEIPTS_METRICS_PORT": str(metrics), "RECEIPTS_LOG_LEVEL": "WARNING",
                       "RECEIPTS_PROVIDER_RATE_LIMIT_PER_SECOND": repr(limit)}
                return sup.start(f"worker-{i}", ["worker"], env, port=metrics)

            workers = [start(i) for i in range(pods)]
            for w in workers:
                w.wait_healthy(timeout_seconds=120)
            updates_before = _flow_updates(dsn)
            while not provider.get_json("/answers"):
                time.sleep(0.1)
            first = min(t for t, _ in provider.get_json("/answers"))
            events.append((0.0, f"{pods} pods"))

            def at(offset: float) -> None:
                time.sleep(max(0.0, first + offset - time.monotonic()))

            at(seconds / 3)
            workers.append(start(pods))
            events.append((round(time.monotonic() - first, 1), "one pod joins"))
            at(2 * seconds / 3)
            waker = _waker(workers)
            victim = next(w for w in workers if w is not waker and w.running)
            victim.kill()
            events.append((round(time.monotonic() - first, 1), "a pod killed (SIGKILL)"))
            if kill_waker and waker is not None:
                time.sleep(5.0)
                waker.kill()
                events.append((round(time.monotonic() - first, 1), "the waker killed (SIGKILL)"))
            at(seconds + 2)
            times = sorted(t for t, _ in provider.get_json("/answers"))
            updates = _flow_updates(dsn) - updates_before
        windows = _windows(times, first + 2.0, first + 2.0 + seconds)
        shares = [round(w / (limit * 10), 3) for w in windows]
        doc = {"pods": pods, "limit_per_second": limit, "seconds": seconds,
               "kill_waker": kill_waker, "events": events, "windows": windows,
               "window_shares": shares, "receipt_flow_updates": updates,
               "within_10_percent": all(0.9 <= s <= 1.1 for s in shares)}
        log(f"{pods} pods, limit {limit:g}/s: per 10 s window {windows} "
            f"(share of the limit {shares}); receipt_flow updates {updates}; events {events}")
        return doc
    finally:
        bench.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_rate",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--pods", type=int, default=16)
    p.add_argument("--limit", type=float, default=200.0, help="jobs/s for the whole fleet")
    p.add_argument("--seconds", type=float, default=60.0, help="measured seconds")
    p.add_argument("--kill-waker", action="store_true", help="also kill the elected waker")
    p.add_argument("--out", type=Path, help="write the run as JSON")
    args = p.parse_args(argv)
    doc = run(pods=args.pods, limit=args.limit, seconds=args.seconds, kill_waker=args.kill_waker,
              log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if doc["within_10_percent"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
