"""The review page in the chart: off by default; when on, a least-privilege Deployment."""

from __future__ import annotations

from typing import Any

import pytest
from chartkit import CHART, by_kind, render, template

UI_VALUES = (CHART / "ci" / "ui-values.yaml",)


def _ui(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith("-ui")]
    return doc


def test_the_review_page_is_off_by_default() -> None:
    docs = render(())
    assert not [d for d in docs if d["metadata"]["name"].endswith("-ui")]


def test_the_review_page_deployment_binds_all_interfaces_and_gets_only_what_it_needs() -> None:
    docs = render(UI_VALUES)
    deployment = _ui(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["ui"]
    env = {e["name"]: e for e in container["env"]}
    assert env["RECEIPTS_UI_HOST"]["value"] == "0.0.0.0"
    assert env["RECEIPTS_UI_PORT"]["value"] == "8090"
    assert env["RECEIPTS_UI_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "receipts-ui-admin", "key": "token"}
    assert env["RECEIPTS_UI_VIEWER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "receipts-ui-viewer", "key": "token"}
    assert env["RECEIPTS_UI_ANONYMOUS_READ"]["value"] == "false"
    assert env["RECEIPTS_UI_REFRESH_SECONDS"]["value"] == "5"
    assert env["RECEIPTS_UI_POOL_MAX_SIZE"]["value"] == "2"  # what the budget counts
    assert "RECEIPTS_PROVIDER_TOKEN" not in env  # it never calls the provider
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False
    service = _ui(docs, "Service")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in service["spec"]["selector"].items())
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "ui"
    # The worker Service and PDB do not select the review page.
    worker_service = next(d for d in by_kind(docs, "Service") if d is not service)
    assert worker_service["spec"]["selector"]["app.kubernetes.io/component"] == "worker"


@pytest.mark.slow
def test_without_an_admin_token_secret_the_page_is_read_only() -> None:
    docs = render((), ("ui.enabled=true", "ui.anonymousRead=true"))
    (container,) = _ui(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    names = {e["name"] for e in container["env"]}
    assert "RECEIPTS_UI_ADMIN_TOKEN" not in names and "RECEIPTS_UI_VIEWER_TOKEN" not in names
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RECEIPTS_UI_ANONYMOUS_READ"] == "true"


@pytest.mark.slow
def test_reading_the_page_needs_a_viewer_token_unless_said_otherwise() -> None:
    result = template((), ("ui.enabled=true",))
    assert result.returncode != 0
    assert "set ui.viewerToken.existingSecret" in result.stderr
    assert "ui.anonymousRead=true only behind a proxy that authenticates" in result.stderr
    render((), ("ui.enabled=true", "ui.viewerToken.existingSecret=readers"))
    bad = template((), ("ui.enabled=true", "ui.anonymousRead=true", "ui.refreshSeconds=0"))
    assert bad.returncode != 0 and "refreshSeconds" in bad.stderr


@pytest.mark.slow
def test_the_connection_budget_counts_the_review_page() -> None:
    # Defaults: (10 + 1 surge) × (2 + 1) + 1 + 1 = 35, plus 2 per review page replica.
    render((), ("ui.enabled=true", "ui.anonymousRead=true", "connectionBudget.maxConnections=37"))
    result = template((), ("ui.enabled=true", "ui.anonymousRead=true",
                           "connectionBudget.maxConnections=36"))
    assert result.returncode != 0
    assert "+ review page 2 = 37 connections; budget 36" in result.stderr
