"""Databases whose encoding is not UTF8: LATIN1 works (lossy error texts), SQL_ASCII is refused."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest
from aiohttp import web

from receipts.errors import QueueError
from receipts.migrate import apply_migrations
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
    dsn = _database(pg18, "receipts_sql_ascii", "SQL_ASCII")
    apply_migrations(dsn)
    yield dsn
    pg18.drop_database(dsn)


async def test_a_latin1_database_stores_a_foreign_error_text_lossily_instead_of_crashing(
        latin1, stub):
    async def reject(_: web.Request) -> web.Response:
        return web.json_response({"error": HOSTILE}, status=422)

    stub.answer(reject)
    enqueue_many(latin1, ["ørder-1", "order-2"])
    settings = make_settings(latin1, provider_url=stub.url)
    async with worker_runtime(settings, metrics_port=0) as runtime:
        task = asyncio.create_task(runtime.worker.run())
        try:
            for _ in range(200):
                if fetch_rows(latin1, "SELECT count(*) FROM receipt_jobs"
                                      " WHERE state = 'failed'") == [(2,)]:
                    break
                await asyncio.sleep(0.05)
        finally:
            runtime.worker.stop()
            await asyncio.wait_for(task, 20)
        failures = runtime.metrics.registry.get_sample_value(
            "receipts_failures_total", {"reason": "rejected"})
    rows = fetch_rows(latin1, "SELECT order_id, state, last_error FROM receipt_jobs"
                              " ORDER BY order_id")
    assert [(o, s) for o, s, _ in rows] == [("order-2", "failed"), ("ørder-1", "failed")]
    assert all(e.startswith("422 ") and "no receipt" in e and "?" in e for _, _, e in rows)
    assert failures == 2


async def test_a_sql_ascii_database_is_refused_at_start_with_one_line(sql_ascii):
    with pytest.raises(QueueError, match="SQL_ASCII"):
        await run_worker(make_settings(sql_ascii, metrics_port=0))
    result = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "receipts", "worker"],
        env={"RECEIPTS_DATABASE_URL": sql_ascii, "RECEIPTS_PROVIDER_URL": "http://127.0.0.1:9/r",
             "RECEIPTS_METRICS_PORT": "0", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "SQL_ASCII" in lines[0] and "Traceback" not in result.stderr
