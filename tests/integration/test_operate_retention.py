"""Retention: ``receipts recover`` prunes only old done/failed rows, in bounded batches."""

from __future__ import annotations

import psycopg
import pytest

from receipts import recovery
from receipts.enqueue import enqueue
from receipts.jobqueue import JobQueue
from tests.conftest import fetch_rows, make_settings

SEED = """
INSERT INTO receipt_jobs (id, order_id, state, attempts, finished_at, created_at, last_error)
SELECT gen_random_uuid(), %(prefix)s || g, %(state)s, 1,
       CASE WHEN %(state)s IN ('done', 'failed')
            THEN statement_timestamp() - make_interval(secs => %(age)s) END,
       statement_timestamp() - make_interval(secs => %(age)s + 60),
       CASE WHEN %(state)s = 'failed' THEN '422 rejected' END
FROM generate_series(1, %(n)s) AS g
"""
DAY = 86_400.0


def _seed(dsn: str, prefix: str, state: str, n: int, age_seconds: float) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SEED, {"prefix": prefix, "state": state, "n": n, "age": age_seconds})


class _CountingQueue(JobQueue):
    """A JobQueue that records how many rows each prune statement deleted."""

    prune_batches: list[int]

    async def prune(self, *, retention_seconds: float, batch: int) -> int:
        n = await super().prune(retention_seconds=retention_seconds, batch=batch)
        self.prune_batches.append(n)
        return n


def _orders(dsn: str) -> set[str]:
    return {str(r[0]) for r in fetch_rows(dsn, "SELECT order_id FROM receipt_jobs")}


@pytest.mark.slow
async def test_pruning_deletes_only_old_finished_rows_in_bounded_batches(
    dsn: str, queue: JobQueue
) -> None:
    settings = make_settings(dsn, retention_days=1, prune_batch_size=7)
    _seed(dsn, "old-done-", "done", 23, 10 * DAY)
    _seed(dsn, "old-failed-", "failed", 5, DAY + 60)          # just outside the window
    _seed(dsn, "new-done-", "done", 3, DAY - 60)              # just inside the window
    _seed(dsn, "new-failed-", "failed", 2, 3600)
    _seed(dsn, "old-ready-", "ready", 4, 30 * DAY)            # never pruned: not finished
    _seed(dsn, "old-running-", "ready", 1, 30 * DAY)          # and an old running attempt
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE receipt_jobs SET state = 'running', lease_token = gen_random_uuid(),"
                     " lease_until = statement_timestamp() + interval '1 hour'"
                     " WHERE order_id LIKE 'old-running-%'")
    keep = {o for o in _orders(dsn) if not o.startswith(("old-done-", "old-failed-"))}

    counting = _CountingQueue(queue.pool, lease_seconds=settings.lease_seconds,
                              max_attempts=settings.max_attempts)
    counting.prune_batches = []
    report = await recovery.run_once(counting, settings)

    assert report.pruned == 28
    assert _orders(dsn) == keep
    assert counting.prune_batches == [7, 7, 7, 7, 0]  # bounded; stops on a short batch
    # A second sweep finds nothing more.
    assert (await recovery.run_once(counting, settings)).pruned == 0

    # Inside the window the row still deduplicates enqueue; a pruned order's does not
    # (the trade-off: retention must outlast any re-submission of an order).
    with psycopg.connect(dsn) as conn:
        assert enqueue(conn, "new-done-1") is None
        assert enqueue(conn, "new-failed-2") is None
        assert enqueue(conn, "old-done-1") is not None
    (state,), = fetch_rows(dsn, "SELECT state FROM receipt_jobs WHERE order_id = 'new-done-1'")
    assert state == "done"


async def test_retention_zero_turns_pruning_off(dsn: str, queue: JobQueue) -> None:
    settings = make_settings(dsn, retention_days=0)
    _seed(dsn, "ancient-", "done", 5, 3650 * DAY)
    report = await recovery.run_once(queue, settings)
    assert report.pruned == 0
    assert len(_orders(dsn)) == 5


async def test_a_failed_job_retried_while_a_prune_waits_on_it_is_kept(
    dsn: str, queue: JobQueue
) -> None:
    import asyncio
    import time

    _seed(dsn, "old-failed-", "failed", 3, 10 * DAY)
    retrying = psycopg.connect(dsn)  # an operator's retry, not yet committed
    try:
        retrying.execute("UPDATE receipt_jobs SET state = 'ready', attempts = 0,"
                         " run_at = statement_timestamp(), finished_at = NULL"
                         " WHERE order_id = 'old-failed-2'")
        prune = asyncio.create_task(queue.prune(retention_seconds=DAY, batch=10))
        with psycopg.connect(dsn, autocommit=True) as probe:
            deadline = time.monotonic() + 10
            while probe.execute(  # the prune's delete waits on the retried row's lock
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%%receipts_prune(%%'").fetchone() != (1,):
                assert time.monotonic() < deadline, "the prune never waited on the row"
                await asyncio.sleep(0.01)
        retrying.commit()
        assert await asyncio.wait_for(prune, 10) == 2
    finally:
        retrying.close()
    assert _orders(dsn) == {"old-failed-2"}
    (state,), = fetch_rows(dsn, "SELECT state FROM receipt_jobs")
    assert state == "ready"
