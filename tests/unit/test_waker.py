"""What a pod makes of the notifications it hears (no database: a clock of the test's own).

The election, the probe and the hand-over run on a real PostgreSQL in
tests/integration/test_wakeups.py and with real processes in
tests/acceptance/test_waker_fleet.py.
"""

from __future__ import annotations

import json

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
