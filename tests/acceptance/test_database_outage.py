"""A long database outage, with real worker processes and a real PostgreSQL server that is
stopped and started again: the workers are ready within seconds of its return, and their
queue gauges leave the scrape while they cannot be read (no alert fires on a frozen value)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from receipts.embedded import EmbeddedPostgres, free_port
from receipts.migrate import apply_migrations
from receipts.supervisor import Child, Supervisor
from tests.conftest import enqueue_many, fetch_rows

#: How long the database stays down, seconds: long enough for every backoff on the way
#: back to reach its cap (the claim loop's 1 s while the server is unreachable, the
#: outcome writes' 5 s, the pool's 4 s reconnection window), several times over.
OUTAGE_SECONDS = 40.0
#: The queue gauges' read interval in this test, seconds (they go stale after three).
STATS_INTERVAL_SECONDS = 2


def until(predicate: Callable[[], bool], what: str, timeout_seconds: float,
          poll_seconds: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_seconds:g}s: {what}"
        time.sleep(poll_seconds)


@pytest.fixture
def own_server() -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL 18 server of this test's own: the test stops it."""
    pg = EmbeddedPostgres(fast=True)
    pg.start()
    try:
        yield pg
    finally:
        pg.cleanup()


def ready(worker: Child) -> bool:
    try:
        return worker.request("GET", "/readyz", timeout_seconds=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_workers_are_ready_soon_after_a_long_database_outage_and_hide_frozen_gauges(
        own_server, tmp_path):
    dsn = own_server.create_database("outage")
    apply_migrations(dsn)
    enqueue_many(dsn, [f"order-{i}" for i in range(100)])
    with Supervisor(tmp_path) as sup:
        port = free_port()
        provider = sup.start("provider", ["provider", "--port", str(port)], port=port)
        provider.wait_healthy()
        workers = []
        for i in range(2):
            metrics_port = free_port()
            env = {"RECEIPTS_DATABASE_URL": dsn,
                   "RECEIPTS_PROVIDER_URL": provider.url("/receipts"),
                   "RECEIPTS_METRICS_PORT": str(metrics_port),
                   "RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS": str(STATS_INTERVAL_SECONDS),
                   # Leases that outlive the outage: the acks written when it ends land.
                   "RECEIPTS_LEASE_SECONDS": str(2 * OUTAGE_SECONDS)}
            workers.append(sup.start(f"worker-{i}", ["worker"], env, port=metrics_port))
        for w in workers:
            w.wait_healthy()
        until(lambda: fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs"
                                      " WHERE state = 'done'") == [(100,)], "the jobs done", 60)
        until(lambda: all(ready(w) and ("receipts_ready_jobs", ()) in w.scrape()
                          for w in workers), "workers ready, gauges read", 30)
        # Deliveries in flight when the database goes: their acks wait through the outage,
        # and a worker is ready only once they are written too.
        provider.request("PUT", "/faults", json={"latency_seconds": 3}).raise_for_status()
        enqueue_many(dsn, [f"order-slow-{i}" for i in range(20)])
        until(lambda: sum(w.scrape().value("receipts_inflight_deliveries") for w in workers)
              >= 10, "deliveries in flight", 30)

        own_server.stop()
        down_at = time.monotonic()
        until(lambda: not any(ready(w) for w in workers), "workers not ready", 30)
        # Three stats intervals after the last read, the queue gauges are gone; the time of
        # that last read stays.
        until(lambda: all(("receipts_ready_jobs", ()) not in w.scrape() for w in workers),
              "the queue gauges to leave the scrape", 3 * STATS_INTERVAL_SECONDS * 1.2 + 5)
        for w in workers:
            samples = w.scrape()
            assert ("receipts_queue_stats_timestamp_seconds", ()) in samples
            assert not any(name in {"receipts_queue_lag_seconds", "receipts_expired_leases",
                                    "receipts_jobs", "receipts_table_dead_tuples"}
                           for name, _ in samples)
        time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - down_at)))
        failures = [w.scrape().value("receipts_db_errors_total", statement="claim")
                    for w in workers]

        own_server.start()
        back_at = time.monotonic()
        ready_after: dict[str, float] = {}

        def all_ready() -> bool:
            for w in workers:
                if w.name not in ready_after and ready(w):
                    ready_after[w.name] = time.monotonic() - back_at
            return len(ready_after) == len(workers)

        until(all_ready, "workers ready again", 60, poll_seconds=0.05)
        print(f"\n[figures] database down {OUTAGE_SECONDS:g}s ({min(failures):g}+ failed claims "
              f"per worker): /readyz 200 again after "
              + ", ".join(f"{s:.2f}s" for s in sorted(ready_after.values())))
        # The claim loop's backoff had reached its cap: 0.1, 0.2, 0.4, 0.8, then 1 s (each
        # failed claim also waits out the pool's own connection attempt).
        assert min(failures) >= 5
        assert max(ready_after.values()) <= 5.0
        writes = [w.scrape().by_label("receipts_db_errors_total", "statement").get("ack", 0)
                  for w in workers]
        assert sum(writes) > 0  # the acks of the deliveries in flight had been waiting
        enqueue_many(dsn, [f"order-after-{i}" for i in range(50)])
        until(lambda: fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs"
                                      " WHERE state = 'done'") == [(170,)],
              "every job delivered, those in flight during the outage included", 60)
        until(lambda: all(("receipts_ready_jobs", ()) in w.scrape() for w in workers),
              "the queue gauges back", 3 * STATS_INTERVAL_SECONDS + 5)
