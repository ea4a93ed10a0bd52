"""Databases whose encoding is not UTF8: LATIN1 works (lossy error texts), SQL_ASCII is refused.

SQL_ASCII is refused by every command that connects, with the worker's one
line and exit status 2 (a settings problem): ``receipts migrate`` creates
nothing there, so no orders service can enqueue into a database no worker
would serve; ``enqueue``, ``jobs`` and ``recover`` refuse an installation
migrated there by an earlier version.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest
from aiohttp import web

from receipts.errors import UnusableDatabase
from receipts.migrate import apply_migrations, migration_sql
from receipts.runtime import run_worker, worker_runtime
from tests.conftest import Server, enqueue_many, fetch_rows, make_settings

HOSTILE = "заказ отклонён: 日本 ✓ — no receipt"


def _database(server: Server, name: str, encoding: str) -> str:
    with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f"CREATE DATABASE \"{name}\" ENCODING '{encoding}' LC_COLLATE 'C'"
                     " LC_CTYPE 'C' TEMPLATE template0")
    return server.dsn_for(name)


@pytest.fixture
def latin1(pg18: Server) -> Iterator[str]:
    dsn = _database(pg18, "receipts_latin1", "LATIN1")
    apply_migrations(dsn)
    yield dsn
    pg18.drop_database(dsn)


@pytest.fixture
def sql_ascii(pg18: Server) -> Iterator[str]:
    """An empty SQL_ASCII database."""
    dsn = _database(pg18, "receipts_sql_ascii", "SQL_ASCII")
    yield dsn
    pg18.drop_database(dsn)


@pytest.fixture
def migrated_sql_ascii(sql_ascii: str) -> str:
    """A SQL_ASCII database holding a queue (migrated by a version that did not refuse it)."""
    with psycopg.connect(sql_ascii) as conn:
        conn.execute(migration_sql().encode())
    return sql_ascii


def receipts_cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``receipts ARGS`` against *dsn* in a clean environment."""
    return subprocess.run(
        [sys.executable, "-m", "receipts", *args],
        env={"RECEIPTS_DATABASE_URL": dsn, "RECEIPTS_PROVIDER_URL": "http://127.0.0.1:9/r",
             "RECEIPTS_METRICS_PORT": "0", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60)


def assert_refused_in_one_line(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0] == ("receipts: error: database 'receipts_sql_ascii' uses encoding SQL_ASCII,"
                        " which stores text unchecked; create it with ENCODING 'UTF8'")


async def test_a_latin1_database_stores_a_foreign_error_text_lossily_instead_of_crashing(
        latin1, stub):
    # A provider that accepts nothing: its rejections are held (no evidence that it
    # judges orders), so each job goes back to ready with the rejection's text as its
    # last error. That text is what a Latin-1 database must store without crashing.
    async def reject(_: web.Request) -> web.Response:
        return web.json_response({"error": HOSTILE}, status=422)

    stub.answer(reject)
    enqueue_many(latin1, ["ørder-1", "order-2"])
    settings = make_settings(latin1, provider_url=stub.url)
    async with worker_runtime(settings, metrics_port=0) as runtime:
        task = asyncio.create_task(runtime.worker.run())
        try:
            for _ in range(400):
                if fetch_rows(latin1, "SELECT count(*) FROM receipt_jobs"
                                      " WHERE last_error LIKE '%%422 %%'") == [(2,)]:
                    break
                await asyncio.sleep(0.05)
        finally:
            runtime.worker.stop()
            await asyncio.wait_for(task, 20)
        assert not task.exception()
    rows = fetch_rows(latin1, "SELECT order_id, state, last_error FROM receipt_jobs"
                              " ORDER BY order_id")
    assert [o for o, _, _ in rows] == ["order-2", "ørder-1"]
    assert all(s in ("ready", "failed") for _, s, _ in rows), rows
    assert all(e and "422 " in e and "no receipt" in e and "?" in e for _, _, e in rows), rows


@pytest.mark.slow
async def test_the_worker_refuses_a_sql_ascii_database_at_start_with_one_line(
        migrated_sql_ascii):
    with pytest.raises(UnusableDatabase, match="SQL_ASCII"):
        await run_worker(make_settings(migrated_sql_ascii, metrics_port=0))
    result = await asyncio.to_thread(receipts_cli, migrated_sql_ascii, "worker")
    assert_refused_in_one_line(result)


@pytest.mark.slow
def test_migrate_refuses_a_sql_ascii_database_and_creates_nothing(sql_ascii):
    assert_refused_in_one_line(receipts_cli(sql_ascii, "migrate"))
    assert_refused_in_one_line(receipts_cli(sql_ascii, "migrate", "--check"))
    assert_refused_in_one_line(receipts_cli(sql_ascii, "migrate", "--print-sql", "--pending"))
    with pytest.raises(UnusableDatabase):
        apply_migrations(sql_ascii)
    tables = fetch_rows(sql_ascii, "SELECT count(*) FROM pg_class"
                                   " WHERE relname LIKE 'receipt%%' AND relkind = 'r'")
    assert tables == [(0,)]
    # The same text applied by a team's own tool is not ours to judge: no database read.
    assert receipts_cli(sql_ascii, "migrate", "--print-sql").returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ("enqueue", "order-1"), ("jobs", "stats"), ("jobs", "list"), ("recover",),
], ids=["enqueue", "jobs-stats", "jobs-list", "recover"])
def test_commands_refuse_a_queue_that_lives_in_a_sql_ascii_database(migrated_sql_ascii, args):
    assert_refused_in_one_line(receipts_cli(migrated_sql_ascii, *args))
    assert fetch_rows(migrated_sql_ascii, "SELECT count(*) FROM receipt_jobs") == [(0,)]
