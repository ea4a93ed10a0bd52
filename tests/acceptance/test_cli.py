"""The `receipts` command as a user runs it: real processes, real signals."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import pytest

from receipts.embedded import free_port
from receipts.supervisor import Child, run_command
from tests.conftest import enqueue_many, fetch_rows

SECRET = "s3cr3t-pa55"


def receipts(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    """``receipts ARGS`` to its end, with only *env*'s settings."""
    return run_command(args, env, timeout_seconds=timeout)


def until(predicate: Callable[[], bool], what: str, timeout_seconds: float = 20) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)






def set_faults(provider: Child, **faults: object) -> None:
    provider.request("PUT", "/faults", json=faults).raise_for_status()


def worker_env(dsn: str, provider: Child, **extra: str) -> dict[str, str]:
    env = {
        "RECEIPTS_DATABASE_URL": dsn,
        "RECEIPTS_PROVIDER_URL": provider.url("/receipts"),
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


@pytest.mark.slow
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
        ({"RECEIPTS_EVENT_LOOP": "trio"}, "RECEIPTS_EVENT_LOOP"),
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


@pytest.mark.slow
def test_a_database_that_does_not_answer_is_exit_1_without_the_password():
    dsn = f"postgresql://app:{SECRET}@127.0.0.1:{free_port()}/db"
    result = receipts("migrate", env={"RECEIPTS_DATABASE_URL": dsn})
    assert result.returncode == 1
    assert "database unavailable" in result.stderr
    assert SECRET not in result.stderr + result.stdout


@pytest.mark.slow
def test_the_demo_on_a_database_that_does_not_answer_is_one_line_and_exit_1():
    dsn = f"postgresql://app:{SECRET}@127.0.0.1:{free_port()}/db"
    result = receipts("demo", "--dsn", dsn, timeout=60)
    assert result.returncode == 1
    assert "database unavailable" in result.stderr
    assert "Traceback" not in result.stderr
    assert SECRET not in result.stderr + result.stdout


@pytest.mark.slow
def test_the_review_page_on_a_taken_port_exits_1_at_once():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {"RECEIPTS_DATABASE_URL": f"postgresql://app:{SECRET}@127.0.0.1:{free_port()}/db",
               "RECEIPTS_UI_PORT": str(taken.getsockname()[1])}
        # It used to hang here for good (the pool's reconnect task outlived the
        # failed start), deaf to SIGTERM: the timeout would fail the test.
        result = receipts("ui", env=env, timeout=30)
    assert result.returncode == 1
    assert "address already in use" in result.stderr.lower()
    assert SECRET not in result.stderr + result.stdout


@pytest.mark.slow
def test_bad_usage_is_exit_2():
    assert receipts("no-such-command").returncode == 2
    assert receipts("recover", "--loop", "soon").returncode == 2


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_worker_killed_mid_delivery_is_recovered_and_redelivered_with_the_same_key(
        dsn, provider, sup):
    set_faults(provider, latency_seconds=2.0)
    enqueue_many(dsn, ["order-crash"])
    env = worker_env(dsn, provider)
    victim = sup.start("victim", ["worker"], env)
    until(lambda: provider.get_json("/stats").get("requests", 0) >= 1,
          "the victim's delivery to reach the provider")
    assert victim.kill() == -9
    assert fetch_rows(dsn, "SELECT state, attempts FROM receipt_jobs") == [("running", 1)]

    set_faults(provider, latency_seconds=0.0)
    rescuer = sup.start("rescuer", ["worker"], worker_env(dsn, provider))

    def recovered_and_done() -> bool:
        assert receipts("recover", env=env).returncode == 0
        return fetch_rows(dsn, "SELECT state FROM receipt_jobs") == [("done",)]

    until(recovered_and_done, "the job to be recovered and redelivered", timeout_seconds=30)
    assert rescuer.stop() == 0
    assert fetch_rows(dsn, "SELECT attempts, last_error FROM receipt_jobs") == [
        (2, "lease expired")]
    receipts_seen = provider.get_json("/receipts")
    assert list(receipts_seen) == ["receipt:order-crash"]
    # The killed worker's request finished at the provider: the second attempt
    # with the same key was a replay, not a second receipt.
    assert receipts_seen["receipt:order-crash"]["requests"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_sigterm_finishes_inflight_deliveries_acks_them_claims_nothing_more_exits_0(
        dsn, provider, sup, event_loop):
    set_faults(provider, latency_seconds=1.5)
    enqueue_many(dsn, [f"order-{i}" for i in range(20)])
    env = worker_env(dsn, provider, RECEIPTS_CONCURRENCY="4",
                     RECEIPTS_LEASE_SECONDS="20", RECEIPTS_LEASE_MARGIN_SECONDS="5",
                     RECEIPTS_DELIVERY_TIMEOUT_SECONDS="10",
                     RECEIPTS_SHUTDOWN_GRACE_SECONDS="10", RECEIPTS_EVENT_LOOP=event_loop)
    worker = sup.start("worker", ["worker"], env,
                       port=int(env["RECEIPTS_METRICS_PORT"])).wait_healthy()
    until(lambda: worker.scrape().total("receipts_inflight_deliveries") >= 4,
          "4 deliveries in flight")
    assert worker.stop(timeout_seconds=30) == 0
    counts = dict(fetch_rows(dsn, "SELECT state, count(*) FROM receipt_jobs GROUP BY state"))
    assert counts == {"done": 4, "ready": 16}
    log_lines = [json.loads(ln) for ln in worker.output().splitlines() if ln.startswith("{")]
    assert any(rec["event"] == "stopped" for rec in log_lines)
    started = next(rec for rec in log_lines if rec["event"] == "worker_started")
    assert started["event_loop"] == event_loop


@pytest.mark.slow
def test_recover_loop_runs_until_sigterm(dsn, sup):
    recover = sup.start("recover", ["recover", "--loop", "0.2"], {"RECEIPTS_DATABASE_URL": dsn})
    recover.wait_for_output("recovery_sweep", count=2)
    assert recover.running
    assert recover.stop(timeout_seconds=10) == 0


@pytest.mark.slow
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
    assert figure("lost (not done, failed, held)") == 0
    assert figure("done without a receipt") == 0
    # A held rejection (no other order accepted around it, so not judged) is in the queue.
    assert figure("receipts delivered (done)") + figure("failed") + figure(
        "held, awaiting evidence") == 400
    assert figure("receipts at provider (unique)") >= figure("receipts delivered (done)")
    # The metrics excerpt: one labelled line of counters per live worker, and their sum.
    per_worker = [ln.split() for ln in out.splitlines() if ln.strip().startswith("worker-")
                  and "claimed=" in ln]
    total = next(ln.split() for ln in out.splitlines() if ln.strip().startswith("all ")
                 and "claimed=" in ln)
    assert per_worker and all(cols[0].startswith("worker-") for cols in per_worker)

    def count(cols: list[str], name: str) -> int:
        return int(next(c for c in cols if c.startswith(name + "=")).split("=")[1])

    assert count(total, "acks") == sum(count(cols, "acks") for cols in per_worker)
    # The worker frozen past its lease: what the database refused as stale and what the
    # worker gave up itself, together its lost leases (a refused write counts in both).
    late = next(ln for ln in out.splitlines() if ln.strip().startswith("late outcomes"))
    assert figure("late outcomes not written") == count(total, "leases_lost")
    assert f"({count(total, 'stale_acks')} refused as stale" in late
    assert f"{count(total, 'leases_lost') - count(total, 'stale_acks')} given up" in late
    # The provider outage is called ridden out only when the fleet paused for it.
    outage = next(ln for ln in out.splitlines() if ln.strip().startswith("provider outage"))
    ridden = outage.split("ridden out", 1)[1].split()
    assert ridden[0] in ("yes:", "not", "no"), outage
    if ridden[0] == "yes:":
        assert int(ridden[1]) >= 1 and int(ridden[1]) <= count(total, "pauses"), outage


@pytest.mark.slow
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


@pytest.mark.slow
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
