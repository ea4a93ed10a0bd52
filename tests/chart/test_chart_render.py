"""The Helm chart lints, renders to valid Kubernetes objects, and behaves as documented."""

from __future__ import annotations

import json
import math
import re
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
    REQUIRED_VALUES,
    by_kind,
    crd_schema,
    helm,
    one,
    pod_specs,
    render,
    template,
)
from kubernetes_validate.utils import SchemaNotFoundError, VersionNotSupportedError

from receipts.settings import Settings

SCENARIOS: list[tuple[Path, ...]] = [(), *((path,) for path in CI_VALUES)]
SCENARIO_IDS = ["defaults", *(path.name.removesuffix("-values.yaml") for path in CI_VALUES)]
KUBE_VERSIONS = [OLDEST_KUBE_VERSION, kubernetes_validate.latest_version()]
CUSTOM_GROUPS = ("keda.sh/", "monitoring.coreos.com/")
BUDGET_AT_LIMIT = CHART / "ci" / "budget-at-limit-values.yaml"


def test_ci_scenarios_cover_the_documented_cases() -> None:
    names = {path.name for path in CI_VALUES}
    assert {
        "keda-values.yaml",
        "hpa-values.yaml",
        "monitoring-values.yaml",
        "monitoring-off-values.yaml",
        "existing-secret-values.yaml",
        "budget-at-limit-values.yaml",
        "keda-pgbouncer-values.yaml",
        "scheduling-values.yaml",
    } <= names


# --------------------------------------------------------------------------- lint


@pytest.mark.slow
@pytest.mark.parametrize("values", SCENARIOS, ids=SCENARIO_IDS)
def test_helm_lint_strict_is_clean(values: tuple[Path, ...]) -> None:
    args = ["lint", "--strict", str(CHART), "-f", str(REQUIRED_VALUES)]
    for path in values:
        args += ["-f", str(path)]
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


# ------------------------------------------------------------- schema validation


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("values", SCENARIOS, ids=SCENARIO_IDS)
def test_scaled_object_min_replicas_do_not_exceed_max(values: tuple[Path, ...]) -> None:
    # The CRD's CEL rule (minReplicaCount <= maxReplicaCount) is not evaluated by jsonschema.
    for scaled in by_kind(render(values), "ScaledObject"):
        spec = scaled["spec"]
        assert 0 <= spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)


def test_kube_version_below_the_chart_minimum_is_refused() -> None:
    result = template((), (), "1.19.16")
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


def values_file(tmp_path: Path, values: dict[str, Any]) -> tuple[Path, ...]:
    """A values file holding *values* (for numbers `--set` would pass as strings)."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return (path,)


def budget_failure(*sets: str, values: tuple[Path, ...] = ()) -> str:
    result = template(values, sets)
    assert result.returncode != 0, "rendering should have failed"
    return result.stderr


def test_budget_exactly_at_its_limit_renders() -> None:
    docs = render((BUDGET_AT_LIMIT,))
    assert one(docs, "Deployment")


def test_budget_one_below_the_need_fails_with_the_arithmetic_and_the_rule() -> None:
    message = budget_failure("connectionBudget.maxConnections=16", values=(BUDGET_AT_LIMIT,))
    assert "connection budget exceeded" in message
    assert (
        "(4 max replicas + 1 rollout surge) × 3 per pod (pool 2 + listener 1) + recovery 1 "
        "+ migration 1 + KEDA 0 + reserved 0 = 17 connections; budget 16" in message
    )
    # The formula itself, so the reader can redo the sum for other values.
    assert ("(maxReplicas + worker.maxSurge + max(worker.maxUnavailable, "
            "podDisruptionBudget.maxUnavailable)) × (config.poolMaxSize + 1 listener") in message
    assert "connectionBudget.maxConnections" in message


def test_budget_counts_autoscaling_max_replicas_by_default() -> None:
    # Defaults: (10 + 1 draining) × (2 + 1) + 1 + 1 = 35.
    render((), ("connectionBudget.maxConnections=35",))
    assert "= 35 connections; budget 34" in budget_failure("connectionBudget.maxConnections=34")


def test_budget_counts_fixed_replicas_without_autoscaling() -> None:
    sets = ("autoscaling.enabled=false", "worker.replicaCount=5")
    render((), (*sets, "connectionBudget.maxConnections=20"))  # (5 + 1) × 3 + 2
    assert "(5 max replicas + 1 rollout surge)" in budget_failure(
        *sets, "connectionBudget.maxConnections=19")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sets", "surge"),
    [
        (("worker.maxSurge=2",), 3),  # 2 new pods + 1 old one draining
        (("worker.maxSurge=0", "worker.maxUnavailable=3"), 3),
        # 25 % of 10, rounded up, + the PDB's 1 evicted pod draining.
        (("worker.maxSurge=25%", "worker.maxUnavailable=0"), 4),
        (("worker.maxUnavailable=1", "podDisruptionBudget.maxUnavailable=2"), 2),
        (("worker.maxUnavailable=1", "podDisruptionBudget.maxUnavailable=2",
          "podDisruptionBudget.enabled=false"), 1),
    ],
)
def test_budget_counts_the_pods_a_rollout_or_an_eviction_adds(sets: tuple[str, ...],
                                                             surge: int) -> None:
    need = (10 + surge) * 3 + 2
    render((), (*sets, f"connectionBudget.maxConnections={need}"))
    message = budget_failure(*sets, f"connectionBudget.maxConnections={need - 1}")
    assert f"(10 max replicas + {surge} rollout surge)" in message
    assert f"= {need} connections" in message


@pytest.mark.slow
def test_budget_counts_keda_s_own_connection() -> None:
    keda = ("autoscaling.keda.enabled=true",)
    render((), (*keda, "connectionBudget.maxConnections=36"))  # 35 + KEDA 1
    message = budget_failure(*keda, "connectionBudget.maxConnections=35")
    assert "+ KEDA 1 + reserved 0 = 36 connections" in message
    # KEDA is off with autoscaling off, whatever keda.enabled says.
    render((), (*keda, "autoscaling.enabled=false", "worker.replicaCount=10",
                "connectionBudget.maxConnections=35"))


@pytest.mark.slow
def test_budget_has_no_listener_connection_behind_pgbouncer() -> None:
    pgbouncer = (CHART / "ci" / "pgbouncer-values.yaml",)
    render(pgbouncer)  # (20 + 1) × 2 + 1 + 1 = 44
    message = budget_failure("connectionBudget.maxConnections=43", values=pgbouncer)
    assert "(20 max replicas + 1 rollout surge) × 2 per pod (pool 2 + listener 0)" in message
    configmap = one(render(pgbouncer), "ConfigMap")
    assert configmap["data"]["RECEIPTS_LISTEN_NOTIFY"] == "false"
    assert configmap["data"]["RECEIPTS_PGBOUNCER"] == "true"


@pytest.mark.slow
def test_budget_counts_reserved_connections_and_skips_disabled_jobs() -> None:
    base = ("autoscaling.maxReplicas=2", "config.poolMaxSize=1", "config.listenNotify=false")
    render((), (*base, "connectionBudget.maxConnections=5"))  # (2 + 1) × 1 + 1 + 1
    render((), (*base, "recovery.enabled=false", "migration.enabled=false",
                "connectionBudget.reserved=2", "connectionBudget.maxConnections=5"))
    assert "reserved 3 = 8" in budget_failure(*base, "connectionBudget.reserved=3",
                                              "connectionBudget.maxConnections=7")


@pytest.mark.slow
def test_keda_behind_a_transaction_pooler_is_refused_unless_declared_compatible() -> None:
    sets = ("config.pgbouncer=true", "autoscaling.keda.enabled=true")
    result = template((), sets)
    assert result.returncode != 0
    assert "prepared statement" in result.stderr
    assert "autoscaling.keda.poolerCompatible" in result.stderr
    render((), (*sets, "autoscaling.keda.poolerCompatible=true"))
    # The CPU HPA does not query the database: no objection there.
    render((), ("config.pgbouncer=true",))


def test_a_rollout_that_could_never_replace_a_pod_is_refused() -> None:
    result = template((), ("worker.maxSurge=0", "worker.maxUnavailable=0"))
    assert result.returncode != 0 and "maxSurge" in result.stderr


def test_notes_show_the_same_budget_arithmetic_and_cite_no_document() -> None:
    result = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                  "-f", str(BUDGET_AT_LIMIT))
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert ("(4 max replicas + 1 rollout surge) × 3 connections per pod "
            "(pool 2 + listener 1)") in notes
    assert "+ recovery 1 + migration 1 + KEDA 0 + reserved 0" in notes
    assert "= 17 of 17 (connectionBudget.maxConnections)" in notes
    assert "receipts_jobs list --state failed" in notes
    assert "helm test receipts -n shop --logs" in notes
    assert "port-forward svc/receipts 9464:9464" in notes
    assert "metrics-server" in notes  # the CPU HPA's limits are stated
    for citation in ("docs/", "§", "design", ".md"):
        assert citation not in notes, citation


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


def _settings_from(configmap: dict[str, Any]) -> Settings:
    """The worker's Settings built from the ConfigMap the chart renders."""
    env = {name.removeprefix("RECEIPTS_").lower(): value
           for name, value in configmap["data"].items()}
    return Settings(database_url="postgresql://receipts@db.example/receipts", **env)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"shutdownGraceSeconds": 0},
        {"shutdownGraceSeconds": 2.5, "deliveryTimeoutSeconds": 1.5},
        {"shutdownGraceSeconds": 45, "deliveryTimeoutSeconds": 40},
        {"shutdownGraceSeconds": 300, "deliveryTimeoutSeconds": 100, "leaseSeconds": 300},
    ],
)
def test_grace_period_is_the_worker_s_own_stop_budget_plus_a_margin(
    config: dict[str, float], tmp_path: Path
) -> None:
    docs = render(values_file(tmp_path, {"config": config}))
    grace = one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    budget = _settings_from(one(docs, "ConfigMap")).stop_budget_seconds
    assert grace == math.ceil(budget) + 5, (grace, budget)


def test_the_stop_budget_formula_by_hand() -> None:
    # min(grace, delivery timeout) + ack flush max(5, min(grace, 30)) + pool close 5.
    base = {"database_url": "postgresql://receipts@db.example/receipts"}
    assert Settings(**base).stop_budget_seconds == 10 + 20 + 5  # the defaults
    assert Settings(**base, shutdown_grace_seconds=0).stop_budget_seconds == 0 + 5 + 5
    assert Settings(**base, shutdown_grace_seconds=120, delivery_timeout_seconds=40,
                    lease_seconds=60).stop_budget_seconds == 40 + 30 + 5
    assert one(render(), "Deployment")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] == 40


@pytest.mark.slow
def test_a_grace_period_below_the_stop_budget_is_refused_with_the_formula() -> None:
    result = template((), ("worker.terminationGracePeriodSeconds=39",))
    assert result.returncode != 0
    assert "terminationGracePeriodSeconds (39) is below 40" in result.stderr
    assert "stop budget is 35 s" in result.stderr
    deployment = one(render((), ("worker.terminationGracePeriodSeconds=40",)), "Deployment")
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 40
    # A longer grace drain raises the floor: 10 + 30 + 5 = 45, + 5.
    result = template((), ("config.shutdownGraceSeconds=60",
                           "worker.terminationGracePeriodSeconds=49"))
    assert result.returncode != 0 and "below 50" in result.stderr


@pytest.mark.slow
def test_extra_env_cannot_override_a_setting_the_chart_computes_from() -> None:
    result = template((), ("config.extraEnv.RECEIPTS_SHUTDOWN_GRACE_SECONDS=600",))
    assert result.returncode != 0
    assert "RECEIPTS_SHUTDOWN_GRACE_SECONDS" in result.stderr
    data = one(render((), ("config.extraEnv.RECEIPTS_AUTH_PAUSE_SECONDS=60",)), "ConfigMap")[
        "data"]
    assert data["RECEIPTS_AUTH_PAUSE_SECONDS"] == "60"


def test_a_delivery_timeout_longer_than_the_lease_allows_is_refused() -> None:
    result = template((), ("config.deliveryTimeoutSeconds=55",))
    assert result.returncode != 0
    assert "leaseMarginSeconds" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("values", SCENARIOS, ids=SCENARIO_IDS)
def test_no_container_runs_as_root_or_writes_its_root_filesystem(values: tuple[Path, ...]) -> None:
    specs = pod_specs(render(values))
    assert {name.split("/")[0] for name, _ in specs} == {"Deployment", "CronJob", "Job", "Pod"}
    for name, spec in specs:
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True, name
        assert pod["runAsUser"] > 0 and pod["runAsGroup"] > 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["enableServiceLinks"] is False, name
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_keda_scales_on_jobs_due_or_in_flight_and_replaces_the_hpa() -> None:
    docs = render((CHART / "ci" / "keda-values.yaml",))
    assert by_kind(docs, "HorizontalPodAutoscaler") == []
    scaled = one(docs, "ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 8)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "postgresql"
    assert trigger["metricType"] == "AverageValue"
    query = trigger["metadata"]["query"]
    assert "state = 'ready' AND run_at <= statement_timestamp() AND attempts < 5" in query
    assert "state = 'running' AND lease_until > statement_timestamp()" in query
    assert "receipt_flow WHERE pause_reason IS NOT NULL" in query
    # Target: floor(32 slots × 0.75) = 24 per pod; each count stops at 8 × 24 = 192.
    assert trigger["metadata"]["targetQueryValue"] == "24"
    assert "LIMIT 192" in query
    # Any job due or in flight wakes a fleet scaled to zero.
    assert trigger["metadata"]["activationTargetQueryValue"] == "0"
    auth = one(docs, "TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert auth["spec"]["secretTargetRef"][0]["parameter"] == "connection"
    assert "replicas" not in one(docs, "Deployment")["spec"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("concurrency", "utilisation", "max_attempts", "target"),
    [
        (32, None, 5, "25"),  # default utilisation 0.8
        (10, 1, 5, "10"),
        (1, 0.5, 5, "1"),  # at least 1
        (7, None, 9, "5"),
    ],
)
def test_keda_target_is_slots_times_utilisation(
    concurrency: int, utilisation: float | None, max_attempts: int, target: str, tmp_path: Path
) -> None:
    keda: dict[str, Any] = {"enabled": True}
    if utilisation is not None:
        keda["utilisation"] = utilisation
    values = {"config": {"concurrency": concurrency, "maxAttempts": max_attempts},
              "autoscaling": {"keda": keda}}
    docs = render(values_file(tmp_path, values))
    (trigger,) = one(docs, "ScaledObject")["spec"]["triggers"]
    assert trigger["metadata"]["targetQueryValue"] == target
    assert f"attempts < {max_attempts}" in trigger["metadata"]["query"]


@pytest.mark.parametrize("utilisation", [0, 1.5])
def test_keda_utilisation_outside_0_to_1_is_refused(utilisation: float, tmp_path: Path) -> None:
    values = {"autoscaling": {"keda": {"enabled": True, "utilisation": utilisation}}}
    result = template(values_file(tmp_path, values))
    assert result.returncode != 0 and "utilisation" in result.stderr


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
        # Only the pods of the same rollout step count (the old ones are about to go).
        assert constraint["matchLabelKeys"] == ["pod-template-hash"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    service = one(docs, "Service")
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


@pytest.mark.slow
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
        "RECEIPTS_LOCK_TIMEOUT_SECONDS", "RECEIPTS_ADAPTIVE_CONCURRENCY",
        "RECEIPTS_ADAPTIVE_CONCURRENCY_FLOOR", "RECEIPTS_ADAPTIVE_CONCURRENCY_CEILING",
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
        "HorizontalPodAutoscaler", "PodDisruptionBudget", "Pod",
    }


def _all_objects(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)


@pytest.mark.slow
def test_release_names_prefix_every_object() -> None:
    docs = render((CHART / "ci" / "keda-values.yaml",), release="prod")
    for name in _all_objects(docs):
        assert name.split("/", 1)[1].startswith("prod-receipts"), name


# ------------------------------------------------------------------ chart details

WORKLOAD_COMPONENTS = {"Deployment": "worker", "CronJob": "recovery", "Job": "migration"}
SHARED_KINDS = {"ConfigMap", "ServiceAccount", "PrometheusRule"}


def test_shared_objects_carry_no_component_and_workloads_their_own() -> None:
    docs = render((CHART / "ci" / "keda-values.yaml",))
    seen = set()
    for doc in docs:
        labels = doc["metadata"]["labels"]
        kind = doc["kind"]
        annotations = doc["metadata"].get("annotations", {})
        if kind == "ConfigMap" and doc["metadata"]["name"].endswith("-dashboard"):
            assert labels["app.kubernetes.io/component"] == "dashboard"
        elif kind in SHARED_KINDS or (kind == "Secret" and "helm.sh/hook" not in annotations):
            assert "app.kubernetes.io/component" not in labels, kind
            seen.add(kind)
        elif kind in WORKLOAD_COMPONENTS:
            assert labels["app.kubernetes.io/component"] == WORKLOAD_COMPONENTS[kind], kind
    assert seen == SHARED_KINDS | {"Secret"}


def _placement(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    return spec.get("nodeSelector"), spec.get("tolerations"), spec.get("affinity")


def test_recovery_and_migration_pods_take_the_worker_placement_unless_set() -> None:
    docs = render((CHART / "ci" / "scheduling-values.yaml",))
    specs = {name.split("/")[0]: spec for name, spec in pod_specs(docs)}
    worker = _placement(specs["Deployment"])
    assert worker[0] == {"pool": "workers"} and worker[1] and worker[2]
    assert _placement(specs["Job"]) == worker  # migration: nothing set, inherits
    # recovery: its own nodeSelector; [] and {} mean none, not the worker's.
    assert _placement(specs["CronJob"]) == ({"pool": "batch"}, None, None)


def test_placement_defaults_to_none_anywhere() -> None:
    for _, spec in pod_specs(render()):
        assert _placement(spec) == (None, None, None)


@pytest.mark.slow
def test_retention_zero_turns_pruning_off_and_renders() -> None:
    data = one(render((), ("config.retentionDays=0",)), "ConfigMap")["data"]
    assert data["RECEIPTS_RETENTION_DAYS"] == "0"
    settings = _settings_from({"data": data})
    assert settings.retention_seconds == 0  # recovery skips pruning at 0
    assert template((), ("config.retentionDays=-1",)).returncode != 0


def test_failed_recovery_runs_and_their_logs_are_kept_for_the_runbook() -> None:
    cron = one(render(), "CronJob")
    job = cron["spec"]["jobTemplate"]["spec"]
    # No TTL: the history limits keep the last failed Jobs (and their pods) until newer
    # failures replace them, however long ago they failed.
    assert "ttlSecondsAfterFinished" not in job
    assert cron["spec"]["failedJobsHistoryLimit"] >= 1
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # failed pods stay
    job = one(render((), ("recovery.ttlSecondsAfterFinished=86400",)), "CronJob")
    assert job["spec"]["jobTemplate"]["spec"]["ttlSecondsAfterFinished"] == 86400


@pytest.mark.slow
def test_pdb_lets_unhealthy_pods_be_evicted_where_kubernetes_knows_the_field() -> None:
    pdb = one(render(), "PodDisruptionBudget")
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    old = one(render((), (), "1.25.0"), "PodDisruptionBudget")
    assert "unhealthyPodEvictionPolicy" not in old["spec"]


def test_the_default_image_tag_is_the_version_the_chart_ships_with() -> None:
    import receipts

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == receipts.__version__
    image = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"registry.shop.internal/receipts:{receipts.__version__}"


def test_every_values_key_has_a_comment_above_it() -> None:
    """Each key of values.yaml is documented by the comment right above it, or lies inside
    a value documented as a whole (a `# --` comment above an ancestor: its default)."""
    missing = []
    stack: list[tuple[int, bool]] = []  # (indent, documented as a whole) of open ancestors
    comment: list[str] = []  # the comment lines right above the current line
    for number, line in enumerate((CHART / "values.yaml").read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped)
            continue
        key = re.match(r"^(\s*)(?:- )?([A-Za-z0-9_.-]+):", line)
        if key:
            indent = len(key[1])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            if not comment and not any(whole for _, whole in stack):
                missing.append(f"{number}: {stripped}")
            stack.append((indent, bool(comment) and comment[0].startswith("# --")))
        if stripped:
            comment = []
    assert not missing, "keys without a comment above them:\n" + "\n".join(missing)


@pytest.mark.parametrize(("sets", "message"), [
    (("config.adaptiveConcurrencyFloor=50", "config.adaptiveConcurrencyCeiling=10"),
     "config.adaptiveConcurrencyFloor (50) must be <= config.adaptiveConcurrencyCeiling (10)"),
    (("config.adaptiveConcurrencyFloor=null",), "must be set, each at least 1"),
])
def test_adaptive_concurrency_bounds_every_pod_would_refuse_are_refused(
        sets: tuple[str, ...], message: str) -> None:
    result = template((), sets)
    assert result.returncode != 0
    assert message in result.stderr
