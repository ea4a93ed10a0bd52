"""Alert rules: one source (the chart), valid PromQL, and a promtool unit test per alert."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from chartkit import (
    CHART,
    CI_VALUES,
    DEPLOY_DOC,
    RULES_FILE,
    RULES_TEST_FILE,
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

# What the Deploy issue asks the rules to cover.
REQUIRED_ALERTS = {
    "ReceiptsQueueLagHigh",  # queue lag high
    "ReceiptsReadyJobsGrowingAtMaxReplicas",  # due ready jobs growing at max replicas
    "ReceiptsJobsFailed",  # failed jobs appearing
    "ReceiptsStaleAcks",  # stale acks happening
    "ReceiptsExpiredLeasesNotRecovered",  # expired leases not being recovered
    "ReceiptsRecoveryNotRunning",  # recovery CronJob not running
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
    anchor = annotations["runbook_url"].rsplit("#", 1)[1]
    assert anchor == alert.lower()
    headings = re.findall(r"^#+\s+(.+?)\s*$", DEPLOY_DOC.read_text(), flags=re.MULTILINE)
    # Exactly one heading: a second one would move the anchor to `#…-1`.
    assert headings.count(alert) == 1, f"README.md needs one runbook section titled {alert}"
