"""Claims start at the waker's watermark, and no row that becomes ready below it is stranded.

A worker runs in this event loop against a real PostgreSQL (its own LISTEN
session, so it is the fleet's waker and a member), delivering to a recorder.
Each test makes one row ready in a way that can put it below the watermark
(a retry, a recovered lease, a back-dated ``run_at``, a transaction that
commits late) and measures from the moment the row was committed to the
moment the worker handed it to the deliverer: at most 1 s each. The last test
checks the claim's plan with EXPLAIN while a long reader holds a snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from receipts.db import make_pool
from receipts.enqueue import enqueue_async
from receipts.model import Job, Outcome, Reason, Verdict
from receipts.runtime import make_queue
from receipts.statements import claim_query
from receipts.waker import NIL_UUID
from tests.conftest import enqueue_many, fetch_rows, make_settings
from tests.integration.test_worker import Running, until

#: How soon a row made ready below the watermark must be claimed, seconds.
PICKUP_SECONDS = 1.0


class Recorder:
    """A deliverer that notes when each order reached it; *retry_first* orders get a
    retryable answer on their first attempt."""

    def __init__(self, retry_first: tuple[str, ...] = ()) -> None:
        self.seen: dict[str, list[float]] = {}
        self.retry_first = set(retry_first)

    async def deliver(self, job: Job) -> Outcome:
        self.seen.setdefault(job.order_id, []).append(time.monotonic())
        if job.order_id in self.retry_first and job.attempt == 1:
            return Outcome(Verdict.RETRY, Reason.PROVIDER_5XX, status=503)
        return Outcome(Verdict.DELIVERED, Reason.DELIVERED, status=201)

    async def aclose(self) -> None:
        return None


@pytest.fixture
async def running(dsn: str) -> AsyncIterator[tuple[Running, Recorder]]:
    recorder = Recorder(retry_first=("retried",))
    settings = make_settings(dsn, retry_base_seconds=0.05, retry_cap_seconds=0.05)
    async with Running(settings, deliverer=recorder) as run:
        wakeups = run.worker.wakeups
        assert wakeups is not None
        # Elected, and the watermark has moved to now - margin at least once.
        await until(lambda: wakeups.is_waker and wakeups.watermark is not None, timeout=15)
        yield run, recorder


def mark_of(run: Running) -> tuple[datetime, Any]:
    wakeups = run.worker.wakeups
    assert wakeups is not None and wakeups.watermark is not None
    return wakeups.watermark


async def picked_up(recorder: Recorder, order: str, since: float, attempt: int = 1) -> float:
    """Seconds from *since* until *order*'s *attempt* reached the deliverer."""
    await until(lambda: len(recorder.seen.get(order, [])) >= attempt, timeout=10)
    return recorder.seen[order][attempt - 1] - since


async def test_the_watermark_follows_the_oldest_ready_job(dsn, running):
    run, recorder = running
    enqueue_many(dsn, [f"early-{i}" for i in range(20)])
    await until(lambda: len(recorder.seen) == 20, timeout=10)
    newest = fetch_rows(dsn, "SELECT max(run_at) FROM receipt_jobs")[0][0]
    assert isinstance(newest, datetime)
    # Every job is done: the watermark passes them all (at most the margin behind now).
    await until(lambda: mark_of(run)[0] > newest, timeout=5)


async def test_a_retried_job_is_claimed_again_within_a_second(dsn, running):
    _, recorder = running
    enqueue_many(dsn, ["retried"])
    first = await picked_up(recorder, "retried", 0.0)
    again = await picked_up(recorder, "retried", first, attempt=2)
    # The retry's delay is 0.05 s; its outcome write is coalesced for a few ms.
    assert again <= PICKUP_SECONDS, again


async def test_a_recovered_lease_is_claimed_within_a_second(dsn, running):
    _, recorder = running
    # A pod claimed this job an hour ago and died: its lease has run out.
    fetch_rows(dsn, """
        INSERT INTO receipt_jobs (id, order_id, state, attempts, run_at, lease_token, lease_until)
        VALUES (gen_random_uuid(), 'abandoned', 'running', 1, now() - interval '1 hour',
                gen_random_uuid(), now() - interval '1 second') RETURNING id""")
    settings = make_settings(dsn)
    pool = make_pool(settings, "test", max_size=1)
    await pool.open(wait=True, timeout=10)
    try:
        batch = await make_queue(settings, pool).recover_expired(batch=10, delay_seconds=0.0)
        since = time.monotonic()
    finally:
        await pool.close()
    assert batch.to_ready == 1
    assert await picked_up(recorder, "abandoned", since) <= PICKUP_SECONDS


async def test_a_back_dated_job_below_the_watermark_is_claimed_within_a_second(dsn, running):
    run, recorder = running
    an_hour_ago = datetime.now(UTC) - timedelta(hours=1)
    assert mark_of(run)[0] > an_hour_ago
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        async with conn.transaction():
            await enqueue_async(conn, "back-dated", run_at=an_hour_ago)
        since = time.monotonic()
    assert await picked_up(recorder, "back-dated", since) <= PICKUP_SECONDS


async def test_a_transaction_that_commits_late_is_claimed_within_a_second(dsn, running):
    run, recorder = running
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        async with conn.transaction():
            await enqueue_async(conn, "late")  # run_at = now(): this transaction's start
            cur = await conn.execute("SELECT run_at FROM receipt_jobs WHERE order_id = 'late'")
            row = await cur.fetchone()
            assert row is not None
            # The watermark passes the uncommitted row before it commits.
            await until(lambda: mark_of(run)[0] > row[0], timeout=10)
        since = time.monotonic()
    assert await picked_up(recorder, "late", since) <= PICKUP_SECONDS


def _explain(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]
             ) -> dict[str, Any]:
    (doc,), = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}",
                           params).fetchall()
    return (doc if isinstance(doc, list) else json.loads(doc))[0]


def _index_scans(plan: dict[str, Any]) -> list[dict[str, Any]]:
    out = [plan] if plan.get("Index Name") == "receipt_jobs_ready" else []
    for child in plan.get("Plans", []):
        out += _index_scans(child)
    return out


def _buffers(plans: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Buffers each plan's scans of the ready index touched (hit or read)."""
    return {name: sum(n.get("Shared Hit Blocks", 0) + n.get("Shared Read Blocks", 0)
                      for n in _index_scans(p["Plan"])) for name, p in plans.items()}


def _plans_from(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any],
                keys: tuple[str, str], bounds: dict[str, tuple[Any, Any]]
                ) -> dict[str, dict[str, Any]]:
    """EXPLAIN ANALYZE of *statement* once per named (run_at, id) bound, passed as the
    two *keys* of *params*; each in a transaction rolled back (a claim writes)."""
    plans = {}
    for name, (run_at, job_id) in bounds.items():
        conn.execute("BEGIN")
        try:
            plans[name] = _explain(conn, statement, params | {keys[0]: run_at, keys[1]: job_id})
        finally:
            conn.execute("ROLLBACK")
    return plans


@contextlib.contextmanager
def _claimed_under_a_held_snapshot(dsn: str, **connect: Any
                                   ) -> Iterator[psycopg.Connection[Any]]:
    """A long reader's REPEATABLE READ snapshot held in one session while the other
    (yielded, autocommit) claims the oldest 5,000 ready jobs, 100 at a time: their
    index entries stay alive until the reader commits, on leaving."""
    with psycopg.connect(dsn, autocommit=True) as reader, \
            psycopg.connect(dsn, autocommit=True, **connect) as conn:
        conn.execute("ANALYZE receipt_jobs")
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM receipt_jobs")  # the snapshot is taken
        text = claim_query(100).as_string(conn)
        for _ in range(50):
            conn.execute(text, {"max_attempts": 5, "lease_seconds": 60.0, "probe": False,
                                "after_run_at": None, "after_id": None})
        try:
            yield conn
        finally:
            reader.execute("COMMIT")


def test_a_claim_from_the_watermark_skips_what_a_long_reader_keeps_alive(dsn):
    """With 5,000 claimed jobs' entries kept by a held snapshot, the claim from the
    watermark starts its index scan there (a row comparison in the Index Cond) and
    reads a few pages, where a claim from the index's start reads many."""
    fetch_rows(dsn, """
        INSERT INTO receipt_jobs (id, order_id, run_at)
        SELECT gen_random_uuid(), 'held-' || g,
               statement_timestamp() - make_interval(secs => (20000 - g) / 1000.0)
        FROM generate_series(1, 20000) AS g RETURNING 1""")
    params = {"max_attempts": 5, "lease_seconds": 60.0, "probe": False,
              "after_run_at": None, "after_id": None}
    with _claimed_under_a_held_snapshot(dsn) as conn:
        text = claim_query(100).as_string(conn)
        head = conn.execute("SELECT run_at, id FROM receipt_jobs WHERE state = 'ready'"
                            " ORDER BY run_at, id LIMIT 1").fetchone()
        assert head is not None
        plans = _plans_from(conn, text, params, ("after_run_at", "after_id"),
                            {"start": (None, None), "watermark": (head[0], head[1])})
    (scan,) = _index_scans(plans["watermark"]["Plan"])
    assert "ROW(run_at, id) >=" in scan["Index Cond"]
    buffers = _buffers(plans)
    print(f"\n[figures] claim of 100 past 5,000 claimed entries kept by a snapshot:"
          f" buffers {buffers}, ms {[round(p['Execution Time'], 2) for p in plans.values()]}")
    assert buffers["watermark"] * 5 < buffers["start"], buffers


@pytest.mark.parametrize("plan_mode", ["force_custom_plan", "force_generic_plan"])
def test_the_near_sweep_reads_only_its_last_seconds_of_what_a_long_reader_keeps_alive(
        dsn, plan_mode):
    """5,000 claimed jobs spread over 50 s of run_at below the watermark, their entries
    kept by a held snapshot: the full sweep walks them all, the near sweep (the last
    NEAR_SECONDS) a fifth; both bounds are the ready index's Index Cond, with custom
    and generic plans, and a row below the near sweep's reach is found by the full."""
    from receipts.statements import statements
    from receipts.waker import NEAR_SECONDS
    fetch_rows(dsn, """
        INSERT INTO receipt_jobs (id, order_id, run_at)
        SELECT gen_random_uuid(), 'held-' || g,
               statement_timestamp() - make_interval(secs => (20000 - g) / 100.0)
        FROM generate_series(1, 20000) AS g RETURNING 1""")
    sweep = statements()["waker_sweep"].format(schema="public")
    for n, key in enumerate(("max_attempts", "reach_seconds", "below_run_at", "below_id"), 1):
        sweep = sweep.replace(f"%({key})s", f"${n}")
    with _claimed_under_a_held_snapshot(dsn, cursor_factory=psycopg.ClientCursor) as conn:
        head = conn.execute("SELECT run_at, id FROM receipt_jobs WHERE state = 'ready'"
                            " ORDER BY run_at, id LIMIT 1").fetchone()
        assert head is not None
        conn.execute(f"SET plan_cache_mode = {plan_mode}")
        plans, found = {}, {}
        conn.execute("BEGIN")
        try:
            conn.execute(f"PREPARE sweep_stmt(int, float8, timestamptz, uuid) AS {sweep}")
            for name, reach in (("full", "NULL"), ("near", str(NEAR_SECONDS))):
                args = f"5, {reach}, '{head[0].isoformat()}', '{head[1]}'"
                conn.execute(f"EXECUTE sweep_stmt({args})")  # warm; measure the second
                plans[name] = _explain(conn, f"EXECUTE sweep_stmt({args})", {})
            # A back-dated row, far below the near sweep's reach.
            conn.execute("INSERT INTO receipt_jobs (id, order_id, run_at)"
                         " VALUES (gen_random_uuid(), 'back-dated', now() - interval '1 hour')")
            for name, reach in (("full", "NULL"), ("near", str(NEAR_SECONDS))):
                found[name] = conn.execute(
                    f"EXECUTE sweep_stmt(5, {reach}, '{head[0].isoformat()}', '{head[1]}')"
                ).fetchall()
        finally:
            conn.execute("ROLLBACK")
    for plan in plans.values():
        (scan,) = _index_scans(plan["Plan"])
        assert scan["Index Cond"].count("ROW(run_at, id)") == 2, scan["Index Cond"]
        assert scan["Actual Rows"] == 0
    buffers = _buffers(plans)
    print(f"\n[figures] sweeps below 5,000 claimed entries kept by a snapshot ({plan_mode}):"
          f" buffers {buffers}, ms {[round(p['Execution Time'], 3) for p in plans.values()]}")
    assert buffers["near"] * 3 < buffers["full"], buffers
    # One row each, with what the database spent on it; the near one found nothing.
    assert found["full"][0][1] is not None and found["near"][0][:2] == (None, None)
    assert all(timedelta(0) <= rows[0][2] < timedelta(seconds=1) for rows in found.values())


async def test_while_the_full_sweep_is_spread_out_a_late_commit_is_claimed_within_a_second(
        dsn, running, monkeypatch):
    """A full sweep that is slow (a long reader) runs at most every SWEEP_MAX_SECONDS:
    in between, the near sweep still finds a transaction that committed late, and
    the full one a back-dated row."""
    import receipts.waker as waker
    run, recorder = running
    # Every full sweep now waits SWEEP_MAX_SECONDS for the next, however quick it was.
    monkeypatch.setattr(waker, "SWEEP_BUSY_SHARE", 1e-9)
    wakeups = run.worker.wakeups
    assert wakeups is not None
    wakeups._next_full_sweep = 0.0  # one full sweep now, then only near ones
    await until(lambda: wakeups._next_full_sweep > time.monotonic() + 5, timeout=5)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        async with conn.transaction():
            await enqueue_async(conn, "late-near")
            cur = await conn.execute("SELECT run_at FROM receipt_jobs WHERE order_id = 'late-near'")
            row = await cur.fetchone()
            assert row is not None
            await until(lambda: mark_of(run)[0] > row[0], timeout=10)
        since = time.monotonic()
    assert wakeups._next_full_sweep > time.monotonic()  # no full sweep found it
    assert await picked_up(recorder, "late-near", since) <= PICKUP_SECONDS
    # An hour back is beyond the near sweep: the next full sweep finds it.
    full_due = wakeups._next_full_sweep
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        await enqueue_async(conn, "back-dated-far", run_at=datetime.now(UTC) - timedelta(hours=1))
    await until(lambda: "back-dated-far" in recorder.seen, timeout=waker.SWEEP_MAX_SECONDS + 5)
    assert recorder.seen["back-dated-far"][0] >= full_due


def test_the_probe_on_an_empty_queue_reads_no_further_back_than_the_watermark(dsn):
    """Every job claimed (the calm-day queue between two probes) and their entries kept
    by a held snapshot: the probe's scans stop at the watermark instead of walking back
    over all of them, as a probe from the index's start (a new waker's first) does."""
    from receipts.statements import statements
    fetch_rows(dsn, """
        INSERT INTO receipt_jobs (id, order_id, run_at)
        SELECT gen_random_uuid(), 'held-' || g,
               statement_timestamp() - interval '1 minute' + make_interval(secs => g / 1000.0)
        FROM generate_series(1, 5000) AS g RETURNING 1""")
    probe = statements()["waker_probe"].format(schema="public")
    params = {"max_attempts": 5, "seen_run_at": None, "seen_id": None,
              "channel": "test_unheard", "heartbeat": False, "waker_channel": "test_unheard",
              "schema_name": "public", "margin_seconds": 1.0, "stuck_seconds": 0.15,
              "channels": [], "before": [], "fleet_channel": "test_unheard", "shares": None,
              "local": None}
    with _claimed_under_a_held_snapshot(dsn) as conn:  # every job claimed
        mark = conn.execute("SELECT statement_timestamp() - interval '1 second'").fetchone()
        assert mark is not None
        plans = _plans_from(conn, probe, params, ("from_run_at", "from_id"),
                            {"start": (None, None), "watermark": (mark[0], NIL_UUID)})
    buffers = _buffers(plans)
    print(f"\n[figures] probe of an empty queue past 5,000 claimed entries kept by a"
          f" snapshot: buffers {buffers}")
    assert buffers["watermark"] * 10 < buffers["start"], buffers


async def test_without_a_long_reader_back_dated_rows_in_a_row_are_each_claimed_within_a_second(
        dsn, running):
    """A quick full sweep keeps its every-SWEEP_SECONDS turn whatever the round trip or
    a busy client make it look like (its cost is the database's own clock): a new
    user's trial found rows back-dated an hour claimed 1-5 s late when it was not."""
    import random
    _, recorder = running
    late = []
    for n in range(8):
        await asyncio.sleep(random.uniform(0.3, 1.0))  # any phase of the sweeps' turn
        async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
            await enqueue_async(conn, f"back-dated-{n}",
                                run_at=datetime.now(UTC) - timedelta(hours=1))
        since = time.monotonic()
        late.append(await picked_up(recorder, f"back-dated-{n}", since))
    assert max(late) <= PICKUP_SECONDS, late


def test_the_near_sweeps_reach_is_absolute_time_across_a_daylight_saving_change(dsn):
    """The watermark comes back in the session's time zone; the reach is subtracted in
    SQL, in absolute time. Europe/Berlin's clocks went forward at 01:00 UTC on
    2026-03-29: 10 s below 01:00:05 UTC reaches 00:59:55 UTC, not an hour further."""
    from zoneinfo import ZoneInfo

    from receipts.statements import query
    changed = datetime(2026, 3, 29, 1, 0, 5, tzinfo=UTC)
    fetch_rows(dsn, """
        INSERT INTO receipt_jobs (id, order_id, run_at)
        VALUES (gen_random_uuid(), 'inside', %(changed)s - interval '7 seconds'),
               (gen_random_uuid(), 'outside', %(changed)s - interval '15 seconds')
        RETURNING 1""", {"changed": changed})
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET TimeZone = 'Europe/Berlin'")
        mark = conn.execute("SELECT %s::timestamptz", (changed,)).fetchone()
        assert mark is not None and mark[0].tzinfo == ZoneInfo("Europe/Berlin")
        (run_at, _, spent), = conn.execute(query("waker_sweep"), {
            "max_attempts": 5, "reach_seconds": 10.0, "below_run_at": mark[0],
            "below_id": NIL_UUID}).fetchall()
    assert run_at == changed - timedelta(seconds=7) and spent >= timedelta(0)
