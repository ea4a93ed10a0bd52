"""Admission control's commit probe and the sessions' synchronous_commit, on a real PostgreSQL."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from psycopg.pq import TransactionStatus

from receipts.db import connection_kwargs, make_pool
from receipts.jobqueue import JobQueue
from tests.conftest import fetch_rows, make_settings


def _lsn(dsn: str) -> int:
    (lsn,) = fetch_rows(dsn, "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")[0]
    return int(lsn)  # type: ignore[call-overload]


@pytest.mark.slow
async def test_the_commit_probe_writes_wal_and_commits_as_an_ordinary_role(dsn):
    role = f"probe_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        settings = make_settings(make_conninfo(dsn, user=role))
        pool = make_pool(settings, "worker", max_size=1)
        await pool.open(wait=True, timeout=10)
        try:
            queue = JobQueue(pool, lease_seconds=30, max_attempts=5)
            before = _lsn(dsn)
            seconds = [await queue.commit_probe() for _ in range(3)]
            assert _lsn(dsn) > before  # a WAL record, so its commit waits for a flush
            assert all(0 < s < 5 for s in seconds)
            async with pool.connection() as conn:  # left as it was found
                assert conn.info.transaction_status is TransactionStatus.IDLE
                cur = await conn.execute("SHOW synchronous_commit")
                assert (await cur.fetchone()) == ("off",)  # SET LOCAL did not leak
        finally:
            await pool.close()
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP ROLE "{role}"')


@pytest.mark.parametrize("value", ["off", "on", "local"])
def test_worker_and_recovery_sessions_take_the_setting_and_operator_sessions_do_not(dsn, value):
    settings = make_settings(dsn, synchronous_commit=value)
    with psycopg.connect(dsn) as conn:
        (server_default,) = conn.execute("SHOW synchronous_commit").fetchone() or ("?",)
    for role in ("worker", "recover", "jobs", "enqueue", "ui", "migrate"):
        with psycopg.connect(settings.dsn, **connection_kwargs(settings, role)) as conn:
            (got,) = conn.execute("SHOW synchronous_commit").fetchone() or ("?",)
        assert got == (value if role in ("worker", "recover") else server_default), role
