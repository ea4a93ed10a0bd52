"""The operator's room: one method per named block of ``sql/operations.sql``.

Its audience is the operator, through ``receipts jobs …`` and the review
page: the review lists and counts, one job and its attempt history, retry
and discard of named jobs or of a filter, bulk actions run in bounded
batches, the fleet-wide pause an operator sets and lifts, the workers seen,
and signed-out review-page sessions. The worker's and recovery's statements
live in :mod:`receipts.jobqueue`; the CLI and the page reach this room
through :mod:`receipts.review` (retry, discard, list, show) and get an
:class:`Operations` from the composition code
(:func:`receipts.runtime.make_operations`), never from a queue's pool.
Like :class:`receipts.jobqueue.JobQueue`, every method is one
short autocommit statement on a borrowed pool connection
(:func:`receipts.db.borrow`, which translates driver errors); none runs on a
claim's or an ack's path. The rules that decide what to run (durations, who
may shorten which pause, how batches are sized) live in :mod:`receipts.fleet`
and :mod:`receipts.bulk`.

Every method raises :class:`~receipts.errors.DatabaseUnavailable` when the
database cannot be reached, :class:`~receipts.errors.StatementTimeout` when a
statement was stopped for running too long, :class:`~receipts.errors.SchemaMissing`
before the migrations its statements need (0007 for the console's tables, 0008
for the pause rule), :class:`~receipts.errors.QueueError` otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from receipts.db import borrow
from receipts.errors import StatementTimeout
from receipts.model import FlowState, JobState, PauseReason, QueueStats
from receipts.statements import DEFAULT_SCHEMA, qualifier, query, statements

#: What a bulk action can do, and the job states each applies to.
BULK_ACTIONS = {"retry": ("failed",), "discard": ("ready", "failed")}


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


@dataclass(frozen=True, slots=True)
class FleetFlow:
    """The fleet-wide provider state as an operator reads it (``fleet_flow``).

    Attributes:
        now: the database's time of the reading.
        reason: the effective reason of the pause in force (``auth``,
            ``outage``, ``retry_after``, ``rejecting`` or ``manual``), None
            when the fleet claims.
        stored_reason: ``pause_reason`` as written (what released workers read).
        paused_until: when the pause ends (a probe follows for outage/auth).
        remaining_seconds: seconds until ``paused_until`` (0 when past).
        pause_seconds: the length a failed probe doubles, seconds.
        probe_until: a probe's deadline while one is out, else None.
        note, paused_by, paused_at: the operator's note, who and when, for a
            pause whose cause applies (None otherwise).
        tokens: the fleet bucket as the next claim would find it (jobs).
        last_probe_at, last_probe_outcome: the last probe, when recorded.
    """

    now: datetime
    reason: str | None
    stored_reason: str | None
    paused_until: datetime | None
    remaining_seconds: float
    pause_seconds: float
    probe_until: datetime | None
    note: str | None
    paused_by: str | None
    paused_at: datetime | None
    tokens: float
    last_probe_at: datetime | None
    last_probe_outcome: str | None

    @property
    def paused(self) -> bool:
        """True while claims are paused (a pause in force, or a probe awaited)."""
        return self.reason is not None

    @property
    def awaiting_probe(self) -> bool:
        """An outage or auth pause whose time is up: one probe decides."""
        return self.paused and self.remaining_seconds <= 0 and self.stored_reason in (
            "outage", "auth")


@dataclass(frozen=True, slots=True)
class PauseOutcome:
    """What ``pause_fleet`` did: ``paused_until`` None means refused (a longer
    automatic pause is in force: ``previous_reason`` until ``previous_until``)."""

    paused_until: datetime | None
    previous_reason: str | None
    previous_until: datetime | None

    @property
    def paused(self) -> bool:
        """True when the manual pause is now in force."""
        return self.paused_until is not None


@dataclass(frozen=True, slots=True)
class ResumeOutcome:
    """What ``resume_fleet`` found and did: the pause there was (reason None:
    none) and whether it was lifted (False: none, or not the one expected)."""

    reason: str | None
    paused_until: datetime | None
    note: str | None
    lifted: bool


@dataclass(frozen=True, slots=True)
class BulkStep:
    """One committed batch of a bulk action: the action's running totals after
    it, its status (``running`` or ``done``), its cursor, and what this batch
    changed."""

    examined: int
    changed: int
    status: str
    cursor_at: datetime | None
    cursor_id: uuid.UUID | None
    batch_changed: int
    changed_ids: list[uuid.UUID] = field(default_factory=list)


def bulk_view(action: dict[str, Any]) -> ReviewFilter:
    """The :class:`ReviewFilter` a ``receipt_bulk_actions`` row covers (its cutoff included)."""
    return ReviewFilter(state=JobState(action["job_state"]), reason=action["reason"],
                        status=action["http_status"], since=action["since"],
                        until=action["until"], order_contains=action["order_contains"],
                        error_prefix=action.get("error_prefix"),
                        cutoff=action["cutoff"])


class Operations:
    """The operator's statements on a pool (see the module doc).

    Args:
        pool: an open pool of autocommit connections (:func:`receipts.db.make_pool`).
        schema: the schema of the tables (``ValueError`` for a bad name).
        deadline_seconds: client-side deadline of each statement (None: none).
    """

    def __init__(self, pool: AsyncConnectionPool, *, schema: str = DEFAULT_SCHEMA,
                 deadline_seconds: float | None = None) -> None:
        qualifier(schema)
        self.pool = pool
        self.schema = schema
        self.deadline_seconds = deadline_seconds

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        async with borrow(self.pool, self.deadline_seconds) as conn:
            yield conn

    async def _dicts(self, statement: sql.SQL | sql.Composed,
                     params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        async with self._conn() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(statement, params)
            return await cur.fetchall() if cur.rownumber is not None else []

    async def _rows(self, statement: sql.SQL | sql.Composed,
                    params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        async with self._conn() as conn:
            cur = await conn.execute(statement, params)
            return await cur.fetchall() if cur.rownumber is not None else []

    def _q(self, name: str) -> sql.SQL:
        return query(name, self.schema)

    # ------------------------------------------------------------ review

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
        number of distinct ids). Each becomes ready, attempts 0, due now;
        ``last_error`` is kept, prefixed ``manual retry after:``. The rows are
        locked and re-checked in the same statement, so a job that another
        operator, a worker or recovery moved meanwhile makes it change
        nothing (never a partial retry). Returns the ids retried.
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

    async def queue_stats(self) -> QueueStats:
        """The queue gauges, as the worker reads them (the worker's ``queue_stats``
        statement, shared: one rule for both readers)."""
        rows = await self._rows(self._q("queue_stats"))
        return QueueStats.from_row(rows[0])

    async def flow_state(self, *, rate: float = 0.0, burst: float = 1.0) -> FlowState:
        """The fleet-wide pause and the bucket's tokens now, as a worker's gauges read it.

        *rate* (jobs/s) and *burst* (jobs) are the fleet's rate limit; tokens
        is None without one (*rate* 0).
        """
        rows = await self._rows(
            self._q("flow_state"), {"rate": float(rate), "burst": float(burst)}
        )
        if not rows:
            return FlowState()
        reason, left, _pause_seconds, tokens = rows[0]
        return FlowState(PauseReason(reason) if reason else None,
                         float(left) if reason else None,
                         float(tokens) if rate > 0 else None)

    # ---------------------------------------------------------- the fleet

    async def fleet_flow(self, *, rate: float = 0.0, burst: float = 1.0) -> FleetFlow:
        """The fleet-wide pause and bucket now; *rate* (jobs/s) and *burst* (jobs)
        are the fleet's rate limit, to bring the stored tokens up to date."""
        (row,) = await self._dicts(self._q("fleet_flow"), {"rate": float(rate),
                                                           "burst": float(burst)})
        return FleetFlow(
            now=row["now"], reason=row["effective_reason"], stored_reason=row["pause_reason"],
            paused_until=row["paused_until"],
            remaining_seconds=float(row["remaining_seconds"] or 0.0),
            pause_seconds=float(row["pause_seconds"] or 0.0), probe_until=row["probe_until"],
            note=row["pause_note"], paused_by=row["paused_by"], paused_at=row["paused_at"],
            tokens=float(row["tokens"] or 0.0), last_probe_at=row["last_probe_at"],
            last_probe_outcome=row["last_probe_outcome"])

    async def pause_fleet(self, seconds: float, *, note: str, paused_by: str,
                          replace: bool = False) -> PauseOutcome:
        """Pause every worker's claims for *seconds* from now (``pause_fleet``).

        Refused (nothing changes) while a longer automatic pause is in force,
        unless *replace*. *note* ≤ 200 and *paused_by* ≤ 100 characters.
        """
        (row,) = await self._dicts(self._q("pause_fleet"), {
            "seconds": float(seconds), "note": note, "paused_by": paused_by,
            "replace": bool(replace)})
        return PauseOutcome(row["paused_until"], row["previous_reason"], row["previous_until"])

    async def wake_fleet(self, *, channel: str) -> None:
        """Notify *channel* (the workers' wake-up channel) from this short transaction."""
        async with self._conn() as conn:
            await conn.execute(self._q("wake_fleet"), {"channel": channel})

    async def resume_fleet(self, *, expected_until: datetime | None = None) -> ResumeOutcome:
        """Lift the fleet's pause, whatever its reason (``resume_fleet``).

        With *expected_until*, only a pause ending exactly then (the one the
        operator saw) is lifted.
        """
        (row,) = await self._dicts(self._q("resume_fleet"), {"expected_until": expected_until})
        return ResumeOutcome(row["effective_reason"], row["paused_until"], row["pause_note"],
                             bool(row["lifted"]))

    # ----------------------------------------------------------- workers

    async def workers_seen(self, *, seconds: float) -> list[dict[str, Any]]:
        """Workers heard from within *seconds*: dicts of the ``receipt_workers``
        columns plus ``age_seconds`` (since the last heartbeat)."""
        return await self._dicts(self._q("workers_seen"), {"seconds": float(seconds)})

    # --------------------------------------------------------- sessions

    async def revoke_session(self, sid: str, *, expires_at: datetime) -> None:
        """Refuse review-page session *sid* until *expires_at* (``revoke_session``)."""
        async with self._conn() as conn:
            await conn.execute(self._q("revoke_session"), {"sid": sid, "expires_at": expires_at})

    async def revoked_sessions(self) -> set[str]:
        """The ids of signed-out sessions whose cookies have not expired yet."""
        return {r["sid"] for r in await self._dicts(self._q("revoked_sessions"))}

    # ----------------------------------------------------- bulk actions

    async def bulk_create(self, *, action: str, view: ReviewFilter, expected: int | None,
                          runner: uuid.UUID, created_by: str) -> dict[str, Any]:
        """Record a confirmed bulk action owned by *runner*; returns its row.

        *view* must carry the confirmation's ``cutoff``. Raises ``ValueError``
        for an action *view*'s state does not allow.
        """
        if action not in BULK_ACTIONS or str(view.state) not in BULK_ACTIONS[action]:
            raise ValueError(f"{action} does not apply to {view.state} jobs")
        if view.cutoff is None:
            raise ValueError("a bulk action needs its confirmation time (cutoff)")
        (row,) = await self._dicts(self._q("bulk_create"), {
            "id": uuid.uuid4(), "action": action, "job_state": str(view.state),
            "reason": view.reason, "http_status": view.status, "since": view.since,
            "until": view.until, "order_contains": view.order_contains,
            "error_prefix": view.error_prefix, "cutoff": view.cutoff,
            "expected": expected, "runner": runner, "created_by": created_by[:100]})
        return row

    async def bulk_get(self, action_id: uuid.UUID) -> dict[str, Any] | None:
        """One bulk action's row plus ``idle_seconds`` (since its last batch), or None."""
        rows = await self._dicts(self._q("bulk_get"), {"id": action_id})
        return rows[0] if rows else None

    async def bulk_recent(self, *, seconds: float) -> list[dict[str, Any]]:
        """Running actions and those created within *seconds*, newest first (≤ 10)."""
        return await self._dicts(self._q("bulk_recent"), {"seconds": float(seconds)})

    async def bulk_take(self, action_id: uuid.UUID, *, runner: uuid.UUID,
                        stale_seconds: float) -> dict[str, Any] | None:
        """Make *runner* the owner of a stopped, failed or abandoned action; its row, or None."""
        rows = await self._dicts(self._q("bulk_take"), {
            "id": action_id, "runner": runner, "stale_seconds": float(stale_seconds)})
        return rows[0] if rows else None

    async def bulk_release(self, action_id: uuid.UUID, *, runner: uuid.UUID) -> bool:
        """Hand *runner*'s running action to whichever page takes it next (at once, not
        after the stale time); False when *runner* no longer owned it running."""
        return bool(await self._dicts(self._q("bulk_release"), {"id": action_id,
                                                                "runner": runner}))

    async def bulk_orphans(self, *, stale_seconds: float) -> list[uuid.UUID]:
        """Ids of running actions nobody runs: released, or silent for *stale_seconds*
        (≤ 10, oldest first)."""
        rows = await self._dicts(self._q("bulk_orphans"), {"stale_seconds": float(stale_seconds)})
        return [r["id"] for r in rows]

    async def bulk_find(self, *, action: str, view: ReviewFilter) -> dict[str, Any] | None:
        """The action already confirmed with this action, filter and ``view.cutoff``, or None
        (a form sent twice finds the first one's action)."""
        rows = await self._dicts(self._q("bulk_find"), {
            "action": action, "job_state": str(view.state), "reason": view.reason,
            "http_status": view.status, "since": view.since, "until": view.until,
            "order_contains": view.order_contains, "error_prefix": view.error_prefix,
            "cutoff": view.cutoff})
        return rows[0] if rows else None

    async def bulk_stop(self, action_id: uuid.UUID) -> bool:
        """Stop a running action after its current batch; False when it was not running."""
        return bool(await self._dicts(self._q("bulk_stop"), {"id": action_id}))

    async def bulk_fail(self, action_id: uuid.UUID, *, runner: uuid.UUID, error: str) -> None:
        """Mark *runner*'s action failed with *error* (≤ 500 characters)."""
        await self._dicts(self._q("bulk_fail"), {"id": action_id, "runner": runner,
                                                 "error": error})

    async def bulk_step(self, action: dict[str, Any], *, runner: uuid.UUID, batch: int,
                        after: tuple[datetime, uuid.UUID] | None,
                        want_ids: bool = False) -> BulkStep | None:
        """Run one batch of *action* (a ``receipt_bulk_actions`` row) from the cursor *after*.

        Walks at most *batch* jobs of the action's state; returns the
        action's totals after the batch (with the ids it changed when
        *want_ids*), or None when *runner* no longer owns it running
        (stopped, or taken over).
        """
        view = bulk_view(action)
        effect = statements(self.schema)[f"{action['action']}_effect"]
        statement = sql.SQL(statements(self.schema)["bulk_step"]).format(  # type: ignore[arg-type,unused-ignore]
            state=sql.Literal(str(view.state)), key=sql.Identifier(view.key),
            cutoff_key=sql.Identifier(view.cutoff_key), matching=matching(view, self.schema),
            effect=sql.SQL(effect))  # type: ignore[arg-type,unused-ignore]
        rows = await self._dicts(statement, view.params() | {
            "id": action["id"], "runner": runner, "batch": int(batch),
            "after_at": after[0] if after else None, "after_id": after[1] if after else None,
            "want_ids": want_ids})
        if not rows:
            return None
        r = rows[0]
        return BulkStep(int(r["examined"]), int(r["changed"]), r["status"], r["cursor_at"],
                        r["cursor_id"], int(r["batch_changed"]), list(r["changed_ids"] or []))

    # ------------------------------------------------------- the console

    async def failure_groups(self, *, limit: int = 200, failed_cap: int = 100_000,
                             ready_cap: int = 100_000) -> list[dict[str, Any]]:
        """The most recent *failed_cap* failed jobs and at most *ready_cap* ready jobs
        carrying an error, grouped by the first 60 characters of ``last_error``: dicts
        of ``state``, ``prefix``, ``jobs``, ``first_at``, ``last_at``, ``capped`` (a
        bound was reached), ``reason`` and ``status`` (of the group's most recent
        job); at most *limit*, largest first."""
        return await self._dicts(self._q("failure_groups"), {
            "limit": int(limit), "failed_cap": int(failed_cap), "ready_cap": int(ready_cap)})

    async def attempt_rates(self, *, since: datetime | None = None) -> list[dict[str, Any]]:
        """Attempts per minute since *since* (at most the last hour): dicts of ``minute``,
        ``attempts``, ``delivered``, ``p50`` and ``p95`` (attempt time, seconds)."""
        return await self._dicts(self._q("attempt_rates"), {"since": since})

    async def attempt_percentiles(self) -> dict[str, Any]:
        """The last hour's ``delivered``, ``attempts``, ``p50`` and ``p95`` (seconds)."""
        (row,) = await self._dicts(self._q("attempt_percentiles"))
        return row

    async def ui_sample(self, *, at: datetime, ready: int, running: int, failed: int) -> None:
        """Keep the queue-depth sample of *at*'s minute (the first writer of a minute wins)."""
        async with self._conn() as conn:
            await conn.execute(self._q("ui_sample"), {"at": at, "ready": ready,
                                                      "running": running, "failed": failed})

    async def ui_samples(self) -> list[dict[str, Any]]:
        """The kept queue-depth samples of the last hour, oldest first."""
        return await self._dicts(self._q("ui_samples"))

    # ------------------------------------------------------ held rejections

    async def held_jobs(self, *, limit: int = 50) -> list[dict[str, Any]]:
        """The held rejections (``held_jobs``): at most *limit* ready jobs whose last
        4xx was held for want of evidence, oldest due first; each dict has id,
        order_id, attempts, run_at, last_error, created_at and ``held`` (the
        group's size). Raises ``ValueError`` for *limit* < 1."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        return await self._dicts(self._q("held_jobs"), {"limit": int(limit)})

    async def held_action(self, action: str, *, batch: int = 1000) -> int:
        """Discard (*action* ``discard``) or send again now (``retry``) every held
        rejection, in batches of *batch* (``held_discard``/``held_retry``); returns
        how many jobs changed. Raises ``ValueError`` for another action."""
        if action not in ("discard", "retry"):
            raise ValueError(f"no held action {action!r}")
        statement = self._q(f"held_{action}")
        changed = 0
        while True:
            rows = await self._dicts(statement, {"batch": int(batch)})
            changed += len(rows)
            if len(rows) < batch:
                return changed
