"""What a pod makes of the notifications it hears (no database: a clock of the test's own).

The election, the probe and the hand-over run on a real PostgreSQL in
tests/integration/test_wakeups.py and with real processes in
tests/acceptance/test_waker_fleet.py.
"""

from __future__ import annotations

import json
from collections import deque
from datetime import timedelta

import pytest

from receipts.enqueue import NOTIFY_CHANNEL
from receipts.metrics import Metrics
from receipts.waker import (
    FLEET_CHANNEL,
    LEFT_SUFFIX,
    SILENT_SECONDS,
    WAKER_CHANNEL,
    Wakeups,
    lock_key,
)
from tests.conftest import make_settings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pod(schema: str | None = None) -> tuple[Wakeups, Clock, list[int]]:
    clock, woken = Clock(), []
    settings = make_settings("postgresql://u@127.0.0.1:9/db",
                             **({"database_schema": schema} if schema else {}))
    wakeups = Wakeups(settings, Metrics(), lambda: woken.append(1), clock=clock)
    return wakeups, clock, woken


def test_the_lock_key_is_stable_and_one_per_queue_schema():
    assert lock_key("public") == lock_key("public")
    assert lock_key("public") != lock_key("shop")
    assert -(2 ** 63) <= lock_key("shop") < 2 ** 63


def test_a_heartbeat_of_this_queue_keeps_the_waker_alive_for_the_silent_period():
    wakeups, clock, _ = pod()
    assert not wakeups.waker_alive()  # nothing heard yet: this pod will run for the lock
    wakeups.hear(WAKER_CHANNEL, "public")
    clock.now += SILENT_SECONDS - 0.1
    assert wakeups.waker_alive()
    clock.now += 0.2
    assert not wakeups.waker_alive()


def test_another_queues_heartbeat_does_not_count():
    wakeups, _, _ = pod("shop")
    wakeups.hear(WAKER_CHANNEL, "public")
    assert not wakeups.waker_alive()
    wakeups.hear(WAKER_CHANNEL, "shop")
    assert wakeups.waker_alive()


def test_a_waker_that_left_is_not_waited_for():
    wakeups, clock, _ = pod()
    wakeups.hear(WAKER_CHANNEL, "public")
    wakeups._next_try = clock.now + SILENT_SECONDS
    wakeups.hear(WAKER_CHANNEL, "public" + LEFT_SUFFIX)
    assert not wakeups.waker_alive()
    assert wakeups._next_try == clock.now  # runs for the lock on its next turn


def test_every_notification_on_the_ready_channel_wakes_the_claim_loop():
    wakeups, _, woken = pod()
    wakeups.hear(NOTIFY_CHANNEL, "")
    wakeups.hear(NOTIFY_CHANNEL, "")
    wakeups.hear(WAKER_CHANNEL, "public")  # a heartbeat is not a wake-up
    assert len(woken) == 2


def test_the_fleets_size_comes_from_a_fresh_announcement_of_this_queue_only():
    """Adaptive concurrency shares its increase among the pods the waker names
    (receipts.capacity): a stale, foreign or garbled announcement names nobody."""
    wakeups, clock, _ = pod()
    assert wakeups.announced_size() is None and wakeups.fleet_size() == 1
    shares = {"a1": 0.25, "b2": 0.25, "c3": 0.25, "d4": 0.25}
    wakeups.hear(FLEET_CHANNEL, json.dumps({"schema": "shop", "shares": shares}))
    assert wakeups.announced_size() is None
    wakeups.hear(FLEET_CHANNEL, "{not json")
    assert wakeups.announced_size() is None
    wakeups.hear(FLEET_CHANNEL, json.dumps({"schema": "public", "shares": shares}))
    assert wakeups.announced_size() == 4 and wakeups.fleet_size() == 4
    clock.now += SILENT_SECONDS + 0.1
    assert wakeups.announced_size() is None and wakeups.fleet_size() == 1


class Session:
    """A stand-in for the waker's LISTEN session: ``fleet_members`` answers with
    :attr:`members`, ``waker_probe`` with the next row of :attr:`probes`."""

    def __init__(self, members: dict[str, int]) -> None:
        self.members = members
        self.probes: list[tuple[object, ...]] = []

    async def fetchall(self, statement: object, params: object = None) -> list[tuple[object, ...]]:
        return [(tag, slots, 0) for tag, slots in sorted(self.members.items())]

    async def fetchone(self, statement: object, params: object = None) -> tuple[object, ...]:
        return self.probes.pop(0)


def probe_row(*, due: int, woken: int, stuck: bool = False) -> tuple[object, ...]:
    """A ``waker_probe`` row: fresh work, *due* jobs, *woken* members, head *stuck*."""
    return (None, None, woken > 0, None, None, due, woken, None, None, None, False, stuck)


def test_the_wakers_pod_leads_while_its_share_alone_hands_work_away_and_not_after_a_backlog():
    """receipts.waker, "A leading share": doubled at each heartbeat after a probe
    that woke others because this pod's share fell short, up to LEAD_MAX_SHARE;
    back to the slots' share after a head stuck at two probes in a row."""
    import asyncio

    from receipts.waker import LEAD_MAX_SHARE

    offer, unshared = [2], [10]  # the bucket allows 2 jobs; the slots would take 10
    clock = Clock()
    wakeups = Wakeups(make_settings("postgresql://u@127.0.0.1:9/db"), Metrics(), lambda: None,
                      tag="a" * 8, free_slots=lambda: offer[0],
                      unshared_room=lambda: unshared[0], clock=clock)
    tags = [c * 8 for c in "abcdefgh"]
    session = Session({t: 32 for t in tags})

    async def heartbeat() -> float:
        shares = await wakeups.read_members(session)  # type: ignore[arg-type]
        assert abs(sum(shares.values()) - 1.0) < 1e-5
        return shares[tags[0]]

    async def probe(**row: object) -> None:
        session.probes.append(probe_row(**row))  # type: ignore[arg-type]
        await wakeups.probe(session)  # type: ignore[arg-type]

    async def scenario() -> None:
        assert await heartbeat() == 0.125  # by slots: an eighth
        await probe(due=5, woken=2)        # 5 due, 2 allowed by the share, 10 by the slots
        assert await heartbeat() == 0.25
        await probe(due=5, woken=2)
        assert await heartbeat() == LEAD_MAX_SHARE
        await probe(due=5, woken=2)
        assert await heartbeat() == LEAD_MAX_SHARE  # at most
        await probe(due=0, woken=0, stuck=True)     # one stuck probe: a late commit
        await probe(due=1, woken=0)
        assert await heartbeat() == LEAD_MAX_SHARE
        await probe(due=9, woken=3, stuck=True)
        await probe(due=9, woken=3, stuck=True)     # stuck twice in a row: a backlog
        assert await heartbeat() == 0.125
        unshared[0] = 4                             # the slots could not take 5 either
        await probe(due=5, woken=2)
        assert await heartbeat() == 0.125
        offer[0], unshared[0] = 5, 10               # the share allowed it all: woke nobody
        await probe(due=5, woken=0)
        assert await heartbeat() == 0.125
        assert wakeups.lead is None

    asyncio.run(scenario())


def test_under_a_rate_limit_a_member_is_counted_for_no_more_than_its_full_bucket():
    """receipts.waker: a burst of due work beyond one pod's tokens wakes the next pod
    too. Each member's free slots are capped at burst × its announced share (≥ 1);
    without a limit, or without a share for it, its free slots stand."""
    limited = make_settings("postgresql://u@127.0.0.1:9/db",
                            provider_rate_limit_per_second=20.0)
    wakeups = Wakeups(limited, Metrics(), lambda: None, tag="a" * 8)
    wakeups.shares = {"a" * 8: 0.5, "b" * 8: 0.25, "c" * 8: 0.2, "d" * 8: 0.05}
    wakeups._members = deque([("b" * 8, 32), ("c" * 8, 2), ("d" * 8, 32), ("e" * 8, 7)])
    # burst = one second's worth (20): b 5 tokens, c 4 (but 2 free slots), d 1, e no share.
    assert wakeups._targets() == (
        None, [f"receipts_ready_{c * 8}" for c in "bcde"], [0, 5, 7, 8])
    unlimited = Wakeups(make_settings("postgresql://u@127.0.0.1:9/db"), Metrics(),
                        lambda: None, tag="a" * 8)
    unlimited.shares = dict(wakeups.shares)
    unlimited._members = deque(wakeups._members)
    assert unlimited._targets()[2] == [0, 32, 34, 66]


def test_a_waker_that_led_and_loses_its_role_drops_to_an_even_share_at_once():
    """Its successor's announcement may take seconds, and meanwhile gives the others
    shares that add up to 1: the old waker must not go on claiming at its lead."""
    wakeups, _, _ = pod()
    wakeups.tag = "a" * 8
    wakeups.lead = 0.5
    wakeups.shares = {"a" * 8: 0.5, "b" * 8: 0.25, "c" * 8: 0.25}
    wakeups._set_waker(False)
    assert wakeups.lead is None
    assert wakeups.shares == {"a" * 8: pytest.approx(1 / 3), "b" * 8: 0.25, "c" * 8: 0.25}
    follower, _, _ = pod()  # a pod that never led keeps what it heard
    follower.tag = "b" * 8
    follower.shares = {"a" * 8: 0.5, "b" * 8: 0.25, "c" * 8: 0.25}
    follower._set_waker(False)
    assert follower.shares == {"a" * 8: 0.5, "b" * 8: 0.25, "c" * 8: 0.25}


class SweepSession:
    """A stand-in for the waker's session that answers ``waker_sweep``: each call
    spends :attr:`took` seconds of the database's time, and *wait* more of the test's
    clock (a round trip, a busy event loop); it records its bounds."""

    def __init__(self, clock: Clock, took: float, wait: float = 0.0) -> None:
        self.clock, self.took, self.wait = clock, took, wait
        self.calls: list[dict[str, object]] = []

    async def fetchone(self, statement: object, params: dict[str, object]
                       ) -> tuple[object, ...]:
        self.calls.append(params)
        self.clock.now += self.took + self.wait
        return (None, None, timedelta(seconds=self.took))


@pytest.mark.parametrize(("took", "wait", "fulls"), [
    (0.0001, 0.0, {20}),  # a quick full sweep: every SWEEP_SECONDS, as before
    # ...however long the round trip and the event loop made it look to the client
    (0.0001, 0.016, {20}),
    # a long reader's: once per took / SWEEP_BUSY_SHARE = 1 s, on the next tick
    (0.003, 0.0, {4, 5}),
    (0.2, 0.0, {1}),  # a very slow one: at most SWEEP_MAX_SECONDS apart
])
def test_a_slow_full_sweep_is_spread_out_and_the_near_sweep_fills_the_gaps(took, wait, fulls):
    """receipts.waker, "The watermark": the full sweep costs the database at most
    SWEEP_BUSY_SHARE of the time (by the database's own clock); between two full
    sweeps a near one looks at the last NEAR_SECONDS below the watermark every
    SWEEP_SECONDS."""
    import asyncio
    from datetime import UTC, datetime
    from uuid import UUID

    from receipts.waker import NEAR_SECONDS, SWEEP_SECONDS
    wakeups, clock, _ = pod()
    session = SweepSession(clock, took, wait)
    mark = (datetime(2026, 12, 7, 12, tzinfo=UTC), UUID(int=7))
    wakeups._mark = mark

    async def five_seconds() -> None:
        end = clock.now + 5.0
        while clock.now < end:
            if clock.now >= wakeups._next_sweep:
                assert await wakeups.sweep(session) is False  # type: ignore[arg-type]
            clock.now = max(clock.now, min(wakeups._next_sweep, end))

    asyncio.run(five_seconds())
    full = [c for c in session.calls if c["reach_seconds"] is None]
    near = [c for c in session.calls if c["reach_seconds"] is not None]
    assert len(full) in fulls
    assert session.calls[0]["reach_seconds"] is None  # a new waker sweeps it all first
    assert len(session.calls) == pytest.approx(5.0 / SWEEP_SECONDS, abs=1)
    assert all(c["reach_seconds"] == NEAR_SECONDS for c in near)
    assert all((c["below_run_at"], c["below_id"]) == mark for c in session.calls)


def test_a_sweep_that_finds_a_row_lowers_the_watermark_to_it():
    import asyncio
    from datetime import UTC, datetime, timedelta
    from uuid import UUID
    wakeups, _, _ = pod()
    mark = (datetime(2026, 12, 7, 12, tzinfo=UTC), UUID(int=7))
    found = (mark[0] - timedelta(hours=1), UUID(int=3))
    wakeups._mark = mark

    class Finds:
        async def fetchone(self, statement: object, params: object) -> tuple[object, ...]:
            return (*found, timedelta(microseconds=100))

    assert asyncio.run(wakeups.sweep(Finds())) is True  # type: ignore[arg-type]
    assert wakeups._mark == found and wakeups.watermark == found
    # No watermark yet (a new waker before its first probe): nothing to sweep below.
    fresh, _, _ = pod()
    assert asyncio.run(fresh.sweep(Finds())) is False  # type: ignore[arg-type]
    # Nothing found: the statement's one row has NULLs.
    quiet, clock, _ = pod()
    quiet._mark = mark
    assert asyncio.run(quiet.sweep(SweepSession(clock, 0.0001))) is False  # type: ignore[arg-type]
    assert quiet._mark == mark
