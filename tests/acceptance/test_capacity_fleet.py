"""Adaptive concurrency across a fleet: real worker processes against a real provider of
capacity C, on PostgreSQL.

Three ``receipts worker`` processes with 16 slots each (48 in all, six times C) and
adaptive concurrency on drain a backlog from ``receipts provider`` with a capacity of
C = 8 concurrent requests, beyond which it answers 503 at once. Once the limits have
converged, the provider's load stays near C and 503s are a small share of its answers,
where the slots alone would send it six times what it can take.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import pytest

from receipts.supervisor import Child
from tests.acceptance.test_flow_fleet import answers, set_faults, start_workers, states, until
from tests.conftest import check_invariants, enqueue_many, fetch_rows

CAPACITY, LATENCY_SECONDS, JOBS = 8, 0.05, 3000
#: Answers before this many seconds after the first one are the convergence.
CONVERGE_SECONDS = 8.0


@pytest.fixture
def dsn(pg18) -> Iterator[str]:
    database = pg18.new_database()
    yield database
    pg18.drop_database(database)


def loads(provider: Child) -> list[tuple[float, int]]:
    return [(t, n) for t, n in provider.get_json("/loads")]


@pytest.mark.slow
def test_a_fleet_with_adaptive_concurrency_holds_the_provider_near_its_capacity(
        dsn, sup, provider):
    enqueue_many(dsn, [f"order-{i}" for i in range(JOBS)])
    set_faults(provider, latency_seconds=LATENCY_SECONDS, capacity=CAPACITY,
               capacity_answer="503")
    workers = start_workers(sup, dsn, provider, 3, concurrency="16",
                            adaptive_concurrency="true", retry_base_seconds="0.2",
                            retry_cap_seconds="1")
    began = time.monotonic()
    until(lambda: states(dsn).get("done", 0) >= JOBS * 0.9, "90 % of the jobs delivered", 180)
    took = time.monotonic() - began
    limits = [w.scrape().value("receipts_concurrency_limit") for w in workers]
    pauses = sum(w.scrape().total("receipts_provider_pauses_total") for w in workers)
    until(lambda: states(dsn).get("done", 0) == JOBS, "every job delivered", 120)
    check_invariants(dsn, 5)

    seen = answers(provider)
    start = seen[0][0] + CONVERGE_SECONDS
    end = max(t for t, s in seen if s == 201) - 1.0  # before the queue ran dry
    steady = [s for t, s in seen if start <= t <= end]
    arrivals = sorted(n for t, n in loads(provider) if start <= t <= end)
    assert len(steady) > 500, "too short a steady state to judge"
    refused = sum(1 for s in steady if s == 503) / len(steady)
    delivered = sum(1 for s in steady if s == 201) / (end - start)
    allowed = CAPACITY / LATENCY_SECONDS
    p95 = arrivals[int(0.95 * (len(arrivals) - 1))]
    mean_load = statistics.fmean(arrivals)
    reported = [n for (n,) in fetch_rows(
        dsn, "SELECT concurrency_limit FROM receipt_workers WHERE concurrency_limit IS NOT NULL")]
    print(f"\n[figures] capacity {CAPACITY}, 3 pods x 16 slots, adaptive on: steady "
          f"{end - start:.1f}s, load at arrival mean {mean_load:.1f} p95 {p95} max "
          f"{arrivals[-1]}; 503s {100 * refused:.1f}% of {len(steady)} answers; "
          f"{delivered:.0f} receipts/s of the {allowed:.0f}/s C allows; limits at 90 % "
          f"{limits}; fleet pauses {pauses:g}; heartbeat limits {reported}; 90 % in {took:.1f}s")
    assert p95 <= 1.3 * CAPACITY, (p95, mean_load)
    assert refused <= 0.04, refused  # measured 0.7 % (2.1-2.5 % before the increase was shared)
    assert delivered >= 0.6 * allowed, delivered  # measured 0.91
    assert all(1 <= n <= 16 for n in limits) and sum(limits) <= 3 * CAPACITY, limits
    assert reported and all(1 <= n <= 16 for n in reported), reported
