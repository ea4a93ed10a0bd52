"""The benchmark command runs end to end (reduced sizes; no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_runs_end_to_end_and_writes_its_table_as_json(tmp_path):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert doc["machine"]["postgres"]["fsync"] == "on"
    assert doc["machine"]["postgres"]["synchronous_commit"] == "on"
    assert summary["raw"] and summary["receipts"] and summary["connections"]
    # The capacity planner's stable key (bench/README.md).
    assert summary["capacity"]["worker_cpu_us_per_http_delivery"]["median"] > 0
    assert {"receipts:waker", "receipts:notify", "receipts:poll"} <= set(summary["pickup"])
    assert summary["claim"]["uses_ready_index"] is True
    assert {"idle", "drain"} <= set(summary["checkout"])
    assert {t["target"] for t in doc["targets"]} >= {
        "receipts / raw limit (batch 100)", "DB connections held (pool + LISTEN)",
        "claim p99 at 1M done + 100k ready / empty"}
    assert any(t["target"].startswith("checkout p99 under drain") for t in doc["targets"])
    assert "target" in result.stdout and "raw pgbench" in result.stdout


def run_smoke(module: str, tmp_path: Path) -> tuple[dict, str]:
    out = tmp_path / f"{module}.json"
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
    result = subprocess.run([sys.executable, "-m", module, "--smoke", "--out", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def test_the_checkout_scenario_runs_on_both_disks_with_the_shim_loaded(tmp_path):
    doc, stdout = run_smoke("bench.checkout", tmp_path)
    assert set(doc["summary"]) == {"local", "slow"}
    assert doc["servers"]["slow"]["shim"] and doc["servers"]["local"]["shim"] is None
    for disk in ("local", "slow"):
        rows = doc["summary"][disk]["throughput"]
        assert {"order", "plain", "function", "receipts", "v020"} <= set(rows)
        assert all(cell["per_second"] > 0 for row in rows.values() for cell in row.values())
    local = doc["summary"]["local"]
    assert set(local["python"]) == {"order", "plain", "receipts", "v020"}
    assert set(local["rates"]) == {"order", "receipts"}
    assert "without ON CONFLICT" in local["rowcost"]
    assert "notify" not in doc["statements"]["receipts"].lower()
    assert "target" in stdout


def test_the_wakeups_scenario_measures_pickup_and_an_idle_fleet(tmp_path):
    doc, stdout = run_smoke("bench.wakeups", tmp_path)
    assert set(doc["summary"]["pickup"]) == {"waker", "notify"}
    assert all(run["measured"] == run["jobs"] for run in doc["pickup"])
    assert {run["pods"] for run in doc["idle"]} == {1, 2}
    assert "idle fleet" in stdout
