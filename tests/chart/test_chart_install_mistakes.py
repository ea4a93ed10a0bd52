"""Install-time mistakes a platform engineer made that used to render, each now refused with
one message naming the value; the API versions chosen from the cluster's version (1.20 up to
the current release); the NetworkPolicy's database port behind PgBouncer."""

from __future__ import annotations

from pathlib import Path

import pytest
from chartkit import CHART, by_kind, one, render, template

DSN = "secret.databaseUrl=postgresql://receipts@db.shop.internal/shop"


def refusal(*sets: str, kube_version: str | None = None) -> str:
    """helm's one-line error for values the chart must refuse."""
    result = template((), sets, kube_version)
    assert result.returncode != 0, f"rendered although it should not: {sets}"
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]
    return line


# ------------------------------------------------------------------ API versions


@pytest.mark.parametrize(("kube", "cronjob", "pdb", "hpa"), [
    ("1.20.2", "batch/v1beta1", "policy/v1beta1", "autoscaling/v2beta2"),
    ("1.21.0", "batch/v1", "policy/v1", "autoscaling/v2beta2"),
    ("1.23.0", "batch/v1", "policy/v1", "autoscaling/v2"),
    ("1.35.0", "batch/v1", "policy/v1", "autoscaling/v2"),
    (None, "batch/v1", "policy/v1", "autoscaling/v2"),  # helm's default: a current release
])
def test_api_versions_follow_the_cluster_s_version(kube: str | None, cronjob: str, pdb: str,
                                                   hpa: str) -> None:
    docs = render((), (), kube)
    assert one(docs, "CronJob")["apiVersion"] == cronjob
    assert one(docs, "PodDisruptionBudget")["apiVersion"] == pdb
    assert one(docs, "HorizontalPodAutoscaler")["apiVersion"] == hpa


def test_fields_newer_than_the_cluster_are_left_out() -> None:
    # matchLabelKeys (1.27) is refused by 1.20's API server ("unknown field")
    old = one(render((), (), "1.26.0"), "Deployment")["spec"]["template"]["spec"]
    assert all("matchLabelKeys" not in c for c in old["topologySpreadConstraints"])
    new = one(render(), "Deployment")["spec"]["template"]["spec"]
    constraints = new["topologySpreadConstraints"]
    assert all(c["matchLabelKeys"] == ["pod-template-hash"] for c in constraints)


def test_the_beta_hpa_carries_the_same_spec() -> None:
    old = one(render((), ("autoscaling.hpa.metric=external",), "1.20.2"), "HorizontalPodAutoscaler")
    new = one(render((), ("autoscaling.hpa.metric=external",)), "HorizontalPodAutoscaler")
    assert old["spec"] == new["spec"]


# ------------------------------------------------------------------ refusals


def test_an_existing_secret_and_a_dsn_together_are_refused() -> None:
    message = refusal("secret.existingSecret=receipts-credentials")  # the DSN is in the defaults
    assert ('secret.existingSecret ("receipts-credentials") is set together with '
            "secret.databaseUrl") in message
    message = refusal("secret.existingSecret=creds", "secret.databaseUrl=",
                      "secret.providerToken=t0k")
    assert "together with secret.providerToken" in message
    render((), ("secret.existingSecret=creds", "secret.databaseUrl="))


def test_the_provider_url_is_required() -> None:
    result = template((), ("config.providerUrl=",))
    assert result.returncode != 0
    assert "config.providerUrl is required" in result.stderr


@pytest.mark.parametrize("url", [
    "https://receipts.example.com/v1/receipts", "http://example.org/r",
    "https://api.example.net:8443/r", "HTTPS://Receipts.EXAMPLE.com/x",
])
def test_an_example_com_provider_url_is_refused(url: str) -> None:
    message = refusal(f"config.providerUrl={url}")
    assert "is a documentation placeholder" in message


def test_a_provider_host_merely_containing_example_is_accepted() -> None:
    render((), ("config.providerUrl=https://example.com.provider.internal/r",))
    render((), ("config.providerUrl=https://myexample.com/r",))


@pytest.mark.parametrize("zone", ["Europe/Pariss", "CET+1", "UTC+1", "europe/paris",
                                  "Mars/Olympus"])
def test_a_time_zone_not_in_the_iana_database_is_refused(zone: str) -> None:
    message = refusal(f"recovery.timeZone={zone}")
    assert f'recovery.timeZone "{zone}" is not a time zone of the IANA database' in message


@pytest.mark.parametrize("zone", ["Europe/Paris", "UTC", "America/Argentina/Buenos_Aires",
                                  "Etc/GMT+1"])
def test_iana_time_zones_are_accepted(zone: str) -> None:
    cron = one(render((), (f"recovery.timeZone={zone}",)), "CronJob")
    assert cron["spec"]["timeZone"] == zone


def test_a_time_zone_is_refused_where_kubernetes_would_drop_it() -> None:
    message = refusal("recovery.timeZone=Europe/Paris", kube_version="1.20.2")
    assert "needs Kubernetes 1.25 or later" in message


@pytest.mark.parametrize(("pod", "resource", "wanted", "limit"), [
    ("worker", "memory", "128Mi", "100Mi"),
    ("worker", "memory", "1Gi", "512Mi"),
    ("recovery", "memory", "96Mi", "64M"),
    ("migration", "memory", "200M", "190Mi"),
    ("helmTest", "memory", "96Mi", "95Mi"),
    ("worker", "cpu", "500m", "0.25"),
])
def test_a_limit_below_its_request_is_refused(pod: str, resource: str, wanted: str,
                                              limit: str) -> None:
    message = refusal(f"{pod}.resources.requests.{resource}={wanted}",
                      f"{pod}.resources.limits.{resource}={limit}")
    assert f"{pod}.resources.limits.{resource} ({limit}) is below its request ({wanted})" in message


def test_a_limit_at_or_above_its_request_is_accepted() -> None:
    render((), ("worker.resources.requests.memory=128Mi",
                "worker.resources.limits.memory=134217728",
                "recovery.resources.requests.memory=1G", "recovery.resources.limits.memory=1Gi",
                "worker.resources.requests.cpu=1", "worker.resources.limits.cpu=1000m"))


# ------------------------------------------------------------------ network policy


def _database_ports(docs: list[dict[str, object]]) -> set[int]:
    [policy] = by_kind(docs, "NetworkPolicy")
    spec = policy["spec"]
    assert isinstance(spec, dict)
    return {p["port"] for rule in spec["egress"] for p in rule["ports"]} - {53, 443, 3128, 9091}


@pytest.mark.parametrize(("sets", "port"), [
    ((), 5432),
    (("config.pgbouncer=true",), 6432),
    (("config.pgbouncer=true", "networkPolicy.database.port=5432"), 5432),
    (("networkPolicy.database.port=15432",), 15432),
])
def test_the_database_port_follows_pgbouncer(sets: tuple[str, ...], port: int) -> None:
    docs = render((), ("networkPolicy.enabled=true", *sets))
    assert port in _database_ports(docs)
    assert ({5432, 6432} - {port}).isdisjoint(_database_ports(docs))


def test_the_required_values_file_is_what_the_docs_install_with(tmp_path: Path) -> None:
    # docs/deploy.md's install snippet must render (no example.com placeholder in it)
    text = (CHART.parents[1] / "docs" / "deploy.md").read_text()
    snippet = text.split("helm install receipts ./helm/receipts", 1)[1].split("```", 1)[0]
    sets = [part.split("=", 1)[0].strip() + "=" + part.split("=", 1)[1].split()[0].rstrip("\\")
            for part in snippet.split("--set ")[1:]]
    # the snippet's existing Secret replaces the tests' DSN
    result = template((), (*sets, "secret.databaseUrl="))
    assert result.returncode == 0, result.stderr
