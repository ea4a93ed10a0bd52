"""The operator's statements: one method per named block of ``sql/operations.sql``.

The fleet-wide pause an operator sets and lifts, worker heartbeats, bulk
actions run in bounded batches, and signed-out review-page sessions
(migration 0007). Like :class:`receipts.jobqueue.JobQueue`, every method is one
short autocommit statement on a borrowed pool connection
(:func:`receipts.db.borrow`, which translates driver errors); none runs on a
claim's or an ack's path. The rules that decide what to run (durations, who
may shorten which pause, how batches are sized) live in :mod:`receipts.fleet`
and :mod:`receipts.bulk`.

Every method raises :class:`~receipts.errors.DatabaseUnavailable` when the
database cannot be reached, :class:`~receipts.errors.StatementTimeout` when a
statement was stopped for running too long, :class:`~receipts.errors.SchemaMissing`
before migration 0007, :class:`~receipts.errors.QueueError` otherwise.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from receipts.db import borrow
from receipts.jobqueue import ReviewFilter, matching
from receipts.statements import DEFAULT_SCHEMA, qualifier, query, statements

#: What a bulk action can do, and the job states each applies to.
BULK_ACTIONS = {"retry": ("failed",), "discard": ("ready", "failed")}


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
    from receipts.model import JobState

    return ReviewFilter(state=JobState(action["job_state"]), reason=action["reason"],
                        status=action["http_status"], since=action["since"],
                        until=action["until"], order_contains=action["order_contains"],
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

    def _q(self, name: str) -> sql.SQL:
        return query(name, self.schema)

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

    async def resume_fleet(self, *, expected_until: datetime | None = None) -> ResumeOutcome:
        """Lift the fleet's pause, whatever its reason (``resume_fleet``).

        With *expected_until*, only a pause ending exactly then (the one the
        operator saw) is lifted.
        """
        (row,) = await self._dicts(self._q("resume_fleet"), {"expected_until": expected_until})
        return ResumeOutcome(row["effective_reason"], row["paused_until"], row["pause_note"],
                             bool(row["lifted"]))

    # ------------------------------------------------------- heartbeats

    async def heartbeat(self, *, tag: str, pod: str, pid: int, version: str, slots: int,
                        inflight: int, claimed_total: int, uptime_seconds: float,
                        since_claim_seconds: float | None, stopped: bool = False) -> None:
        """Upsert this worker's ``receipt_workers`` row (``heartbeat``); ages in seconds."""
        async with self._conn() as conn:
            await conn.execute(self._q("heartbeat"), {
                "tag": tag, "pod": pod, "pid": pid, "version": version, "slots": slots,
                "inflight": inflight, "claimed_total": claimed_total,
                "uptime_seconds": max(0.0, uptime_seconds),
                "since_claim_seconds": (None if since_claim_seconds is None
                                        else max(0.0, since_claim_seconds)),
                "stopped": stopped})

    async def forget_workers(self, *, seconds: float) -> int:
        """Delete heartbeat rows not seen for *seconds*; returns how many."""
        async with self._conn() as conn:
            cur = await conn.execute(self._q("forget_workers"), {"seconds": float(seconds)})
            return cur.rowcount

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
            "until": view.until, "order_contains": view.order_contains, "cutoff": view.cutoff,
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
