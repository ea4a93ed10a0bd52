"""Workers through PgBouncer in transaction pooling mode (Debian ``pgbouncer``).

PgBouncer runs in front of the embedded PostgreSQL 18, started by a fixture
as the unprivileged ``embedded_postgres`` user (it refuses to run as root).
Behind a transaction pooler the worker must use no server-side prepared
statements, no LISTEN and no startup options (``RECEIPTS_PGBOUNCER=true``);
this test proves that a real worker process delivers every job that way.
Skipped when ``pgbouncer`` is not installed (``scripts/install-tools.sh``
installs it), unless ``RECEIPTS_TEST_REQUIRE_PGBOUNCER=1``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from receipts.embedded import SERVER_USER, free_port
from receipts.enqueue import enqueue
from receipts.supervisor import Supervisor, run_command
from tests.chaos.run import read_events
from tests.conftest import Server, fetch_rows

PGBOUNCER = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer"
                                           if os.path.exists("/usr/sbin/pgbouncer") else None)


def _bouncer_ini(folder: Path, pg_port: int, port: int) -> Path:
    (folder / "users.txt").write_text('"postgres" ""\n')
    ini = folder / "pgbouncer.ini"
    ini.write_text(f"""\
[databases]
* = host=127.0.0.1 port={pg_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder}/users.txt
pool_mode = transaction
default_pool_size = 4
max_client_conn = 100
server_reset_query =
ignore_startup_parameters = extra_float_digits
logfile = {folder}/pgbouncer.log
pidfile =
""")
    return ini


@pytest.fixture(scope="module")
def pgbouncer(pg18: Server) -> Iterator[int]:
    """PgBouncer (transaction pooling) in front of the embedded PostgreSQL 18; yields its port."""
    if PGBOUNCER is None:
        if os.environ.get("RECEIPTS_TEST_REQUIRE_PGBOUNCER") == "1":
            pytest.fail("pgbouncer is required but not installed (scripts/install-tools.sh)")
        pytest.skip("pgbouncer is not installed (scripts/install-tools.sh installs it)")
    assert pg18.embedded is not None
    folder = Path(tempfile.mkdtemp(prefix="receipts-pgbouncer-"))
    port = free_port()
    ini = _bouncer_ini(folder, pg18.embedded.port, port)
    args = [PGBOUNCER, str(ini)]
    if os.geteuid() == 0:  # pgbouncer refuses root: it switches to the server's user
        shutil.chown(folder, SERVER_USER)
        for path in folder.iterdir():
            shutil.chown(path, SERVER_USER)
        args = [PGBOUNCER, "-u", SERVER_USER, str(ini)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres",
                                     connect_timeout=1, prepare_threshold=None) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = (folder / "pgbouncer.log").read_text(errors="replace")[-800:]
                    pytest.fail(f"pgbouncer did not start: {log}")
                time.sleep(0.1)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(folder, ignore_errors=True)


def _worker_env(dsn: str, provider_url: str, metrics_port: int, name: str) -> dict[str, str]:
    return {
        "RECEIPTS_DATABASE_URL": dsn,
        "RECEIPTS_PGBOUNCER": "true",
        "RECEIPTS_PROVIDER_URL": provider_url,
        "RECEIPTS_CONCURRENCY": "8",
        "RECEIPTS_LEASE_SECONDS": "20",
        "RECEIPTS_DELIVERY_TIMEOUT_SECONDS": "5",
        "RECEIPTS_POLL_INTERVAL_SECONDS": "0.1",
        "RECEIPTS_RETRY_BASE_SECONDS": "0.05",
        "RECEIPTS_RETRY_CAP_SECONDS": "0.2",
        "RECEIPTS_MAX_ATTEMPTS": "20",
        "RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS": "1",
        "RECEIPTS_METRICS_PORT": str(metrics_port),
        "RECEIPTS_APPLICATION_NAME": name,
    }


@pytest.mark.slow
async def test_workers_deliver_every_job_through_pgbouncer_transaction_pooling(
    pg18: Server, pgbouncer: int, provider, tmp_path: Path
):
    direct = pg18.new_database()
    name = psycopg.conninfo.conninfo_to_dict(direct)["dbname"]
    pooled = f"postgresql://postgres@127.0.0.1:{pgbouncer}/{name}"
    provider.set_faults(error_rate=0.05, latency_seconds=0.002)
    orders = [f"bouncer-{i:04d}" for i in range(400)]
    # The orders service's own connection through the pooler: no prepared statements either.
    with psycopg.connect(pooled, prepare_threshold=None) as conn:
        for start in range(0, len(orders), 50):
            with conn.transaction():
                for order_id in orders[start:start + 50]:
                    enqueue(conn, order_id)
    try:
        with Supervisor(tmp_path) as sup:
            workers = []
            for i in range(2):
                port = free_port()
                workers.append(sup.start(f"worker-{i}", ["worker"],
                                         _worker_env(pooled, provider.url, port, f"bouncer-{i}"),
                                         port=port))
            for worker in workers:
                await asyncio.to_thread(worker.wait_healthy)
            deadline = time.monotonic() + 60
            done = 0
            while time.monotonic() < deadline:
                done = fetch_rows(
                    direct, "SELECT count(*) FROM receipt_jobs WHERE state = 'done'")[0][0]
                if done == len(orders) or any(not w.running for w in workers):
                    break
                await asyncio.sleep(0.2)
            metrics = [await asyncio.to_thread(w.scrape) for w in workers]
            server_listeners = fetch_rows(
                direct, "SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'LISTEN%%'")
            prepared = fetch_rows(
                direct, "SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'EXECUTE%%'")
            codes = await asyncio.to_thread(sup.stop_all)
        assert done == len(orders), [w.tail() for w in workers]
        assert list(codes.values()) == [0, 0]
        assert set(provider.provider.receipts) == {f"receipt:{o}" for o in orders}
        assert sum(m.total("receipts_acks_total") for m in metrics) == len(orders)
        assert sum(m.total("receipts_db_errors_total") for m in metrics) == 0
        assert all(m.value("receipts_database_ready") == 1 for m in metrics)
        assert server_listeners == [(0,)] and prepared == [(0,)]
        for worker in workers:  # no LISTEN attempted, no prepared-statement errors
            assert worker.log_path is not None
            assert not read_events(worker.log_path,
                                   {"listen_failed", "claim_failed", "write_failed"})
            # No waker behind a transaction pooler (no session to hold its lock), and it says so.
            polling = read_events(worker.log_path, {"wakeups_polling"})
            assert [e["reason"] for e in polling] == ["pgbouncer"]
        # A recovery sweep through the pooler works too.
        result = await asyncio.to_thread(
            run_command, ["recover"], {"RECEIPTS_DATABASE_URL": pooled,
                                       "RECEIPTS_PGBOUNCER": "true"}, timeout_seconds=30)
        assert result.returncode == 0, result.stderr
        assert "recovered 0 expired lease(s)" in result.stdout
    finally:
        pg18.drop_database(direct)


def _poison_search_path(pooled: str, servers: int) -> None:
    """Leave ``search_path = nowhere`` on *servers* pooled server connections.

    Each client holds a transaction open at the same time (so each gets its
    own server connection) and runs a session-level SET: in transaction
    pooling the setting outlives the client's transaction and is handed to
    whoever gets that server connection next. That is the leak.
    """
    conns = [psycopg.connect(pooled, prepare_threshold=None) for _ in range(servers)]
    try:
        for conn in conns:
            conn.execute("SET search_path = nowhere")
        for conn in conns:
            conn.commit()
    finally:
        for conn in conns:
            conn.close()


@pytest.mark.slow
async def test_a_search_path_leaked_by_another_pooler_client_redirects_nothing(
    pg18: Server, pgbouncer: int, provider, tmp_path: Path
):
    direct = pg18.new_database()
    name = psycopg.conninfo.conninfo_to_dict(direct)["dbname"]
    pooled = f"postgresql://postgres@127.0.0.1:{pgbouncer}/{name}"
    try:
        _poison_search_path(pooled, servers=4)  # default_pool_size above: every server
        with psycopg.connect(pooled, prepare_threshold=None, autocommit=True) as conn:
            assert conn.execute("SHOW search_path").fetchone() == ("nowhere",)
            with pytest.raises(psycopg.errors.UndefinedTable):  # unqualified: redirected
                conn.execute("SELECT count(*) FROM receipt_jobs")
        orders = [f"leak-{i:03d}" for i in range(60)]
        with psycopg.connect(pooled, prepare_threshold=None) as conn:
            for order_id in orders:  # the enqueue API names the schema when asked to
                enqueue(conn, order_id, schema="public")
        with Supervisor(tmp_path) as sup:
            port = free_port()
            worker = sup.start("worker", ["worker"],
                               _worker_env(pooled, provider.url, port, "leak"), port=port)
            await asyncio.to_thread(worker.wait_healthy)
            deadline = time.monotonic() + 60
            done = 0
            while time.monotonic() < deadline and worker.running:
                done = fetch_rows(
                    direct, "SELECT count(*) FROM receipt_jobs WHERE state = 'done'")[0][0]
                if done == len(orders):
                    break
                await asyncio.sleep(0.2)
            metrics = await asyncio.to_thread(worker.scrape)
            codes = await asyncio.to_thread(sup.stop_all)
        assert done == len(orders), worker.tail()
        assert list(codes.values()) == [0]
        assert metrics.total("receipts_acks_total") == len(orders)
        assert metrics.total("receipts_db_errors_total") == 0
        assert worker.log_path is not None
        assert not read_events(worker.log_path, {"claim_failed", "write_failed"})
        env = {"RECEIPTS_DATABASE_URL": pooled, "RECEIPTS_PGBOUNCER": "true"}
        stats = await asyncio.to_thread(run_command, ["jobs", "stats"], env,
                                        timeout_seconds=30)
        assert stats.returncode == 0, stats.stderr
        recover = await asyncio.to_thread(run_command, ["recover"], env, timeout_seconds=30)
        assert recover.returncode == 0, recover.stderr
        with psycopg.connect(pooled, prepare_threshold=None, autocommit=True) as conn:
            assert conn.execute("SHOW search_path").fetchone() == ("nowhere",)  # still leaked
    finally:
        pg18.drop_database(direct)

