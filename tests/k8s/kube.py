"""kubectl and helm against the test cluster, and a deadline-bound wait on a condition."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "receipts"
T = TypeVar("T")


class Kube:
    """kubectl/helm in one namespace with a fixed environment (KUBECONFIG, helm homes)."""

    def __init__(self, env: dict[str, str], namespace: str) -> None:
        self.env = env
        self.namespace = namespace

    def run(self, *args: str, check: bool = True, stdin: str | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """Run a command; on ``check`` a non-zero exit raises AssertionError with its output."""
        result = subprocess.run(list(args), env=self.env, text=True, capture_output=True,
                                input=stdin, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """``kubectl -n <namespace> ARGS``."""
        return self.run("kubectl", "-n", self.namespace, *args, **kwargs)

    def helm(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """``helm -n <namespace> ARGS``."""
        return self.run("helm", "-n", self.namespace, *args, **kwargs)

    def get(self, *args: str) -> Any:
        """``kubectl get ARGS -o json``, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def pods(self, component: str = "worker") -> list[dict[str, Any]]:
        """The release's pods of one component (app.kubernetes.io/component label)."""
        items = self.get("pods", "-l", f"app.kubernetes.io/component={component}")["items"]
        return list(items)

    def ready_workers(self) -> list[str]:
        """Names of worker pods that are Ready and not terminating."""
        names = []
        for pod in self.pods():
            if pod["metadata"].get("deletionTimestamp"):
                continue
            conditions = pod.get("status", {}).get("conditions", [])
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                names.append(pod["metadata"]["name"])
        return sorted(names)

    def diagnostics(self) -> str:
        """Pods, events and recent worker logs, for a failure message."""
        parts = [self.kubectl("get", "all,pdb,hpa,networkpolicy", "-o", "wide", check=False).stdout,
                 self.kubectl("get", "events", "--sort-by=.lastTimestamp",
                              check=False).stdout[-4000:],
                 self.kubectl("logs", "-l", "app.kubernetes.io/component=worker", "--tail=20",
                              "--prefix", check=False).stdout[-4000:]]
        return "\n".join(parts)


def wait_until(what: str, probe: Callable[[], T | None], timeout: float,
               interval: float = 1.0, on_timeout: Callable[[], str] | None = None) -> T:
    """Poll ``probe`` until it returns a truthy value (returned) or ``timeout`` seconds pass
    (AssertionError naming ``what``, with ``on_timeout()``'s text when given)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = on_timeout() if on_timeout else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{extra}")
        time.sleep(interval)
