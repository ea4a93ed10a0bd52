"""Queue signals read from the database: the age of the oldest undelivered job."""

from __future__ import annotations

import pytest

from receipts.jobqueue import JobQueue
from tests.conftest import claim_jobs, enqueue_many, fetch_rows, reschedule_one


@pytest.mark.slow
async def test_a_retry_restarts_the_lag_but_not_the_age_of_the_oldest_undelivered_job(
    dsn: str, queue: JobQueue
) -> None:
    enqueue_many(dsn, ["old", "new"])
    fetch_rows(dsn, "UPDATE receipt_jobs SET created_at = created_at - interval '1 hour',"
                    " run_at = run_at - interval '1 hour' WHERE order_id = 'old' RETURNING 1")
    before = await queue.queue_stats()
    assert 3590 < before.lag_seconds < 3700
    assert 3590 < before.oldest_undelivered_age_seconds < 3700

    # The provider fails; both attempts are rescheduled ten minutes out: nothing is due.
    for job in await claim_jobs(queue, 10):
        assert await reschedule_one(queue, job, delay_seconds=600, error="503") is not None
    during = await queue.queue_stats()
    assert during.ready_due == 0 and during.lag_seconds == 0
    assert 3590 < during.oldest_undelivered_age_seconds < 3700

    # A running attempt counts as undelivered too.
    fetch_rows(dsn, "UPDATE receipt_jobs SET run_at = now() RETURNING 1")
    claimed = await claim_jobs(queue, 10)
    assert len(claimed) == 2
    assert 3590 < (await queue.queue_stats()).oldest_undelivered_age_seconds < 3700

    await queue.ack([(job.id, job.token) for job in claimed])
    assert (await queue.queue_stats()).oldest_undelivered_age_seconds == 0


@pytest.mark.slow
async def test_the_oldest_finished_row_is_what_pruning_keeps_within_the_retention(
    dsn: str, queue: JobQueue
) -> None:
    assert (await queue.queue_stats()).oldest_finished_age_seconds == 0  # nothing finished
    enqueue_many(dsn, ["done-old", "discarded-older", "done-new"])
    claimed = await claim_jobs(queue, 10)
    await queue.ack([(job.id, job.token) for job in claimed])
    fetch_rows(dsn, "UPDATE receipt_jobs SET finished_at = now() - interval '2 days'"
                    " WHERE order_id = 'done-old' RETURNING 1")
    fetch_rows(dsn, "UPDATE receipt_jobs SET state = 'discarded',"
                    " finished_at = now() - interval '3 days'"
                    " WHERE order_id = 'discarded-older' RETURNING 1")
    # A discarded row is pruned like a done one: it counts.
    assert 3 * 86400 - 60 < (await queue.queue_stats()).oldest_finished_age_seconds < 3 * 86400 + 60

    # Pruning with a one-day retention leaves only the new row.
    assert await queue.prune(retention_seconds=86400, batch=100) == 2
    assert 0 <= (await queue.queue_stats()).oldest_finished_age_seconds < 60
