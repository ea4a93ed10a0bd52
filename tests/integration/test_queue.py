"""The queue statements against a real PostgreSQL: enqueue, claim, ack, reschedule, recover."""

from __future__ import annotations

import asyncio
import time
import uuid

import psycopg
import pytest

from receipts.db import make_pool
from receipts.enqueue import enqueue
from receipts.errors import InvalidOrderId, SchemaMissing
from receipts.jobqueue import JobQueue
from receipts.migrate import apply_migrations, bundled_migrations
from receipts.model import JobState
from tests.conftest import (
    check_invariants,
    claim_jobs,
    enqueue_many,
    fetch_rows,
    make_settings,
    reschedule_one,
)


@pytest.mark.slow
def test_migrations_apply_once_and_again_as_a_noop(server):
    dsn = server.new_database(migrated=False)
    try:
        assert apply_migrations(dsn) == [m.version for m in bundled_migrations()]
        assert apply_migrations(dsn) == []
        indexes = {r[0] for r in fetch_rows(
            dsn, "SELECT indexname FROM pg_indexes WHERE tablename = 'receipt_jobs'")}
        assert {"receipt_jobs_ready", "receipt_jobs_expired"} <= indexes
    finally:
        server.drop_database(dsn)


@pytest.mark.slow
def test_concurrent_migration_runners_do_not_collide(server):
    from concurrent.futures import ThreadPoolExecutor

    dsn = server.new_database(migrated=False)
    try:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda _: apply_migrations(dsn), range(6)))
        files = len(bundled_migrations())
        assert sum(len(r) for r in results) == files  # each file applied exactly once
        assert fetch_rows(dsn, "SELECT count(*) FROM receipts_schema_migrations") == [(files,)]
    finally:
        server.drop_database(dsn)


def test_enqueue_rolls_back_with_the_order_and_commits_with_it(dsn):
    with psycopg.connect(dsn) as conn:
        with conn.transaction(force_rollback=True):
            assert enqueue(conn, "order-rolled-back") is not None
        with conn.transaction():
            assert enqueue(conn, "order-1") is not None
        with conn.transaction():
            assert enqueue(conn, "order-1") is None
    rows = fetch_rows(dsn, "SELECT order_id, state, attempts FROM receipt_jobs")
    assert rows == [("order-1", "ready", 0)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "bad", ["", "x" * 201, "a\x00b", "line\nbreak", "\udcff", " ", "trail ", " lead"]
)
def test_enqueue_refuses_order_ids_the_queue_cannot_carry(dsn, bad):
    with psycopg.connect(dsn) as conn, pytest.raises(InvalidOrderId):
        enqueue(conn, bad)
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs") == [(0,)]


@pytest.mark.slow
async def test_claim_returns_at_most_the_limit_with_fresh_tokens(dsn, queue: JobQueue):
    enqueue_many(dsn, [f"o{i}" for i in range(5)])
    first = await claim_jobs(queue, 3)
    second = await claim_jobs(queue, 3)
    assert len(first) == 3 and len(second) == 2
    assert len({j.token for j in first + second}) == 5
    assert {j.attempt for j in first + second} == {1}
    assert await claim_jobs(queue, 3) == []
    check_invariants(dsn, 5)


async def test_a_stale_worker_cannot_ack_a_newer_attempt(dsn, queue: JobQueue):
    enqueue_many(dsn, ["order-stale"])
    (old,) = await claim_jobs(queue, 1)
    # The lease runs out (moved into the past, as time passes for a paused worker).
    fetch_rows(dsn, "UPDATE receipt_jobs SET lease_until = now() - interval '1 second'"
                    " RETURNING id")
    batch = await queue.recover_expired(batch=100, delay_seconds=0)
    assert batch.to_ready == 1
    (new,) = await claim_jobs(queue, 1)
    assert new.id == old.id and new.token != old.token and new.attempt == 2

    assert await queue.ack([(old.id, old.token)]) == set()
    assert await reschedule_one(queue, old, delay_seconds=0, error="late") is None
    assert fetch_rows(dsn, "SELECT state, lease_token FROM receipt_jobs") == [
        ("running", new.token)]
    assert await queue.ack([(new.id, new.token)]) == {new.id}
    assert fetch_rows(dsn, "SELECT state, lease_token FROM receipt_jobs") == [("done", None)]


async def test_an_ack_after_the_lease_expired_is_refused_even_without_recovery(dsn, queue):
    enqueue_many(dsn, ["order-late"])
    (job,) = await claim_jobs(queue, 1)
    fetch_rows(dsn, "UPDATE receipt_jobs SET lease_until = now() - interval '1 ms' RETURNING 1")
    assert await queue.ack([(job.id, job.token)]) == set()
    assert fetch_rows(dsn, "SELECT state FROM receipt_jobs") == [("running",)]


@pytest.mark.slow
async def test_batched_ack_reports_only_the_pairs_it_completed(dsn, queue: JobQueue):
    enqueue_many(dsn, [f"o{i}" for i in range(4)])
    jobs = await claim_jobs(queue, 4)
    pairs = [(j.id, j.token) for j in jobs]
    pairs[0] = (jobs[0].id, uuid.uuid4())  # a wrong token
    assert await queue.ack(pairs) == {j.id for j in jobs[1:]}
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs WHERE state = 'done'") == [(3,)]


async def test_failures_end_in_failed_at_max_attempts_never_ready(dsn, settings):
    pool = make_pool(settings, "test")
    await pool.open()
    queue = JobQueue(pool, lease_seconds=30, max_attempts=3)
    try:
        enqueue_many(dsn, ["order-5xx"])
        states = []
        for _ in range(3):
            (job,) = await claim_jobs(queue, 1)
            states.append(await reschedule_one(queue, job, delay_seconds=0, error="503 provider"))
            check_invariants(dsn, 3)
        assert states == [JobState.READY, JobState.READY, JobState.FAILED]
        assert await claim_jobs(queue, 1) == []
        assert fetch_rows(dsn, "SELECT state, attempts, last_error FROM receipt_jobs") == [
            ("failed", 3, "503 provider")]
    finally:
        await pool.close()


@pytest.mark.slow
async def test_permanent_failure_fails_at_once(dsn, queue):
    enqueue_many(dsn, ["order-422"])
    (job,) = await claim_jobs(queue, 1)
    state = await reschedule_one(queue, job, delay_seconds=0, error="422 bad", permanent=True)
    assert state == "failed"


async def test_recovery_fails_expired_jobs_at_max_attempts(dsn, settings):
    pool = make_pool(settings, "test")
    await pool.open()
    queue = JobQueue(pool, lease_seconds=30, max_attempts=1)
    try:
        enqueue_many(dsn, ["order-crash"])
        await claim_jobs(queue, 1)
        fetch_rows(dsn, "UPDATE receipt_jobs SET lease_until = now() - interval '1 s' RETURNING 1")
        batch = await queue.recover_expired(batch=100, delay_seconds=0)
        assert (batch.to_ready, batch.to_failed) == (0, 1)
        assert fetch_rows(dsn, "SELECT state, last_error FROM receipt_jobs") == [
            ("failed", "lease expired")]
    finally:
        await pool.close()


async def test_recovery_leaves_live_leases_alone(dsn, queue):
    enqueue_many(dsn, ["order-live"])
    (job,) = await claim_jobs(queue, 1)
    batch = await queue.recover_expired(batch=100, delay_seconds=0)
    assert (batch.to_ready, batch.to_failed) == (0, 0)
    assert await queue.ack([(job.id, job.token)]) == {job.id}


async def test_lease_arithmetic_uses_the_database_clock_in_any_session_timezone(dsn):
    # The zone is pinned on every connection the pool opens (a startup option).
    zoned = psycopg.conninfo.make_conninfo(dsn, options="-c TimeZone=Pacific/Kiritimati")
    pool = make_pool(make_settings(zoned), "test")
    await pool.open()
    try:
        async with pool.connection() as conn:
            zone = await (await conn.execute("SHOW TimeZone")).fetchone()
        assert zone == ("Pacific/Kiritimati",)  # UTC+14
        queue = JobQueue(pool, lease_seconds=30, max_attempts=5)
        enqueue_many(dsn, ["order-tz"])
        (job,) = await claim_jobs(queue, 1)
        (remaining,) = fetch_rows(
            dsn, "SELECT extract(epoch FROM lease_until - now()) FROM receipt_jobs")[0]
        assert 25 < float(remaining) <= 30
        assert await queue.ack([(job.id, job.token)]) == {job.id}
    finally:
        await pool.close()


@pytest.mark.slow
async def test_eight_concurrent_claimers_never_share_a_live_job(dsn, settings):
    enqueue_many(dsn, [f"order-{i:05d}" for i in range(2000)])
    pool = make_pool(settings, "test", max_size=8)
    await pool.open()
    queue = JobQueue(pool, lease_seconds=60, max_attempts=5)
    claimed: list[uuid.UUID] = []
    biggest = 0

    async def claimer() -> None:
        nonlocal biggest
        while True:
            jobs = await claim_jobs(queue, 7)
            biggest = max(biggest, len(jobs))
            if not jobs:
                return
            claimed.extend(j.id for j in jobs)
            await asyncio.sleep(0)
            assert await queue.ack([(j.id, j.token) for j in jobs]) == {j.id for j in jobs}

    try:
        await asyncio.gather(*(claimer() for _ in range(8)))
    finally:
        await pool.close()
    assert len(claimed) == 2000 and len(set(claimed)) == 2000
    assert biggest <= 7
    assert fetch_rows(dsn, "SELECT state, count(*) FROM receipt_jobs GROUP BY state") == [
        ("done", 2000)]


@pytest.mark.slow
async def test_operations_before_migrations_raise_schema_missing(server):
    dsn = server.new_database(migrated=False)
    try:
        settings = make_settings(dsn)
        pool = make_pool(settings, "test")
        await pool.open()
        try:
            with pytest.raises(SchemaMissing, match="receipts migrate"):
                await claim_jobs(JobQueue(pool, lease_seconds=30, max_attempts=5), 1)
        finally:
            await pool.close()
    finally:
        server.drop_database(dsn)


@pytest.mark.slow
async def test_a_job_is_found_by_an_order_id_that_is_itself_a_uuid(dsn, queue, operations):
    order_id = str(uuid.uuid4())
    enqueue_many(dsn, [order_id])
    row = await operations.show_job(order_id)
    assert row is not None and row["order_id"] == order_id
    assert (await operations.show_job(str(row["id"])))["order_id"] == order_id
    assert await operations.show_job(str(uuid.uuid4())) is None


async def test_a_failed_job_keeps_its_run_at(dsn, queue):
    enqueue_many(dsn, ["order-final"])
    (job,) = await claim_jobs(queue, 1)
    await reschedule_one(queue, job, delay_seconds=3600, error="422", permanent=True)
    (run_at, finished_at), = fetch_rows(dsn, "SELECT run_at, finished_at FROM receipt_jobs")
    assert run_at <= finished_at


@pytest.mark.slow
async def test_the_dsn_options_such_as_a_search_path_are_kept(server):
    import psycopg
    from psycopg.conninfo import make_conninfo

    dsn = server.new_database(migrated=False)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA shop")
        scoped = make_conninfo(dsn, options="-c search_path=shop")
        apply_migrations(scoped)
        enqueue_many(scoped, ["order-in-shop"])
        settings = make_settings(scoped)
        assert settings.db_schema == "shop"  # the DSN's search_path names the schema
        pool = make_pool(settings, "test")
        await pool.open()
        try:
            queue = JobQueue(pool, lease_seconds=30, max_attempts=5, schema=settings.db_schema)
            (job,) = await claim_jobs(queue, 1)
            async with pool.connection() as conn:
                cur = await conn.execute("SHOW statement_timeout")
                assert (await cur.fetchone())[0] == "5s"
        finally:
            await pool.close()
        assert job.order_id == "order-in-shop"
        assert fetch_rows(dsn, "SELECT count(*) FROM shop.receipt_jobs") == [(1,)]
    finally:
        server.drop_database(dsn)


async def test_the_workers_claim_and_ack_are_planned_once_per_session(settings):
    """On the worker's pool every prepared statement uses its generic plan
    (receipts.db.GENERIC_PLAN_ROLES): left to the plan cache, the ack was planned afresh
    on every call. The claim's batch size is a literal, one prepared statement per
    size, so its generic plan stays on the ready index."""
    with psycopg.connect(settings.dsn) as conn:
        for n in range(60):
            enqueue(conn, f"plan-{n}")
    pool = make_pool(settings, "worker", max_size=1)
    await pool.open(wait=True, timeout=10)
    try:
        queue = JobQueue(pool, lease_seconds=30, max_attempts=5)
        for _ in range(20):
            result = await queue.claim(3)
            assert len(result.attempts) == 3
            await queue.ack([(a.job.id, a.job.token) for a in result.attempts])
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT generic_plans, custom_plans, statement LIKE 'WITH done AS%%'"
                " FROM pg_prepared_statements")
            plans = await cur.fetchall()
    finally:
        await pool.close()
    # Prepared on the fifth run: 15 runs of each on its generic plan, none planned anew.
    assert sorted((g, c) for g, c, _ in plans) == [(15, 0), (15, 0)], plans
    assert {is_ack for _, _, is_ack in plans} == {True, False}


@pytest.mark.parametrize("rate", [0.0, 1000.0], ids=["claim", "claim_limited"])
async def test_a_claim_carrying_acks_is_planned_once_and_brings_the_wal_positions(
        settings, rate: float):
    """The worker's riding ack (receipts.completion: the pending acks go with the next
    claim): both claim statements carry it, under the worker's tag, on a generic
    plan, and its answer holds what the ack's own would (the ids done, the WAL
    positions read after every earlier commit)."""
    with psycopg.connect(settings.dsn) as conn:
        for n in range(40):
            enqueue(conn, f"ride-{n}")
    pool = make_pool(settings, "worker", max_size=1)
    await pool.open(wait=True, timeout=10)
    try:
        queue = JobQueue(pool, lease_seconds=30, max_attempts=5, rate_limit_per_second=rate,
                         burst=rate or None, worker_tag="0badcafe")
        pending: list[tuple[uuid.UUID, uuid.UUID]] = []
        for _ in range(12):
            before = await queue.wal_position()
            result = await queue.claim(3, acks=pending)
            if pending:
                assert result.acked == {job_id for job_id, _ in pending}
                assert result.acked.position.insert_lsn >= before.insert_lsn > 0  # type: ignore[attr-defined]
            else:
                assert result.acked is None
            assert len(result.attempts) == 3 and all(
                str(a.job.token).endswith("0badcafe") for a in result.attempts)
            pending = [(a.job.id, a.job.token) for a in result.attempts]
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                " WHERE statement LIKE 'WITH done AS%%candidate AS%%'")
            plans = await cur.fetchall()
    finally:
        await pool.close()
    assert plans == [(6, 0)], plans  # prepared on the fifth of 11 runs
    assert fetch_rows(settings.dsn, "SELECT count(*) FROM receipt_jobs WHERE state = 'done'"
                      ) == [(33,)]


async def test_a_claim_whose_acked_row_is_locked_waits_holding_no_claimable_job(
        dsn, settings, queue: JobQueue):
    """The carried ack's update runs to its end before the claim locks a candidate:
    while another transaction holds an acked row, the waiting claim holds nothing
    that another pod could claim, and once the row is free it acks it and claims."""
    enqueue_many(dsn, ["locked-1", "free-1", "free-2"])
    (held,) = await claim_jobs(queue, 1)
    other_pool = make_pool(settings, "test", max_size=1)
    await other_pool.open(wait=True, timeout=10)
    try:
        other = JobQueue(other_pool, lease_seconds=30, max_attempts=5)
        with psycopg.connect(dsn) as blocker:
            blocker.execute("SELECT 1 FROM receipt_jobs WHERE id = %s FOR UPDATE", (held.id,))
            carrying = asyncio.create_task(queue.claim(1, acks=[(held.id, held.token)]))
            await until_waiting_on_a_lock(dsn)
            # The ready jobs are not locked by the waiting claim: another pod takes one.
            assert [a.job.order_id for a in (await other.claim(1)).attempts] == ["free-1"]
            blocker.rollback()
        result = await asyncio.wait_for(carrying, 10)
    finally:
        await other_pool.close()
    assert result.acked == {held.id}
    assert [a.job.order_id for a in result.attempts] == ["free-2"]


async def until_waiting_on_a_lock(dsn: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not fetch_rows(dsn, "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                              " AND datname = current_database()"):
        assert time.monotonic() < deadline, "no statement waited on a lock"
        await asyncio.sleep(0.01)


async def test_an_ack_carries_the_wal_positions_that_bound_earlier_writes(dsn, queue: JobQueue):
    enqueue_many(dsn, ["order-wal-1", "order-wal-2"])
    first, second = await claim_jobs(queue, 2)
    before = await queue.wal_position()
    done = await queue.ack([(first.id, first.token)])
    assert done == {first.id} and done.position is not None
    # Read after the claim returned: at or past its commit, and past the read before.
    assert done.position.insert_lsn >= before.insert_lsn > 0
    assert done.position.flush_lsn <= done.position.insert_lsn
    # An ack that completes nothing (a stale token) still carries them.
    stale = await queue.ack([(second.id, uuid.uuid4())])
    assert stale == set() and stale.position is not None
    assert stale.position.insert_lsn > done.position.insert_lsn  # the first ack's commit
