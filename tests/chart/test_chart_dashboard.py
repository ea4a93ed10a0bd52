"""The Grafana dashboard: every query parses and uses only metrics the service exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from chartkit import CHART, DASHBOARD, find_tool, one, render, run

# The service's metric names (docs/design.md §5, §9 and the recovery job's Pushgateway metrics).
EXPORTED = {
    "receipts_claims_total",
    "receipts_jobs_claimed_total",
    "receipts_acks_total",
    "receipts_stale_acks_total",
    "receipts_retries_total",
    "receipts_failures_total",
    "receipts_leases_lost_total",
    "receipts_expired_leases",
    "receipts_ready_jobs",
    "receipts_queue_lag_seconds",
    "receipts_jobs",
    "receipts_inflight_deliveries",
    "receipts_pool_connections",
    "receipts_concurrency_slots",
    "receipts_oldest_transaction_age_seconds",
    "receipts_recovery_last_success_timestamp_seconds",
    "receipts_recovery_expired_total",
    "receipts_recovery_pruned_total",
}
HISTOGRAMS = {"receipts_delivery_duration_seconds"}
ALLOWED = EXPORTED | {f"{h}{end}" for h in HISTOGRAMS for end in ("_bucket", "_sum", "_count")}
PROCESS_METRIC = re.compile(r"^process_[a-z_]+$")

# Grafana variables, replaced by values PromQL accepts.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "${namespace}": ".*",
    "$namespace": ".*",
    "${job}": ".*",
    "$job": ".*",
}
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                   "offset", "and", "or", "unless", "inf", "nan"}


def targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query, including panels nested in rows."""
    found = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                found.append((panel["title"], target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return found


def substitute(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names referenced by a PromQL expression (string literals and label lists
    removed; what is left that is not a function, keyword, duration or number)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )
    names = set()
    for match in re.finditer(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group(0)
        following = text[match.end():].lstrip()
        if following.startswith("(") or word.lower() in PROMQL_KEYWORDS:
            continue
        names.add(word)
    return names


DASH = json.loads(DASHBOARD.read_text())
EXPRS = targets(DASH)


def test_dashboard_has_queries_for_every_topic() -> None:
    used = set().union(*(metric_names(substitute(expr)) for _, expr in EXPRS))
    # throughput, lag, due ready vs replicas, stale acks, retries and failures by reason,
    # latency percentiles, pool usage
    assert {
        "receipts_acks_total",
        "receipts_queue_lag_seconds",
        "receipts_ready_jobs",
        "receipts_concurrency_slots",
        "receipts_stale_acks_total",
        "receipts_retries_total",
        "receipts_failures_total",
        "receipts_delivery_duration_seconds_bucket",
        "receipts_pool_connections",
    } <= used
    assert any("histogram_quantile(0.99" in expr for _, expr in EXPRS)
    assert any("by (reason)" in expr and "receipts_retries_total" in expr for _, expr in EXPRS)
    assert any("by (reason)" in expr and "receipts_failures_total" in expr for _, expr in EXPRS)


def test_every_dashboard_query_uses_only_exported_metrics() -> None:
    unknown = {}
    for title, expr in EXPRS:
        for name in metric_names(substitute(expr)):
            if name not in ALLOWED and not PROCESS_METRIC.match(name):
                unknown.setdefault(title, set()).add(name)
    assert not unknown, f"metrics the service does not export: {unknown}"


def test_metric_name_extraction_sees_bare_and_selected_names() -> None:
    assert metric_names('sum by (le) (rate(a_bucket{x="y{"}[5m])) / b + c offset 5m') == {
        "a_bucket", "b", "c"}


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    assert len(EXPRS) >= 10
    rules = [
        {"record": f"dashboard:query_{index}:check", "expr": substitute(expr)}
        for index, (_, expr) in enumerate(EXPRS)
    ]
    rule_file = tmp_path / "dashboard.rules.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run([find_tool("promtool"), "check", "rules", str(rule_file)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout


def test_dashboard_template_variables_and_datasource() -> None:
    names = [variable["name"] for variable in DASH["templating"]["list"]]
    assert names == ["datasource", "namespace", "job"]
    for _, panel_ds in ((p["title"], p.get("datasource")) for p in DASH["panels"]
                        if p["type"] != "row"):
        assert panel_ds == {"type": "prometheus", "uid": "${datasource}"}
    assert DASH["uid"] and DASH["title"] == "Receipts"


def test_dashboard_ships_as_a_sidecar_configmap_when_enabled() -> None:
    assert not [d for d in render() if d["metadata"]["name"].endswith("-dashboard")]
    docs = render((CHART / "ci" / "keda-values.yaml",))
    configmap = next(d for d in docs if d["kind"] == "ConfigMap"
                     and d["metadata"]["name"].endswith("-dashboard"))
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"]["grafana_folder"] == "Receipts"
    assert json.loads(configmap["data"]["receipts.json"]) == DASH
    assert one(docs, "Deployment")
