"""The benchmark command runs end to end (reduced sizes; no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from receipts.statements import statements

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_console_benchmark_runs_end_to_end(tmp_path):
    out = tmp_path / "console.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.experiments.console", "--rounds", "1", "--drain-jobs", "500",
         "--readings", "2", "--reading-rows", "2000", "--bulk-rows", "3000",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["tagged_tokens"]["plain"]["jobs_per_second"] > 0
    assert doc["tagged_tokens"]["tagged"]["server_cpu_us_per_job"] >= 0
    assert doc["shared_reading"]["readings"] == 2
    assert doc["heartbeats"]["hot_share"] == 1.0
    assert doc["bulk_retry"]["rows"] == 3000 and doc["bulk_retry"]["batches"] >= 2


@pytest.mark.slow
def test_the_memory_bench_runs_end_to_end_and_fits_its_line(tmp_path):
    out = tmp_path / "memory.json"
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
    result = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--slots", "4,16", "--rounds", "1",
         "--jobs-per-slot", "1", "--latency-ms", "200", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [run["slots"] for run in doc["runs"]] == [4, 16]
    assert all(run["peak_mib"] >= run["idle_mib"] > 0 for run in doc["runs"])
    assert {"base_bytes", "per_slot_bytes"} <= set(doc["summary"]["model"])
    assert "KiB × slots" in result.stdout


@pytest.mark.slow
def test_the_commit_comparison_runs_both_modes_interleaved(tmp_path):
    out = tmp_path / "commit.json"
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
    result = subprocess.run(
        [sys.executable, "-m", "bench.experiments.commit", "--rounds", "1", "--seconds", "1",
         "--jobs", "3000", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [p["mode"] for p in doc["phases"]] == ["idle", "off", "on", "on", "off"]
    assert all(p["wal_fsyncs_per_second"] >= 0 for p in doc["phases"])
    assert "drain off/on" in result.stdout


def run_smoke(module: str, tmp_path: Path) -> tuple[dict, str]:
    out = tmp_path / f"{module}.json"
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
    result = subprocess.run([sys.executable, "-m", module, "--smoke", "--out", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_wakeups_scenario_measures_pickup_and_an_idle_fleet(tmp_path):
    doc, stdout = run_smoke("bench.experiments.wakeups", tmp_path)
    assert set(doc["summary"]["pickup"]) == {"waker", "notify"}
    assert all(run["measured"] == run["jobs"] for run in doc["pickup"])
    assert {run["pods"] for run in doc["idle"]} == {1, 2}
    assert "idle fleet" in stdout


@pytest.mark.slow
def test_the_leading_share_experiment_measures_pickup_under_a_binding_limit(tmp_path):
    """Two workers (this checkout's, and the same src as the "baseline"), one round at
    one rate: every job's pickup measured, under the fleet's rate limit."""
    out = tmp_path / "lead.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.experiments.lead", "--smoke", "--rates", "8",
         "--pods", "2", "--baseline-src", str(ROOT / "src"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert sorted(r["worker"] for r in runs) == ["baseline", "this"]
    assert all(r["measured"] == r["jobs"] == 40 and r["processes"] == 2 for r in runs)
    assert "p99 ms" in result.stdout


def test_the_capacity_benchmarks_oracle_gives_the_fleet_exactly_the_capacity():
    """The oracle row (``--adaptive oracle``) is a static setting with C in flight: its
    slots add up to C, spread as evenly as the pods allow, and no pod has none."""
    from bench.experiments.capacity import main, oracle_slots

    for pods, capacity in [(1, 16), (2, 16), (3, 16), (5, 16), (16, 16), (7, 100)]:
        slots = oracle_slots(pods, capacity)
        assert len(slots) == pods and sum(slots) == capacity
        assert max(slots) - min(slots) <= 1
    assert oracle_slots(20, 16) == [1] * 20  # more pods than C: each keeps one
    for bad in (["--adaptive", "on,sometimes"], ["--pods", "abc"], ["--pods", "1,0"],
                ["--capacity", "0"], ["--warmup", "40", "--seconds", "30"]):
        with pytest.raises(SystemExit):
            main(bad)  # refused before any database starts


@pytest.mark.slow
def test_the_listener_experiment_delivers_only_the_listeners_channel(tmp_path):
    out = tmp_path / "listeners.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.experiments.listeners", "--rounds", "1",
         "--commits", "500", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["mine"]["delivered"] == 500 and summary["other"]["delivered"] == 0
    assert all(summary[c]["us_per_commit"] >= 0 for c in summary)


@pytest.mark.slow
def test_the_riding_ack_experiment_writes_the_same_rows_in_fewer_statements(tmp_path):
    out = tmp_path / "ride.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.experiments.ride", "--rounds", "1", "--loops", "20",
         "--gap", "0", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    # 20 claims of 4 jobs: with the acks riding, one statement per claim (0.25 per job);
    # alone, 19 more (the last round's jobs are not acked).
    assert summary["one statement"]["statements_per_job"] == 0.25
    assert summary["two statements"]["statements_per_job"] == round(39 / 80, 3)
    assert all(summary[m]["us_per_job"] > 0 for m in summary)


@pytest.mark.slow
def test_the_probe_experiment_wakes_one_pod_per_probe_with_each_text(tmp_path):
    out = tmp_path / "probe.json"
    text = tmp_path / "probe.sql"
    text.write_text(statements(None)["waker_probe"])  # the same text, read from a file
    result = subprocess.run(
        [sys.executable, "-m", "bench.experiments.probe", "--rounds", "1", "--probes", "60",
         "--done", "1000", "--sql", str(text), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["sql"] for r in runs] == ["waker_probe", str(text)]
    # 4 jobs fall due before each probe and the first member has 8 free slots: one pod.
    assert all(r["woken_per_probe"] == 1.0 and r["us_per_probe"] > 0 for r in runs)
