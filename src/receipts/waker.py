"""Wake-ups off the checkout's commit path: LISTEN, and one elected waker per fleet.

An enqueue sends no notification (a transaction with one holds an
instance-wide lock through its commit's WAL flush; docs/design.md, "The
checkout's commit path"). Instead, each worker keeps one dedicated session
(:class:`receipts.db.ListenSession`, ``RECEIPTS_LISTEN_NOTIFY``) that:

* LISTENs on ``receipts_ready`` (:data:`receipts.enqueue.NOTIFY_CHANNEL`; a
  notification cuts the claim loop's poll sleep short) and on
  ``receipts_waker`` (:data:`WAKER_CHANNEL`, the waker's heartbeat);
* while no waker has been heard for :data:`SILENT_SECONDS`, tries to become the
  fleet's waker: a session advisory lock (``waker_lock``; :func:`lock_key`, one
  per queue schema), held until this session ends, so a killed pod or a
  dropped connection frees it;
* as the waker, runs ``waker_probe`` every :data:`PROBE_SECONDS`: one backward
  probe of the ready index for the newest due job. When that differs from what
  the last probe saw, new due work has appeared (a job committed, a scheduled
  or retried one became due) and the statement itself notifies
  ``receipts_ready``, from its own short transaction: every pod's LISTEN
  wakes, including released (0.2.0) workers, which listen on the same channel.
  A tail that stays (a backlog being worked, a paused fleet) wakes nobody
  again, and a paused fleet is not woken at all. Every
  :data:`HEARTBEAT_SECONDS` the probe also notifies ``receipts_waker`` with the
  queue's schema as payload;
* on a clean stop, the waker unlocks and says so (payload ``"<schema> left"``),
  so another pod takes over at once instead of after :data:`SILENT_SECONDS`.

The waker's session gets ``idle_session_timeout`` (:data:`IDLE_SESSION_TIMEOUT_SECONDS`,
PostgreSQL 14+): it queries every few tens of milliseconds, so a session idle
that long belongs to a waker that stopped (a frozen process, a partition) and
the server ends it, freeing the lock. While a waker is heard, the claim loop
polls :data:`receipts.worker.WAKER_POLL_FACTOR` times less often: polling stays
the safety net, and an idle fleet's cost to the database does not grow with
its pod count.

What keeps a calm day cheap (docs/design.md, "Calm-day wake-ups"):

* **Members.** A pod with a tag (its ``receipt_workers`` row's) holds a
  second advisory lock on its LISTEN session (``member_lock``) and LISTENs
  on a channel of its own, ``receipts_ready_<tag>``. Once per heartbeat the
  waker reads the members (``fleet_members``: the locks, joined with the
  heartbeat rows' slots and deliveries in flight) and announces each one's
  share of the provider rate limit on :data:`FLEET_CHANNEL`
  (:mod:`receipts.ratelimit`), with the watermark.
* **A leading share.** Shares follow the slots, so at 16 pods the waker's
  pod may claim a sixteenth of the limit, less than a calm day's order rate:
  the rest of the new work goes to other pods, a claim of a job or two each,
  whose acks have no claim of their own to ride on. When a probe hands work
  to others only because this pod's share held it back, and no due head got
  stuck since the last heartbeat, the next announcement doubles this pod's
  share (at most :data:`LEAD_MAX_SHARE`; the others split the rest by
  slots). A head stuck at two probes in a row (the fleet falls behind: a
  backlog, or a binding limit) returns every share to the slots' at the
  next heartbeat, so under load the fleet shares the limit as before.
* **The watermark.** Each probe also returns the oldest ready ``(run_at,
  id)`` at or after the previous one (capped at now − :data:`MARGIN_SECONDS`),
  which claims start their index scan from (:meth:`Wakeups.claim_bound`).
  Every :data:`SWEEP_SECONDS`, ``waker_sweep`` looks below it for a row that
  became ready there (a back-dated run_at, a transaction that commits long
  after it began) and lowers it: the whole index below it when the full
  sweep is due (spread out while it is slow, so that it costs at most
  :data:`SWEEP_BUSY_SHARE` of the time), else the last :data:`NEAR_SECONDS`
  below it, where late commits land.
* **Targeted wake-ups.** New due work that the waker's own pod can take
  whole (what it could claim now, within its throttles) wakes that pod
  alone, in-process: no notification, since a notifying commit signals every
  LISTEN session of the database. Other new work, or a due head waiting
  :data:`STUCK_SECONDS`, wakes only the members whose free slots add up to
  the due jobs, in turn, on their own channels (the waker's pod among
  them), with the watermark as payload; under a rate limit each member
  counts for no more than its bucket holds when full. With no member known, every pod is
  woken on ``receipts_ready`` as before; with members, new work that woke
  one also notifies ``receipts_ready`` with payload :data:`MEMBERS_PAYLOAD`,
  which wakes released workers and pods without a tag and which members
  ignore. A pod not woken keeps a slow, jittered poll whose fleet-wide rate
  does not grow with the pod count (:meth:`Wakeups.fleet_size`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import random
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from receipts.db import ListenSession
from receipts.enqueue import NOTIFY_CHANNEL
from receipts.errors import QueueError
from receipts.logs import get_logger
from receipts.metrics import Metrics
from receipts.ratelimit import shares_of
from receipts.settings import Settings
from receipts.statements import query

log = get_logger("waker")

#: The channel of the waker's heartbeat; its payload is the queue's schema.
WAKER_CHANNEL = "receipts_waker"
#: How often the elected waker probes the ready index, seconds. Pickup is this
#: plus a round trip or two (the bench's pickup figures: p99 ≈ 60 ms).
PROBE_SECONDS = 0.07
#: How often the waker tells the other pods it is alive, seconds.
HEARTBEAT_SECONDS = 1.0
#: A waker unheard for this long is presumed gone; the others try the lock.
SILENT_SECONDS = 3.0
#: While no waker is heard, a pod tries the lock this often (× U(0.5, 1.5)), seconds.
ELECTION_RETRY_SECONDS = 2.0
#: The waker's session is ended by the server after this long without a query.
IDLE_SESSION_TIMEOUT_SECONDS = 5.0
#: A LISTEN session that has heard nothing for this long is checked with a round trip.
LISTEN_CHECK_SECONDS = 30.0
#: The step-down message of a waker that stops cleanly.
LEFT_SUFFIX = " left"
OUTAGE_BACKOFF_FIRST_SECONDS = 0.5
OUTAGE_BACKOFF_MAX_SECONDS = 30.0
#: How long a stopping waker spends on its step-down message, seconds.
STEP_DOWN_SECONDS = 1.0
#: The channel of the waker's fleet announcement (JSON: schema, shares, watermark).
FLEET_CHANNEL = "receipts_fleet"
#: The payload of a wake-up on ``receipts_ready`` that members ignore (the waker
#: woke the ones the work needs on their own channels).
MEMBERS_PAYLOAD = "members"
#: A member pod's own wake-up channel is this prefix and its tag.
MEMBER_CHANNEL_PREFIX = "receipts_ready_"
#: The watermark is never above now minus this (seconds): a row made ready by a
#: statement that began less than this ago (a retry, a recovered lease, an
#: ordinary checkout) is never below it; older ones are the sweep's.
MARGIN_SECONDS = 1.0
#: A due head that has waited this long (seconds) wakes more pods.
STUCK_SECONDS = 0.15
#: How often the waker sweeps below the watermark, seconds: the full sweep
#: when it is due, the near one otherwise.
SWEEP_SECONDS = 0.25
#: The full sweep (the whole index below the watermark) runs at least this
#: often (seconds), however slow it is.
SWEEP_MAX_SECONDS = 10.0
#: The full sweep's share of the time: after one on which the database spent
#: t seconds the next waits at least t / SWEEP_BUSY_SHARE. A long reader keeps the entries of
#: every job claimed since it began alive below the watermark, and the full
#: sweep walks them all (2.7 ms a sweep on average through a 10-minute hold at
#: 50 jobs/s): at 0.3 % it then runs about once a second instead of four times.
SWEEP_BUSY_SHARE = 0.003
#: The near sweep's reach below the watermark, seconds of run_at: a transaction
#: that commits up to this long after it began, plus the watermark's margin,
#: less how far the watermark moves until the next near sweep (about 10.7-11 s
#: in all), is found within SWEEP_SECONDS whatever a long reader keeps alive;
#: older rows (a back-dated run_at, a longer transaction) wait for the full sweep.
NEAR_SECONDS = 10.0
#: While a waker is heard, the fleet's pods together poll about once per this
#: many seconds (each pod every pods × this), so an idle fleet's polls do not
#: grow with its size.
FLEET_POLL_SECONDS = 2.0
#: The most of the rate limit the waker's pod leads with (a share, 0–1): the
#: other pods keep at least the rest between them ("A leading share", above).
LEAD_MAX_SHARE = 0.5
NIL_UUID = UUID(int=0)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def lock_key(schema: str) -> int:
    """The waker's advisory-lock key for the queue in *schema*: a stable signed 64-bit number.

    Advisory locks are per database, so one key per schema gives every queue
    of a database its own waker.
    """
    digest = hashlib.sha256(f"receipts.waker:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def member_key(schema: str) -> int:
    """The first key of every member lock of the queue in *schema* (0 ≤ key < 2³¹)."""
    digest = hashlib.sha256(f"receipts.member:{schema}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFF_FFFF


def tag_number(tag: str) -> int:
    """A worker tag (8 hex digits) as the signed 32-bit second key of its member lock."""
    n = int(tag, 16)
    return n - (1 << 32) if n >= 1 << 31 else n


def encode_mark(run_at: datetime, job_id: UUID) -> str:
    """A watermark as a wake-up payload: microseconds since 1970 (exact), a space, the id."""
    delta = run_at - _EPOCH
    micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return f"{micros} {job_id}"


def decode_mark(payload: str) -> tuple[datetime, UUID] | None:
    """The watermark of a payload made by :func:`encode_mark` (or the probe); None when
    it is not one (an empty or foreign payload)."""
    micros, _, job_id = payload.strip().partition(" ")
    try:
        return _EPOCH + timedelta(microseconds=int(micros)), UUID(job_id)
    except ValueError:
        return None


class Wakeups:
    """This pod's part in the fleet's wake-ups (see the module doc).

    Args:
        settings: the worker's settings (schema, max attempts, timeouts, the DSN).
        metrics: ``receipts_waker_elected``, ``receipts_waker_wakes_total`` and
            the probe's ``receipts_db_statement_duration_seconds``.
        wake: called for every wake-up (cuts the claim loop's sleep short).
        tag: this pod's tag (its heartbeat row's), or None: no member.
        free_slots: how many new jobs this pod could claim now (its free slots
            within its throttles; ≤ 0: none), its offer when it is the waker and
            a member; None: its heartbeat row's free slots, as for the others.
        unshared_room: what this pod's last *free_slots* offer would have been
            but for its share of the rate limit, or None when the share did not
            cut it; when that would have taken the new work whole, the waker
            leads with a larger share ("A leading share"). None: never.
        clock: monotonic seconds (tests pass their own).

    :meth:`run` keeps one :class:`~receipts.db.ListenSession` open, reconnecting
    with backoff; it never raises for database errors.
    """

    def __init__(self, settings: Settings, metrics: Metrics, wake: Callable[[], None], *,
                 tag: str | None = None, free_slots: Callable[[], int] | None = None,
                 unshared_room: Callable[[], int | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._free_slots = free_slots
        self._unshared_room = unshared_room
        self.metrics = metrics
        self._wake = wake
        self._clock = clock
        self.schema = settings.db_schema
        self.key = lock_key(self.schema)
        #: This pod's tag (its heartbeat row's), or None: then it is no member, has
        #: no channel of its own and is woken with everyone.
        self.tag = tag
        self.channel = MEMBER_CHANNEL_PREFIX + tag if tag else None
        self.is_waker = False
        #: When this pod last heard the fleet's waker (monotonic), or None.
        self.heard_at: float | None = None
        #: The newest due job the last probe saw: (run_at, id), or None.
        self._seen: tuple[datetime | None, UUID | None] = (None, None)
        #: When this pod tries the lock next, while no waker is heard (monotonic).
        self._next_try = clock()
        #: The watermark claims start from, as last computed or heard, or None.
        self.watermark: tuple[datetime, UUID] | None = None
        #: The last announced shares (tag → share of the rate limit) and when heard.
        self.shares: dict[str, float] | None = None
        self.shares_at = float("-inf")
        #: When this pod's LISTEN session took its member lock (monotonic), or None.
        self.member_since: float | None = None
        # The waker's own state: the watermark it probes from, the members in
        # the order they are woken (tag, free slots), the next sweep.
        self._mark: tuple[datetime | None, UUID | None] = (None, None)
        self._members: deque[tuple[str, int]] = deque()
        self._next_sweep = self._next_full_sweep = clock()
        #: The waker's pod's leading share (None: its slots' share), and what the
        #: probes saw since the last heartbeat: work handed to others because
        #: this pod's share fell short; a stuck due head.
        self.lead: float | None = None
        self._share_short = False
        self._stuck = False
        self._stuck_probes = 0
        self._started = clock()
        self._probe_seconds = metrics.statement_duration.labels("waker_probe")
        self._sweep_seconds = metrics.statement_duration.labels("waker_sweep")
        metrics.waker_elected.set(0)

    def claim_bound(self) -> tuple[datetime, UUID] | None:
        """The watermark a claim may start from now: None unless a waker is heard
        (only a live waker's sweep lowers it for rows that appear below it)."""
        return self.watermark if self.waker_alive() else None

    def fleet_size(self) -> int:
        """The pods the last fresh announcement named (1 when none is known)."""
        return self.announced_size() or 1

    def announced_size(self) -> int | None:
        """The pods the waker's last announcement named, when it is fresh (heard
        within :data:`SILENT_SECONDS`); None when there is none."""
        if self.shares and self._clock() - self.shares_at < SILENT_SECONDS:
            return max(1, len(self.shares))
        return None

    def member_age(self) -> float | None:
        """Seconds since this pod's member lock was taken, or, before its LISTEN
        session first took one, since this pod started (None: it has no tag)."""
        if self.tag is None:
            return None
        return self._clock() - (self._started if self.member_since is None
                                else self.member_since)

    def waker_alive(self) -> bool:
        """True while this pod is the waker or has heard one within ``SILENT_SECONDS``."""
        if self.is_waker:
            return True
        return self.heard_at is not None and self._clock() - self.heard_at < SILENT_SECONDS

    async def run(self) -> None:
        """Listen (and wake, when elected) until cancelled; reconnects after failures."""
        backoff = OUTAGE_BACKOFF_FIRST_SECONDS
        try:
            while True:
                try:
                    async with await ListenSession.open(self.settings) as session:
                        backoff = OUTAGE_BACKOFF_FIRST_SECONDS
                        await self.serve(session)
                except QueueError as exc:
                    self._lost(exc)
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, OUTAGE_BACKOFF_MAX_SECONDS)
        finally:
            self._set_waker(False)  # however it ends, this pod wakes nobody any more

    def _lost(self, exc: QueueError) -> None:
        if self.is_waker:
            log.warning("waker_lost", extra={"error": str(exc)})
        else:
            log.debug("listen_failed", extra={"error": str(exc)})
        self._set_waker(False)

    def _set_waker(self, elected: bool) -> None:
        if self.lead is not None and self.shares and self.tag in self.shares:
            # A waker that led keeps using its last shares until a successor's
            # announcement (up to SHARE_FRESH_SECONDS), while the successor gives
            # the others shares that add up to 1 without it: back to an even share
            # (its slots' share when the pods are alike) so the two do not overlap
            # by the lead (half the limit).
            self.shares = {**self.shares,
                           self.tag: min(self.shares[self.tag], 1.0 / len(self.shares))}
        self.is_waker = elected
        self.metrics.waker_elected.set(1 if elected else 0)
        self._seen = (None, None)
        self._mark = (None, None)  # a new waker walks the index once from its start
        self._members.clear()
        self._next_sweep = self._next_full_sweep = self._clock()
        self.lead, self._share_short, self._stuck, self._stuck_probes = None, False, False, 0

    async def serve(self, session: ListenSession) -> None:
        """One session's life: LISTEN, then listen, elect and probe until it fails.

        Raises :class:`QueueError` when the session fails; on cancellation a
        waker steps down first (at most ``STEP_DOWN_SECONDS``).
        """
        await session.listen(NOTIFY_CHANNEL, WAKER_CHANNEL, FLEET_CHANNEL,
                             *([self.channel] if self.channel else []))
        if self.tag is not None:
            row = await session.fetchone(query("member_lock"), {
                "key": member_key(self.schema), "tag": tag_number(self.tag)})
            # A session that lost its lock (a reconnect) counts from its new one.
            self.member_since = self._clock() if row and row[0] else None
        self._wake()  # anything enqueued while nobody listened here
        try:
            await self._loop(session)
        except asyncio.CancelledError:
            if self.is_waker:
                with contextlib.suppress(QueueError, TimeoutError):
                    async with asyncio.timeout(STEP_DOWN_SECONDS):
                        await self.step_down(session)
            raise

    async def _loop(self, session: ListenSession) -> None:
        now = self._clock()
        self._next_try = next_probe = next_heartbeat = quiet_since = now
        while True:
            now = self._clock()
            if self.is_waker:
                if now >= next_probe:
                    heartbeat = now >= next_heartbeat
                    if heartbeat:
                        await self.read_members(session)
                    if now >= self._next_sweep:
                        await self.sweep(session)
                    await self.probe(session, heartbeat=heartbeat)
                    next_probe = max(next_probe + PROBE_SECONDS, self._clock())
                    if heartbeat:
                        next_heartbeat = now + HEARTBEAT_SECONDS
                    quiet_since = self._clock()
                wait = next_probe - self._clock()
            else:
                if not self.waker_alive() and now >= self._next_try:
                    if await self.try_election(session):
                        next_probe = next_heartbeat = self._clock()
                        continue
                    self._next_try = self._clock() + ELECTION_RETRY_SECONDS * random.uniform(
                        0.5, 1.5)
                    quiet_since = self._clock()
                if self.heard_at is not None and self.waker_alive():
                    # The waker is presumed gone SILENT_SECONDS after its last heartbeat.
                    self._next_try = max(self._next_try, self.heard_at + SILENT_SECONDS)
                if self._clock() - quiet_since >= LISTEN_CHECK_SECONDS:
                    await session.fetchone(query("listen_check"))  # a half-open session fails here
                    quiet_since = self._clock()
                wait = min(self._next_try, quiet_since + LISTEN_CHECK_SECONDS) - self._clock()
            for channel, payload in await session.notifications(max(0.0, wait)):
                quiet_since = self._clock()
                self.hear(channel, payload)

    def hear(self, channel: str, payload: str) -> None:
        """Act on one notification: a wake-up (the fleet's, or this pod's own with the
        watermark), the waker's announcement, heartbeat or step-down."""
        if channel == NOTIFY_CHANNEL:
            # 'members': the waker woke the members it chose on their own channels;
            # this one is for released workers and pods without a tag.
            if payload != MEMBERS_PAYLOAD or self.channel is None:
                self._wake()
        elif channel == self.channel:
            mark = decode_mark(payload)
            if mark is not None and not self.is_waker:
                self.watermark = mark
            self._wake()
        elif channel == FLEET_CHANNEL:
            self._hear_fleet(payload)
        elif channel == WAKER_CHANNEL and not self.is_waker:
            if payload == self.schema:
                self.heard_at = self._clock()
            elif payload == self.schema + LEFT_SUFFIX:
                self.heard_at = None  # the lock is free: try at once
                self._next_try = self._clock()

    async def try_election(self, session: ListenSession) -> bool:
        """Try to take the waker's lock; True when this pod is now the fleet's waker."""
        row = await session.fetchone(query("waker_lock"), {
            "key": self.key,
            "idle_timeout_ms": str(round(IDLE_SESSION_TIMEOUT_SECONDS * 1000)),
        })
        if not row or not row[0]:
            return False
        self._set_waker(True)
        log.info("waker_elected", extra={"schema": self.schema})
        return True

    def _hear_fleet(self, payload: str) -> None:
        """The waker's announcement: shares and watermark (JSON; foreign or bad ones ignored)."""
        try:
            doc = json.loads(payload)
            if not isinstance(doc, dict) or doc.get("schema") != self.schema:
                return
            shares = {str(k): float(v) for k, v in dict(doc.get("shares") or {}).items()}
        except (ValueError, TypeError):
            return
        now = self._clock()
        self.shares, self.shares_at = shares, now
        if not self.is_waker:
            self.heard_at = now
            mark = decode_mark(str(doc.get("after") or ""))
            if mark is not None:
                self.watermark = mark

    async def read_members(self, session: ListenSession) -> dict[str, float]:
        """The waker reads the live members (``fleet_members``); returns their shares.

        Keeps the members' wake-up order (a pod that joined goes last) and
        each one's free slots as its last heartbeat row said (its slots when
        it has no row yet).
        """
        members: dict[str, tuple[int | None, int]] = {}
        rows = await session.fetchall(query("fleet_members", self.schema),
                                      {"key": member_key(self.schema)})
        for tag, slots, inflight in rows:
            members[tag] = (slots, inflight or 0)
        order = [t for t, _ in self._members if t in members]
        order += sorted(t for t in members if t not in order)
        self._members = deque(
            (t, max((members[t][0] or self.settings.concurrency) - members[t][1], 0))
            for t in order)
        slots = {t: m[0] for t, m in members.items()}
        self.lead = self._next_lead(shares_of(slots))
        shares = shares_of(slots, None if self.lead is None or self.tag is None
                           else (self.tag, self.lead))
        self.shares, self.shares_at = shares, self._clock()
        return shares

    def _next_lead(self, by_slots: dict[str, float]) -> float | None:
        """This pod's leading share for the next announcement ("A leading share"):
        back to its slots' share (None) after a stuck head or when it is no member
        or alone; doubled (at most :data:`LEAD_MAX_SHARE`) after a probe handed
        work to others because its share fell short; else as it was."""
        short, stuck, self._share_short, self._stuck = self._share_short, self._stuck, False, False
        own = by_slots.get(self.tag) if self.tag is not None else None
        if own is None or len(by_slots) < 2 or stuck or own >= LEAD_MAX_SHARE:
            return None
        lead = max(own, self.lead or 0.0)
        if short:
            lead = min(LEAD_MAX_SHARE, 2 * lead)
        return lead if lead > own else None

    def _targets(self) -> tuple[int | None, list[str], list[int]]:
        """Who ``waker_probe`` may wake: what this pod could claim now when it is a
        member (live when the worker gave it; None when no member), the members'
        channels in turn, pods with free slots first (this pod among them as one
        with none), and for each the free slots of the pods ahead of it."""
        members = [(t, self._bucket_room(t, f)) for t, f in self._members]
        own = [f for t, f in members if t == self.tag]
        offer: int | None = None
        if own:
            offer = own[0] if self._free_slots is None else self._free_slots()
            # Woken in-process when it can take the work whole; else it counts as
            # full: woken beside others for a part, it would race them for the rows.
            members = [(t, 0 if t == self.tag else f) for t, f in members]
        ranked = sorted(members, key=lambda m: m[1] <= 0)  # stable: keeps the turn
        before = list(itertools.accumulate((max(f, 0) for _, f in ranked), initial=0))
        return ((None if offer is None else max(offer, 0)),
                [MEMBER_CHANNEL_PREFIX + t for t, _ in ranked], before[:-1])

    def _bucket_room(self, tag: str, free: int) -> int:
        """What member *tag* with *free* slots could claim at once under the rate
        limit: no more than its bucket holds when full (the burst × the share last
        announced for it; at least 1), so that a burst of new work beyond one
        pod's tokens wakes the next pod too instead of waiting for that pod's
        bucket or the stuck head (pickup p99 rose from 71 to 94 ms at 12 orders/s
        under a 20/s limit of 4 pods, the others' shares at a sixth each, before
        this; bench/README.md, "A leading share at 16 pods"). *free* as it is
        without a rate limit or a share for *tag*."""
        share = (self.shares or {}).get(tag)
        if self.settings.provider_rate_limit_per_second <= 0 or share is None or free <= 0:
            return free
        return min(free, max(1, int(self.settings.burst * share)))

    async def probe(self, session: ListenSession, *, heartbeat: bool = False) -> bool:
        """One ``waker_probe``: wake the pods new due work needs; True when it woke any.

        This pod, when it is a member that can take the new work whole, is
        woken in-process (the *wake* callback); otherwise members are woken on
        their channels. Also moves the watermark forward (:attr:`watermark`),
        and on a *heartbeat* announces the members' shares with it. Raises
        :class:`QueueError` when the session fails.
        """
        seen_run_at, seen_id = self._seen
        from_run_at, from_id = self._mark
        local, channels, before = self._targets()
        shares = self.shares if heartbeat and self._members else None
        params: dict[str, Any] = {
            "max_attempts": self.settings.max_attempts,
            "seen_run_at": seen_run_at, "seen_id": seen_id,
            "from_run_at": from_run_at, "from_id": from_id,
            "margin_seconds": MARGIN_SECONDS, "stuck_seconds": STUCK_SECONDS,
            "local": local, "channels": channels, "before": before,
            "channel": NOTIFY_CHANNEL, "heartbeat": heartbeat,
            "waker_channel": WAKER_CHANNEL, "schema_name": self.schema,
            "fleet_channel": FLEET_CHANNEL,
            "shares": None if shares is None else json.dumps(shares, sort_keys=True),
        }
        start = time.perf_counter()
        row = await session.fetchone(query("waker_probe", self.schema), params)
        self._probe_seconds.observe(time.perf_counter() - start)
        if row is None:
            return False
        self._seen = (row[0], row[1])
        self._mark = (row[3], row[4])
        self.watermark = (row[3], row[4])
        woken = int(row[6] or 0)
        # A backlog: a head stuck at two probes in a row (one stuck probe may be
        # a single job whose checkout committed late, with an old run_at).
        self._stuck_probes = self._stuck_probes + 1 if row[11] else 0
        if self._stuck_probes >= 2:
            self._stuck = True
        elif woken and local is not None and local < (due := int(row[5] or 0)):
            room = self._unshared_room() if self._unshared_room is not None else None
            if room is not None and room >= due:
                self._share_short = True
        if woken:  # the next new work goes to the next pods: the woken go last
            done = {c.removeprefix(MEMBER_CHANNEL_PREFIX) for c in channels[:woken]}
            self._members = deque([m for m in self._members if m[0] not in done]
                                  + [m for m in self._members if m[0] in done])
        if row[2]:
            self.metrics.waker_wakes.inc()
            if row[10] or not channels:
                self._wake()  # this pod, in-process (members: on their channels)
            return True
        return False

    async def sweep(self, session: ListenSession) -> bool:
        """One ``waker_sweep`` below the watermark; True when it lowered it.

        The full sweep (from the index's start) when it is due, else the near
        one (the last :data:`NEAR_SECONDS` of run_at below the watermark). The
        next sweep is due after :data:`SWEEP_SECONDS`; the next full one after
        the seconds the database spent on the full sweep (its own clock) /
        :data:`SWEEP_BUSY_SHARE` when that is longer (at most
        :data:`SWEEP_MAX_SECONDS`).

        Raises :class:`QueueError` when the session fails.
        """
        below_run_at, below_id = self._mark
        now = self._clock()
        self._next_sweep = now + SWEEP_SECONDS
        if below_run_at is None:
            return False
        full = now >= self._next_full_sweep
        row = await session.fetchone(query("waker_sweep", self.schema), {
            "max_attempts": self.settings.max_attempts,
            "reach_seconds": None if full else NEAR_SECONDS,
            "below_run_at": below_run_at, "below_id": below_id or NIL_UUID})
        self._sweep_seconds.observe(self._clock() - now)
        if full:
            # What the database spent, by its own clock: a round trip or a busy
            # event loop would otherwise hold off a quick sweep (a trial: 0.7-16 ms
            # a call without a long reader, rows back-dated an hour claimed 1-5 s late).
            spent = row[2].total_seconds() if row is not None and row[2] is not None else 0.0
            self._next_full_sweep = now + min(
                SWEEP_MAX_SECONDS, max(SWEEP_SECONDS, spent / SWEEP_BUSY_SHARE))
        if row is None or row[0] is None:
            return False
        self._mark = (row[0], row[1])
        self.watermark = (row[0], row[1])
        log.info("watermark_lowered", extra={"schema": self.schema, "full": full})
        return True

    async def step_down(self, session: ListenSession) -> None:
        """Release the lock and tell the fleet (payload ``"<schema> left"``)."""
        await session.fetchone(query("waker_step_down"), {
            "key": self.key, "waker_channel": WAKER_CHANNEL,
            "payload": self.schema + LEFT_SUFFIX,
        })
        self._set_waker(False)
        log.info("waker_stepped_down", extra={"schema": self.schema})
