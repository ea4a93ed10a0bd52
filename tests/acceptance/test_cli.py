"""The `receipts` command as a user runs it: real processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from receipts.embedded import free_port
from tests.conftest import enqueue_many, fetch_rows

SECRET = "s3cr3t-pa55"


def receipts(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
             ) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")}
    full |= env or {}
    return subprocess.run([sys.executable, "-m", "receipts", *args], env=full, text=True,
                          capture_output=True, timeout=timeout)


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")}
    full |= env
    with log.open("wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "receipts", *args], env=full,
                                stdout=fh, stderr=subprocess.STDOUT)


def wait_http(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            assert time.monotonic() < deadline, f"{url} did not answer"
            time.sleep(0.05)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return {k: float(v) for k, _, v in (ln.rpartition(" ") for ln in lines)
            if k.startswith("receipts_")}


@pytest.fixture
def provider_proc(tmp_path):
    """`receipts provider` as a process; yields its base URL. Faults via PUT /faults."""
    port = free_port()
    proc = spawn(["provider", "--port", str(port)], {}, tmp_path / "provider.log")
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/stats")
    yield base
    proc.terminate()
    proc.wait(10)


def set_faults(base: str, **faults: object) -> None:
    req = urllib.request.Request(f"{base}/faults", data=json.dumps(faults).encode(),
                                 method="PUT", headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=5).close()


def worker_env(dsn: str, provider: str, **extra: str) -> dict[str, str]:
    env = {
        "RECEIPTS_DATABASE_URL": dsn,
        "RECEIPTS_PROVIDER_URL": f"{provider}/receipts",
        "RECEIPTS_LEASE_SECONDS": "4",
        "RECEIPTS_LEASE_MARGIN_SECONDS": "1",
        "RECEIPTS_DELIVERY_TIMEOUT_SECONDS": "3",
        "RECEIPTS_POLL_INTERVAL_SECONDS": "0.2",
        "RECEIPTS_RECOVERY_DELAY_SECONDS": "0",
        "RECEIPTS_METRICS_PORT": str(free_port()),
    }
    env.update(extra)
    return env


# ----------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"RECEIPTS_CONCURRENCY": "0"}, "RECEIPTS_CONCURRENCY"),
        ({"RECEIPTS_CONCURRENCY": "many"}, "RECEIPTS_CONCURRENCY"),
        ({"RECEIPTS_LEASE_SECONDS": "-5"}, "RECEIPTS_LEASE_SECONDS"),
        ({"RECEIPTS_DELIVERY_TIMEOUT_SECONDS": "55"}, "RECEIPTS_DELIVERY_TIMEOUT_SECONDS"),
        ({"RECEIPTS_DATABASE_URL": f"mysql://u:{SECRET}@h/db"}, "RECEIPTS_DATABASE_URL"),
        ({"RECEIPTS_DATABASE_URL": f"postgresql://u:{SECRET}@h:notaport/db"},
         "RECEIPTS_DATABASE_URL"),
        ({"RECEIPTS_DATABASE_URL": f"host=h password={SECRET} bogus=1"}, "RECEIPTS_DATABASE_URL"),
        ({"RECEIPTS_PROVIDER_URL": "ftp://x"}, "RECEIPTS_PROVIDER_URL"),
        ({"RECEIPTS_MAX_ATTEMPTS": "0"}, "RECEIPTS_MAX_ATTEMPTS"),
        ({"RECEIPTS_LOG_LEVEL": "LOUD"}, "RECEIPTS_LOG_LEVEL"),
        ({"RECEIPTS_METRICS_PORT": "70000"}, "RECEIPTS_METRICS_PORT"),
        ({"RECEIPTS_DATABASE_URL": ""}, "RECEIPTS_DATABASE_URL"),
    ],
)
def test_each_invalid_setting_is_refused_with_its_name_and_exit_2(env, names):
    base = {"RECEIPTS_DATABASE_URL": "postgresql://app@127.0.0.1:1/shop",
            "RECEIPTS_PROVIDER_TOKEN": SECRET}
    result = receipts("worker", env=base | env)
    assert result.returncode == 2
    assert names in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert SECRET not in result.stderr + result.stdout


def test_a_database_that_does_not_answer_is_exit_1_without_the_password():
    dsn = f"postgresql://app:{SECRET}@127.0.0.1:{free_port()}/db"
    result = receipts("migrate", env={"RECEIPTS_DATABASE_URL": dsn})
    assert result.returncode == 1
    assert "database unavailable" in result.stderr
    assert SECRET not in result.stderr + result.stdout


def test_bad_usage_is_exit_2():
    assert receipts("no-such-command").returncode == 2
    assert receipts("recover", "--loop", "soon").returncode == 2


def test_migrate_enqueue_and_stats_from_the_command_line(server):
    dsn = server.new_database(migrated=False)
    try:
        env = {"RECEIPTS_DATABASE_URL": dsn}
        first = receipts("migrate", env=env)
        assert first.returncode == 0 and "0001_receipt_jobs.sql" in first.stdout
        assert "up to date" in receipts("migrate", env=env).stdout
        out = receipts("enqueue", "A-1", "A-2", "A-1", env=env)
        assert out.returncode == 0 and "enqueued 2 job(s); 1 order(s)" in out.stdout
        stats = json.loads(receipts("jobs", "stats", "--json", env=env).stdout)
        assert stats["jobs"]["ready"] == 2
    finally:
        server.drop_database(dsn)


# -------------------------------------------------------------- processes


def test_a_worker_killed_mid_delivery_is_recovered_and_redelivered_with_the_same_key(
        dsn, provider_proc, tmp_path):
    set_faults(provider_proc, latency_seconds=2.0)
    enqueue_many(dsn, ["order-crash"])
    env = worker_env(dsn, provider_proc)
    victim = spawn(["worker"], env, tmp_path / "victim.log")
    deadline = time.monotonic() + 20
    while get_json(f"{provider_proc}/stats").get("requests", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait(5)
    assert fetch_rows(dsn, "SELECT state, attempts FROM receipt_jobs") == [("running", 1)]

    set_faults(provider_proc, latency_seconds=0.0)
    rescuer = spawn(["worker"], worker_env(dsn, provider_proc), tmp_path / "rescuer.log")
    try:
        deadline = time.monotonic() + 30
        while fetch_rows(dsn, "SELECT state FROM receipt_jobs") != [("done",)]:
            assert time.monotonic() < deadline, "job was not redelivered"
            result = receipts("recover", env=env)
            assert result.returncode == 0
            time.sleep(0.3)
    finally:
        rescuer.send_signal(signal.SIGTERM)
        assert rescuer.wait(20) == 0
    assert fetch_rows(dsn, "SELECT attempts, last_error FROM receipt_jobs") == [
        (2, "lease expired")]
    receipts_seen = get_json(f"{provider_proc}/receipts")
    assert list(receipts_seen) == ["receipt:order-crash"]
    # The killed worker's request finished at the provider: the second attempt
    # with the same key was a replay, not a second receipt.
    assert receipts_seen["receipt:order-crash"]["requests"] == 2


def test_sigterm_finishes_inflight_deliveries_acks_them_claims_nothing_more_exits_0(
        dsn, provider_proc, tmp_path):
    set_faults(provider_proc, latency_seconds=1.5)
    enqueue_many(dsn, [f"order-{i}" for i in range(20)])
    env = worker_env(dsn, provider_proc, RECEIPTS_CONCURRENCY="4",
                     RECEIPTS_LEASE_SECONDS="20", RECEIPTS_LEASE_MARGIN_SECONDS="5",
                     RECEIPTS_DELIVERY_TIMEOUT_SECONDS="10",
                     RECEIPTS_SHUTDOWN_GRACE_SECONDS="10")
    proc = spawn(["worker"], env, tmp_path / "worker.log")
    port = int(env["RECEIPTS_METRICS_PORT"])
    wait_http(f"http://127.0.0.1:{port}/healthz")
    deadline = time.monotonic() + 20
    while scrape(port).get("receipts_inflight_deliveries", 0) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    counts = dict(fetch_rows(dsn, "SELECT state, count(*) FROM receipt_jobs GROUP BY state"))
    assert counts == {"done": 4, "ready": 16}
    log_lines = [json.loads(ln) for ln in (tmp_path / "worker.log").read_text().splitlines()
                 if ln.startswith("{")]
    assert any(rec["event"] == "stopped" for rec in log_lines)


def test_recover_loop_runs_until_sigterm(dsn, tmp_path):
    proc = spawn(["recover", "--loop", "0.2"], {"RECEIPTS_DATABASE_URL": dsn},
                 tmp_path / "recover.log")
    time.sleep(1.0)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    sweeps = [ln for ln in (tmp_path / "recover.log").read_text().splitlines()
              if "recovery_sweep" in ln]
    assert len(sweeps) >= 2


def test_the_demo_runs_end_to_end_and_loses_nothing(server):
    dsn = server.new_database()
    try:
        enqueue_many(dsn, ["someone-elses-order"])  # the demo must not touch it
        result = receipts("demo", "--dsn", dsn, "--orders", "400", "--workers", "3",
                          "--concurrency", "16", timeout=300)
        assert fetch_rows(dsn, "SELECT order_id, state, attempts FROM receipt_jobs") == [
            ("someone-elses-order", "ready", 0)]
        leftovers = fetch_rows(dsn, "SELECT nspname FROM pg_namespace"
                                    " WHERE nspname LIKE 'receipts_demo%%'")
        assert leftovers == []
    finally:
        server.drop_database(dsn)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "result: OK — nothing lost" in out

    def figure(label: str) -> int:
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(label))
        return int(line.split()[len(label.split())])

    assert figure("orders placed") == 400
    assert figure("lost (not done, not failed)") == 0
    assert figure("done without a receipt") == 0
    assert figure("receipts delivered (done)") + figure("failed") == 400
    assert figure("receipts at provider (unique)") >= figure("receipts delivered (done)")
    assert "receipts_jobs_claimed_total" in out


@pytest.mark.parametrize(
    "args",
    [["--orders", "0"], ["--workers", "0"], ["--concurrency", "-1"],
     ["--dsn", f"postgresql://u:{SECRET}@h@x/db"], ["--dsn", "mysql://x/y"]],
)
def test_demo_refuses_bad_options_before_starting_anything(args):
    result = receipts("demo", *args, timeout=30)
    assert result.returncode == 2
    assert SECRET not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [["provider", "--port", "99999"], ["provider", "--latency-ms", "-5"],
     ["recover", "--loop", "nan"], ["recover", "--loop", "0.000001"],
     ["jobs", "list", "--limit", "99999999999999999999"]],
)
def test_out_of_range_options_are_usage_errors(args):
    result = receipts(*args, env={"RECEIPTS_DATABASE_URL": "postgresql://u@127.0.0.1:1/d"})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
