"""The Helm chart lints, renders to valid Kubernetes objects, and behaves as documented."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from chartkit import (
    CHART,
    CI_VALUES,
    NAMESPACE,
    OLDEST_KUBE_VERSION,
    RELEASE,
    by_kind,
    crd_schema,
    helm,
    one,
    pod_specs,
    render,
    template,
)
from kubernetes_validate.utils import SchemaNotFoundError, VersionNotSupportedError

SCENARIOS: list[tuple[Path, ...]] = [(), *((path,) for path in CI_VALUES)]
SCENARIO_IDS = ["defaults", *(path.name.removesuffix("-values.yaml") for path in CI_VALUES)]
KUBE_VERSIONS = [OLDEST_KUBE_VERSION, kubernetes_validate.latest_version()]
CUSTOM_GROUPS = ("keda.sh/", "monitoring.coreos.com/")
BUDGET_AT_LIMIT = CHART / "ci" / "budget-at-limit-values.yaml"
KEDA_QUERY = (
    "SELECT count(*) FROM receipt_jobs WHERE state = 'ready' AND run_at <= statement_timestamp()"
)


def test_ci_scenarios_cover_the_documented_cases() -> None:
    names = {path.name for path in CI_VALUES}
    assert {
        "keda-values.yaml",
        "hpa-values.yaml",
        "monitoring-values.yaml",
        "monitoring-off-values.yaml",
        "existing-secret-values.yaml",
        "budget-at-limit-values.yaml",
    } <= names


# --------------------------------------------------------------------------- lint


@pytest.mark.parametrize("values", SCENARIOS, ids=SCENARIO_IDS)
def test_helm_lint_strict_is_clean(values: tuple[Path, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for path in values:
        args += ["-f", str(path)]
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


# ------------------------------------------------------------- schema validation


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", SCENARIOS, ids=SCENARIO_IDS)
def test_every_manifest_validates_against_its_schema(
    values: tuple[Path, ...], kube_version: str
) -> None:
    docs = render(values, kube_version=kube_version)
    assert docs, "nothing rendered"
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["apiVersion"].startswith(CUSTOM_GROUPS):
            schema = crd_schema(doc["apiVersion"], doc["kind"])
            errors = sorted(
                jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path)
            )
            assert not errors, f"{name}: " + "; ".join(
                f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors
            )
            continue
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except (SchemaNotFoundError, VersionNotSupportedError) as exc:
            pytest.fail(f"{name}: no Kubernetes {kube_version} schema: {exc}")
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} is invalid for Kubernetes {kube_version}: {exc.message}")


def test_crd_validation_catches_a_misspelt_field() -> None:
    docs = render((CHART / "ci" / "keda-values.yaml",))
    scaled = json.loads(json.dumps(one(docs, "ScaledObject")))
    scaled["spec"]["maxReplicas"] = scaled["spec"].pop("maxReplicaCount")
    errors = list(
        jsonschema.Draft7Validator(crd_schema(scaled["apiVersion"], "ScaledObject")).iter_errors(
            scaled
        )
    )
    assert any("maxReplicas" in e.message for e in errors)


@pytest.mark.parametrize("values", SCENARIOS, ids=SCENARIO_IDS)
def test_scaled_object_min_replicas_do_not_exceed_max(values: tuple[Path, ...]) -> None:
    # The CRD's CEL rule (minReplicaCount <= maxReplicaCount) is not evaluated by jsonschema.
    for scaled in by_kind(render(values), "ScaledObject"):
        spec = scaled["spec"]
        assert 0 <= spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)


def test_kube_version_below_the_chart_minimum_is_refused() -> None:
    result = template((), (), "1.24.0")
    assert result.returncode != 0
    assert "kubeVersion" in result.stderr or "incompatible" in result.stderr


# ---------------------------------------------------------------- values schema


def test_values_schema_accepts_the_default_values() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)
    for path in CI_VALUES:
        jsonschema.Draft7Validator(schema).validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("config.concurrency=many", "concurrency"),
        ("autoscaling.maxReplicas=ten", "maxReplicas"),
        ("config.listenNotify=maybe", "listenNotify"),
    ],
)
def test_values_schema_rejects_a_wrong_type(setting: str, complaint: str) -> None:
    result = template((), (setting,))
    assert result.returncode != 0
    assert complaint in result.stderr


@pytest.mark.parametrize("setting", ["replicas=3", "config.concurrancy=8"])
def test_values_schema_rejects_unknown_keys(setting: str) -> None:
    result = template((), (setting,))
    assert result.returncode != 0
    assert "additional properties" in result.stderr.lower() or "not allowed" in result.stderr


# ------------------------------------------------------------- connection budget


def budget_failure(*sets: str, values: tuple[Path, ...] = ()) -> str:
    result = template(values, sets)
    assert result.returncode != 0, "rendering should have failed"
    return result.stderr


def test_budget_exactly_at_its_limit_renders() -> None:
    docs = render((BUDGET_AT_LIMIT,))
    assert one(docs, "Deployment")


def test_budget_one_below_the_need_fails_with_the_arithmetic() -> None:
    message = budget_failure("connectionBudget.maxConnections=13", values=(BUDGET_AT_LIMIT,))
    assert "connection budget exceeded" in message
    assert (
        "4 max replicas × 3 per pod (pool 2 + listener 1) + recovery 1 + migration 1 "
        "+ reserved 0 = 14 connections; budget 13" in message
    )
    assert "connectionBudget.maxConnections" in message


def test_budget_counts_autoscaling_max_replicas_by_default() -> None:
    # Defaults: 10 × (2 + 1) + 1 + 1 = 32.
    render((), ("connectionBudget.maxConnections=32",))
    assert "= 32 connections; budget 31" in budget_failure("connectionBudget.maxConnections=31")


def test_budget_counts_fixed_replicas_without_autoscaling() -> None:
    sets = ("autoscaling.enabled=false", "worker.replicaCount=5")
    render((), (*sets, "connectionBudget.maxConnections=17"))
    assert "5 max replicas" in budget_failure(*sets, "connectionBudget.maxConnections=16")


def test_budget_has_no_listener_connection_behind_pgbouncer() -> None:
    pgbouncer = (CHART / "ci" / "pgbouncer-values.yaml",)
    render(pgbouncer)  # 20 × 2 + 1 + 1 = 42
    message = budget_failure("connectionBudget.maxConnections=41", values=pgbouncer)
    assert "20 max replicas × 2 per pod (pool 2 + listener 0)" in message
    configmap = one(render(pgbouncer), "ConfigMap")
    assert configmap["data"]["RECEIPTS_LISTEN_NOTIFY"] == "false"
    assert configmap["data"]["RECEIPTS_PGBOUNCER"] == "true"


def test_budget_counts_reserved_connections_and_skips_disabled_jobs() -> None:
    base = ("autoscaling.maxReplicas=2", "config.poolMaxSize=1", "config.listenNotify=false")
    render((), (*base, "connectionBudget.maxConnections=4"))  # 2×1 + 1 + 1
    render((), (*base, "recovery.enabled=false", "migration.enabled=false",
                "connectionBudget.reserved=2", "connectionBudget.maxConnections=4"))
    assert "reserved 3 = 7" in budget_failure(*base, "connectionBudget.reserved=3",
                                              "connectionBudget.maxConnections=6")


def test_notes_show_the_same_budget_arithmetic() -> None:
    result = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                  "-f", str(BUDGET_AT_LIMIT))
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "4 max replicas × 3 connections per pod (pool 2 + listener 1)" in notes
    assert "+ recovery 1 + migration 1 + reserved 0" in notes
    assert "= 14 of 14 (connectionBudget.maxConnections)" in notes
    assert "receipts jobs list --state failed" in notes
    assert "port-forward svc/receipts 9464:9464" in notes


# ------------------------------------------------------------------- behaviour


def test_recovery_cronjob_forbids_concurrent_runs_and_is_bounded() -> None:
    cron = one(render(), "CronJob")
    spec = cron["spec"]
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["schedule"] == "* * * * *"
    assert spec["startingDeadlineSeconds"] > 0
    assert spec["successfulJobsHistoryLimit"] >= 0 and spec["failedJobsHistoryLimit"] >= 1
    job = spec["jobTemplate"]["spec"]
    assert 0 < job["activeDeadlineSeconds"] < 3600
    container = job["template"]["spec"]["containers"][0]
    assert container["args"] == ["recover"]


def test_migration_runs_as_a_pre_install_and_pre_upgrade_hook() -> None:
    docs = render()
    job = one(docs, "Job")
    hooks = job["metadata"]["annotations"]
    assert set(hooks["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["migrate"]
    # The release Secret does not exist yet at pre-install: a hook Secret comes first.
    hook_secret = next(s for s in by_kind(docs, "Secret") if "helm.sh/hook" in s["metadata"].get(
        "annotations", {}))
    assert int(hook_secret["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        hooks["helm.sh/hook-weight"])
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RECEIPTS_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == (
        hook_secret["metadata"]["name"])


def test_grace_period_exceeds_delivery_timeout_plus_drain() -> None:
    for sets in [(), ("config.deliveryTimeoutSeconds=45", "config.shutdownGraceSeconds=30")]:
        deployment = one(render((), sets), "Deployment")
        config = one(render((), sets), "ConfigMap")["data"]
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > float(config["RECEIPTS_DELIVERY_TIMEOUT_SECONDS"]) + float(
            config["RECEIPTS_SHUTDOWN_GRACE_SECONDS"])


def test_a_too_short_grace_period_is_refused() -> None:
    result = template((), ("worker.terminationGracePeriodSeconds=30",))
    assert result.returncode != 0
    assert "terminationGracePeriodSeconds" in result.stderr


def test_a_delivery_timeout_longer_than_the_lease_allows_is_refused() -> None:
    result = template((), ("config.deliveryTimeoutSeconds=55",))
    assert result.returncode != 0
    assert "leaseMarginSeconds" in result.stderr


@pytest.mark.parametrize("values", SCENARIOS, ids=SCENARIO_IDS)
def test_no_container_runs_as_root_or_writes_its_root_filesystem(values: tuple[Path, ...]) -> None:
    specs = pod_specs(render(values))
    assert {name.split("/")[0] for name, _ in specs} == {"Deployment", "CronJob", "Job"}
    for name, spec in specs:
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True, name
        assert pod["runAsUser"] > 0 and pod["runAsGroup"] > 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name
        tmp = next(v for v in spec["volumes"] if v["name"] == "tmp")
        assert "emptyDir" in tmp, name
        for container in spec["containers"]:
            ctx = container["securityContext"]
            assert ctx["runAsNonRoot"] is True, name
            assert ctx.get("runAsUser", pod["runAsUser"]) > 0, name
            assert ctx["readOnlyRootFilesystem"] is True, name
            assert ctx["allowPrivilegeEscalation"] is False, name
            assert ctx.get("privileged", False) is False, name
            assert ctx["capabilities"]["drop"] == ["ALL"], name
            assert "add" not in ctx["capabilities"], name
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"], name


def test_service_account_does_not_mount_a_token() -> None:
    account = one(render(), "ServiceAccount")
    assert account["automountServiceAccountToken"] is False


SECRET_DSN = "postgresql://receipts:Sup3rS3cretPw@db.example:5432/receipts"
SECRET_TOKEN = "tok_9f8e7d6c5b4a"


def test_secrets_never_appear_outside_secrets() -> None:
    docs = render((CHART / "ci" / "keda-values.yaml",),
                  (f"secret.databaseUrl={SECRET_DSN}", f"secret.providerToken={SECRET_TOKEN}"))
    for doc in docs:
        if doc["kind"] == "Secret":
            continue
        text = json.dumps(doc)
        for needle in (SECRET_DSN, "Sup3rS3cretPw", SECRET_TOKEN):
            assert needle not in text, f"{doc['kind']}/{doc['metadata']['name']} leaks a secret"
    for configmap in by_kind(docs, "ConfigMap"):
        keys = set(configmap.get("data", {}))
        assert not keys & {"RECEIPTS_DATABASE_URL", "RECEIPTS_PROVIDER_TOKEN"}
    for name, spec in pod_specs(docs):
        env = {e["name"]: e for e in spec["containers"][0].get("env", [])}
        for var in ("RECEIPTS_DATABASE_URL", "RECEIPTS_PROVIDER_TOKEN"):
            assert "secretKeyRef" in env[var]["valueFrom"], (name, var)


def test_existing_secret_replaces_the_chart_secret_everywhere() -> None:
    docs = render((CHART / "ci" / "existing-secret-values.yaml",))
    assert by_kind(docs, "Secret") == []
    for name, spec in pod_specs(docs):
        env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in spec["containers"][0]["env"]
               if "valueFrom" in e}
        assert env["RECEIPTS_DATABASE_URL"] == {"name": "receipts-credentials", "key": "dsn"}, name
        assert env["RECEIPTS_PROVIDER_TOKEN"]["key"] == "token", name
    auth = one(docs, "TriggerAuthentication")
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "connection", "name": "receipts-credentials", "key": "keda-dsn"}]
    assert by_kind(docs, "ServiceAccount") == []
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "receipts-runner"


def test_keda_scales_on_due_ready_jobs_and_replaces_the_hpa() -> None:
    docs = render((CHART / "ci" / "keda-values.yaml",))
    assert by_kind(docs, "HorizontalPodAutoscaler") == []
    scaled = one(docs, "ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 8)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "postgresql"
    assert trigger["metadata"]["query"] == KEDA_QUERY
    assert trigger["metadata"]["targetQueryValue"] == "200"
    assert trigger["metadata"]["activationTargetQueryValue"] == "1"
    auth = one(docs, "TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert auth["spec"]["secretTargetRef"][0]["parameter"] == "connection"
    assert "replicas" not in one(docs, "Deployment")["spec"]


def test_without_keda_a_cpu_hpa_scales_the_workers() -> None:
    docs = render((CHART / "ci" / "hpa-values.yaml",))
    assert by_kind(docs, "ScaledObject") == []
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9464"


def test_scale_to_zero_needs_keda() -> None:
    result = template((), ("autoscaling.minReplicas=0",))
    assert result.returncode != 0 and "keda" in result.stderr.lower()


def test_fixed_replicas_without_autoscaling() -> None:
    docs = render((CHART / "ci" / "monitoring-off-values.yaml",))
    assert one(docs, "Deployment")["spec"]["replicas"] == 3
    assert by_kind(docs, "HorizontalPodAutoscaler") == by_kind(docs, "ScaledObject") == []
    assert by_kind(docs, "PrometheusRule") == [] and one(docs, "ServiceMonitor")


def test_worker_deployment_wiring() -> None:
    docs = render()
    deployment = one(docs, "Deployment")
    spec = deployment["spec"]
    pod = spec["template"]
    selector = spec["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert spec["strategy"]["rollingUpdate"]["maxSurge"] == 0  # the budget holds in rollouts
    (container,) = pod["spec"]["containers"]
    assert container["args"] == ["worker"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9464, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["envFrom"] == [{"configMapRef": {"name": one(docs, "ConfigMap")["metadata"][
        "name"]}}]
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert "checksum/config" in pod["metadata"]["annotations"]
    for constraint in pod["spec"]["topologySpreadConstraints"]:
        assert constraint["labelSelector"]["matchLabels"] == selector
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    service = one(docs, "Service")
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


def test_config_change_rolls_the_workers() -> None:
    def checksum(*sets: str) -> str:
        deployment = one(render((), sets), "Deployment")
        return deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert checksum() != checksum("config.concurrency=16")


def test_configmap_carries_every_documented_setting() -> None:
    data = one(render((CHART / "ci" / "monitoring-values.yaml",)), "ConfigMap")["data"]
    expected = {
        "RECEIPTS_PROVIDER_URL", "RECEIPTS_CONCURRENCY", "RECEIPTS_LEASE_SECONDS",
        "RECEIPTS_LEASE_MARGIN_SECONDS", "RECEIPTS_MAX_ATTEMPTS",
        "RECEIPTS_DELIVERY_TIMEOUT_SECONDS", "RECEIPTS_POLL_INTERVAL_SECONDS",
        "RECEIPTS_CLAIM_BATCH_MAX", "RECEIPTS_METRICS_PORT", "RECEIPTS_LOG_LEVEL",
        "RECEIPTS_POOL_MAX_SIZE", "RECEIPTS_LISTEN_NOTIFY", "RECEIPTS_PGBOUNCER",
        "RECEIPTS_SHUTDOWN_GRACE_SECONDS", "RECEIPTS_RETRY_BASE_SECONDS",
        "RECEIPTS_RETRY_CAP_SECONDS", "RECEIPTS_RETENTION_DAYS", "RECEIPTS_PUSHGATEWAY_URL",
        "RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS", "RECEIPTS_STATEMENT_TIMEOUT_SECONDS",
        "RECEIPTS_LOCK_TIMEOUT_SECONDS",
    }
    assert set(data) == expected
    assert all(isinstance(value, str) for value in data.values())
    assert data["RECEIPTS_METRICS_PORT"] == "9464"


def test_service_monitor_scrapes_the_metrics_service() -> None:
    docs = render((CHART / "ci" / "monitoring-values.yaml",))
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rule = one(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_defaults_render_no_custom_resources() -> None:
    # KEDA and prometheus-operator CRDs are opt-in: a plain cluster can install the defaults.
    kinds = {doc["kind"] for doc in render()}
    assert kinds == {
        "ServiceAccount", "Secret", "ConfigMap", "Service", "Deployment", "CronJob", "Job",
        "HorizontalPodAutoscaler", "PodDisruptionBudget",
    }


def _all_objects(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)


def test_release_names_prefix_every_object() -> None:
    docs = render((CHART / "ci" / "keda-values.yaml",), release="prod")
    for name in _all_objects(docs):
        assert name.split("/", 1)[1].startswith("prod-receipts"), name
