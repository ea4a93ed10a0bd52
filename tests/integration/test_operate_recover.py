"""``receipts recover``: its summary, and its counts pushed to a (tiny, real) Pushgateway."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from receipts.embedded import free_port
from receipts.supervisor import parse_metrics, run_command
from tests.conftest import enqueue_many, fetch_rows


@dataclass
class FakeGateway:
    """Records every request: (method, path, content type, body)."""

    port: int
    requests: list[tuple[str, str, str, str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def gateway() -> Iterator[FakeGateway]:
    fake = FakeGateway(free_port())

    class Handler(BaseHTTPRequestHandler):
        def _record(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode()
            fake.requests.append((self.command, self.path,
                                  self.headers.get("Content-Type", ""), body))
            self.send_response(200)
            self.end_headers()

        do_PUT = do_POST = _record

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", fake.port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def _seed(dsn: str) -> None:
    """Two expired leases with attempts left, one at max attempts, three old done rows."""
    enqueue_many(dsn, ["exp-1", "exp-2", "exp-max", "fresh"])
    fetch_rows(dsn, """
        UPDATE receipt_jobs SET state = 'running', attempts = CASE order_id
                 WHEN 'exp-max' THEN 5 ELSE 1 END,
               lease_token = gen_random_uuid(),
               lease_until = statement_timestamp() - interval '1 minute'
        WHERE order_id LIKE 'exp-%%' RETURNING 1""")
    # Done rows are written as such: an UPDATE to done must pass the ack's lease guard.
    fetch_rows(dsn, """
        INSERT INTO receipt_jobs (id, order_id, state, attempts, finished_at)
        SELECT gen_random_uuid(), 'old-' || g, 'done', 1,
               statement_timestamp() - interval '3 days'
        FROM generate_series(1, 3) AS g RETURNING 1""")


def _env(dsn: str, **extra: str) -> dict[str, str]:
    return {"RECEIPTS_DATABASE_URL": dsn, "RECEIPTS_MAX_ATTEMPTS": "5",
            "RECEIPTS_RETENTION_DAYS": "1", "RECEIPTS_RECOVERY_DELAY_SECONDS": "0", **extra}


@pytest.mark.slow
def test_recover_pushes_its_counts_to_the_pushgateway(dsn: str, gateway: FakeGateway) -> None:
    _seed(dsn)
    started = time.time()
    result = run_command(["recover"], _env(dsn, RECEIPTS_PUSHGATEWAY_URL=gateway.url))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("recovered 2 expired lease(s) to ready, 1 to failed;")
    assert "pruned 3 finished row(s)" in result.stdout
    assert "due again" not in result.stdout  # RECEIPTS_RECOVERY_DELAY_SECONDS=0: due at once

    (method, path, content_type, body), = gateway.requests
    assert (method, path) == ("PUT", "/metrics/job/receipts-recover")
    assert content_type.startswith("text/plain")
    pushed = parse_metrics(body)
    # This sweep's figures, as gauges the next push replaces (never `_total` counters).
    assert pushed.value("receipts_recovery_last_sweep_expired_leases", result="ready") == 2
    assert pushed.value("receipts_recovery_last_sweep_expired_leases", result="failed") == 1
    assert pushed.value("receipts_recovery_last_sweep_exhausted_jobs") == 0
    assert pushed.value("receipts_recovery_last_sweep_pruned_rows") == 3
    assert 0 < pushed.value("receipts_recovery_last_sweep_duration_seconds") < 60
    assert pushed.value("receipts_recovery_last_success_timestamp_seconds") >= started - 1
    assert "# TYPE receipts_recovery_last_sweep_pruned_rows gauge" in body
    assert not [name for name, _ in pushed if name.endswith(("_total", "_created"))]

    states = dict(fetch_rows(dsn, "SELECT order_id, state FROM receipt_jobs"))
    assert states == {"exp-1": "ready", "exp-2": "ready", "exp-max": "failed", "fresh": "ready"}


@pytest.mark.slow
def test_recover_without_a_pushgateway_just_prints(dsn: str) -> None:
    _seed(dsn)
    result = run_command(["recover", "--json"], _env(dsn))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # stdout is the report alone; logs go to stderr
    assert (report["expired_to_ready"], report["expired_to_failed"], report["pruned"]) == (2, 1, 3)


@pytest.mark.slow
def test_an_unreachable_pushgateway_is_logged_and_does_not_fail_the_sweep(dsn: str) -> None:
    _seed(dsn)
    url = f"http://127.0.0.1:{free_port()}"
    result = run_command(["recover"], _env(dsn, RECEIPTS_PUSHGATEWAY_URL=url))
    assert result.returncode == 0, result.stderr
    assert '"event": "push_failed"' in result.stderr
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs WHERE state = 'running'") == [(0,)]


@pytest.mark.slow
def test_recover_loop_pushes_after_every_sweep(dsn: str, gateway: FakeGateway,
                                               tmp_path) -> None:
    from receipts.supervisor import Supervisor

    _seed(dsn)
    with Supervisor(tmp_path) as sup:
        child = sup.start("recover", ["recover", "--loop", "0.2"],
                          _env(dsn, RECEIPTS_PUSHGATEWAY_URL=gateway.url))
        deadline = time.monotonic() + 30
        while len(gateway.requests) < 3:
            assert time.monotonic() < deadline, child.tail()
            time.sleep(0.05)
        child.terminate()
        assert child.wait(timeout_seconds=20) == 0
    assert {(m, p) for m, p, _, _ in gateway.requests} == {("PUT", "/metrics/job/receipts-recover")}


@pytest.mark.slow
def test_migrate_waits_for_a_lock_boundedly_and_stops_on_sigterm(server, tmp_path) -> None:
    import signal as signals

    import psycopg

    from receipts.migrate import LOCK_KEY
    from receipts.supervisor import Supervisor

    dsn = server.new_database(migrated=False)
    try:
        with psycopg.connect(dsn) as holder:  # another runner holds the migration lock
            holder.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
            result = run_command(["migrate"], {"RECEIPTS_DATABASE_URL": dsn,
                                               "RECEIPTS_MIGRATE_LOCK_TIMEOUT_SECONDS": "1"})
            assert result.returncode == 1
            assert "lock was not granted within 1s" in result.stderr
            assert len(result.stderr.strip().splitlines()) == 1

            with Supervisor(tmp_path) as sup:  # as PID 1 would be: SIGTERM must stop it
                child = sup.start("migrate", ["migrate"], {"RECEIPTS_DATABASE_URL": dsn})
                deadline = time.monotonic() + 20
                while not fetch_rows(dsn, "SELECT 1 FROM pg_stat_activity WHERE"
                                          " application_name = 'receipts-migrate'"
                                          " AND wait_event_type = 'Lock'"):
                    assert time.monotonic() < deadline, child.tail()
                    time.sleep(0.05)
                child.send_signal(signals.SIGTERM)
                assert child.wait(timeout_seconds=10) == 128 + signals.SIGTERM
                assert "stopped by SIGTERM" in child.output()
            holder.rollback()
        assert fetch_rows(dsn, "SELECT to_regclass('receipt_jobs') IS NULL") == [(True,)]
    finally:
        server.drop_database(dsn)


def test_the_summary_says_when_recovered_jobs_are_due_again() -> None:
    """A recovered job waits a jittered part of the delay (a new user took one for stuck)."""
    from receipts.recovery import RecoveryReport

    report = RecoveryReport(expired_to_ready=1, duration_seconds=0.01)
    assert report.summary(delay_seconds=8.0).endswith(
        "; the recovered jobs are due again within 8s (RECEIPTS_RECOVERY_DELAY_SECONDS, jittered)")
    assert "due again" not in report.summary()
    assert "due again" not in RecoveryReport().summary(delay_seconds=8.0)  # nothing recovered


@pytest.mark.slow
async def test_recover_loop_outlives_a_database_that_is_down_when_it_starts(
        dsn: str, tmp_path) -> None:
    """``recover --loop`` is a long-running process, as the worker is: a database that
    cannot be reached when it starts (a crash recovery's "the database system is
    starting up" ended it with exit 1 in the crash test) is logged as
    ``recovery_failed`` and the loop goes on; once the database answers, its sweep
    recovers the expired leases. SIGTERM still ends it with 0. A one-shot
    ``recover`` still fails fast."""
    import asyncio

    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from receipts.supervisor import Supervisor
    from tests.chaos.pgproxy import PgProxy

    _seed(dsn)
    port = free_port()  # nothing listens here until the proxy starts
    upstream = int(conninfo_to_dict(dsn)["port"] or 5432)
    through = make_conninfo(dsn, host="127.0.0.1", port=str(port),  # as the proxy speaks
                            sslmode="disable", gssencmode="disable")
    once = run_command(["recover"], _env(through))
    assert once.returncode == 1 and "database unavailable" in once.stderr
    with Supervisor(tmp_path) as sup:
        child = sup.start("recover", ["recover", "--loop", "0.2"], _env(through))
        deadline = time.monotonic() + 30
        while child.output().count('"event": "recovery_failed"') < 2:
            assert time.monotonic() < deadline and child.running, child.tail()
            await asyncio.sleep(0.05)
        proxy = PgProxy(upstream, port)
        await proxy.start()
        try:
            while fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs"
                                  " WHERE state = 'running'") != [(0,)]:
                assert time.monotonic() < deadline and child.running, child.tail()
                await asyncio.sleep(0.05)
            child.terminate()
            assert await asyncio.to_thread(child.wait, timeout_seconds=20) == 0, child.tail()
        finally:
            await proxy.close()


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_recover_loop_stops_at_once_on_a_signal_during_its_first_connection(
        sig: str, tmp_path) -> None:
    """A server that accepts the connection and never answers (a half-open network):
    a stop signal while ``recover --loop`` waits for it ends the loop at once with 0,
    not after a logged failure and another sweep (a new user's trial: the first SIGINT
    was swallowed and the loop ran on for ten minutes)."""
    import signal as signals
    import socket

    from receipts.supervisor import Supervisor

    with socket.socket() as silent, Supervisor(tmp_path) as sup:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        silent.settimeout(30)
        port = silent.getsockname()[1]
        child = sup.start("recover", ["recover", "--loop", "0.2"],
                          _env(f"postgresql://u@127.0.0.1:{port}/x?sslmode=disable"
                               "&gssencmode=disable&connect_timeout=20"))
        held, _ = silent.accept()  # the loop's first connection is waiting on us
        with held:
            child.send_signal(getattr(signals, sig))
            assert child.wait(timeout_seconds=5) == 0, child.tail()
    assert "recovery_failed" not in child.output()
