"""The console's shared reading on a real PostgreSQL: fifty viewers cost one reading per
interval; a page of the list is read once for everyone who asks at once; without a viewer
the reading slows down; a lost database leaves the last reading on the page."""

from __future__ import annotations

import asyncio

import pytest

from receipts.db import make_pool
from receipts.errors import DatabaseUnavailable
from receipts.jobqueue import JobQueue
from receipts.operations import Operations
from receipts.ui.app import ListCache
from receipts.ui.monitor import Monitor
from tests.conftest import enqueue_many, make_settings


@pytest.mark.slow
async def test_fifty_viewers_share_one_reading_per_interval(dsn: str) -> None:
    enqueue_many(dsn, ["m-1", "m-2"])
    pool = make_pool(make_settings(dsn), "ui", max_size=4)
    await pool.open(wait=True)
    try:
        queue = JobQueue(pool, lease_seconds=30, max_attempts=5)
        clock = [0.0]
        monitor = Monitor(queue, Operations(pool), refresh_seconds=5.0, clock=lambda: clock[0])
        snapshots = await asyncio.gather(*(monitor.current() for _ in range(50)))
        assert monitor.readings == 1 and {id(s) for s in snapshots} == {id(snapshots[0])}
        assert snapshots[0].stats.ready == 2 and len(monitor.history) == 1
        clock[0] = 4.0  # within the interval: no statement at all
        await asyncio.gather(*(monitor.current() for _ in range(50)))
        assert monitor.readings == 1
        clock[0] = 5.0
        await asyncio.gather(*(monitor.current() for _ in range(50)))
        assert monitor.readings == 2 and len(monitor.history) == 2
        # Viewed a moment ago: sample every 5 s; nobody for two minutes: every minute.
        assert monitor.next_sample_in() == 5.0
        clock[0] = 5.0 + 121
        assert monitor.next_sample_in() == 0
        monitor._read_at = clock[0]
        assert monitor.next_sample_in() == 60.0
        # A slow reading stretches the interval: at most a tenth of the time is spent reading.
        monitor.reading_seconds = 2.0
        assert monitor.interval() == 20.0
        monitor.viewed()
        assert monitor.next_sample_in() == 20.0
    finally:
        await pool.close()


async def test_a_page_of_the_list_is_read_once_for_everyone_asking_at_once() -> None:
    loads = 0
    gate = asyncio.Event()

    async def load() -> str:
        nonlocal loads
        loads += 1
        await gate.wait()
        return "page"

    cache = ListCache(5.0)
    waiting = [asyncio.create_task(cache.get("failed|", load)) for _ in range(20)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*waiting) == ["page"] * 20 and loads == 1
    assert await cache.get("failed|", load) == "page" and loads == 1
    cache.clear()
    await cache.get("failed|", load)
    assert loads == 2


@pytest.mark.slow
async def test_the_last_reading_stays_when_the_database_goes_away(dsn: str) -> None:
    pool = make_pool(make_settings(dsn), "ui", max_size=2)
    await pool.open(wait=True)
    queue = JobQueue(pool, lease_seconds=30, max_attempts=5)
    clock = [0.0]
    monitor = Monitor(queue, Operations(pool), refresh_seconds=1.0, clock=lambda: clock[0])
    first = await monitor.current()
    await pool.close()
    clock[0] = 10.0
    assert await monitor.current() is first  # the page keeps showing it, with its time
    assert monitor.error and not monitor.answered_within(5)
    fresh = Monitor(queue, Operations(pool), refresh_seconds=1.0)
    try:
        await fresh.current()
    except DatabaseUnavailable:
        pass
    else:
        raise AssertionError("a first reading without a database must fail")
