"""A real Prometheus (``.tools/bin/prometheus``) scraping real worker processes every second
and evaluating the chart's shipped alert rules with their durations scaled down
(``tests/chart/alert_timeline.py``'s :func:`scaled_rules`), for the console's fleet tests."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from receipts.embedded import free_port

CHART_TESTS = Path(__file__).resolve().parents[1] / "chart"


def scaled_rules(scale: float) -> str:
    """The shipped rules (the chart's defaults) with durations and thresholds divided by
    *scale*: the same rendering ``alert_timeline.py`` plays its fleet against."""
    if str(CHART_TESTS) not in sys.path:  # tests/chart is a folder of scripts, not a package
        sys.path.insert(0, str(CHART_TESTS))
    from alert_timeline import scaled_rules as render

    return str(render(scale))


class Prometheus:
    """``prometheus`` on a free port: *targets* scraped every second (job ``receipts``,
    namespace ``shop``), *rules* evaluated every second; its data under *folder*."""

    def __init__(self, folder: Path, rules: Path, targets: list[str]) -> None:
        if str(CHART_TESTS) not in sys.path:
            sys.path.insert(0, str(CHART_TESTS))
        from chartkit import find_tool

        self.folder = folder / "prometheus"
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "receipts", "honor_labels": True,
                                "static_configs": [{"targets": targets,
                                                    "labels": {"namespace": "shop"}}]}],
        }))
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = (self.folder / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [find_tool("prometheus"), f"--config.file={config}",
             f"--storage.tsdb.path={self.folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self._log.close()

    def _get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.base + path, timeout=10) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Return once Prometheus answers ``/-/ready``; ``TimeoutError`` otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.base + "/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if self.process.poll() is not None:
                raise RuntimeError((self.folder / "prometheus.log").read_text()[-2000:])
            time.sleep(0.2)
        raise TimeoutError("Prometheus did not become ready")

    def value(self, expr: str) -> float | None:
        """The first sample of an instant query, or None when it returns nothing."""
        answer = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        result = answer["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def alerts(self) -> dict[str, str]:
        """``{alert name: state}`` of every pending or firing alert now."""
        return {a["labels"]["alertname"]: a["state"]
                for a in self._get("/api/v1/alerts")["data"]["alerts"]}

    def last_evaluation(self) -> str:
        """The newest ``lastEvaluation`` over the rule groups (RFC 3339 text)."""
        groups = self._get("/api/v1/rules")["data"]["groups"]
        return max(g["lastEvaluation"] for g in groups)

    async def evaluations_after(self, seconds: float) -> dict[str, Any]:
        """Watch for *seconds*: ``{"evaluations": distinct rule evaluations seen,
        "alerts": {name: state} of every alert pending or firing at any point}``."""
        seen: dict[str, str] = {}
        evaluations: set[str] = set()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            seen |= await asyncio.to_thread(self.alerts)
            evaluations.add(await asyncio.to_thread(self.last_evaluation))
            await asyncio.sleep(0.5)
        return {"evaluations": len(evaluations), "alerts": seen}
