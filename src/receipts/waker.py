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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any
from uuid import UUID

from receipts.db import ListenSession
from receipts.enqueue import NOTIFY_CHANNEL
from receipts.errors import QueueError
from receipts.logs import get_logger
from receipts.metrics import Metrics
from receipts.settings import Settings
from receipts.statements import query

log = get_logger("waker")

#: The channel of the waker's heartbeat; its payload is the queue's schema.
WAKER_CHANNEL = "receipts_waker"
#: How often the elected waker probes the ready index, seconds. Pickup is this
#: plus a round trip or two (the bench's pickup figures: p99 ≈ 60 ms).
PROBE_SECONDS = 0.05
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


def lock_key(schema: str) -> int:
    """The waker's advisory-lock key for the queue in *schema*: a stable signed 64-bit number.

    Advisory locks are per database, so one key per schema gives every queue
    of a database its own waker.
    """
    digest = hashlib.sha256(f"receipts.waker:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class Wakeups:
    """This pod's part in the fleet's wake-ups (see the module doc).

    Args:
        settings: the worker's settings (schema, max attempts, timeouts, the DSN).
        metrics: ``receipts_waker_elected``, ``receipts_waker_wakes_total`` and
            the probe's ``receipts_db_statement_duration_seconds``.
        wake: called for every wake-up (cuts the claim loop's sleep short).
        clock: monotonic seconds (tests pass their own).

    :meth:`run` keeps one :class:`~receipts.db.ListenSession` open, reconnecting
    with backoff; it never raises for database errors.
    """

    def __init__(self, settings: Settings, metrics: Metrics, wake: Callable[[], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.metrics = metrics
        self._wake = wake
        self._clock = clock
        self.schema = settings.db_schema
        self.key = lock_key(self.schema)
        self.is_waker = False
        #: When this pod last heard the fleet's waker (monotonic), or None.
        self.heard_at: float | None = None
        #: The newest due job the last probe saw: (run_at, id), or None.
        self._seen: tuple[datetime | None, UUID | None] = (None, None)
        #: When this pod tries the lock next, while no waker is heard (monotonic).
        self._next_try = clock()
        self._probe_seconds = metrics.statement_duration.labels("waker_probe")
        metrics.waker_elected.set(0)

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
        self.is_waker = elected
        self.metrics.waker_elected.set(1 if elected else 0)
        self._seen = (None, None)

    async def serve(self, session: ListenSession) -> None:
        """One session's life: LISTEN, then listen, elect and probe until it fails.

        Raises :class:`QueueError` when the session fails; on cancellation a
        waker steps down first (at most ``STEP_DOWN_SECONDS``).
        """
        await session.listen(NOTIFY_CHANNEL, WAKER_CHANNEL)
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
        """Act on one notification: a wake-up, or the waker's heartbeat or step-down."""
        if channel == NOTIFY_CHANNEL:
            self._wake()
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

    async def probe(self, session: ListenSession, *, heartbeat: bool = False) -> bool:
        """One ``waker_probe``: wake the fleet when new due work appeared; True when it did."""
        seen_run_at, seen_id = self._seen
        params: dict[str, Any] = {
            "max_attempts": self.settings.max_attempts,
            "seen_run_at": seen_run_at, "seen_id": seen_id,
            "channel": NOTIFY_CHANNEL, "heartbeat": heartbeat,
            "waker_channel": WAKER_CHANNEL, "schema_name": self.schema,
        }
        start = time.perf_counter()
        row = await session.fetchone(query("waker_probe", self.schema), params)
        self._probe_seconds.observe(time.perf_counter() - start)
        if row is None:
            return False
        self._seen = (row[0], row[1])
        if row[2]:
            self.metrics.waker_wakes.inc()
            self._wake()
            return True
        return False

    async def step_down(self, session: ListenSession) -> None:
        """Release the lock and tell the fleet (payload ``"<schema> left"``)."""
        await session.fetchone(query("waker_step_down"), {
            "key": self.key, "waker_channel": WAKER_CHANNEL,
            "payload": self.schema + LEFT_SUFFIX,
        })
        self._set_waker(False)
        log.info("waker_stepped_down", extra={"schema": self.schema})
