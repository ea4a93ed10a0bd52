"""The fleet's wake-ups on a real PostgreSQL: one waker elected among several LISTEN
sessions, woken on new due work only, replaced when its session goes.

Each `Wakeups` here is what one worker pod runs (its LISTEN session and its part in
the election), in this test's event loop; `tests/acceptance/test_waker_fleet.py` does
the same with real worker processes and kill -9.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg import sql

from receipts.db import ListenSession, connection_kwargs, make_pool
from receipts.enqueue import NOTIFY_CHANNEL, enqueue
from receipts.jobqueue import JobQueue
from receipts.metrics import Metrics
from receipts.waker import (
    FLEET_CHANNEL,
    MEMBER_CHANNEL_PREFIX,
    SILENT_SECONDS,
    WAKER_CHANNEL,
    Wakeups,
    lock_key,
)
from tests.conftest import enqueue_many, fetch_rows, make_settings
from tests.integration.test_enqueue_api import Listener

# Pickup and failover are measured here in fractions of a second: run alone (solo).
pytestmark = pytest.mark.solo


class Pod:
    """One pod's wake-ups: counts the times its claim loop would have been woken.

    With a *tag* it is a member (its own channel; woken only when the work
    needs it) and, given a *queue*, claims on each wake-up from the watermark,
    as its claim loop would.
    """

    def __init__(self, dsn: str, *, tag: str | None = None, queue: JobQueue | None = None,
                 free_slots: Callable[[], int] | None = None,
                 unshared_room: Callable[[], int | None] | None = None,
                 **settings: object) -> None:
        self.metrics = Metrics()
        self.woken = 0
        self.claimed: list[str] = []
        self.queue = queue
        self.wakeups = Wakeups(make_settings(dsn, **settings), self.metrics, self._wake,
                               tag=tag, free_slots=free_slots, unshared_room=unshared_room)
        self.task: asyncio.Task[None] | None = None
        self._claims: set[asyncio.Task[None]] = set()

    def _wake(self) -> None:
        self.woken += 1
        if self.queue is not None:
            task = asyncio.create_task(self._claim())
            self._claims.add(task)
            task.add_done_callback(self._claims.discard)

    async def _claim(self) -> None:
        assert self.queue is not None
        result = await self.queue.claim(32, after=self.wakeups.claim_bound())
        self.claimed += [a.job.order_id for a in result.attempts]

    def start(self) -> Pod:
        self.task = asyncio.create_task(self.wakeups.run())
        return self

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    @property
    def is_waker(self) -> bool:
        return self.wakeups.is_waker

    def probes(self) -> float:
        return self.metrics.registry.get_sample_value(
            "receipts_db_statement_duration_seconds_count", {"statement": "waker_probe"}) or 0.0

    def wakes(self) -> float:
        return self.metrics.registry.get_sample_value("receipts_waker_wakes_total") or 0.0


async def until(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> float:
    """Wait for *predicate*; the seconds it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out: {what}"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


@pytest.fixture
async def pods(dsn) -> AsyncIterator[list[Pod]]:
    started = [Pod(dsn).start() for _ in range(3)]
    await until(lambda: sum(p.is_waker for p in started) == 1, "a waker elected")
    await until(lambda: all(p.wakeups.waker_alive() for p in started), "every pod hears it")
    yield started
    for pod in started:
        await pod.stop()


def waker_of(pods: list[Pod]) -> Pod:
    (waker,) = [p for p in pods if p.is_waker]
    return waker


async def enqueue_one(dsn: str, order: str, **kwargs: object) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        from receipts.enqueue import enqueue_async

        await enqueue_async(conn, order, **kwargs)  # type: ignore[arg-type]


async def probes_pass(waker: Pod, n: int) -> None:
    """Wait until the waker has probed *n* more times (the probe is the signal)."""
    target = waker.probes() + n
    await until(lambda: waker.probes() >= target, f"{n} more probes")


@pytest.mark.slow
async def test_exactly_one_of_several_pods_is_elected_and_the_others_hear_it(pods):
    waker = waker_of(pods)
    assert waker.metrics.registry.get_sample_value("receipts_waker_elected") == 1
    others = [p for p in pods if p is not waker]
    assert all(p.metrics.registry.get_sample_value("receipts_waker_elected") == 0
               for p in others)
    await probes_pass(waker, 40)  # two seconds of probing: still the one waker
    assert [p.is_waker for p in pods].count(True) == 1
    assert all(p.wakeups.waker_alive() for p in others)


@pytest.mark.slow
async def test_a_committed_job_wakes_every_pod_once_from_the_wakers_own_transaction(
        dsn, pods):
    waker = waker_of(pods)
    await probes_pass(waker, 2)
    before = [p.woken for p in pods]
    listener = Listener(dsn)  # a plain LISTEN session, as a released worker has
    try:
        await enqueue_one(dsn, "order-1")
        await until(lambda: all(p.woken > b for p, b in zip(pods, before, strict=True)),
                    "every pod woken")
        await probes_pass(waker, 10)  # the same due job: nobody is woken again
        assert waker.wakes() == 1
        assert await asyncio.to_thread(listener.count) == 1
    finally:
        listener.close()


@pytest.mark.slow
async def test_a_job_scheduled_later_wakes_the_fleet_when_it_becomes_due(dsn, pods):
    waker = waker_of(pods)
    await probes_pass(waker, 2)
    due = datetime.now(UTC) + timedelta(seconds=1)
    await enqueue_one(dsn, "later", run_at=due)
    await probes_pass(waker, 5)
    assert waker.wakes() == 0  # committed, not yet due
    await until(lambda: waker.wakes() == 1, "a wake when it falls due")
    assert datetime.now(UTC) >= due


@pytest.mark.slow
async def test_a_paused_fleet_and_a_standing_backlog_are_not_woken_again(dsn, pods):
    waker = waker_of(pods)
    with psycopg.connect(dsn) as conn:
        for i in range(5):
            enqueue(conn, f"backlog-{i}")
    await until(lambda: waker.wakes() == 1, "a wake for the backlog")
    await probes_pass(waker, 20)  # nobody claims it: the same tail, no second wake
    assert waker.wakes() == 1
    fetch_rows(dsn, "UPDATE receipt_flow SET pause_reason = 'outage', "
                    "paused_until = now() + interval '1 hour' WHERE id = 1 RETURNING 1")
    await enqueue_one(dsn, "during-the-pause")
    await probes_pass(waker, 20)
    assert waker.wakes() == 1
    fetch_rows(dsn, "UPDATE receipt_flow SET pause_reason = NULL, paused_until = NULL "
                    "WHERE id = 1 RETURNING 1")
    await enqueue_one(dsn, "after-the-pause")
    await until(lambda: waker.wakes() == 2, "a wake for new work after the pause")


@pytest.mark.slow
async def test_a_stopping_waker_hands_over_at_once(pods):
    waker = waker_of(pods)
    await waker.stop()
    others = [p for p in pods if p is not waker]
    took = await until(lambda: sum(p.is_waker for p in others) == 1, "a new waker",
                       timeout=SILENT_SECONDS)
    assert took < 1.0


@pytest.mark.slow
async def test_a_waker_whose_session_is_killed_is_replaced_within_seconds(dsn, pods, caplog):
    waker = waker_of(pods)
    (pid,) = fetch_rows(dsn, "SELECT l.pid FROM pg_locks AS l JOIN pg_database AS d"
                             " ON d.oid = l.database AND d.datname = current_database()"
                             " WHERE l.locktype = 'advisory' AND l.granted"
                             " AND ((l.classid::int8 << 32) | l.objid::int8) = %s",
                        (lock_key("public"),))[0]
    fetch_rows(dsn, "SELECT pg_terminate_backend(%s)", (pid,))
    await until(lambda: not waker.is_waker, "the waker noticed its session is gone", 10)
    assert any(r.msg == "waker_lost" for r in caplog.records)
    took = await until(lambda: sum(p.is_waker for p in pods) == 1, "a waker again",
                       timeout=3 * SILENT_SECONDS)
    print(f"\n[figures] waker session killed: a waker again after {took:.2f} s")
    await probes_pass(waker_of(pods), 2)
    await enqueue_one(dsn, "after-the-change")
    await until(lambda: waker_of(pods).wakes() >= 1, "the waker wakes the fleet")


@pytest.mark.slow
async def test_each_queue_schema_has_its_own_waker(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA shop")
    from receipts.migrate import apply_migrations

    apply_migrations(dsn, schema="shop", beside_existing=True)
    public, shop = Pod(dsn).start(), Pod(dsn, database_schema="shop").start()
    try:
        await until(lambda: public.is_waker and shop.is_waker, "a waker per queue")
        assert lock_key("public") != lock_key("shop")
    finally:
        await public.stop()
        await shop.stop()


@pytest.mark.slow
async def test_a_waker_heartbeat_names_its_queue(dsn, pods):
    listener = psycopg.connect(dsn, autocommit=True)
    try:
        listener.execute(f"LISTEN {WAKER_CHANNEL}")
        notes = await asyncio.to_thread(lambda: list(listener.notifies(timeout=3, stop_after=2)))
        payloads = {n.payload for n in notes}
        assert payloads == {"public"}
    finally:
        listener.close()
    assert NOTIFY_CHANNEL == "receipts_ready"  # the channel released workers listen on


@pytest.fixture
async def members(dsn) -> AsyncIterator[list[Pod]]:
    """Three member pods (tags a…, b…, c…) that claim when woken, on one pool."""
    settings = make_settings(dsn)
    pool = make_pool(settings, "test", max_size=4)
    await pool.open(wait=True, timeout=10)
    queue = JobQueue(pool, lease_seconds=30.0, max_attempts=settings.max_attempts)
    started = [Pod(dsn, tag=c * 8, queue=queue).start() for c in "abc"]
    await until(lambda: sum(p.is_waker for p in started) == 1, "a waker elected")
    # Every pod has heard the waker announce all three shares.
    await until(lambda: all(p.wakeups.shares is not None and len(p.wakeups.shares) == 3
                            for p in started), "three members announced")
    yield started
    for pod in started:
        await pod.stop()
    await pool.close()


async def test_new_work_the_wakers_pod_can_take_wakes_only_it_and_notifies_nobody(
        dsn, members):
    """At a calm rate no probe notifies: each costs every LISTEN session a signal."""
    waker = waker_of(members)
    listener = Listener(dsn)  # receipts_ready: released workers and pods without a tag
    try:
        for n, order in enumerate(("first", "second"), start=1):
            before = [p.woken for p in members]
            await enqueue_one(dsn, order)
            await until(lambda o=order: o in waker.claimed, f"{order} claimed by the waker")
            await probes_pass(waker, 5)  # nothing due is left: nobody else is woken
            woken = [p.woken - b for p, b in zip(members, before, strict=True)]
            assert woken == [1 if p is waker else 0 for p in members], (order, woken)
            assert waker.wakes() == n
        assert listener.count() == 0
    finally:
        listener.close()


async def test_new_work_the_wakers_pod_cannot_take_goes_to_the_others_in_turn(dsn):
    settings = make_settings(dsn)
    pool = make_pool(settings, "test", max_size=4)
    await pool.open(wait=True, timeout=10)
    queue = JobQueue(pool, lease_seconds=30.0, max_attempts=settings.max_attempts)
    # Each pod's own slots are full: as the waker it takes nothing itself.
    members = [Pod(dsn, tag=c * 8, queue=queue, free_slots=lambda: 0).start() for c in "abc"]
    try:
        await until(lambda: sum(p.is_waker for p in members) == 1, "a waker elected")
        await until(lambda: all(p.wakeups.shares is not None and len(p.wakeups.shares) == 3
                                for p in members), "three members announced")
        waker = waker_of(members)
        for n, order in enumerate(("first", "second"), start=1):
            before = [p.woken for p in members]
            await enqueue_one(dsn, order)
            await until(lambda o=order: any(o in p.claimed for p in members), f"{order} claimed")
            await probes_pass(waker, 5)
            woken = [p.woken - b for p, b in zip(members, before, strict=True)]
            assert sorted(woken) == [0, 0, 1] and woken[members.index(waker)] == 0, woken
            assert waker.wakes() == n
        first = next(p for p in members if "first" in p.claimed)
        second = next(p for p in members if "second" in p.claimed)
        assert first is not second  # in turn, not always the same pod
    finally:
        for pod in members:
            await pod.stop()
        await pool.close()


async def test_the_waker_announces_shares_and_a_killed_member_drops_out_at_once(dsn, members):
    assert {p.wakeups.tag for p in members} == set(members[0].wakeups.shares or {})
    assert sum((members[0].wakeups.shares or {}).values()) == pytest.approx(1.0, abs=1e-5)
    victim = next(p for p in members if not p.is_waker)
    assert victim.wakeups.tag is not None
    with psycopg.connect(dsn, autocommit=True) as conn:  # its session dies, as with kill -9
        (ended,), = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = 'advisory'"
            " AND objsubid = 2 AND objid = %s::int8::oid AND database = (SELECT oid"
            " FROM pg_database WHERE datname = current_database())",
            (int(victim.wakeups.tag, 16),)
        ).fetchall()
        assert ended == 1
    await victim.stop()
    others = [p for p in members if p is not victim]
    took = await until(lambda: all(len(p.wakeups.shares or {}) == 2 for p in others),
                       "two members announced", timeout=5)
    assert took < 2.5  # within a heartbeat or two
    assert all((p.wakeups.shares or {}).get(p.wakeups.tag) == pytest.approx(0.5)
               for p in others)


async def test_a_back_dated_job_below_the_watermark_is_swept_and_claimed(dsn, members):
    waker = waker_of(members)
    await until(lambda: waker.wakeups.watermark is not None, "a watermark")
    await enqueue_one(dsn, "old", run_at=datetime.now(UTC) - timedelta(days=1))
    took = await until(lambda: any("old" in p.claimed for p in members), "the old job claimed")
    assert took < 1.0
    assert FLEET_CHANNEL == "receipts_fleet"


async def test_the_wakers_pod_leads_with_a_larger_share_until_the_fleet_falls_behind(dsn):
    """docs/design.md, "A leading share", on the real probe and announcement: each
    pod's share of the limit is a third (equal slots) until new work goes to the others
    only because the waker's pod's share held it back (its bucket allows 1 job, its
    slots 32); then every pod hears the waker's pod announced at LEAD_MAX_SHARE and the
    others at a quarter. A backlog nobody claims (a head stuck probe after probe) puts
    every share back to a third at the next heartbeat."""
    from receipts.waker import LEAD_MAX_SHARE

    offer = {"n": 1}
    members = [Pod(dsn, tag=c * 8, free_slots=lambda: offer["n"],
                   unshared_room=lambda: 32) for c in "abc"]
    for p in members:
        p.start()
    try:
        await until(lambda: sum(p.is_waker for p in members) == 1, "a waker elected")
        await until(lambda: all(len(p.wakeups.shares or {}) == 3 for p in members),
                    "three members announced")
        waker = waker_of(members)
        lead, rest = waker.wakeups.tag, [p.wakeups.tag for p in members if p is not waker]
        assert all(v == pytest.approx(1 / 3, abs=1e-5)
                   for v in (members[0].wakeups.shares or {}).values())

        def heard(own: float, other: float) -> bool:
            return all((p.wakeups.shares or {}).get(lead) == pytest.approx(own, abs=1e-5)
                       and all((p.wakeups.shares or {}).get(t) == pytest.approx(other, abs=1e-5)
                               for t in rest) for p in members)

        # Nobody claims here (no queue): take the rows away as soon as they are woken for.
        before = sum(p.woken for p in members if p is not waker)
        enqueue_many(dsn, ["lead-1", "lead-2", "lead-3"])
        await until(lambda: sum(p.woken for p in members if p is not waker) > before,
                    "the others woken for work the waker's pod could not take")
        fetch_rows(dsn, "DELETE FROM receipt_jobs RETURNING 1")
        await until(lambda: heard(LEAD_MAX_SHARE, (1 - LEAD_MAX_SHARE) / 2),
                    "the waker's pod announced leading", timeout=5)
        # A backlog: due rows older than STUCK_SECONDS that no pod claims.
        offer["n"] = 0
        enqueue_many(dsn, [f"backlog-{k}" for k in range(5)])
        fetch_rows(dsn, "UPDATE receipt_jobs SET run_at = run_at - interval '0.5 s'"
                        " RETURNING 1")
        await until(lambda: heard(1 / 3, 1 / 3), "every share back to the slots'", timeout=5)
        assert waker.wakeups.lead is None
    finally:
        for p in members:
            await p.stop()


def expected_woken(free: list[int], due: int, own: int | None = None,
                   stuck: bool = False) -> tuple[bool, list[int]]:
    """The wake rule, written out: whether the waker's own pod (member *own*, None: it
    is none) is woken in-process, and which members are woken on their channels.
    New work that the waker's pod can take whole is its alone (not for a stuck
    head); otherwise the members, those with free slots first (in their turn; the
    waker's pod as one with none), are each woken while the free slots ahead of them
    are fewer than the due jobs."""
    if own is not None and not stuck and free[own] >= due > 0:
        return True, []
    if own is not None:  # it counts as full: woken for a part, it would race the others
        free = [0 if k == own else f for k, f in enumerate(free)]
    ranked = [k for k, f in enumerate(free) if f > 0] + [k for k, f in enumerate(free) if f <= 0]
    woken, ahead = [], 0
    for k in ranked:
        if ahead < due:
            woken.append(k)
        ahead += max(free[k], 0)
    return False, sorted(woken)


_RULE_CASES = [([4, 8, 8], 3, None), ([4, 8, 8], 4, None), ([4, 8, 8], 5, None),
               ([4, 8, 8], 30, None), ([0, 0, 2], 1, None), ([0, 5, 0, 5], 6, None),
               ([0, 0, 0], 2, None), ([32], 256, None),
               # The waker's own pod first: alone while its slots cover the work.
               ([30, 32, 32], 4, 0), ([3, 32, 32], 4, 0), ([0, 32, 32], 4, 0),
               ([32, 8, 8], 40, 0), ([8, 4, 8], 13, 1), ([32], 5, 0), ([0], 5, 0)]
_RULE_CASES += [([random.Random(n).randint(0, 9) for _ in range(random.Random(-n).randint(1, 7))],
                 random.Random(n * 7).randint(1, 40), None if n % 2 else 0)
                for n in range(1, 9)]


@pytest.mark.parametrize("stuck", [False, True], ids=["new", "stuck"])
@pytest.mark.parametrize(("free", "due", "own"), _RULE_CASES)
async def test_due_work_wakes_the_wakers_pod_alone_or_exactly_the_members_it_needs(
        dsn, free, due, own, stuck):
    """One probe of the real statement with members named: the waker's own pod is woken
    in-process when it can take the work whole, and otherwise the channels notified are
    those the rule picks (the caller adds up the slots ahead; the statement compares).
    No notification at all when the waker's pod takes the work alone."""
    settings = make_settings(dsn)
    local: list[int] = []
    tags = [f"{k:08x}" for k in range(len(free))]
    wakeups = Wakeups(settings, Metrics(), lambda: local.append(1),
                      tag=None if own is None else tags[own])
    wakeups._members = deque(zip(tags, free, strict=True))
    enqueue_many(dsn, [f"rule-{k}" for k in range(due)])
    if stuck:  # the head has waited longer than STUCK_SECONDS
        fetch_rows(dsn, "UPDATE receipt_jobs SET run_at = run_at - interval '0.5 s'"
                        " RETURNING 1")
    listener = psycopg.connect(dsn, autocommit=True)
    session = await ListenSession.open(settings)
    try:
        for tag in tags:
            listener.execute(
                sql.SQL("LISTEN {}").format(sql.Identifier(MEMBER_CHANNEL_PREFIX + tag)))
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        await wakeups.probe(session)
        listener.execute("LISTEN sentinel")
        with psycopg.connect(dsn, autocommit=True) as other:
            other.execute("SELECT pg_notify('sentinel', '')")
        notes = []
        for note in listener.notifies(timeout=10):
            if note.channel == "sentinel":
                break
            notes.append(note)
    finally:
        await session.close()
        listener.close()
    channels = [n.channel for n in notes if n.channel != NOTIFY_CHANNEL]
    woken = sorted(tags.index(c.removeprefix(MEMBER_CHANNEL_PREFIX)) for c in channels)
    assert (bool(local), woken) == expected_woken(free, min(due, 256), own, stuck), channels
    # For released workers: when a member was woken (new work is fresh at a first
    # probe, stuck or not).
    assert [n.payload for n in notes if n.channel == NOTIFY_CHANNEL] == (
        ["members"] if woken else [])


async def test_the_wakers_session_plans_its_probe_once_not_on_every_call(dsn):
    """The probe runs every 70 ms with a parameter in each index condition: left to the
    plan cache it is planned afresh each time (a custom plan). The LISTEN session (and
    the worker's pool) ask for the generic plan, so after psycopg prepares it no probe
    is planned again. Recovery, operator and checkout sessions keep the server's choice."""
    settings = make_settings(dsn)
    wakeups = Wakeups(settings, Metrics(), lambda: None)
    session = await ListenSession.open(settings)
    try:
        for _ in range(12):
            await wakeups.probe(session)
        rows = await session.fetchall(sql.SQL(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE statement LIKE %(probe)s"), {"probe": "WITH tail AS%"})
        (mode,) = await session.fetchall(sql.SQL("SHOW plan_cache_mode"), {})
    finally:
        await session.close()
    assert len(rows) == 1 and rows[0][1] == 0 and rows[0][0] >= 6, rows
    assert mode == ("force_generic_plan",)
    for role, expected in (("worker", "force_generic_plan"), ("recover", "auto"),
                           ("jobs", "auto"), ("enqueue", "auto"), ("ui", "auto")):
        with psycopg.connect(settings.dsn, **connection_kwargs(settings, role)) as conn:
            assert conn.execute("SHOW plan_cache_mode").fetchone() == (expected,), role
