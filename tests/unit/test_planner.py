"""The capacity planner: Little's law, the bench's CPU per delivery, the chart's budget rule."""

from __future__ import annotations

import math

import pytest
import yaml

from receipts.cli import main
from receipts.planner import (
    DB_CEILING_BATCHED_JOBS_PER_SECOND,
    HTTP_DELIVERY_CPU_SECONDS,
    MAX_CONCURRENCY,
    MEMORY_LIMIT_HEADROOM,
    POD_CPU_CORES,
    WORKER_RSS_BASE_BYTES,
    WORKER_RSS_PER_SLOT_BYTES,
    Plan,
    PlanError,
    describe,
    helm_values,
    plan,
)


def test_in_flight_is_rate_times_latency() -> None:
    assert plan(2_000, 0.2).in_flight == pytest.approx(400)
    assert plan(40, 0.05).in_flight == pytest.approx(2)


def test_a_small_rate_needs_the_minimum_fleet() -> None:
    p = plan(40, 0.2)
    assert (p.pods_for_cpu, p.pods_for_slots) == (1, 1)
    assert (p.min_replicas, p.max_replicas) == (2, 3)
    assert p.concurrency == 10  # 8 in flight / 0.8
    assert p.keda_target == 8
    assert p.shards == 1


#: A fixed CPU figure for the arithmetic below (the default follows the bench).
CPU = 580e-6


def test_cpu_decides_the_pods_when_the_provider_is_fast() -> None:
    p = plan(2_000, 0.2, cpu_per_delivery_seconds=CPU)
    cores = 2_000 * CPU
    assert p.worker_cpu_cores == pytest.approx(cores)
    assert p.pods_for_cpu == math.ceil(cores / POD_CPU_CORES) == 2
    # The slots follow the pods: each pod carries its share of the 400 in flight at 80 %.
    assert p.concurrency == 250 and p.keda_target == 200
    # At the planned rate KEDA's formula asks for exactly the pods planned.
    assert math.ceil(p.in_flight / p.keda_target) == p.pods_for_cpu
    assert p.max_replicas == 3  # + a quarter, at least one pod


def test_slots_decide_the_pods_when_the_provider_is_slow() -> None:
    p = plan(500, 10.0)  # 5,000 in flight, 6,250 slots
    assert p.pods_for_slots == math.ceil(6_250 / MAX_CONCURRENCY) == 13
    assert p.pods_for_slots > p.pods_for_cpu
    assert p.concurrency <= MAX_CONCURRENCY
    assert p.concurrency * p.pods_for_slots * p.utilisation >= p.in_flight


@pytest.mark.parametrize(("rate", "latency"), [
    (1, 0.2), (0.01, 0.05), (40, 0.2), (2_000, 0.2), (500, 10.0), (50_000, 0.2)])
def test_the_autoscaler_can_always_add_a_pod(rate: float, latency: float) -> None:
    # min = max would be a ScaledObject that never scales but holds a budget connection.
    p = plan(rate, latency)
    assert p.min_replicas < p.max_replicas
    assert p.max_replicas >= max(p.pods_for_cpu, p.pods_for_slots) + 1


MIB = 1024 * 1024


@pytest.mark.parametrize(("rate", "latency"), [(1, 0.2), (2_000, 0.2), (500, 10.0)])
def test_memory_follows_the_slots_by_the_benchs_figures(rate: float, latency: float) -> None:
    p = plan(rate, latency)
    measured = WORKER_RSS_BASE_BYTES + WORKER_RSS_PER_SLOT_BYTES * p.concurrency
    assert measured <= p.memory_request_bytes < measured + 16 * MIB
    assert p.memory_limit_bytes >= MEMORY_LIMIT_HEADROOM * measured
    assert p.memory_request_bytes % (16 * MIB) == p.memory_limit_bytes % (16 * MIB) == 0
    values = yaml.safe_load(helm_values(p))["worker"]["resources"]
    assert values["requests"]["memory"] == f"{p.memory_request_bytes // MIB}Mi"
    assert values["limits"]["memory"] == f"{p.memory_limit_bytes // MIB}Mi"


def test_more_slots_need_more_memory() -> None:
    small, large = plan(40, 0.2), plan(2_000, 0.2)
    assert small.concurrency < large.concurrency
    assert small.memory_limit_bytes <= large.memory_limit_bytes


def test_the_planners_memory_figures_are_the_benchs_latest() -> None:
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "bench" / "results" / "memory.json"
    summary = json.loads(results.read_text())["summary"]
    assert {"32", "400", "1000"} <= set(summary["by_slots"])  # measured where plans go
    assert summary["model"]["base_bytes"] == WORKER_RSS_BASE_BYTES
    assert summary["model"]["per_slot_bytes"] == WORKER_RSS_PER_SLOT_BYTES


def test_connections_follow_the_chart_budget_rule() -> None:
    p = plan(2_000, 0.2, cpu_per_delivery_seconds=CPU)
    # (max replicas + 1 draining) × (pool 2 + listener 1) + recovery + migration + KEDA.
    assert p.connections == (3 + 1) * 3 + 3


def test_past_half_a_database_the_queue_is_sharded() -> None:
    p = plan(50_000, 0.2)
    assert p.shards == 2 and p.release_rate == 25_000
    assert p.db_share == pytest.approx(25_000 / DB_CEILING_BATCHED_JOBS_PER_SECOND)
    assert p.db_share <= 0.5
    # The fleet figures are one release's.
    assert p.worker_cpu_cores == pytest.approx(25_000 * HTTP_DELIVERY_CPU_SECONDS)
    # A database measured at twice the bench's ceiling carries it alone.
    assert plan(50_000, 0.2, db_ceiling=2 * DB_CEILING_BATCHED_JOBS_PER_SECOND).shards == 1


def test_utilisation_sets_the_headroom_in_slots() -> None:
    assert plan(100, 1.0, utilisation=1.0).concurrency == 100
    assert plan(100, 1.0, utilisation=0.5).concurrency == 200


def test_helm_values_are_valid_yaml_with_the_plan_s_numbers() -> None:
    p = plan(2_000, 0.2, cpu_per_delivery_seconds=CPU)
    values = yaml.safe_load(helm_values(p))
    assert values["config"]["concurrency"] == p.concurrency
    assert values["autoscaling"]["minReplicas"] == p.min_replicas
    assert values["autoscaling"]["maxReplicas"] == p.max_replicas
    assert values["autoscaling"]["keda"] == {"enabled": True, "utilisation": 0.8}
    assert values["connectionBudget"]["maxConnections"] == p.connections
    assert values["worker"]["resources"]["requests"]["cpu"] == "600m"  # 1.16 cores / 2, up


@pytest.mark.parametrize(
    ("rate", "latency", "utilisation", "complaint"),
    [
        (0, 1, 0.8, "--rate"),
        (-5, 1, 0.8, "--rate"),
        (math.inf, 1, 0.8, "--rate"),
        (10, math.nan, 0.8, "--latency"),
        (10, 0, 0.8, "--latency"),
        (10, 1, 0, "--utilisation"),
        (10, 1, 1.5, "--utilisation"),
    ],
)
def test_bad_input_is_refused_naming_the_option(rate: float, latency: float,
                                                utilisation: float, complaint: str) -> None:
    with pytest.raises(PlanError, match=complaint):
        plan(rate, latency, utilisation=utilisation)


def test_describe_shows_every_figure_and_the_values() -> None:
    text = describe(plan(50_000, 0.2))
    for needle in ("in flight", "worker CPU", "concurrency", "replicas", "KEDA target",
                   "memory", "DB connections", "WAL", "shards             2", "Helm values"):
        assert needle in text, needle


def test_receipts_plan_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--rate", "2000", "--latency", "0.2", "--cpu-per-delivery", "580"]) == 0
    out = capsys.readouterr().out
    assert "plan for 2,000 receipts/s at 0.2 s per delivery" in out
    assert "maxReplicas: 3" in out
    assert main(["plan", "--rate", "2000", "--latency", "0.2"]) == 0  # the bench's figure
    assert f"({HTTP_DELIVERY_CPU_SECONDS * 1e6:.0f} µs per delivery, bench)" in (
        capsys.readouterr().out)


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--rate", "fast", "--latency", "0.2"],
        ["plan", "--rate", "-3", "--latency", "0.2"],
        ["plan", "--latency", "0.2"],
        ["plan", "--rate", "10", "--latency", "0.2", "--utilisation", "2"],
    ],
)
def test_receipts_plan_bad_input_is_exit_2_with_one_line(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("receipts: error: --")


def test_plan_is_a_frozen_value() -> None:
    p = plan(40, 0.2)
    with pytest.raises(AttributeError):
        p.concurrency = 1  # type: ignore[misc]
    assert isinstance(p, Plan)


def test_a_cpu_figure_of_ones_own_decides_the_pods_instead_of_the_benchs() -> None:
    default = plan(20_000, 0.2)
    own = plan(20_000, 0.2, cpu_per_delivery_seconds=4 * HTTP_DELIVERY_CPU_SECONDS)
    assert own.worker_cpu_cores == pytest.approx(4 * default.worker_cpu_cores)
    assert own.pods_for_cpu > default.pods_for_cpu
    with pytest.raises(PlanError, match="--cpu-per-delivery"):
        plan(100, 0.2, cpu_per_delivery_seconds=0)


def test_plan_takes_the_cpu_per_delivery_in_microseconds(capsys) -> None:
    assert main(["plan", "--rate", "2000", "--latency", "0.2",
                 "--cpu-per-delivery", "1000"]) == 0
    assert "2.00 cores (1000 µs per delivery)" in capsys.readouterr().out
    assert main(["plan", "--rate", "2000", "--latency", "0.2",
                 "--cpu-per-delivery", "lots"]) == 2


def test_the_planners_cpu_per_delivery_is_the_benchs_latest_figure() -> None:
    import json
    from pathlib import Path

    latest = Path(__file__).resolve().parents[2] / "bench" / "results" / "latest.json"
    capacity = json.loads(latest.read_text())["summary"]["capacity"]
    measured_us = capacity["worker_cpu_us_per_http_delivery"]["median"]
    assert measured_us == pytest.approx(HTTP_DELIVERY_CPU_SECONDS * 1e6, abs=0.5)


def test_a_provider_capacity_says_the_rate_it_allows_and_turns_adaptation_on(capsys) -> None:
    p = plan(500, 0.2, provider_capacity=60)
    assert p.provider_rate == pytest.approx(300) and p.capacity_pods == math.ceil(60 / 125) + 1
    values = yaml.safe_load(helm_values(p))
    assert values["config"]["adaptiveConcurrency"] is True
    # The ceiling follows the slots, so that no slot of the plan is left unused (64 is the
    # default ceiling; this plan has more slots than that).
    assert values["config"]["adaptiveConcurrencyCeiling"] == values["config"]["concurrency"]
    assert values["config"]["concurrency"] > 64
    assert "the rate is above it" in describe(p)
    assert "adaptiveConcurrency" not in helm_values(plan(500, 0.2))  # not given: as before
    assert "provider " not in describe(plan(500, 0.2))
    assert main(["plan", "--rate", "100", "--latency", "0.2", "--provider-capacity", "60"]) == 0
    out = capsys.readouterr().out
    assert "60 requests at once allow 300.0 receipts/s" in out and "above it" not in out
    assert "the HPA on the external metric" in out  # both autoscaling paths are capped
    with pytest.raises(PlanError):
        plan(100, 0.2, provider_capacity=0)


def test_a_provider_capacity_is_a_whole_number_and_one_below_min_replicas_is_named(
        capsys) -> None:
    for bad in ("1.5", "0", "-1", "nan", "1e12"):
        assert main(["plan", "--rate", "10", "--latency", "0.2",
                     "--provider-capacity", bad]) == 2, bad
        assert "--provider-capacity" in capsys.readouterr().err
    # Each pod keeps its floor (1) in flight: two pods overload a provider of capacity 1.
    tight = describe(plan(10, 0.2, provider_capacity=1))
    assert "minReplicas 2 is above it" in tight
    assert "minReplicas 2 is above it" not in describe(plan(10, 0.2, provider_capacity=2))


def test_a_provider_capacity_beyond_the_fleets_reach_says_so_and_reads_as_a_number() -> None:
    """10 million at once: no "1e+07", and no pod count above maxReplicas."""
    p = plan(200, 0.2, provider_capacity=10_000_000)
    text = describe(p)
    assert "10,000,000 requests at once" in text and "e+07" not in text
    assert f"more than maxReplicas {p.max_replicas} pods can send" in text
    assert f"at most {p.capacity_pods} pods" not in text
    held = describe(plan(200, 0.2, provider_capacity=60))
    assert "a fleet the provider holds asks for at most" in held
