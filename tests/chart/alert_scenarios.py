"""Build `promtool test rules` files from tests/chart/alert_scenarios.yaml.

The YAML describes a healthy fleet (per-worker series and the exporters' series, as
timelines) and scenarios laid over it; each check names exactly the alerts that fire at a
minute. :func:`promtool_tests` turns one profile's view of it into a promtool test file
whose checks compare ``group by (alertname) (ALERTS{alertstate="firing"})`` with that set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SCENARIOS_FILE = Path(__file__).resolve().parent / "alert_scenarios.yaml"
WORKER_LABELS = 'job="receipts",namespace="shop"'
_RAMP = re.compile(r"^(-?[0-9.]+)([+-][0-9.]+)$")

Timeline = dict[int, Any]


@dataclass(frozen=True)
class Check:
    """One evaluation: the scenario, the minute, and the alerts expected to fire."""

    scenario: str
    minute: int
    firing: frozenset[str]


def load() -> dict[str, Any]:
    """The scenarios file as a dict."""
    data: dict[str, Any] = yaml.safe_load(SCENARIOS_FILE.read_text())
    return data


def samples(timeline: Timeline, minutes: int) -> str:
    """The promtool `values` text of *timeline* over minutes 0..*minutes*, one token each.

    A minute maps to a number (constant from then on), "N+S"/"N-S" (N then, S more or less
    per minute), "stale" (a staleness marker, then nothing) or "absent" (nothing).
    """
    points = sorted(timeline.items())
    tokens = []
    for minute in range(minutes + 1):
        start, spec = max(((m, s) for m, s in points if m <= minute), default=(0, "absent"))
        if spec == "absent" or (spec == "stale" and minute > start):
            tokens.append("_")
        elif spec == "stale":
            tokens.append("stale")
        elif isinstance(spec, str) and (ramp := _RAMP.match(spec.replace(" ", ""))):
            value = float(ramp[1]) + float(ramp[2]) * (minute - start)
            tokens.append(f"{value:g}")
        else:
            tokens.append(f"{float(spec):g}")
    return " ".join(tokens)


def _with_labels(key: str, extra: str) -> str:
    name, _, labels = key.partition("{")
    labels = labels.rstrip("}")
    return f"{name}{{{extra}{',' + labels if labels else ''}}}"


def _overlay(base: dict[str, Timeline], overrides: dict[str, Timeline]) -> dict[str, Timeline]:
    """*base* with *overrides* laid over it: "*" first, to every series, then by name."""
    out = {key: dict(timeline) for key, timeline in base.items()}
    for key in out:
        out[key].update(overrides.get("*", {}))
    for key, timeline in overrides.items():
        if key != "*":
            out.setdefault(key, {}).update(timeline)
    return out


def input_series(data: dict[str, Any], scenario: dict[str, Any],
                 exporters: list[str]) -> list[dict[str, str]]:
    """promtool input_series of one scenario for a profile with *exporters*."""
    minutes = data["minutes"]
    series = []
    overrides: dict[str, Timeline] = scenario.get("worker", {})
    for pod in data["workers"]:
        # "name@pod" overrides apply to that worker only.
        mine = {k: v for k, v in overrides.items() if "@" not in k}
        for key, timeline in overrides.items():
            name, _, only = key.partition("@")
            if only == pod:
                mine.setdefault(name, {}).update(timeline)
        for key, timeline in _overlay(data["worker"], mine).items():
            series.append((_with_labels(key, f'{WORKER_LABELS},pod="{pod}"'), timeline))
    for exporter in exporters:
        extra = scenario.get("exporters", {}).get(exporter, {})
        series += list(_overlay(data["exporters"][exporter], extra).items())
    out = []
    for name, timeline in series:
        values = samples(timeline, minutes)
        if set(values.split()) != {"_"}:
            out.append({"series": name, "values": values})
    return out


def checks(data: dict[str, Any], profile: str) -> list[Check]:
    """Every check of every scenario, with the alerts expected to fire in *profile*."""
    out = []
    for scenario in data["scenarios"]:
        for check in scenario["checks"]:
            firing = frozenset(check["fire"]) | frozenset(check.get(profile, []))
            out.append(Check(scenario["name"], check["at"], firing))
    return out


def promtool_tests(data: dict[str, Any], profile: str, rule_file: str) -> str:
    """A promtool test file running every scenario against *rule_file* for *profile*."""
    exporters = data["profiles"][profile]["exporters"]
    tests = []
    for scenario in data["scenarios"]:
        firing = [c for c in checks(data, profile) if c.scenario == scenario["name"]]
        tests.append({
            "name": scenario["name"],
            "interval": "1m",
            "input_series": input_series(data, scenario, exporters),
            "promql_expr_test": [
                {
                    "expr": 'group by (alertname) (ALERTS{alertstate="firing"})',
                    "eval_time": f"{check.minute}m",
                    "exp_samples": [{"labels": f'{{alertname="{name}"}}', "value": 1}
                                    for name in sorted(check.firing)],
                }
                for check in firing
            ],
        })
    document = {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests}
    return yaml.safe_dump(document, sort_keys=False, width=10_000)
