"""Alert rules: one source (the chart), valid PromQL, and a promtool unit test per alert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from chartkit import (
    CHART,
    CI_VALUES,
    RULES_FILE,
    RULES_TEST_FILE,
    RUNBOOK_DIR,
    default_rules_text,
    find_tool,
    rules_spec_text,
    run,
    template,
)

ALERTS = [
    rule["alert"]
    for group in yaml.safe_load(RULES_FILE.read_text())["groups"]
    for rule in group["rules"]
    if "alert" in rule
]

# What the rules must cover.
REQUIRED_ALERTS = {
    "ReceiptsQueueLagHigh",  # queue lag high
    "ReceiptsOldestUndeliveredTooOld",  # a job undelivered long after its enqueue (retries)
    "ReceiptsReadyJobsGrowingAtMaxReplicas",  # due ready jobs growing at max replicas
    "ReceiptsJobsFailed",  # failure ratio over a window
    "ReceiptsStaleAcks",  # stale acks relative to acks
    "ReceiptsProviderPaused",  # provider paused (auth, outage, retry_after) for too long
    "ReceiptsRateLimitSaturated",  # the provider's rate limit caps deliveries for long
    "ReceiptsDatabaseNotReady",  # workers whose database is unready
    "ReceiptsQueueStatsStale",  # queue gauges frozen (which silences the queue alerts)
    "ReceiptsExpiredLeasesNotRecovered",  # expired leases not being recovered
    "ReceiptsRecoveryNotRunning",  # recovery CronJob's last success too old
    "ReceiptsLongTransaction",  # the xmin horizon held back
    "ReceiptsXminHorizonHeld",  # ... by any holder: prepared transactions, replication slots
    "ReceiptsWorkersDown",  # no worker being scraped
}


def promtool(*args: str, cwd: Path | None = None) -> None:
    result = run([find_tool("promtool"), *args], cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr


def test_plain_rule_file_equals_the_chart_rules() -> None:
    assert RULES_FILE.read_text() == default_rules_text(), (
        "deploy/prometheus/receipts.rules.yaml is out of date: "
        "run `python tests/chart/chartkit.py write-rules`"
    )


def test_the_required_alerts_exist() -> None:
    assert set(ALERTS) >= REQUIRED_ALERTS
    assert len(ALERTS) == len(set(ALERTS))


def test_promtool_checks_the_plain_rule_file() -> None:
    promtool("check", "rules", str(RULES_FILE))


def test_promtool_checks_the_prometheus_rule_of_every_scenario(tmp_path: Path) -> None:
    checked = []
    for values in CI_VALUES:
        result = template((values,))
        assert result.returncode == 0, result.stderr
        if "kind: PrometheusRule" not in result.stdout:
            continue
        rule_file = tmp_path / f"{values.stem}.rules.yaml"
        rule_file.write_text(rules_spec_text(result.stdout))
        promtool("check", "rules", str(rule_file))
        checked.append(values.name)
    assert len(checked) >= 2, checked


def test_scale_to_zero_rules_do_not_page_when_workers_are_scaled_away(tmp_path: Path) -> None:
    result = template((CHART / "ci" / "keda-values.yaml",))
    assert result.returncode == 0, result.stderr
    spec = yaml.safe_load(rules_spec_text(result.stdout))
    (down,) = [r for g in spec["groups"] for r in g["rules"] if r["alert"] == "ReceiptsWorkersDown"]
    assert "kube_deployment_spec_replicas" in down["expr"]


def _rule(spec_text: str, alert: str) -> dict[str, Any]:
    spec = yaml.safe_load(spec_text)
    (rule,) = [r for g in spec["groups"] for r in g["rules"] if r.get("alert") == alert]
    return rule


def test_no_rule_depends_on_a_replica_count() -> None:
    default = template((), ("prometheusOperator.enabled=true",))
    other = template((), ("prometheusOperator.enabled=true", "autoscaling.maxReplicas=3",
                          "autoscaling.minReplicas=2", "worker.replicaCount=2"))
    assert default.returncode == 0 and other.returncode == 0, default.stderr + other.stderr
    assert rules_spec_text(default.stdout) == rules_spec_text(other.stdout)
    growing = _rule(RULES_FILE.read_text(), "ReceiptsReadyJobsGrowingAtMaxReplicas")["expr"]
    assert "kube_horizontalpodautoscaler_spec_max_replicas" in growing
    assert "up{" not in growing


def _promtool_test(tmp_path: Path, spec_text: str, tests: str) -> None:
    """promtool unit *tests* of the rendered rules' expressions (annotations left out)."""
    spec = yaml.safe_load(spec_text)
    for group in spec["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "rules.test.yaml").write_text(tests)
    promtool("test", "rules", "rules.test.yaml", cwd=tmp_path)


PUSHGATEWAY_TESTS = """\
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'receipts_recovery_last_success_timestamp_seconds{job="receipts-recover"}'
        values: '0x30'
    alert_rule_test:
      - {eval_time: 12m, alertname: ReceiptsRecoveryNotRunning, exp_alerts: []}
      - eval_time: 20m
        alertname: ReceiptsRecoveryNotRunning
        exp_alerts: [{exp_labels: {severity: warning, job: receipts-recover}}]
  - interval: 1m
    input_series:
      - series: 'receipts_recovery_last_success_timestamp_seconds{job="receipts-recover"}'
        values: '0+60x30'
      # kube-state-metrics' view is not what this variant reads.
      - series: 'kube_cronjob_status_last_successful_time{cronjob="receipts-recovery"}'
        values: '0x30'
    alert_rule_test:
      - {eval_time: 25m, alertname: ReceiptsRecoveryNotRunning, exp_alerts: []}
"""


def test_recovery_success_can_be_read_from_the_pushgateway_instead(tmp_path: Path) -> None:
    result = template((), ("prometheusOperator.enabled=true",
                           "alerts.recoveryLastSuccessFrom=pushgateway"))
    assert result.returncode == 0, result.stderr
    spec_text = rules_spec_text(result.stdout)
    expr = _rule(spec_text, "ReceiptsRecoveryNotRunning")["expr"]
    assert "receipts_recovery_last_success_timestamp_seconds" in expr and "kube_" not in expr
    _promtool_test(tmp_path, spec_text, PUSHGATEWAY_TESTS)


def test_without_the_recovery_cronjob_there_is_no_recovery_success_alert() -> None:
    result = template((), ("prometheusOperator.enabled=true", "recovery.enabled=false"))
    assert result.returncode == 0, result.stderr
    spec = yaml.safe_load(rules_spec_text(result.stdout))
    alerts = {r["alert"] for g in spec["groups"] for r in g["rules"]}
    assert "ReceiptsRecoveryNotRunning" not in alerts
    assert "ReceiptsExpiredLeasesNotRecovered" in alerts  # still true: someone must recover


FIXED_REPLICAS_TESTS = """\
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'receipts_ready_jobs{job="receipts",namespace="shop"}'
        values: '1000+50x40'
    alert_rule_test:
      - eval_time: 35m
        alertname: ReceiptsReadyJobsGrowingAtMaxReplicas
        exp_alerts: [{exp_labels: {severity: warning, job: receipts, namespace: shop}}]
  - interval: 1m
    input_series:
      - series: 'receipts_ready_jobs{job="receipts",namespace="shop"}'
        values: '50000-500x40'
    alert_rule_test:
      - {eval_time: 35m, alertname: ReceiptsReadyJobsGrowingAtMaxReplicas, exp_alerts: []}
"""


def test_with_a_fixed_replica_count_growth_alone_is_enough(tmp_path: Path) -> None:
    result = template((), ("prometheusOperator.enabled=true", "autoscaling.enabled=false"))
    assert result.returncode == 0, result.stderr
    spec_text = rules_spec_text(result.stdout)
    assert "kube_" not in _rule(spec_text, "ReceiptsReadyJobsGrowingAtMaxReplicas")["expr"]
    _promtool_test(tmp_path, spec_text, FIXED_REPLICAS_TESTS)


def test_promtool_unit_tests_pass() -> None:
    promtool("test", "rules", RULES_TEST_FILE.name, cwd=RULES_TEST_FILE.parent)


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    tests = yaml.safe_load(RULES_TEST_FILE.read_text())
    assert tests["rule_files"] == [RULES_FILE.name]
    fires: set[str] = set()
    silent: set[str] = set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    missing_fire = set(ALERTS) - fires
    missing_silent = set(ALERTS) - silent
    assert not missing_fire, f"no firing test for {sorted(missing_fire)}"
    assert not missing_silent, f"no not-firing test for {sorted(missing_silent)}"


@pytest.mark.parametrize("alert", ALERTS)
def test_every_alert_is_documented_with_a_runbook(alert: str) -> None:
    rule = next(
        r for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]
        if r.get("alert") == alert
    )
    assert rule["labels"]["severity"] in {"warning", "critical"}
    annotations = rule["annotations"]
    assert annotations["summary"] and annotations["description"]
    # The default names no host: it is the page's folder in the repository, which is
    # also its path on the built docs site (docs/runbook/index.md).
    assert annotations["runbook_url"] == f"docs/runbook/{alert.lower()}/"
    page = RUNBOOK_DIR / alert.lower() / "README.md"
    assert page.exists(), f"{alert} needs a runbook page, {page} (python scripts/gen_docs.py)"
    assert page.read_text().startswith(f"# {alert}\n")


def test_runbook_links_follow_the_base_url_the_operator_sets() -> None:
    base = "https://docs.example.internal/receipts/runbook/"
    result = template((), ("prometheusOperator.enabled=true", f"alerts.runbookUrl={base}"))
    assert result.returncode == 0, result.stderr
    rules = [r for g in yaml.safe_load(rules_spec_text(result.stdout))["groups"]
             for r in g["rules"] if "alert" in r]
    assert {r["annotations"]["runbook_url"] for r in rules} == {
        f"{base}{alert.lower()}/" for alert in ALERTS}
