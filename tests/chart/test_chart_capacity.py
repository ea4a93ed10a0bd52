"""The KEDA signal with adaptive concurrency, as the chart renders it, on a real PostgreSQL 18:
while the live pods' adaptive limits are held below their slots (the provider is the
bottleneck), KEDA asks for no more pods than those limits can use plus the headroom, however
deep the backlog; otherwise (limits at their most, none heard, adaptation off) the signal is
unchanged. The replica counts are KEDA's formula applied to the query's value."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import yaml
from chartkit import one, render

from tests.conftest import Server

SLOTS, TARGET, MAX_REPLICAS = 8, 6, 20  # target: floor(8 × 0.75)


def rendered(tmp_path: Path, adaptive: bool, **keda: object) -> str:
    values = tmp_path / f"capacity-{adaptive}.yaml"
    values.write_text(yaml.safe_dump({
        "config": {"concurrency": SLOTS, "maxAttempts": 5, "adaptiveConcurrency": adaptive},
        "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": MAX_REPLICAS,
                        "keda": {"enabled": True, "utilisation": 0.75, **keda}},
        "connectionBudget": {"maxConnections": 100},
    }))
    (trigger,) = one(render((values,)), "ScaledObject")["spec"]["triggers"]
    assert trigger["metadata"]["targetQueryValue"] == str(TARGET)
    query: str = trigger["metadata"]["query"]
    return query


def replicas(metric: float) -> int:
    """KEDA's answer for one sample (AverageValue), clamped to maxReplicas."""
    return min(MAX_REPLICAS, math.ceil(metric / TARGET))


@pytest.fixture(scope="module")
def backlog(pg18: Server) -> Iterator[psycopg.Connection]:
    """A database with 1,000 due ready jobs (far more than any fleet takes at once)."""
    dsn = pg18.new_database()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO receipt_jobs (id, order_id) SELECT gen_random_uuid(),"
                     " 'c-' || g FROM generate_series(1, 1000) AS g")
        yield conn
    pg18.drop_database(dsn)


def workers(conn: psycopg.Connection, *rows: tuple[int | None, float]) -> None:
    """Replace the heartbeat rows: (concurrency_limit, seconds since heard) each."""
    conn.execute("DELETE FROM receipt_workers")
    for i, (limit, age) in enumerate(rows):
        conn.execute(
            "INSERT INTO receipt_workers (tag, pod, slots, inflight, seen_at, concurrency_limit)"
            " VALUES (%s, %s, %s, 0, statement_timestamp() - make_interval(secs => %s), %s)",
            (f"{i:08x}", f"pod-{i}", SLOTS, age, limit))


def value(conn: psycopg.Connection, query: str) -> int:
    row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("limits,expected", [
    # 4 pods held at 2, 2, 3, 1 (sum 8): ceil(8 / 8) + 1 = 2 pods, not 20.
    ([2, 2, 3, 1], 2),
    # 10 pods at 5 each (sum 50): ceil(50 / 8) + 1 = 8 pods.
    ([5] * 10, 8),
    # one pod held at the floor: 1 + 1.
    ([1], 2),
])
def test_a_fleet_held_by_the_provider_asks_for_what_its_limits_can_use(
        backlog, tmp_path, limits, expected):
    capped, plain = rendered(tmp_path, True), rendered(tmp_path, False)
    workers(backlog, *((limit, 5.0) for limit in limits))
    assert replicas(value(backlog, capped)) == expected
    assert replicas(value(backlog, plain)) == MAX_REPLICAS  # without the cap: the maximum
    assert "receipt_workers" not in plain
    print(f"\n[capacity] limits {limits}: KEDA asks for {expected} pods with the cap,"
          f" {MAX_REPLICAS} without")


def test_the_headroom_is_a_value(backlog, tmp_path):
    workers(backlog, (2, 5.0), (2, 5.0))
    assert replicas(value(backlog, rendered(tmp_path, True, capacityHeadroomPods=3))) == 4


def test_no_cap_while_no_live_pod_is_held(backlog, tmp_path):
    capped = rendered(tmp_path, True)
    # Every pod at its slots: the slots, not the provider, bound the fleet: scale out.
    workers(backlog, (SLOTS, 5.0), (SLOTS, 5.0))
    assert replicas(value(backlog, capped)) == MAX_REPLICAS
    # A held pod not heard for two minutes (gone) does not count; nor a pod without a limit.
    workers(backlog, (SLOTS, 5.0), (1, 120.0), (None, 5.0))
    assert replicas(value(backlog, capped)) == MAX_REPLICAS
    # No workers at all (scaled to zero): the backlog wakes the fleet as before.
    workers(backlog)
    assert value(backlog, capped) == value(backlog, rendered(tmp_path, False))


def test_a_paused_provider_still_wins_over_the_cap(backlog, tmp_path):
    capped = rendered(tmp_path, True)
    workers(backlog, (2, 5.0), (2, 5.0))
    backlog.execute("UPDATE receipt_flow SET pause_reason = 'outage',"
                    " paused_until = now() + interval '1 minute'")
    try:
        assert value(backlog, capped) == 1  # no job running: one pod to see the pause end
    finally:
        backlog.execute("UPDATE receipt_flow SET pause_reason = NULL, paused_until = NULL")
