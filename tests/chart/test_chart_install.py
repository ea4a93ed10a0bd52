"""Install day: the chart refuses mistakes with one clear message, keeps every name within
Kubernetes' limits, and renders its optional pieces (NetworkPolicy, extra volumes, proxy,
`helm test`, the external-metric HPA) as documented."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from chartkit import (
    CHART,
    NAMESPACE,
    OLDEST_KUBE_VERSION,
    RELEASE,
    REQUIRED_VALUES,
    by_kind,
    helm,
    one,
    pod_specs,
    render,
    template,
)

DSN = "secret.databaseUrl=postgresql://receipts@db.shop.internal/shop"
IMAGE = "image.repository=registry.shop.internal/receipts"
NETWORK_POLICY = CHART / "ci" / "network-policy-values.yaml"
KUBE_VERSIONS = [OLDEST_KUBE_VERSION, kubernetes_validate.latest_version()]


def refusal(*sets: str, values: tuple[Path, ...] = (), bare: bool = False) -> str:
    """helm's one-line error for values the chart must refuse."""
    result = template(values, sets, bare=bare)
    assert result.returncode != 0, f"rendered although it should not: {sets}"
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]
    return line


def values_file(tmp_path: Path, values: dict[str, Any]) -> tuple[Path, ...]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return (path,)


# ------------------------------------------------------------------ refusals


def test_without_an_image_repository_nothing_renders() -> None:
    message = refusal(DSN, bare=True)
    assert "image.repository is required" in message
    assert "--set image.repository=" in message  # says how


def test_the_documentation_placeholder_image_is_refused() -> None:
    message = refusal(DSN, "image.repository=registry.example.com/receipts", bare=True)
    assert '"registry.example.com/receipts" is a documentation placeholder' in message


def test_without_a_dsn_or_an_existing_secret_nothing_renders() -> None:
    message = refusal(IMAGE, bare=True)
    assert "secret.existingSecret or secret.databaseUrl is required" in message
    render((), ("secret.databaseUrl=", "secret.existingSecret=receipts-credentials"))


@pytest.mark.parametrize("url", ["ftp://x", "receipts.example.com/v1", "http://", "https:/x"])
def test_a_provider_url_that_is_not_http_is_refused(url: str) -> None:
    message = refusal(f"config.providerUrl={url}")
    assert f'config.providerUrl "{url}" must be an http:// or https:// URL' in message


@pytest.mark.parametrize("setting", [
    "config.providerUrl=https://user:pa55@provider.test/v1",
    "proxy.httpsProxy=http://user:pa55@proxy.internal:3128",
])
def test_credentials_in_a_url_bound_for_the_configmap_are_refused(setting: str) -> None:
    message = refusal(setting)
    assert "carries credentials" in message and "ConfigMap" in message
    assert "pa55" not in message


@pytest.mark.parametrize("schedule", ["* * * * * *", "*/5 * * *", "TZ=UTC * * * * *"])
def test_a_schedule_without_five_fields_is_refused(schedule: str) -> None:
    message = refusal(f"recovery.schedule={schedule}")
    assert f'recovery.schedule "{schedule}" has' in message
    assert "a Kubernetes CronJob schedule has 5" in message


@pytest.mark.parametrize("schedule", ["*/2 * * * *", "@hourly", " 0 3 * * 1 "])
def test_five_fields_or_a_macro_are_accepted(schedule: str, tmp_path: Path) -> None:
    cron = one(render(values_file(tmp_path, {"recovery": {"schedule": schedule}})), "CronJob")
    assert cron["spec"]["schedule"] == schedule


@pytest.mark.parametrize("key", ["RECEIPTS_DATABASE_URL", "RECEIPTS_PROVIDER_TOKEN", "PGPASSWORD",
                                 "OTEL_EXPORTER_OTLP_HEADERS_SECRET", "ORDERS_API_KEY"])
def test_secret_looking_extra_env_is_refused(key: str) -> None:
    message = refusal(f"config.extraEnv.{key}=x")
    assert f"config.extraEnv.{key} looks like a secret" in message
    assert "extraEnvFrom" in message


def test_a_url_with_a_password_in_extra_env_is_refused() -> None:
    message = refusal("config.extraEnv.RECEIPTS_OTLP_ENDPOINT=https://u:pw@otel.test")
    assert "holds a URL with a password" in message and ":pw@" not in message


def test_an_extra_volume_mount_needs_its_volume(tmp_path: Path) -> None:
    values = {"extraVolumeMounts": [{"name": "provider-ca", "mountPath": "/etc/ca"}]}
    message = refusal(values=values_file(tmp_path, values))
    assert 'extraVolumeMounts mounts "provider-ca", which is not in extraVolumes' in message


# ------------------------------------------------------- decimals from --set


def test_fractional_values_from_set_are_accepted() -> None:
    # `--set` passes 0.5 as the text "0.5"; the schema takes a decimal text where it wants
    # a number.
    docs = render((), ("config.pollIntervalSeconds=0.5", "config.deliveryTimeoutSeconds=2.5",
                       "config.shutdownGraceSeconds=7.5", "alerts.failureRatio=0.1",
                       "autoscaling.keda.enabled=true", "autoscaling.keda.utilisation=0.5"))
    data = one(docs, "ConfigMap")["data"]
    assert data["RECEIPTS_POLL_INTERVAL_SECONDS"] == "0.5"
    assert data["RECEIPTS_DELIVERY_TIMEOUT_SECONDS"] == "2.5"
    (trigger,) = one(docs, "ScaledObject")["spec"]["triggers"]
    assert trigger["metadata"]["targetQueryValue"] == "16"  # floor(32 × 0.5)
    # The grace period is computed from the text the same way: 2.5 + 7.5 + 5, up, + 5.
    grace = one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == 20


@pytest.mark.parametrize(("setting", "complaint"), [
    ("autoscaling.keda.utilisation=1.5", "autoscaling.keda.utilisation is 1.5: it must be above 0"
                                         " and at most 1"),
    ("config.pollIntervalSeconds=0.0", "config.pollIntervalSeconds is 0.0: it must be above 0"),
    ("alerts.failureRatio=0.0", "alerts.failureRatio is 0.0"),
])
def test_fractional_values_from_set_are_range_checked(setting: str, complaint: str) -> None:
    assert complaint in refusal(setting)


def test_non_numbers_are_still_refused_by_the_schema() -> None:
    result = template((), ("config.pollIntervalSeconds=soon",))
    assert result.returncode != 0 and "pollIntervalSeconds" in result.stderr


# ------------------------------------------------------------------- names

#: Longest name each kind may have: a CronJob appends 11 characters for its Jobs; a Job's
#: name is a label value of its pods; Services, Pods and Deployments (whose pods' names and
#: hostnames derive from it) keep to a DNS label.
NAME_LIMITS = {"CronJob": 52, "Job": 63, "Service": 63, "Pod": 63, "Deployment": 63}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
LONG = "checkout-receipts-eu-west-1-production-bluegreen-canary"  # 56 characters


@pytest.mark.slow
@pytest.mark.parametrize("release", [
    "r", "shop", "receipts", LONG[:43], LONG[:44], LONG[:45], LONG[:52], LONG[:53],
    "x" * 53, "receipts-" + "y" * 44, "shop-" + "z" * 48, "s" * 44,
])
def test_every_name_fits_kubernetes_limits_for_any_release_name(release: str) -> None:
    assert len(release) <= 53  # helm's own limit on release names
    # keda-values gives a DSN; the network policy's values an existing Secret: not both
    docs = render((NETWORK_POLICY, CHART / "ci" / "keda-values.yaml",
                   CHART / "ci" / "monitoring-values.yaml"), ("secret.databaseUrl=",),
                  release=release)
    seen: set[tuple[str, str]] = set()
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        assert len(name) <= NAME_LIMITS.get(kind, 253), (kind, name, len(name))
        assert DNS_SUBDOMAIN.match(name), (kind, name)
        assert (kind, name) not in seen, (kind, name)
        seen.add((kind, name))
    for doc in docs:
        for value in doc["metadata"]["labels"].values():
            assert len(str(value)) <= 63


def test_two_long_release_names_sharing_a_prefix_get_distinct_cronjobs() -> None:
    a_docs, b_docs = render((), release=LONG[:52] + "a"), render((), release=LONG[:52] + "b")
    for kind in ("Deployment", "CronJob", "Job", "Service", "ConfigMap", "Pod"):
        a, b = one(a_docs, kind)["metadata"]["name"], one(b_docs, kind)["metadata"]["name"]
        assert a != b, kind
    a = one(a_docs, "CronJob")["metadata"]["name"]
    assert len(a) == 52 and a.endswith("-recovery")
    # Short names keep their plain form.
    assert one(render(), "CronJob")["metadata"]["name"] == "receipts-recovery"


# ------------------------------------------------------------- new objects


def _ports(rule: dict[str, Any]) -> set[tuple[int, str]]:
    return {(p["port"], p["protocol"]) for p in rule["ports"]}


def test_network_policy_allows_what_the_pods_need_and_nothing_else() -> None:
    docs = render((NETWORK_POLICY,))
    policy = one(docs, "NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    # It selects every pod of the release: workers, recovery, migration, review page, test.
    selector = policy["podSelector"]["matchLabels"]
    pod_labels = {
        "Pod": lambda d: d["metadata"]["labels"],
        "Deployment": lambda d: d["spec"]["template"]["metadata"]["labels"],
        "Job": lambda d: d["spec"]["template"]["metadata"]["labels"],
        "CronJob": lambda d: d["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"],
    }
    workloads = [d for d in docs if d["kind"] in pod_labels]
    assert len(workloads) == len(pod_specs(docs)) == 5
    for doc in workloads:
        assert selector.items() <= pod_labels[doc["kind"]](doc).items(), doc["kind"]
    ingress = {next(iter(_ports(r))): r.get("from") for r in policy["ingress"]}
    assert ingress == {
        (9464, "TCP"): [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}],
        (8090, "TCP"): [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "support"}}}],
    }
    egress = [(_ports(r), r.get("to")) for r in policy["egress"]]
    assert egress[0][0] == {(53, "UDP"), (53, "TCP")} and egress[0][1]
    assert egress[1] == ({(6432, "TCP")}, [{"ipBlock": {"cidr": "10.20.0.0/24"}}])
    # The provider's requests go through the proxy: the proxy is allowed, not the provider.
    assert egress[2] == ({(3128, "TCP")}, [{"ipBlock": {"cidr": "10.30.0.10/32"}}])
    assert egress[3] == ({(9091, "TCP")}, None)  # the Pushgateway, any address
    assert len(egress) == 4


@pytest.mark.slow
@pytest.mark.parametrize(("sets", "port"), [
    (("config.providerUrl=https://provider.test/v1",), 443),
    (("config.providerUrl=http://provider.test:8080/v1",), 8080),
    # HTTPS_PROXY serves an https provider unless NO_PROXY names it.
    (("config.providerUrl=https://provider.test/v1", "proxy.httpsProxy=http://px:3128"), 3128),
    (("config.providerUrl=https://api.provider.test/v1", "proxy.httpsProxy=http://px:3128",
      "proxy.noProxy=.svc\\,provider.test"), 443),
    (("config.providerUrl=http://provider.test/v1", "proxy.httpsProxy=http://px:3128"), 80),
])
def test_network_policy_opens_the_provider_or_its_proxy(sets: tuple[str, ...], port: int) -> None:
    policy = one(render((), ("networkPolicy.enabled=true", *sets)), "NetworkPolicy")["spec"]
    egress = [_ports(r) for r in policy["egress"]]
    assert egress == [{(53, "UDP"), (53, "TCP")}, {(5432, "TCP")}, {(port, "TCP")}]


def test_extra_volumes_reach_every_workload_with_the_ca_file_setting() -> None:
    docs = render((NETWORK_POLICY,))
    specs = pod_specs(docs)
    assert {name.split("/")[0] for name, _ in specs} == {"Deployment", "CronJob", "Job", "Pod"}
    assert len(specs) == 5  # worker, review page, recovery, migration, helm test
    for name, spec in specs:
        assert {"name": "provider-ca", "configMap": {"name": "provider-ca"}} in spec["volumes"]
        for container in spec["containers"]:
            assert {"name": "provider-ca", "mountPath": "/etc/receipts/ca",
                    "readOnly": True} in container["volumeMounts"], name
            assert {"secretRef": {"name": "receipts-extra", "optional": True}} in container[
                "envFrom"], name
    data = one(docs, "ConfigMap")["data"]
    assert data["RECEIPTS_PROVIDER_CA_FILE"] == "/etc/receipts/ca/ca.crt"
    assert data["RECEIPTS_PROVIDER_PROXY"] == "http://egress-proxy.infra:3128"
    assert data["NO_PROXY"] == ".svc,.cluster.local"
    assert "HTTPS_PROXY" not in data


@pytest.mark.slow
def test_helm_test_runs_receipts_check_with_the_workers_settings() -> None:
    docs = render()
    pod = one(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] > 0
    (container,) = spec["containers"]
    assert container["args"] == ["check"]
    worker = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"] == worker["envFrom"]
    assert container["env"] == worker["env"]
    assert container["image"] == worker["image"]
    assert by_kind(render((), ("helmTest.enabled=false",)), "Pod") == []


def test_hooks_never_run_on_rollback_or_delete() -> None:
    # A rollback must never migrate (forward or back): migrations are expand-only and the
    # previous release's workers run on the newer schema (docs/design.md, Upgrades).
    for doc in render((NETWORK_POLICY,)):
        hooks = doc["metadata"].get("annotations", {}).get("helm.sh/hook")
        if hooks:
            assert set(hooks.split(",")) <= {"pre-install", "pre-upgrade", "test"}, doc["kind"]


def test_the_hpa_can_scale_on_the_queue_through_an_external_metric() -> None:
    docs = render((CHART / "ci" / "hpa-external-values.yaml",))
    (metric,) = one(docs, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric == {"type": "External", "external": {
        "metric": {"name": "receipts_jobs_due_or_in_flight",
                   "selector": {"matchLabels": {"job": "receipts"}}},
        "target": {"type": "AverageValue", "averageValue": "25"}}}  # floor(32 × 0.8)
    assert by_kind(docs, "ScaledObject") == []


def test_the_notes_give_the_external_metric_s_adapter_rule() -> None:
    values = ("-f", str(CHART / "ci" / "hpa-external-values.yaml"))
    notes = _notes(*values, "--set", "config.adaptiveConcurrency=true")
    series = "namespace_job:receipts_jobs_due_or_in_flight:capped"
    assert f"metricsQuery: max by (namespace, job) ({series}{{<<.LabelMatchers>>}})" in notes
    assert "name: {as: receipts_jobs_due_or_in_flight}" in notes
    assert "capped\n  at what the pods' adaptive limits can use" in notes
    # Without prometheus-operator the group must be added by hand; the notes say how.
    assert "--show-only templates/prometheusrule.yaml" in notes
    notes = _notes(*values, "--set", "prometheusOperator.enabled=true")
    assert "prometheusrule.yaml" not in notes and "adaptive limits" not in notes
    for citation in ("docs/", ".md"):
        assert citation not in notes, citation
    # The operator on but its PrometheusRule off: the same advice, and the command the
    # notes give prints the group (a trial found it failed with the rule switched off).
    off = ("--set", "prometheusOperator.enabled=true",
           "--set", "prometheusOperator.prometheusRule.enabled=false")
    notes = _notes(*values, *off)
    (advice,) = re.findall(r"--set (prometheusOperator\S+)\s+--show-only (\S+)", notes)
    shown = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                 "-f", str(REQUIRED_VALUES), *values, *off, "--set", advice[0],
                 "--show-only", advice[1])
    assert shown.returncode == 0, shown.stderr
    (rule,) = yaml.safe_load(shown.stdout)["spec"]["groups"][-1:]
    assert rule["name"] == "receipts-autoscaling"


# ------------------------------------------------------------------- NOTES


def _worker(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [d for d in by_kind(docs, "Deployment")
                     if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]
    return deployment


def _notes(*args: str) -> str:
    result = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                  "-f", str(REQUIRED_VALUES), *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:", 1)[1]


@pytest.mark.slow
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_notes_review_jobs_in_a_one_off_pod_that_works_at_zero_workers(
        kube_version: str) -> None:
    notes = _notes("-f", str(CHART / "ci" / "keda-values.yaml"), "-f", str(NETWORK_POLICY))
    assert "exec" not in notes  # the fleet may be at zero pods
    overrides = json.loads(re.search(r"--overrides='([^']+)'", notes)[1])  # type: ignore[index]
    name = re.search(r"run (\S+) --rm", notes)[1]  # type: ignore[index]
    image = re.search(r"--image=(\S+)", notes)[1]  # type: ignore[index]
    # kubectl run's pod, with the overrides merged as --override-type=strategic does.
    container = {**overrides["spec"]["containers"][0], "image": image, "args": ["jobs", "stats"]}
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, **overrides["metadata"]},
           "spec": {**overrides["spec"], "restartPolicy": "Never", "containers": [container]}}
    assert container["name"] == name  # merged into kubectl run's container, not beside it
    kubernetes_validate.validate(pod, kube_version, strict=True)
    docs = render((CHART / "ci" / "keda-values.yaml", NETWORK_POLICY))
    worker = _worker(docs)["spec"]["template"]["spec"]
    assert container["envFrom"] == worker["containers"][0]["envFrom"]
    assert container["env"][0] == next(e for e in worker["containers"][0]["env"]
                                       if e["name"] == "RECEIPTS_DATABASE_URL")
    assert pod["spec"]["volumes"] == worker["volumes"]
    # The NetworkPolicy lets it reach the database.
    selector = one(docs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert "port-forward svc/receipts-ui 8090" in notes  # the review page, when on


@pytest.mark.slow
@pytest.mark.parametrize(("rate", "latency"), [(1, 0.2), (2_000, 0.2), (500, 10.0)])
def test_the_planner_s_values_render(rate: float, latency: float, tmp_path: Path) -> None:
    from receipts.planner import helm_values, plan

    p = plan(rate, latency)
    path = tmp_path / "plan.yaml"
    path.write_text(helm_values(p))
    docs = render((path,))
    resources = _worker(docs)["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["memory"] == f"{p.memory_limit_bytes // 2**20}Mi"
    scaled = one(docs, "ScaledObject")["spec"]
    assert scaled["minReplicaCount"] < scaled["maxReplicaCount"]
