"""The KEDA signal with adaptive concurrency, as the chart renders it, on a real PostgreSQL 18:
while the live pods' adaptive limits are held below their slots (the provider is the
bottleneck), KEDA asks for no more pods than those limits can use plus the headroom, however
deep the backlog; otherwise (limits at their most, none heard, adaptation off) the signal is
unchanged. The replica counts are KEDA's formula applied to the query's value. The
external-metric HPA's PromQL recording rule carries the same cap: promtool evaluates it on
the workers' gauges (the second half of this file)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import psycopg
import pytest
import yaml
from chartkit import CHART, KSM_RULES_FILE, crd_schema, find_tool, one, render, run

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


# ------------------------------------------------- the external-metric HPA (PromQL)
#
# autoscaling.hpa.metric external: the chart's PrometheusRule records the signal the
# External metrics adapter serves (receipts.externalMetricRules), with the same cap as the
# KEDA query. promtool evaluates the rendered rule on the workers' gauges; the replica
# counts are the HPA's formula (AverageValue: ceil(value / target)) applied to its value.

HPA_EXTERNAL = CHART / "ci" / "hpa-external-values.yaml"  # 32 slots, target 25, max 8
HPA_SLOTS, HPA_TARGET, HPA_MAX = 32, 25, 8
SERIES = "namespace_job:receipts_jobs_due_or_in_flight:capped"
POD = 'job="receipts",namespace="shop",pod="w-{}"'


def external_rules(*sets: str) -> list[dict[str, Any]]:
    """The rules of the rendered PrometheusRule's receipts-autoscaling group ([] if none);
    the PrometheusRule checked against prometheus-operator's CRD schema."""
    docs = render((HPA_EXTERNAL,), ("prometheusOperator.enabled=true", *sets))
    rule = one(docs, "PrometheusRule")
    errors = list(jsonschema.Draft7Validator(crd_schema(rule["apiVersion"], rule["kind"]))
                  .iter_errors(rule))
    assert not errors, [e.message for e in errors]
    groups = rule["spec"]["groups"]
    found = [g["rules"] for g in groups if g["name"] == "receipts-autoscaling"]
    return found[0] if found else []


def hpa_replicas(value: float) -> int:
    """The HPA's answer for the External metric's value (AverageValue), within min..max."""
    return max(2, min(HPA_MAX, math.ceil(value / HPA_TARGET)))


def fleet(limits: list[int], ready: int = 1000, ceiling: int = HPA_SLOTS,
          gone: tuple[int, ...] = ()) -> list[dict[str, str]]:
    """Input series of a fleet of pods, one per limit, each with its limits full and the
    same due-jobs gauge; a pod in *gone* stops being scraped after 5 minutes."""
    series = []
    for i, limit in enumerate(limits):
        samples = "{}x5" if i in gone else "{}x30"
        for name, v in (("receipts_concurrency_limit", limit),
                        ("receipts_concurrency_ceiling", ceiling if limit else 0),
                        ("receipts_concurrency_slots", HPA_SLOTS),
                        ("receipts_inflight_deliveries", limit or HPA_SLOTS),
                        ("receipts_ready_jobs", ready)):
            series.append({"series": f"{name}{{{POD.format(i)}}}",
                           "values": samples.format(v)})
    return series


def promtool_values(tmp_path: Path, rules: list[dict[str, Any]],
                    cases: list[tuple[str, list[dict[str, str]], float | None]]) -> None:
    """promtool unit tests of *rules*: each case's fleet gives the recorded value at 20m
    (None: no sample at all, the HPA holds)."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(
        {"groups": [{"name": "receipts-autoscaling", "rules": rules}]}))
    tests = [{"name": name, "interval": "1m", "input_series": series,
              "promql_expr_test": [{
                  "expr": SERIES, "eval_time": "20m",
                  "exp_samples": [] if value is None else [
                      {"labels": f'{SERIES}{{job="receipts",namespace="shop"}}',
                       "value": value}]}]}
             for name, series, value in cases]
    (tmp_path / "rules.test.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}))
    result = run([find_tool("promtool"), "test", "rules", "rules.test.yaml"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_external_metric_rule_carries_the_cap_only_with_adaptation() -> None:
    (capped,) = external_rules("config.adaptiveConcurrency=true")
    assert capped["record"] == SERIES
    for part in ('receipts_concurrency_limit{job="receipts"} > 0',
                 f"/ {HPA_SLOTS}) + 1) * {HPA_TARGET}", 'receipts_ready_jobs{job="receipts"}'):
        assert part in capped["expr"]
    (plain,) = external_rules()
    assert plain["record"] == SERIES  # the same series: the adapter's rule never changes
    assert "receipts_concurrency_limit" not in plain["expr"]
    # The ceiling below the slots is the most a pod may have in flight (as in the KEDA query).
    (low,) = external_rules("config.adaptiveConcurrency=true",
                            "config.adaptiveConcurrencyCeiling=16")
    assert f"/ 16) + 1) * {HPA_TARGET}" in low["expr"]
    # Every alert disabled: the recording rule stays, alone in the PrometheusRule.
    alerts = [r["alert"] for g in yaml.safe_load(KSM_RULES_FILE.read_text())["groups"]
              for r in g["rules"]]
    assert external_rules("alerts.kubeStateMetrics=true",
                          f"alerts.disabled={{{','.join(alerts)}}}") == [plain]
    # Only the external-metric HPA reads it: not KEDA, not the CPU HPA.
    assert external_rules("autoscaling.hpa.metric=cpu") == []
    assert external_rules("autoscaling.keda.enabled=true") == []


@pytest.mark.parametrize("limits,pods", [
    # 4 pods held at 2, 2, 3, 1 (sum 8): ceil(8 / 32) + 1 = 2 pods, not 8.
    ([2, 2, 3, 1], 2),
    # 10 pods at 5 each (sum 50): ceil(50 / 32) + 1 = 3 pods.
    ([5] * 10, 3),
    # one pod held at the floor: 1 + 1.
    ([1], 2),
])
def test_the_external_metric_asks_for_what_the_held_limits_can_use(
        tmp_path, limits, pods):
    capped, = external_rules("config.adaptiveConcurrency=true")
    plain, = external_rules()
    value = pods * HPA_TARGET
    promtool_values(tmp_path / "capped", [capped], [("held", fleet(limits), value)])
    backlog = 1000 + sum(limits)
    promtool_values(tmp_path / "plain", [plain], [("off", fleet(limits), backlog)])
    assert hpa_replicas(value) == pods and hpa_replicas(backlog) == HPA_MAX
    print(f"\n[capacity] external metric, limits {limits}: the HPA asks for {pods} pods"
          f" with the cap, {HPA_MAX} without")


def test_the_external_metric_is_uncapped_unless_a_live_pod_is_held(tmp_path) -> None:
    capped, = external_rules("config.adaptiveConcurrency=true")
    promtool_values(tmp_path, [capped], [
        # Every pod at its slots: the slots, not the provider, bound the fleet: scale out.
        ("at the slots", fleet([HPA_SLOTS, HPA_SLOTS]), 1000 + 2 * HPA_SLOTS),
        # Adaptation off in the pods (limit 0) reads as no limit at all.
        ("off in the pods", fleet([0, 0]), 1000 + 2 * HPA_SLOTS),
        # A held pod no longer scraped (gone) does not count.
        ("held pod gone", fleet([HPA_SLOTS, 1], gone=(1,)), 1000 + HPA_SLOTS),
        # A backlog the held limits can take: the value is the backlog's.
        ("shallow backlog", fleet([2, 2, 3, 1], ready=10), 18),
        # Stale queue statistics (no due-jobs gauge): no value, the HPA holds.
        ("stale statistics", [s for s in fleet([2, 2, 3, 1])
                              if not s["series"].startswith("receipts_ready_jobs")], None),
    ])


def test_the_external_metric_headroom_is_keda_s_value(tmp_path) -> None:
    capped, = external_rules("config.adaptiveConcurrency=true",
                             "autoscaling.keda.capacityHeadroomPods=3")
    promtool_values(tmp_path, [capped], [("headroom 3", fleet([2, 2]), 4 * HPA_TARGET)])
    assert hpa_replicas(4 * HPA_TARGET) == 4
