"""Deadlines on one timer behave as asyncio.timeout_at does, one resolution late at most."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from receipts.deadlines import Deadlines

RESOLUTION = 0.02


async def test_work_that_overruns_its_deadline_raises_timeout_error_within_one_resolution():
    deadlines = Deadlines(RESOLUTION)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError), deadlines.at(start + 0.1) as scope:
        await asyncio.sleep(5)
    assert scope.expired
    assert 0.1 <= loop.time() - start < 0.1 + RESOLUTION + 0.1  # the last term: a busy box
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_work_that_finishes_in_time_is_left_alone_and_the_task_stays_uncancelled():
    deadlines = Deadlines(RESOLUTION)
    loop = asyncio.get_running_loop()
    with deadlines.at(loop.time() + 5) as scope:
        await asyncio.sleep(0.01)
    assert not scope.expired
    await asyncio.sleep(2 * RESOLUTION)  # a later check must not touch the finished scope
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_rescheduled_deadline_expires_at_its_new_time():
    deadlines = Deadlines(RESOLUTION)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError), deadlines.at(start + 30) as scope:
        scope.reschedule(loop.time() + 0.05)
        await asyncio.sleep(5)
    assert loop.time() - start < 1


async def test_concurrent_scopes_expire_each_at_their_own_deadline():
    deadlines = Deadlines(RESOLUTION)
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def bounded(seconds: float, work: float) -> str:
        try:
            with deadlines.at(loop.time() + seconds):
                await asyncio.sleep(work)
        except TimeoutError:
            return "timed out"
        return "done"

    results = await asyncio.gather(*(bounded(5, 0.2) for _ in range(50)),
                                   *(bounded(0.1, 5) for _ in range(50)))
    assert results == ["done"] * 50 + ["timed out"] * 50
    assert loop.time() - start < 2
    # Scopes opened once all earlier ones have closed expire too.
    assert await bounded(0.05, 5) == "timed out"


async def test_a_cancellation_from_outside_stays_a_cancellation():
    deadlines = Deadlines(RESOLUTION)
    loop = asyncio.get_running_loop()

    async def bounded() -> None:
        with deadlines.at(loop.time() + 0.05):
            await asyncio.sleep(5)

    task = asyncio.create_task(bounded())
    await asyncio.sleep(0)  # the scope is open
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_one_instance_serves_a_later_event_loop_after_an_earlier_one_closed():
    deadlines = Deadlines(RESOLUTION)

    async def overrun() -> bool:
        loop = asyncio.get_running_loop()
        try:
            with deadlines.at(loop.time() + 0.05):
                await asyncio.sleep(5)
        except TimeoutError:
            return True
        return False

    # uvloop (the worker's loop) and asyncio's own, each closed before the next starts,
    # the first with the check timer still armed when it closes.
    assert uvloop.run(overrun())
    assert asyncio.run(overrun())
    assert uvloop.run(overrun())


def test_a_resolution_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="positive"):
        Deadlines(0)
