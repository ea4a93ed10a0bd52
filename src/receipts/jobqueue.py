"""The queue: one method per named statement in ``sql/queries.sql``.

This module is the only place that talks SQL to ``receipt_jobs`` for the
worker, recovery and review; it borrows connections through
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

import contextlib
import dataclasses
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from receipts.db import borrow, storable
from receipts.errors import DatabaseUnavailable, StatementTimeout
from receipts.model import (
    Attempt,
    AttemptRecord,
    ClaimResult,
    FlowState,
    Job,
    JobState,
    PauseReason,
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
    statements,
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
class QueueStats:
    """A snapshot of the queue read by :meth:`JobQueue.queue_stats`.

    Counts are rows; ``done_estimate`` comes from table statistics, not a
    count. Ages are seconds, 0 when there is nothing to measure:
    ``lag_seconds`` is the age of the oldest *due* ready job (since its
    ``run_at``, so every retry restarts it); ``oldest_undelivered_age_seconds``
    the time since the oldest ready or running job was enqueued (its
    ``created_at``: retries do not restart it, so a provider outage that keeps
    rescheduling shows here and not in the lag);
    ``oldest_transaction_age_seconds`` the age of the oldest open transaction in
    the database (the xmin horizon that slows claims, docs/design.md §10);
    ``oldest_finished_age_seconds`` the time since the oldest done, failed or
    discarded row finished (pruning keeps it within the retention).
    """

    ready_due: int
    ready: int
    running: int
    expired: int
    failed: int
    lag_seconds: float
    done_estimate: int
    dead_tuples: int
    oldest_transaction_age_seconds: float
    oldest_undelivered_age_seconds: float
    discarded: int = 0
    xmin_age_by_holder: dict[str, int] = field(default_factory=dict)
    oldest_finished_age_seconds: float = 0.0


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

    async def claim(self, limit: int, *, probe: bool = False) -> ClaimResult:
        """See :meth:`JobQueue.claim`."""
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
        async with self._conn() as conn:
            for key in texts:
                params[key] = [storable(conn, t) for t in params[key]]
            cur = await conn.execute(query, params)
            # rownumber, not description: the latter builds a Column per column
            # on every call (bench/README.md has what that cost the claim).
            return await cur.fetchall() if cur.rownumber is not None else []

    async def claim(self, limit: int, *, probe: bool = False) -> ClaimResult:
        """Claim up to *limit* due ready jobs (≥1) in one statement.

        Rows locked by other claimants are skipped, so an empty or short result
        does not prove the queue is empty. Nothing is claimed while the fleet
        is paused, unless *probe* (the caller won :meth:`begin_probe`). Under a
        rate limit the statement also takes one token per job it returns.
        Raises ``ValueError`` for limit < 1.
        """
        if limit < 1:
            raise ValueError("claim limit must be at least 1")
        params: dict[str, Any] = {
            "max_attempts": self.max_attempts, "lease_seconds": self.lease_seconds,
            "probe": probe,
        }
        if self.rate > 0:
            params |= {"rate": self.rate, "burst": self.burst}
        statement = claim_query(limit, limited=self.rate > 0, schema=self.schema,
                                tag=self.worker_tag)
        sent_at = time.monotonic()
        rows = await self._rows(statement, params)
        claimed_at = time.monotonic()
        attempts = [
            Attempt(Job(id=r[0], order_id=r[1], token=r[2], attempt=r[3], traceparent=r[8]),
                    claimed_at, _age(r[4]), sent_at)
            for r in rows if r[0] is not None
        ]
        flow = _flow_state(rows[0][5:8]) if rows else FlowState()
        return ClaimResult(attempts, flow)

    async def ack(self, pairs: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> set[uuid.UUID]:
        """Complete attempts given as (job id, token) pairs; returns the ids done.

        A pair missing from the result is a stale ack: its token was replaced
        or its lease expired, and that row was left untouched.
        """
        if not pairs:
            return set()
        rows = await self._rows(self._q("ack"), ack_params(pairs))
        return {r[0] for r in rows}

    async def reschedule(self, items: Sequence[Reschedule]) -> dict[uuid.UUID, JobState]:
        """Write failed attempts back in one statement; returns {job id: new state}.

        Each becomes ready after its delay, or failed when its outcome is
        permanent or the job has used ``max_attempts`` (after any refund).
        ``last_error`` is the outcome's detail (or reason), cut to 500
        characters. An id missing from the result was a stale attempt:
        nothing changed for it.
        """
        if not items:
            return {}
        rows = await self._rows(
            self._q("reschedule"),
            {
                "ids": [i.attempt.job.id for i in items],
                "tokens": [i.attempt.job.token for i in items],
                "delays": [max(0.0, float(i.delay_seconds)) for i in items],
                "errors": [(i.outcome.detail or str(i.outcome.reason))[:500] for i in items],
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
        async with self._conn() as conn:
            since = self._since(conn)
            cur = await conn.execute(self._q("wal_position"))
            row = await cur.fetchone()
        assert row is not None
        return WalPosition(int(row[0]), int(row[1]), since)

    async def flow_state(self) -> FlowState:
        """The fleet-wide pause and the bucket's tokens now (tokens None without a limit)."""
        rows = await self._rows(
            self._q("flow_state"), {"rate": self.rate, "burst": self.burst}
        )
        if not rows:
            return FlowState()
        reason, left, _pause_seconds, tokens = rows[0]
        return FlowState(PauseReason(reason) if reason else None,
                         float(left) if reason else None,
                         float(tokens) if self.rate > 0 else None)

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
        r = rows[0]
        return QueueStats(
            ready_due=int(r[0]),
            ready=int(r[1]),
            running=int(r[2]),
            expired=int(r[3]),
            failed=int(r[4]),
            lag_seconds=float(r[5]),
            done_estimate=int(r[6]),
            dead_tuples=int(r[7]),
            oldest_transaction_age_seconds=float(r[8]),
            oldest_undelivered_age_seconds=float(r[9]),
            discarded=int(r[10]),
            xmin_age_by_holder={"transaction": int(r[11]), "prepared": int(r[12]),
                                "replication_slot": int(r[13])},
            oldest_finished_age_seconds=float(r[14]),
        )

    # ----------------------------------------------------------- review

    async def state_counts(self) -> dict[JobState, int]:
        """Exact rows by state (every state present, 0 when empty)."""
        counts = dict.fromkeys(JobState, 0)
        for state, n in await self._rows(self._q("state_counts"), {}):
            counts[JobState(state)] = int(n)
        return counts

    async def oldest_failed(self) -> datetime | None:
        """When the oldest failed job failed, or None when none has."""
        rows = await self._rows(self._q("oldest_failed"), {})
        return rows[0][0] if rows else None

    async def list_jobs(
        self, state: JobState, *, limit: int = 50, since: datetime | None = None
    ) -> list[dict[str, Any]]:
        """Jobs in *state*, newest first, at most *limit*; *since* filters by finish time."""
        async with self._conn() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                self._q("list_jobs"), {"state": str(state), "limit": int(limit), "since": since}
            )
            return await cur.fetchall()

    async def show_job(self, key: str) -> dict[str, Any] | None:
        """One job by UUID or, failing that, by order id; None when absent."""
        lookups: list[tuple[str, dict[str, Any]]] = []
        with contextlib.suppress(ValueError):
            lookups.append(("show_job", {"id": uuid.UUID(key)}))
        lookups.append(("show_job_by_order", {"order_id": key}))  # order ids may be UUIDs too
        async with self._conn() as conn:
            cur = conn.cursor(row_factory=dict_row)
            for name, params in lookups:
                await cur.execute(self._q(name), params)
                row = await cur.fetchone()
                if row is not None:
                    return row
        return None

    async def retry_failed(self, ids: Iterable[uuid.UUID] | None) -> list[uuid.UUID]:
        """Make failed jobs deliverable again (all of them when *ids* is None).

        Only rows in state failed change: attempts reset to 0, due now. Returns
        the ids that changed; ids in any other state are left alone.
        """
        rows = await self._rows(
            self._q("retry_failed"), {"ids": None if ids is None else list(ids)}
        )
        return [r[0] for r in rows]

    # ------------------------------------------ attempt history, discard, review

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

    async def job_attempts(self, job_id: uuid.UUID) -> list[dict[str, Any]]:
        """*job_id*'s kept attempt records, newest first.

        Each a dict: ``seq`` (the job's record number), ``attempt``, ``at``
        (database time the record was written), ``reason``, ``status`` (int or
        None), ``error`` (≤ 500 characters or None), ``duration_seconds``
        (float or None), ``worker``.
        """
        async with self._conn() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(self._q("job_attempts"), {"id": job_id})
            return await cur.fetchall()

    async def review_jobs(
        self, view: ReviewFilter, *, limit: int = 50,
        after: tuple[datetime, uuid.UUID] | None = None,
    ) -> list[dict[str, Any]]:
        """One page of jobs matching *view*, newest first (at most *limit*, ≤ 500).

        *after* is the keyset cursor: the (``sort_at``, ``id``) of the last row
        of the previous page. Rows are dicts with the job's columns plus
        ``sort_at`` (the view's time column), ``expired`` (a running job's
        lease has run out), the latest attempt's ``reason`` and ``status``
        (None without history) and ``holder`` (the pod whose lease a running
        job is under, None when unknown).
        """
        params = view.params() | {
            "limit": max(1, min(int(limit), 500)),
            "after_at": after[0] if after else None,
            "after_id": after[1] if after else None,
        }
        async with self._conn() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_review_query("review_jobs", view, self.schema), params)
            return await cur.fetchall()

    async def review_count(self, view: ReviewFilter, *, cap: int | None = None) -> int:
        """How many jobs match *view* now, counting at most *cap* (None: all of them).

        A result equal to *cap* means "at least *cap*".
        """
        rows = await self._rows(_review_query("review_count", view, self.schema),
                                view.params() | {"cap": cap})
        return int(rows[0][0])

    async def count_now(self, view: ReviewFilter, *, timeout_seconds: float,
                        cap: int | None = None) -> tuple[datetime, int | None]:
        """The database's time now, and how many jobs match *view* up to then.

        One transaction: ``statement_timestamp()`` is read first and bounds the
        count (``cutoff``, the moment a bulk action is confirmed); the count
        (of at most *cap* rows, None: all) runs under ``SET LOCAL
        statement_timeout`` = *timeout_seconds* and is None when it did not
        finish in time (a selective filter over many rows).
        """
        now: datetime | None = None
        try:
            async with self._conn() as conn, conn.transaction():
                cur = await conn.execute(
                    "SELECT statement_timestamp(), set_config('statement_timeout', %s, true)",
                    (f"{max(1, round(timeout_seconds * 1000))}ms",))
                row = await cur.fetchone()
                assert row is not None
                now = row[0]
                bounded = dataclasses.replace(view, cutoff=now)
                cur = await conn.execute(_review_query("review_count", bounded, self.schema),
                                         bounded.params() | {"cap": cap})
                counted = await cur.fetchone()
                assert counted is not None
                return row[0], int(counted[0])
        except StatementTimeout:
            if now is None:
                raise
            return now, None

    async def retry_jobs(
        self, target: ReviewFilter | Sequence[uuid.UUID], *, expected: int
    ) -> list[uuid.UUID]:
        """Retry failed jobs (named, or matching a filter), all or nothing.

        Changes nothing, and returns ``[]``, unless exactly *expected* failed
        jobs qualify (the count the operator confirmed; for ids, pass the
        number of distinct ids). Effect as :meth:`retry_failed`. Returns the
        ids retried.
        """
        return await self._act("retry_jobs", target, expected)

    async def discard_jobs(
        self, target: ReviewFilter | Sequence[uuid.UUID], *, expected: int
    ) -> list[uuid.UUID]:
        """Discard ready or failed jobs (named, or matching a filter), all or nothing.

        ``discarded`` is terminal (``finished_at`` set) and keeps the row, so
        the order id stays deduplicated until retention prunes it. Running
        jobs are never touched. Changes nothing, and returns ``[]``, unless
        exactly *expected* jobs qualify. Returns the ids discarded.
        """
        return await self._act("discard_jobs", target, expected)

    async def _act(
        self, name: str, target: ReviewFilter | Sequence[uuid.UUID], expected: int
    ) -> list[uuid.UUID]:
        if isinstance(target, ReviewFilter):
            statement = _action_query(name, target, self.schema)
            params = target.params()
        else:
            statement = _action_query(name, None, self.schema)
            params = {"ids": list(dict.fromkeys(target)), "reason": None, "status": None}
        rows = await self._rows(statement, params | {"expected": int(expected)})
        return [r[0] for r in rows]

    async def job_states(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, JobState]:
        """The current state of each of *ids* that exists."""
        rows = await self._rows(self._q("job_states"), {"ids": list(ids)})
        return {r[0]: JobState(r[1]) for r in rows}

    async def provider_pause(self) -> dict[str, Any]:
        """The provider pause recorded by the workers' flow control (``receipt_flow``).

        A dict: ``pause_reason`` (the effective reason: None, ``auth``,
        ``outage``, ``retry_after``, ``rejecting`` or ``manual``),
        ``paused_until`` (datetime or None), ``pause_seconds`` and
        ``remaining_seconds`` (seconds; 0 when not paused), ``last_probe_at``
        (datetime or None) and ``last_probe_outcome`` (a reason label or None).
        """
        async with self._conn() as conn:
            dcur = conn.cursor(row_factory=dict_row)
            await dcur.execute(self._q("provider_pause"))
            row = await dcur.fetchone()
        return row or {"pause_reason": None, "paused_until": None, "pause_seconds": None,
                       "remaining_seconds": 0.0, "last_probe_at": None,
                       "last_probe_outcome": None}


@dataclass(frozen=True, slots=True)
class ReviewFilter:
    """Which jobs a review list or a bulk action covers (``review_matching``).

    Attributes:
        state: the jobs' state (a literal in the statement, so its partial
            index serves the list).
        reason: the latest attempt's reason (``rejected``, ``max_attempts``…).
        status: the latest attempt's HTTP status.
        since, until: the time column (``finished_at``; ``run_at`` for ready
            jobs) within [since, until).
        order_contains: a plain substring of the order id.
        error_prefix: a failure group's key: the first 60 characters of
            ``last_error`` (``failure_groups``).

    None means "any" for every field but ``state``.
    """

    state: JobState = JobState.FAILED
    reason: str | None = None
    status: int | None = None
    since: datetime | None = None
    until: datetime | None = None
    order_contains: str | None = None
    cutoff: datetime | None = None
    expired: bool | None = None
    error_prefix: str | None = None

    @property
    def key(self) -> str:
        """The time column the list is ordered and filtered by (``since``/``until``)."""
        return _LIST_KEYS[self.state]

    @property
    def cutoff_key(self) -> str:
        """The time column ``cutoff`` bounds: when a job entered a terminal state,
        else when it was enqueued (a job that reaches the state after a bulk
        action's confirmation is never part of it)."""
        return "created_at" if self.state in (JobState.READY, JobState.RUNNING) else "finished_at"

    def params(self) -> dict[str, Any]:
        """The statement parameters of ``review_matching``."""
        return {"reason": self.reason, "status": self.status, "since": self.since,
                "until": self.until, "order_contains": self.order_contains or None,
                "cutoff": self.cutoff, "expired": self.expired,
                "error_prefix": self.error_prefix}


#: The time column each state's list is ordered by (its partial index's key).
_LIST_KEYS = {JobState.READY: "run_at", JobState.RUNNING: "lease_until",
              JobState.DONE: "finished_at", JobState.FAILED: "finished_at",
              JobState.DISCARDED: "finished_at"}


def matching(view: ReviewFilter, schema: str) -> sql.Composed:
    """The ``review_matching`` fragment for *view*, for a statement over ``receipt_jobs AS j``
    and the latest attempt ``AS la`` (review lists, actions, bulk batches)."""
    return sql.SQL(statements(schema)["review_matching"]).format(  # type: ignore[arg-type,unused-ignore]
        state=sql.Literal(str(view.state)), key=sql.Identifier(view.key),
        cutoff_key=sql.Identifier(view.cutoff_key),
    )


def _review_query(name: str, view: ReviewFilter, schema: str) -> sql.Composed:
    """A review statement with *view*'s fragment composed in (a handful per page)."""
    return sql.SQL(statements(schema)[name]).format(  # type: ignore[arg-type,unused-ignore]
        matching=matching(view, schema), key=sql.Identifier(view.key)
    )


def _action_query(name: str, view: ReviewFilter | None, schema: str) -> sql.Composed:
    """retry_jobs/discard_jobs on ids (*view* None) or on *view*'s filter."""
    target = sql.SQL("j.id = ANY(%(ids)s::uuid[])") if view is None else matching(view, schema)
    return sql.SQL(statements(schema)[name]).format(target=target)  # type: ignore[arg-type,unused-ignore]
