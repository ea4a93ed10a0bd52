"""The Grafana dashboard: every query parses, uses only metrics the service exports, and
answers on a real Prometheus scraping what the code exposes; one unit per panel; a uid per
release."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartkit import CHART, DASHBOARD, RULES_FILE, RUNBOOK_DIR, find_tool, one, render, run
from prometheus_client.parser import text_string_to_metric_families

from receipts.embedded import free_port
from receipts.jobqueue import QueueStats
from receipts.metrics import Metrics
from receipts.recovery import RecoveryReport, push_report

# Series the dashboard may read besides the service's own (kube-state-metrics).
EXTERNAL = {"kube_cronjob_status_last_successful_time"}
PROCESS_METRIC = re.compile(r"^process_[a-z_]+$")


@functools.cache
def exposition() -> str:
    """What a worker and a recovery push expose, from the real code: a busy Metrics registry
    plus the body push_report sends (captured by a one-request HTTP server)."""
    metrics = Metrics()
    metrics.acks.inc(40)
    metrics.jobs_claimed.inc(42)
    metrics.claims.inc(9)
    metrics.claim_batch.observe(5)
    metrics.stale_acks.inc()
    metrics.leases_lost.inc()
    metrics.retries.labels("provider_5xx").inc(2)
    metrics.failures.labels("rejected").inc()
    metrics.delivery_duration.labels("delivered").observe(0.08)
    metrics.statement_duration.labels("claim").observe(0.002)
    metrics.db_errors.labels("claim").inc()
    metrics.observe_time_to_receipt(1.7)
    metrics.ready.set(1)
    metrics.slots.set(32)
    metrics.inflight.set(3)
    metrics.provider_paused.labels("outage").set(1)
    metrics.provider_tokens.set(12)
    metrics.claim_rate_limit.set(250)
    for state in ("size", "in_use", "waiting"):
        metrics.pool_connections.labels(state).set(1)
    metrics.observe_queue(QueueStats(
        ready_due=7, ready=9, running=3, expired=1, failed=2, lag_seconds=1.5,
        done_estimate=100, dead_tuples=40, oldest_transaction_age_seconds=0.3,
        oldest_undelivered_age_seconds=12.0))
    pushed: list[bytes] = []

    class Gateway(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            pushed.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    push_report(RecoveryReport(expired_to_ready=2, expired_to_failed=1, pruned=30,
                               duration_seconds=0.4), f"127.0.0.1:{server.server_port}")
    thread.join(10)
    server.server_close()
    (body,) = pushed
    kube_state = (
        "# TYPE kube_cronjob_status_last_successful_time gauge\n"
        'kube_cronjob_status_last_successful_time{namespace="shop",cronjob="receipts-recovery"}'
        f" {int(time.time()) - 30}\n"
    )
    return metrics.render().decode() + body.decode() + kube_state


def exported() -> set[str]:
    """Sample names (with _total, _bucket, …) in the exposition."""
    return {
        sample.name
        for family in text_string_to_metric_families(exposition())
        for sample in family.samples
    }


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
        # why: database readiness and errors, provider pauses, dead tuples, the xmin
        # horizon, stats freshness, flow control, recovery; and what the customer feels
        "receipts_database_ready",
        "receipts_db_errors_total",
        "receipts_provider_paused",
        "receipts_provider_tokens",
        "receipts_claim_rate_limit",
        "receipts_table_dead_tuples",
        "receipts_oldest_transaction_age_seconds",
        "receipts_queue_stats_timestamp_seconds",
        "receipts_oldest_undelivered_age_seconds",
        "receipts_time_to_receipt_seconds_bucket",
        "kube_cronjob_status_last_successful_time",
        "receipts_recovery_last_success_timestamp_seconds",
    } <= used
    assert any("histogram_quantile(0.99" in expr for _, expr in EXPRS)
    assert any("by (reason)" in expr and "receipts_retries_total" in expr for _, expr in EXPRS)
    assert any("by (reason)" in expr and "receipts_failures_total" in expr for _, expr in EXPRS)


def test_every_dashboard_query_uses_only_exported_metrics() -> None:
    allowed = exported() | EXTERNAL
    unknown = {}
    for title, expr in EXPRS:
        for name in metric_names(substitute(expr)):
            if name not in allowed and not PROCESS_METRIC.match(name):
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


def _shipped(docs: list[dict[str, Any]]) -> dict[str, Any]:
    configmap = next(d for d in docs if d["kind"] == "ConfigMap"
                     and d["metadata"]["name"].endswith("-dashboard"))
    return json.loads(configmap["data"]["receipts.json"])  # type: ignore[no-any-return]


@pytest.mark.slow
def test_dashboard_ships_as_a_sidecar_configmap_when_enabled() -> None:
    assert not [d for d in render() if d["metadata"]["name"].endswith("-dashboard")]
    docs = render((CHART / "ci" / "keda-values.yaml",))
    configmap = next(d for d in docs if d["kind"] == "ConfigMap"
                     and d["metadata"]["name"].endswith("-dashboard"))
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"]["grafana_folder"] == "Receipts"
    shipped = _shipped(docs)
    assert {k: v for k, v in shipped.items() if k not in ("uid", "title")} == {
        k: v for k, v in DASH.items() if k not in ("uid", "title")}
    assert one(docs, "Deployment")


@pytest.mark.slow
def test_each_release_gets_its_own_dashboard_uid_and_title() -> None:
    values = (CHART / "ci" / "keda-values.yaml",)
    first = _shipped(render(values))
    second = _shipped(render(values, release="receipts-eu"))
    assert first["uid"] != second["uid"] and first["title"] != second["title"]
    assert first["title"] == "Receipts (shop/receipts)"
    for shipped in (first, second):
        assert re.fullmatch(r"[a-z0-9-]{1,40}", shipped["uid"]), shipped["uid"]
    assert first == _shipped(render(values))  # stable across upgrades


def _graph_panels() -> list[dict[str, Any]]:
    return [p for p in DASH["panels"] if p["type"] != "row"]


def test_one_unit_per_axis_and_thresholds_on_every_stat() -> None:
    for panel in _graph_panels():
        defaults = panel["fieldConfig"]["defaults"]
        assert defaults.get("unit"), f"{panel['title']}: no unit"
        for override in panel["fieldConfig"].get("overrides", []):
            ids = {p["id"] for p in override.get("properties", [])}
            assert not ids & {"unit", "custom.axisPlacement"}, (
                f"{panel['title']}: a second unit or axis")
        if panel["type"] == "stat":
            steps = defaults["thresholds"]["steps"]
            assert len(steps) >= 2, f"{panel['title']}: a stat without thresholds"
    ids = [p["id"] for p in DASH["panels"]]
    assert len(ids) == len(set(ids))


def test_the_runbook_names_only_panels_that_exist() -> None:
    runbook = "\n".join(p.read_text() for p in sorted(RUNBOOK_DIR.glob("*/README.md")))
    # The generated rule blocks name no panel (their bold words are the rule's fields).
    runbook = re.sub(r"<!-- BEGIN GENERATED.*?<!-- END GENERATED -->", "", runbook, flags=re.S)
    named = {" ".join(m.split()) for m in re.findall(r"\*([A-Z][^*]+?)\*", runbook)}
    named -= {"Warning.", "Critical.", "Info."}
    titles = {p["title"] for p in _graph_panels()}
    assert named and named <= titles, sorted(named - titles)


# ----------------------------------------------- every query on a real Prometheus


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def _query(base: str, expr: str) -> dict[str, Any]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        return _get_json(url)
    except urllib.error.HTTPError as exc:  # 400/422: a bad query; the body says why
        return json.loads(exc.read())  # type: ignore[no-any-return]


def _wait(predicate: Any, what: str, timeout_seconds: float = 60) -> None:
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            if predicate():
                return
        except (OSError, LookupError):  # not up yet, or no sample yet
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus on 127.0.0.1 scraping the exposition every second and evaluating
    the plain rule file; yields its base URL."""
    body = exposition().encode()

    class Target(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    target = HTTPServer(("127.0.0.1", 0), Target)
    threading.Thread(target=target.serve_forever, daemon=True).start()
    folder = tmp_path_factory.mktemp("prometheus")
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES_FILE)],
        "scrape_configs": [{
            "job_name": "receipts",
            "honor_labels": True,
            "static_configs": [{"targets": [f"127.0.0.1:{target.server_port}"],
                                "labels": {"namespace": "shop", "pod": "w-1"}}],
        }],
    }))
    port = free_port()
    log = (folder / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [find_tool("prometheus"), f"--config.file={config}",
         f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=5) as response:
                return response.status == 200

        _wait(ready, "Prometheus ready")
        _wait(lambda: float(_query(base, "count_over_time(receipts_acks_total[1m])")
                            ["data"]["result"][0]["value"][1]) >= 3, "three scrapes")
        yield base
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        target.shutdown()
        target.server_close()


@pytest.mark.slow
def test_every_dashboard_query_answers_with_data_on_a_real_prometheus(prometheus: str) -> None:
    failures = {}
    for title, expr in EXPRS:
        answer = _query(prometheus, substitute(expr).replace("[5m]", "[30s]"))
        if answer.get("status") != "success":
            failures[f"{title}: {expr}"] = answer.get("error")
        elif not answer["data"]["result"]:
            failures[f"{title}: {expr}"] = "no data"
    for variable in DASH["templating"]["list"][1:]:
        metric = re.fullmatch(r"label_values\((.+), \w+\)", variable["definition"])
        assert metric, variable["definition"]
        answer = _query(prometheus, substitute(metric.group(1)))
        if answer.get("status") != "success" or not answer["data"]["result"]:
            failures[f"variable {variable['name']}"] = answer.get("error", "no data")
    assert not failures, failures


def test_every_alert_rule_evaluates_cleanly_on_a_real_prometheus(prometheus: str) -> None:
    def evaluated() -> list[dict[str, Any]]:
        groups = _get_json(f"{prometheus}/api/v1/rules")["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]

    _wait(lambda: all(r.get("lastEvaluation", "").startswith("2") and
                      not r["lastEvaluation"].startswith("0001") for r in evaluated()),
          "every rule evaluated")
    rules = evaluated()
    assert len(rules) == len(re.findall(r"^      - alert: ", RULES_FILE.read_text(),
                                        flags=re.MULTILINE))
    unhealthy = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not unhealthy, unhealthy
