"""Alert rules: one source (the chart), valid PromQL, a promtool unit test per alert, and
every alert against a whole fleet, healthy and in each fault (alert_scenarios.yaml), for the
defaults and for the monitoring values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import alert_scenarios
import pytest
import yaml
from chartkit import (
    CHART,
    CI_VALUES,
    KSM_RULES_FILE,
    RULES_FILE,
    RULES_TEST_FILE,
    RUNBOOK_DIR,
    default_rules_text,
    find_tool,
    kube_state_metrics_rules_text,
    render,
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

MONITORING = CHART / "ci" / "monitoring-values.yaml"
PROFILES = {"defaults": (), "monitoring": (MONITORING,)}


def profile_rules(profile: str) -> str:
    """The rule file (spec text) the chart renders for a profile of alert_scenarios.yaml."""
    result = template(PROFILES[profile], ("prometheusOperator.enabled=true",))
    assert result.returncode == 0, result.stderr
    return rules_spec_text(result.stdout)


def alert_names(spec_text: str) -> list[str]:
    return [r["alert"] for g in yaml.safe_load(spec_text)["groups"] for r in g["rules"]
            if "alert" in r]


# The alerts that read an exporter the defaults do not assume (kube-state-metrics).
EXPORTER_ALERTS = {"ReceiptsReadyJobsGrowingAtMaxReplicas", "ReceiptsRecoveryNotRunning",
                   "ReceiptsKubeStateMetricsMissing"}

# What the rules must cover (with every exporter: the monitoring values).
REQUIRED_ALERTS = {
    "ReceiptsQueueLagHigh",  # queue lag high
    "ReceiptsOldestUndeliveredTooOld",  # a job undelivered long after its enqueue (retries)
    "ReceiptsReadyJobsGrowingAtMaxReplicas",  # due ready jobs growing at max replicas
    "ReceiptsJobsFailed",  # failure ratio over a window
    "ReceiptsStaleAcks",  # stale acks relative to acks
    "ReceiptsProviderPaused",  # provider paused (auth, outage, retry_after) for too long
    "ReceiptsProviderRejecting",  # paused because the provider rejects nearly everything
    "ReceiptsManualPauseLong",  # an operator's pause outlasting its expected time (info)
    "ReceiptsRateLimitSaturated",  # the provider's rate limit caps deliveries for long
    "ReceiptsProviderAtCapacity",  # adaptive concurrency held at the provider's capacity
    "ReceiptsDatabaseNotReady",  # workers whose database is unready
    "ReceiptsQueueStatsStale",  # queue gauges frozen (which silences the queue alerts)
    "ReceiptsExpiredLeasesNotRecovered",  # expired leases not being recovered
    "ReceiptsRecoveryNotRunning",  # recovery CronJob's last success too old
    "ReceiptsPruningBehind",  # finished rows kept past the retention: pruning stopped
    "ReceiptsLongTransaction",  # the xmin horizon held back
    "ReceiptsXminHorizonHeld",  # ... by any holder: prepared transactions, replication slots
    "ReceiptsWorkersDown",  # no worker being scraped
    "ReceiptsKubeStateMetricsMissing",  # the alerts that read kube-state-metrics are blind
}


def _rule(spec_text: str, alert: str) -> dict[str, Any]:
    spec = yaml.safe_load(spec_text)
    (rule,) = [r for g in spec["groups"] for r in g["rules"] if r.get("alert") == alert]
    return rule


def promtool(*args: str, cwd: Path | None = None) -> None:
    result = run([find_tool("promtool"), *args], cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr


def test_plain_rule_file_equals_the_chart_rules() -> None:
    assert RULES_FILE.read_text() == default_rules_text(), (
        "deploy/prometheus/receipts.rules.yaml is out of date: "
        "run `python tests/chart/chartkit.py write-rules`"
    )


def test_kube_state_metrics_rule_file_equals_the_chart_rules() -> None:
    assert KSM_RULES_FILE.read_text() == kube_state_metrics_rules_text(), (
        f"{KSM_RULES_FILE.name} is out of date: run `python tests/chart/chartkit.py write-rules`"
    )


def test_the_required_alerts_exist() -> None:
    monitoring = alert_names(profile_rules("monitoring"))
    assert set(monitoring) >= REQUIRED_ALERTS
    assert len(monitoring) == len(set(monitoring))
    # The defaults read the workers' own metrics only.
    assert set(ALERTS) == REQUIRED_ALERTS - EXPORTER_ALERTS
    assert "kube_" not in RULES_FILE.read_text()


def test_the_rate_limit_alert_needs_a_rate_limit() -> None:
    # receipts_provider_tokens is -1 without a limit: "< 1" alone fired by default.
    expr = _rule(RULES_FILE.read_text(), "ReceiptsRateLimitSaturated")["expr"]
    assert "min_over_time(receipts_provider_tokens" in expr and ">= 0" in expr


@pytest.mark.slow
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_alert_in_a_healthy_fleet_and_in_each_fault(profile: str, tmp_path: Path) -> None:
    """alert_scenarios.yaml: exactly the listed alerts fire at each check, for the profile."""
    data = alert_scenarios.load()
    spec_text = profile_rules(profile)
    rendered = set(alert_names(spec_text))
    checks = alert_scenarios.checks(data, profile)
    named = set().union(*(c.firing for c in checks))
    assert named <= rendered, f"scenarios name alerts the {profile} rules lack: {named - rendered}"
    assert rendered <= named, f"alerts no scenario makes fire: {sorted(rendered - named)}"
    healthy = [c for c in checks if c.scenario == "a healthy fleet"]
    assert healthy and all(not c.firing for c in healthy)
    _promtool_test(tmp_path, spec_text,
                   alert_scenarios.promtool_tests(data, profile, "rules.yaml"))
    silent = {name: sum(name not in c.firing for c in checks) for name in rendered}
    fired = {name: sum(name in c.firing for c in checks) for name in rendered}
    print(f"\n[{profile}] {len(rendered)} alerts, {len(checks)} checks in "
          f"{len(data['scenarios'])} scenarios:")
    for name in sorted(rendered):
        print(f"  {name:45} fires in {fired[name]:2}, silent in {silent[name]:2}")


def test_promtool_checks_the_plain_rule_file() -> None:
    promtool("check", "rules", str(RULES_FILE))


@pytest.mark.slow
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


SCALED_TO_ZERO_TESTS = """\
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - name: scaled to zero, no target at all, is not an outage
    interval: 1m
    input_series:
      - series: 'up{job="other",namespace="shop"}'
        values: '1x30'
    alert_rule_test:
      - {eval_time: 20m, alertname: ReceiptsWorkersDown, exp_alerts: []}
  - name: pods that exist but never answer a scrape are
    interval: 1m
    input_series:
      - series: 'up{job="receipts",namespace="shop",pod="w-1"}'
        values: '0x30'
    alert_rule_test:
      - eval_time: 20m
        alertname: ReceiptsWorkersDown
        exp_alerts: [{exp_labels: {severity: critical, job: receipts, namespace: shop}}]
"""


@pytest.mark.slow
def test_scale_to_zero_rules_do_not_page_when_workers_are_scaled_away(tmp_path: Path) -> None:
    keda = (CHART / "ci" / "keda-values.yaml",)
    # With kube-state-metrics: only while the Deployment wants pods.
    result = template(keda, ("alerts.kubeStateMetrics=true",))
    assert result.returncode == 0, result.stderr
    with_ksm = rules_spec_text(result.stdout)
    assert "kube_deployment_spec_replicas" in _rule(with_ksm, "ReceiptsWorkersDown")["expr"]
    assert "ReceiptsKubeStateMetricsMissing" in alert_names(with_ksm)
    # Without it: only when worker targets exist and none answers.
    result = template(keda)
    assert result.returncode == 0, result.stderr
    without = rules_spec_text(result.stdout)
    expr = _rule(without, "ReceiptsWorkersDown")["expr"]
    assert "kube_" not in expr and "absent" not in expr
    assert "ReceiptsKubeStateMetricsMissing" not in alert_names(without)
    _promtool_test(tmp_path, without, SCALED_TO_ZERO_TESTS)


@pytest.mark.slow
def test_no_rule_depends_on_a_replica_count() -> None:
    default = template((MONITORING,), ("prometheusOperator.enabled=true",))
    other = template((MONITORING,), ("prometheusOperator.enabled=true",
                                     "autoscaling.maxReplicas=3", "autoscaling.minReplicas=2",
                                     "worker.replicaCount=2"))
    assert default.returncode == 0 and other.returncode == 0, default.stderr + other.stderr
    assert rules_spec_text(default.stdout) == rules_spec_text(other.stdout)
    growing = _rule(rules_spec_text(default.stdout),
                    "ReceiptsReadyJobsGrowingAtMaxReplicas")["expr"]
    assert "kube_horizontalpodautoscaler_spec_max_replicas" in growing
    assert "up{" not in growing


def _promtool_test(tmp_path: Path, spec_text: str, tests: str, *,
                   annotations: bool = False) -> None:
    """promtool unit *tests* of the rendered rules (their annotations left out unless
    *annotations*)."""
    spec = yaml.safe_load(spec_text)
    for group in spec["groups"]:
        for rule in group["rules"]:
            if not annotations:
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
      - series: 'up{job="pushgateway"}'
        values: '1x30'
    alert_rule_test:
      # Never pushed, or the Pushgateway not scraped: the alert cannot see recovery.
      - eval_time: 10m
        alertname: ReceiptsRecoveryNotRunning
        exp_alerts: [{exp_labels: {severity: warning}}]
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


@pytest.mark.slow
def test_recovery_success_can_be_read_from_the_pushgateway_instead(tmp_path: Path) -> None:
    result = template((), ("prometheusOperator.enabled=true",
                           "alerts.recoveryLastSuccessFrom=pushgateway"))
    assert result.returncode == 0, result.stderr
    spec_text = rules_spec_text(result.stdout)
    expr = _rule(spec_text, "ReceiptsRecoveryNotRunning")["expr"]
    assert "receipts_recovery_last_success_timestamp_seconds" in expr and "kube_" not in expr
    _promtool_test(tmp_path, spec_text, PUSHGATEWAY_TESTS)


@pytest.mark.slow
def test_recovery_success_is_read_where_the_values_say_it_is() -> None:
    def source(*sets: str) -> str:
        result = template((), ("prometheusOperator.enabled=true", *sets))
        assert result.returncode == 0, result.stderr
        spec_text = rules_spec_text(result.stdout)
        if "ReceiptsRecoveryNotRunning" not in alert_names(spec_text):
            return "not rendered"
        expr = _rule(spec_text, "ReceiptsRecoveryNotRunning")["expr"]
        return "kube-state-metrics" if "kube_cronjob" in expr else "pushgateway"

    assert source() == "not rendered"  # neither exporter: nothing to read
    assert source("alerts.kubeStateMetrics=true") == "kube-state-metrics"
    assert source("config.pushgatewayUrl=http://pgw:9091") == "pushgateway"
    assert source("config.pushgatewayUrl=http://pgw:9091",
                  "alerts.kubeStateMetrics=true") == "pushgateway"
    assert source("alerts.recoveryLastSuccessFrom=kube-state-metrics") == "kube-state-metrics"


@pytest.mark.slow
def test_the_recovery_alert_names_the_cronjob_as_rendered_for_any_release_name() -> None:
    release = "checkout-receipts-eu-west-1-production-blue-green-ab"  # 52 characters
    docs = render((), ("prometheusOperator.enabled=true", "alerts.kubeStateMetrics=true"),
                  release=release)
    (cron,) = [d for d in docs if d["kind"] == "CronJob"]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    (recovery,) = [r for g in rule["spec"]["groups"] for r in g["rules"]
                   if r["alert"] == "ReceiptsRecoveryNotRunning"]
    assert f'cronjob="{cron["metadata"]["name"]}"' in recovery["expr"]


def test_without_the_recovery_cronjob_there_is_no_recovery_success_alert() -> None:
    result = template((), ("prometheusOperator.enabled=true", "recovery.enabled=false",
                           "alerts.kubeStateMetrics=true"))
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


@pytest.mark.slow
def test_pruning_is_watched_only_when_it_runs() -> None:
    result = template((), ("prometheusOperator.enabled=true", "config.retentionDays=7"))
    assert result.returncode == 0, result.stderr
    expr = _rule(rules_spec_text(result.stdout), "ReceiptsPruningBehind")["expr"]
    assert "> 604800 + 7200" in expr  # 7 days + alerts.pruningBehindSeconds
    result = template((), ("prometheusOperator.enabled=true", "config.retentionDays=0"))
    assert result.returncode == 0, result.stderr
    assert "ReceiptsPruningBehind" not in alert_names(rules_spec_text(result.stdout))


KSM_TESTS = Path(__file__).resolve().parent / "kube-state-metrics.rules.test.yaml"


@pytest.mark.slow
def test_the_kube_state_metrics_alerts_fire_and_stay_silent(tmp_path: Path) -> None:
    result = template((), ("prometheusOperator.enabled=true", "alerts.kubeStateMetrics=true"))
    assert result.returncode == 0, result.stderr
    spec_text = rules_spec_text(result.stdout)
    tests = yaml.safe_load(KSM_TESTS.read_text())
    named = {c["alertname"] for case in tests["tests"] for c in case["alert_rule_test"]}
    assert named == {"ReceiptsReadyJobsGrowingAtMaxReplicas", "ReceiptsRecoveryNotRunning",
                     "ReceiptsKubeStateMetricsMissing"}
    _promtool_test(tmp_path, spec_text, KSM_TESTS.read_text(), annotations=True)


@pytest.mark.slow
def test_with_a_fixed_replica_count_growth_alone_is_enough(tmp_path: Path) -> None:
    result = template((), ("prometheusOperator.enabled=true", "autoscaling.enabled=false"))
    assert result.returncode == 0, result.stderr
    spec_text = rules_spec_text(result.stdout)
    assert "kube_" not in _rule(spec_text, "ReceiptsReadyJobsGrowingAtMaxReplicas")["expr"]
    _promtool_test(tmp_path, spec_text, FIXED_REPLICAS_TESTS)


@pytest.mark.slow
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


@pytest.mark.parametrize("alert", sorted(REQUIRED_ALERTS))
def test_every_alert_is_documented_with_a_runbook(alert: str) -> None:
    rule = _rule(profile_rules("monitoring"), alert)
    assert rule["labels"]["severity"] in {"info", "warning", "critical"}
    annotations = rule["annotations"]
    assert annotations["summary"] and annotations["description"]
    # No runbook_url by default: a relative link opens nowhere (alerts.runbookUrl sets one).
    assert "runbook_url" not in annotations
    page = RUNBOOK_DIR / alert.lower() / "README.md"
    assert page.exists(), f"{alert} needs a runbook page, {page} (python scripts/gen_docs.py)"
    assert page.read_text().startswith(f"# {alert}\n")


@pytest.mark.slow
def test_runbook_links_follow_the_base_url_the_operator_sets() -> None:
    base = "https://docs.example.internal/receipts/runbook/"
    result = template((), ("prometheusOperator.enabled=true", f"alerts.runbookUrl={base}"))
    assert result.returncode == 0, result.stderr
    rules = [r for g in yaml.safe_load(rules_spec_text(result.stdout))["groups"]
             for r in g["rules"] if "alert" in r]
    assert {r["annotations"]["runbook_url"] for r in rules} == {
        f"{base}{alert.lower()}/" for alert in ALERTS}


@pytest.mark.parametrize("url", ["docs/runbook/", "/runbook/", "runbook",
                                 "https://docs.shop.internal/runbook", "ftp://docs/runbook/"])
def test_a_runbook_url_alertmanager_cannot_open_is_refused(url: str) -> None:
    result = template((), ("prometheusOperator.enabled=true", f"alerts.runbookUrl={url}"))
    assert result.returncode != 0
    assert f'alerts.runbookUrl "{url}" must be an absolute http' in result.stderr


def test_runbook_urls_keep_the_folder_names_of_the_pages() -> None:
    # the pages' folders are the alert names in lower case, and so are the links
    base = "https://docs.shop.internal/receipts/runbook/"
    result = template((), ("prometheusOperator.enabled=true", f"alerts.runbookUrl={base}"))
    rules = [r for g in yaml.safe_load(rules_spec_text(result.stdout))["groups"]
             for r in g["rules"] if "alert" in r]
    for rule in rules:
        folder = rule["annotations"]["runbook_url"].removeprefix(base).rstrip("/")
        assert (RUNBOOK_DIR / folder / "README.md").exists(), folder


def test_named_alerts_can_be_disabled() -> None:
    off = ("ReceiptsManualPauseLong", "ReceiptsStaleAcks")
    result = template((), ("prometheusOperator.enabled=true",
                           f"alerts.disabled={{{','.join(off)}}}"))
    assert result.returncode == 0, result.stderr
    rules = [r["alert"] for g in yaml.safe_load(rules_spec_text(result.stdout))["groups"]
             for r in g["rules"] if "alert" in r]
    assert not set(off) & set(rules)
    assert set(rules) | set(off) == set(ALERTS)


def test_every_alert_disabled_and_nothing_to_record_renders_no_prometheus_rule() -> None:
    """No empty ``groups: []`` object: with every alert off (and the kube-state-metrics
    ones too) and no external-metric HPA to record for, the chart has no PrometheusRule."""
    every = [r["alert"] for g in yaml.safe_load(KSM_RULES_FILE.read_text())["groups"]
             for r in g["rules"]]
    off = f"alerts.disabled={{{','.join(every)}}}"
    result = template((), ("prometheusOperator.enabled=true", "alerts.kubeStateMetrics=true",
                           "autoscaling.keda.enabled=true", off))
    assert result.returncode == 0, result.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(result.stdout) if d]
    assert "PrometheusRule" not in kinds and "ServiceMonitor" in kinds
    # One alert left on: the object is back, with that alert alone.
    kept = template((), ("prometheusOperator.enabled=true", "alerts.kubeStateMetrics=true",
                         "autoscaling.keda.enabled=true",
                         f"alerts.disabled={{{','.join(every[1:])}}}"))
    assert kept.returncode == 0, kept.stderr
    result_rules = [r["alert"] for g in yaml.safe_load(rules_spec_text(kept.stdout))["groups"]
                    for r in g["rules"]]
    assert result_rules == [every[0]]


def test_disabling_an_alert_the_chart_does_not_have_is_refused() -> None:
    result = template((), ("prometheusOperator.enabled=true", "alerts.disabled={ReceiptsLagHigh}"))
    assert result.returncode != 0
    assert "/alerts/disabled/0" in result.stderr and "must be one of" in result.stderr
