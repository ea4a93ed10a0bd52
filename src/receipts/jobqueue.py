"""The worker's and recovery's room: one method per named statement in ``sql/queries.sql``.

Its audience is the worker (claim, ack, reschedule, flow control, gauges,
attempt history) and recovery (expired leases, exhausted jobs, pruning). The
operator's statements (review, retry, discard, bulk actions, the fleet
pause) live in :mod:`receipts.operations`, the orders service's in
:mod:`receipts.enqueue`. Connections are borrowed through
:func:`receipts.db.borrow`, which translates driver errors.

Every statement is one short autocommit transaction: a pool connection is
borrowed for exactly one statement and returned (docs/design.md §4), never held while a
provider is called. The lease protocol (docs/design.md §2):

* claim sets ``running``, ``attempts + 1``, a fresh random token and
  ``lease_until = statement_timestamp() + lease``;
* ack and reschedule are guarded by id + token + unexpired lease, so a
  stale worker can never complete or reschedule a newer attempt;
* recovery returns expired leases to ``ready`` (or ``failed`` at max attempts).
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from receipts.db import borrow, storable
from receipts.errors import DatabaseUnavailable
from receipts.model import (
    Attempt,
    AttemptRecord,
    ClaimResult,
    FlowState,
    Job,
    JobState,
    PauseReason,
    QueueStats,
    Reason,
    Reschedule,
    Verdict,
)
from receipts.statements import (
    DEFAULT_SCHEMA,
    WORKER_TAG,
    claim_query,
    qualifier,
    query,
)


def _age(created_at: datetime | None) -> float | None:
    """Seconds since *created_at* by this machine's clock (for a histogram only)."""
    if created_at is None:
        return None
    return max(0.0, time.time() - created_at.timestamp())


def ack_params(pairs: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> dict[str, str]:
    """(job id, token) pairs as the ``ids`` and ``tokens`` parameters of the
    ``ack`` and ``resolve_writes`` statements: comma-separated hex UUIDs, in
    the same order (one text each: psycopg dumps a ``uuid[]`` element by
    element in Python)."""
    return {"ids": ",".join([p[0].hex for p in pairs]),
            "tokens": ",".join([p[1].hex for p in pairs])}


def _flow_state(row: Sequence[Any]) -> FlowState:
    """A :class:`FlowState` from (pause_reason, pause_left[, tokens]) columns."""
    reason = row[0]
    return FlowState(
        PauseReason(reason) if reason else None,
        float(row[1]) if reason and row[1] is not None else None,
        float(row[2]) if len(row) > 2 and row[2] is not None else None,
    )


@dataclass(frozen=True, slots=True)
class WalPosition:
    """Where the server's write-ahead log stood at one read (:meth:`JobQueue.wal_position`).

    ``insert_lsn`` and ``flush_lsn`` are bytes from ``0/0``: every commit that
    returned before the read started is at or below ``insert_lsn``; everything
    at or below ``flush_lsn`` is on disk. ``connection_since`` is
    ``time.monotonic()`` when this queue first used the connection the read ran
    on: the connection (and so the server it talks to, which a crash would
    have ended) has lived at least since then.
    """

    insert_lsn: int
    flush_lsn: int
    connection_since: float


class Acked(set[uuid.UUID]):
    """The job ids an ack completed (a set, compared as one), and where the
    server's write-ahead log stood while the ack ran.

    ``position`` is a :class:`WalPosition` read inside the ack's own
    statement (so it began after every write that returned before the ack
    was sent), or None when no statement ran (no pairs) or the queue does
    not read one (a test fake).
    """

    position: WalPosition | None = None

    @classmethod
    def read(cls, ids: Any, row: Sequence[Any] | None, since: float) -> Acked:
        """The set of *ids* (an iterable; None: none), positioned by *row*'s two
        WAL columns (``insert_lsn``, ``flush_lsn``; None: no row came back), read
        on a connection first used at *since* (``time.monotonic()``)."""
        done = cls(ids or ())
        if row is not None:
            done.position = WalPosition(int(row[0]), int(row[1]), since)
        return done


@dataclass(frozen=True, slots=True)
class RecoveryBatch:
    """What one recovery batch did: leases expired back to ready / to failed."""

    to_ready: int
    to_failed: int




# ------------------------------------------------------------------- the queue


class WorkerQueue(Protocol):
    """The statements the worker and the completer use: :class:`JobQueue`, or a test fake."""

    lease_seconds: float
    rate: float

    async def claim(self, limit: int, *, probe: bool = False,
                    after: tuple[datetime, uuid.UUID] | None = None,
                    shared_bucket: bool = True,
                    acks: Sequence[tuple[uuid.UUID, uuid.UUID]] = ()) -> ClaimResult:
        """See :meth:`JobQueue.claim` (*acks* only where ``carries_acks`` is true)."""
        ...

    async def ack(self, pairs: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> set[uuid.UUID]:
        """See :meth:`JobQueue.ack`."""
        ...

    async def reschedule(self, items: Sequence[Reschedule]) -> dict[uuid.UUID, JobState]:
        """See :meth:`JobQueue.reschedule`."""
        ...

    async def resolve_writes(
        self, pairs: Sequence[tuple[uuid.UUID, uuid.UUID]]
    ) -> dict[uuid.UUID, JobState]:
        """See :meth:`JobQueue.resolve_writes`."""
        ...

    async def record_attempts(self, records: Sequence[AttemptRecord]) -> None:
        """See :meth:`JobQueue.record_attempts`."""
        ...

    async def extend_pause(self, reason: PauseReason, seconds: float, *,
                           next_probe_seconds: float | None = None,
                           probe_outcome: str | None = None) -> FlowState:
        """See :meth:`JobQueue.extend_pause`."""
        ...

    async def begin_probe(self, guard_seconds: float) -> tuple[datetime, FlowState] | None:
        """See :meth:`JobQueue.begin_probe`."""
        ...

    async def resume(self, probe_until: datetime, *, probe_outcome: str = "delivered") -> bool:
        """See :meth:`JobQueue.resume`."""
        ...

    async def queue_stats(self) -> QueueStats:
        """See :meth:`JobQueue.queue_stats`."""
        ...

    async def commit_probe(self) -> float:
        """See :meth:`JobQueue.commit_probe`."""
        ...

    async def wal_position(self) -> WalPosition:
        """See :meth:`JobQueue.wal_position`."""
        ...

    @property
    def last_failure_at(self) -> float:
        """See :attr:`JobQueue.last_failure_at`."""
        ...


class JobQueue:
    """Queue operations on a pool; every method is one autocommit statement.

    Args:
        pool: an open :class:`psycopg_pool.AsyncConnectionPool` of autocommit
            connections (see :func:`receipts.db.make_pool`).
        lease_seconds: lease length given to each claim, seconds.
        max_attempts: attempts after which a job fails instead of retrying.
        rate_limit_per_second: the fleet-wide token bucket's refill rate
            (jobs/s); 0 means no rate limit (claims leave the bucket alone).
        burst: the bucket's capacity (jobs); defaults to one second's worth.
        max_in_progress: how many 409 "in progress" answers per job give their
            attempt back (docs/design.md §11).
        deadline_seconds: client-side deadline of each statement, seconds
            (None: none); see :func:`receipts.db.borrow`.
        schema: the schema that holds the tables; every statement names it,
            so no session ``search_path`` applies (``ValueError`` for a name
            that is not a lower-case identifier).
        worker_tag: this worker process's 8 hex digits (its
            ``receipt_workers`` row, :mod:`receipts.heartbeat`); every lease
            token its claims write ends in them (``claim_query``). None:
            wholly random tokens.

    Every method raises :class:`~receipts.errors.DatabaseUnavailable` when the
    database cannot be reached, :class:`~receipts.errors.SchemaMissing` before
    migrations, :class:`~receipts.errors.QueueError` otherwise.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool,
        *,
        lease_seconds: float,
        max_attempts: int,
        rate_limit_per_second: float = 0.0,
        burst: float | None = None,
        max_in_progress: int = 20,
        deadline_seconds: float | None = None,
        schema: str = DEFAULT_SCHEMA,
        worker_tag: str | None = None,
    ) -> None:
        self.pool = pool
        if worker_tag is not None and not WORKER_TAG.match(worker_tag):
            raise ValueError(f"a worker tag is 8 lower-case hex digits, not {worker_tag!r}")
        self.worker_tag = worker_tag
        qualifier(schema)  # a bad name fails here, not at the first statement
        self.schema = schema
        self.deadline_seconds = deadline_seconds
        self.lease_seconds = float(lease_seconds)
        self.max_attempts = int(max_attempts)
        self.rate = float(rate_limit_per_second)
        self.burst = float(burst if burst is not None else max(1.0, self.rate))
        self.max_in_progress = int(max_in_progress)
        # When each pool connection was first borrowed (time.monotonic()): a
        # connection replaced after a crash shows up as a new one.
        self._seen: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        self._last_failure_at = float("-inf")

    @property
    def last_failure_at(self) -> float:
        """``time.monotonic()`` when a statement last failed for its connection (-inf: never).

        A database crash ends every connection, and the pool hands out a new
        one only when none of its old ones is left idle, so after a crash a
        statement fails before any statement runs on a new connection: a
        write sent before this instant may have met a crash since.
        """
        return self._last_failure_at

    def _since(self, conn: psycopg.AsyncConnection[Any]) -> float:
        since = self._seen.get(conn)
        if since is None:
            since = self._seen[conn] = time.monotonic()
        return since

    def _q(self, name: str) -> sql.SQL:
        """The named statement, its tables in this queue's schema."""
        return query(name, self.schema)

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        try:
            async with borrow(self.pool, self.deadline_seconds) as conn:
                self._since(conn)
                yield conn
        except DatabaseUnavailable:
            self._last_failure_at = time.monotonic()
            raise

    async def _rows(
        self, query: sql.SQL | sql.Composed, params: dict[str, Any], *,
        texts: tuple[str, ...] = (),
    ) -> list[tuple[Any, ...]]:
        """Run one statement; list parameters named in *texts* are made storable first."""
        return (await self._rows_since(query, params, texts=texts))[0]

    async def _rows_since(
        self, query: sql.SQL | sql.Composed, params: dict[str, Any], *,
        texts: tuple[str, ...] = (),
    ) -> tuple[list[tuple[Any, ...]], float]:
        """:meth:`_rows`, and when this queue first used the connection it ran on
        (``time.monotonic()``: what a WAL position read there proves, :class:`WalPosition`)."""
        async with self._conn() as conn:
            since = self._since(conn)
            for key in texts:
                params[key] = [None if t is None else storable(conn, t) for t in params[key]]
            cur = await conn.execute(query, params)
            # rownumber, not description: the latter builds a Column per column
            # on every call (bench/README.md has what that cost the claim).
            return (await cur.fetchall() if cur.rownumber is not None else []), since

    #: :meth:`claim` takes ``acks`` (a riding ack: :mod:`receipts.completion`).
    carries_acks = True

    async def claim(self, limit: int, *, probe: bool = False,
                    after: tuple[datetime, uuid.UUID] | None = None,
                    shared_bucket: bool = True,
                    acks: Sequence[tuple[uuid.UUID, uuid.UUID]] = ()) -> ClaimResult:
        """Claim up to *limit* due ready jobs (≥1) in one statement.

        Rows locked by other claimants are skipped, so an empty or short result
        does not prove the queue is empty. Nothing is claimed while the fleet
        is paused, unless *probe* (the caller won :meth:`begin_probe`).
        *after* is the watermark, the ``(run_at, id)`` the scan of the ready
        index starts from (None: its start; :meth:`receipts.waker.Wakeups.claim_bound`).
        Under a rate limit the statement also takes one token per job it
        returns from the fleet's shared bucket row, unless not *shared_bucket*
        (the caller charged its own share: :mod:`receipts.ratelimit`).
        *acks*, (job id, token) pairs, are completed by the same statement
        exactly as :meth:`ack` completes them (the guard, the WAL positions):
        the result's ``acked`` is then the :class:`Acked` set :meth:`ack`
        would have returned. Whether or not anything is claimed, they are
        written. Raises ``ValueError`` for limit < 1, and the queue's errors
        (``DatabaseUnavailable`` …: the acks may then have landed or not).
        """
        if limit < 1:
            raise ValueError("claim limit must be at least 1")
        params: dict[str, Any] = {
            "max_attempts": self.max_attempts, "lease_seconds": self.lease_seconds,
            "probe": probe, "after_run_at": after[0] if after else None,
            "after_id": after[1] if after else None,
        }
        limited = self.rate > 0 and shared_bucket
        if limited:
            params |= {"rate": self.rate, "burst": self.burst}
        if acks:
            params |= ack_params(acks)
        statement = claim_query(limit, limited=limited, schema=self.schema,
                                tag=self.worker_tag, acks=bool(acks))
        sent_at = time.monotonic()
        rows, since = await self._rows_since(statement, params)
        claimed_at = time.monotonic()
        attempts = [
            Attempt(Job(id=r[0], order_id=r[1], token=r[2], attempt=r[3], traceparent=r[8]),
                    claimed_at, _age(r[4]), sent_at)
            for r in rows if r[0] is not None
        ]
        flow = _flow_state(rows[0][5:8]) if rows else FlowState()
        acked = None
        if acks:
            acked = (Acked.read(rows[0][9], rows[0][10:12], since) if rows
                     else Acked.read(None, None, since))
        return ClaimResult(attempts, flow, acked)

    async def ack(self, pairs: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> set[uuid.UUID]:
        """Complete attempts given as (job id, token) pairs; returns the ids done.

        A pair missing from the result is a stale ack: its token was replaced
        or its lease expired, and that row was left untouched. The result is
        an :class:`Acked` set: it also carries the server's WAL positions,
        read by the same statement (the completer's durability watch uses
        them as a :meth:`wal_position` read sent when the ack was). Raises
        the queue's errors (``DatabaseUnavailable`` …).
        """
        if not pairs:
            return Acked()
        rows, since = await self._rows_since(self._q("ack"), ack_params(pairs))
        return Acked.read((r[0] for r in rows if r[0] is not None),
                          rows[0][1:3] if rows else None, since)

    async def reschedule(self, items: Sequence[Reschedule]) -> dict[uuid.UUID, JobState]:
        """Write failed attempts back in one statement; returns {job id: new state}.

        Each becomes ready after its delay, or failed when its outcome is
        permanent or the job has used ``max_attempts`` (after any refund).
        ``last_error`` is the outcome's detail (or reason), cut to 500
        characters, or stays as it was for an attempt given back unsent
        (:attr:`Reschedule.unsent`). An id missing from the result was a stale
        attempt: nothing changed for it.
        """
        if not items:
            return {}
        rows = await self._rows(
            self._q("reschedule"),
            {
                "ids": [i.attempt.job.id for i in items],
                "tokens": [i.attempt.job.token for i in items],
                "delays": [max(0.0, float(i.delay_seconds)) for i in items],
                "errors": [None if i.unsent else (i.outcome.detail or str(i.outcome.reason))[:500]
                           for i in items],
                "permanent": [i.outcome.verdict is Verdict.PERMANENT for i in items],
                "refund": [i.refund for i in items],
                "in_progress": [i.outcome.reason is Reason.IN_PROGRESS for i in items],
                "max_attempts": self.max_attempts,
                "max_in_progress": self.max_in_progress,
            },
            texts=("errors",),
        )
        return {r[0]: JobState(r[1]) for r in rows}

    async def resolve_writes(
        self, pairs: Sequence[tuple[uuid.UUID, uuid.UUID]]
    ) -> dict[uuid.UUID, JobState]:
        """Which (job id, token) attempts already have their outcome written; {id: state}.

        For a write whose connection broke around its commit: a pair in the
        result was acked or rescheduled by that attempt (state as written
        then, or later); a pair missing was not, and may be written again
        (the token guard still decides).
        """
        if not pairs:
            return {}
        rows = await self._rows(self._q("resolve_writes"), ack_params(pairs))
        return {r[0]: JobState(r[1]) for r in rows}

    # ------------------------------------------------------- flow control

    async def extend_pause(self, reason: PauseReason, seconds: float, *,
                           next_probe_seconds: float | None = None,
                           probe_outcome: str | None = None) -> FlowState:
        """Pause the fleet for at least *seconds* from now; never shortens a pause.

        *reason* is one the flow control sets (``auth``, ``outage``,
        ``retry_after``, ``rejecting``; a ``rejecting`` pause is stored as
        ``outage`` plus its cause, so released workers honour it). The next
        probe may start *next_probe_seconds* from now (default: when the
        pause ends; never later). *probe_outcome* (a reason label) records
        a failed probe's answer as ``last_probe_outcome``. Returns the
        fleet's state after the statement (``pause_left_seconds``: until the
        next probe of a probed pause, else until its end).
        """
        seconds = max(0.0, float(seconds))
        next_probe = seconds if next_probe_seconds is None else max(
            0.0, min(seconds, float(next_probe_seconds)))
        rows = await self._rows(
            self._q("extend_pause"),
            {"reason": str(reason), "seconds": seconds, "next_probe_seconds": next_probe,
             "probe_outcome": probe_outcome},
        )
        return _flow_state(rows[0][:2])

    async def begin_probe(self, guard_seconds: float) -> tuple[datetime, FlowState] | None:
        """Try to become the one pod that probes the provider during a pause.

        A probe is due at the pause's ``probe_until`` (a short interval after
        the last failure, see :meth:`extend_pause`), not only at its end.
        Returns (the probe's deadline, for :meth:`resume`; the pause with its
        effective reason, whose ``pause_left_seconds`` is the pause *length* a
        failed probe doubles) to the winner, None to everyone else (no probed
        pause, not due yet, or another pod won). *guard_seconds* is how long
        others wait if this pod dies.
        """
        rows = await self._rows(self._q("begin_probe"), {"guard_seconds": float(guard_seconds)})
        if not rows:
            return None
        reason, until, pause_seconds = rows[0]
        return until, FlowState(PauseReason(reason), float(pause_seconds))

    async def resume(self, probe_until: datetime, *, probe_outcome: str = "delivered") -> bool:
        """End the pause after a probe the provider answered; False if it changed since.

        *probe_until* is the deadline :meth:`begin_probe` returned; the
        probe's answer (*probe_outcome*, a reason label) and the time are
        recorded as ``last_probe_outcome`` and ``last_probe_at``.
        """
        return bool(await self._rows(self._q("resume"), {"probe_until": probe_until,
                                                          "probe_outcome": probe_outcome}))

    async def commit_probe(self) -> float:
        """Commit one tiny durable transaction; returns its round trip, seconds.

        The ``commit_probe`` block: a transactional logical-decoding message
        committed with ``synchronous_commit = on`` (whatever the session's
        setting), so the time is one WAL flush plus a round trip — what a
        checkout commit waits for now. Admission control's only sample
        (:mod:`receipts.admission`). Raises :class:`QueueError`.
        """
        start = time.perf_counter()
        async with self._conn() as conn:
            await conn.execute(self._q("commit_probe"))  # no params: one simple query
        return time.perf_counter() - start

    async def wal_position(self) -> WalPosition:
        """Read the server's WAL insert and flush positions (the ``wal_position`` block).

        One tiny statement, no table. The completer proves with it that an
        asynchronously committed write is durable (docs/design.md §2). Raises
        the queue's errors (``DatabaseUnavailable`` …).
        """
        (row,), since = await self._rows_since(self._q("wal_position"), {})
        return WalPosition(int(row[0]), int(row[1]), since)

    async def recover_expired(self, *, batch: int, delay_seconds: float) -> RecoveryBatch:
        """Return one batch (≤ *batch*, ≤ 100) of expired leases to ready or failed.

        Ready rows become due after *delay_seconds* × U(0.5, 1) (jittered so a
        crashed pod's jobs do not come back in one burst).
        """
        rows = await self._rows(
            self._q("recover_expired"),
            {
                "batch": min(int(batch), 100),
                "delay_seconds": float(delay_seconds),
                "max_attempts": self.max_attempts,
            },
        )
        failed = sum(1 for r in rows if r[0] == JobState.FAILED)
        return RecoveryBatch(to_ready=len(rows) - failed, to_failed=failed)

    async def fail_exhausted(self, *, batch: int) -> int:
        """Fail one batch of ready rows whose attempts reached max; returns the count."""
        rows = await self._rows(
            self._q("fail_exhausted"), {"batch": int(batch), "max_attempts": self.max_attempts}
        )
        return len(rows)

    async def prune(self, *, retention_seconds: float, batch: int) -> int:
        """Delete one batch of done/failed rows finished before the retention window."""
        rows = await self._rows(
            self._q("prune"), {"retention_seconds": float(retention_seconds), "batch": int(batch)}
        )
        return len(rows)

    async def queue_stats(self) -> QueueStats:
        """Read the queue gauges (one statement over the partial indexes)."""
        rows = await self._rows(self._q("queue_stats"), {})
        return QueueStats.from_row(rows[0])

    # -------------------------------------------------------- heartbeats

    async def heartbeat(self, *, tag: str, pod: str, pid: int, version: str, slots: int,
                        inflight: int, claimed_total: int, uptime_seconds: float,
                        since_claim_seconds: float | None, stopped: bool = False,
                        concurrency_limit: int | None = None) -> None:
        """Upsert this worker's ``receipt_workers`` row (``heartbeat``); ages in seconds.

        *concurrency_limit*: the worker's adaptive limit on deliveries in flight
        (:mod:`receipts.capacity`), None when adaptation is off.
        """
        async with self._conn() as conn:
            await conn.execute(self._q("heartbeat"), {
                "tag": tag, "pod": pod, "pid": pid, "version": version, "slots": slots,
                "inflight": inflight, "claimed_total": claimed_total,
                "uptime_seconds": max(0.0, uptime_seconds),
                "since_claim_seconds": (None if since_claim_seconds is None
                                        else max(0.0, since_claim_seconds)),
                "stopped": stopped, "concurrency_limit": concurrency_limit})

    async def fleet_concurrency_limit(self) -> tuple[float | None, int]:
        """The mean adaptive limit of the live workers that report one (heard within
        60 s), deliveries in flight per pod (None when none does), and how many do."""
        rows = await self._rows(self._q("fleet_concurrency_limit"), {})
        mean, count = rows[0]
        return (None if not count else float(mean)), int(count or 0)

    async def forget_workers(self, *, seconds: float) -> int:
        """Delete heartbeat rows not seen for *seconds*; returns how many."""
        async with self._conn() as conn:
            cur = await conn.execute(self._q("forget_workers"), {"seconds": float(seconds)})
            return cur.rowcount

    # --------------------------------------------------- attempt history

    async def record_attempts(self, records: Sequence[AttemptRecord]) -> None:
        """Append *records* to their jobs' attempt histories in one statement.

        Each job keeps its last :data:`~receipts.model.ATTEMPT_HISTORY` records
        (a ring: a newer record overwrites the oldest); records of jobs that no
        longer exist are dropped. ``error`` is cut to 500 characters (empty
        means none), ``worker`` to 100. The database stamps the time.
        """
        if not records:
            return
        await self._rows(
            self._q("record_attempts"),
            {
                "job_ids": [r.job_id for r in records],
                "attempts": [r.attempt for r in records],
                "reasons": [str(r.reason) for r in records],
                "statuses": [r.status for r in records],
                "errors": [r.error[:500] or None for r in records],
                "durations": [r.duration_seconds for r in records],
                "workers": [r.worker[:100] or None for r in records],
            },
            texts=("errors",),
        )
