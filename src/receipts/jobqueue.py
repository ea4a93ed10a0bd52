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
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from receipts.db import borrow
from receipts.model import Job, JobState
from receipts.statements import claim_query, query


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
    the database (the xmin horizon that slows claims, docs/design.md §10).
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


@dataclass(frozen=True, slots=True)
class RecoveryBatch:
    """What one recovery batch did: leases expired back to ready / to failed."""

    to_ready: int
    to_failed: int




# ------------------------------------------------------------------- the queue


class JobQueue:
    """Queue operations on a pool; every method is one autocommit statement.

    Args:
        pool: an open :class:`psycopg_pool.AsyncConnectionPool` of autocommit
            connections (see :func:`make_pool`).
        lease_seconds: lease length given to each claim, seconds.
        max_attempts: attempts after which a job fails instead of retrying.

    Every method raises :class:`DatabaseUnavailable` when the database cannot
    be reached, :class:`SchemaMissing` before migrations, :class:`QueueError`
    otherwise.
    """

    def __init__(self, pool: AsyncConnectionPool, *, lease_seconds: float, max_attempts: int):
        self.pool = pool
        self.lease_seconds = float(lease_seconds)
        self.max_attempts = int(max_attempts)

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        async with borrow(self.pool) as conn:
            yield conn

    async def _rows(
        self, query: sql.SQL | sql.Composed, params: dict[str, Any]
    ) -> list[tuple[Any, ...]]:
        async with self._conn() as conn:
            cur = await conn.execute(query, params)
            return await cur.fetchall() if cur.description else []

    async def claim(self, limit: int) -> list[Job]:
        """Claim up to *limit* due ready jobs (≥1) in one statement.

        Rows locked by other claimants are skipped, so an empty or short result
        does not prove the queue is empty. Raises ``ValueError`` for limit < 1.
        """
        if limit < 1:
            raise ValueError("claim limit must be at least 1")
        rows = await self._rows(
            claim_query(limit),
            {"max_attempts": self.max_attempts, "lease_seconds": self.lease_seconds},
        )
        return [Job(id=r[0], order_id=r[1], token=r[2], attempt=r[3]) for r in rows]

    async def ack(self, pairs: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> set[uuid.UUID]:
        """Complete attempts given as (job id, token) pairs; returns the ids done.

        A pair missing from the result is a stale ack: its token was replaced
        or its lease expired, and that row was left untouched.
        """
        if not pairs:
            return set()
        rows = await self._rows(
            query("ack"), {"ids": [p[0] for p in pairs], "tokens": [p[1] for p in pairs]}
        )
        return {r[0] for r in rows}

    async def reschedule(
        self, job: Job, *, delay_seconds: float, error: str, permanent: bool = False
    ) -> JobState | None:
        """Record a failed attempt of *job*: ready after *delay_seconds*, or failed.

        Failed when *permanent* or when the job has used ``max_attempts``.
        *error* is stored as ``last_error`` (truncated to 500 characters).
        Returns the new state, or None for a stale attempt (nothing changed).
        """
        rows = await self._rows(
            query("reschedule"),
            {
                "id": job.id,
                "token": job.token,
                "delay_seconds": max(0.0, float(delay_seconds)),
                "error": error[:500],
                "permanent": permanent,
                "max_attempts": self.max_attempts,
            },
        )
        return JobState(rows[0][0]) if rows else None

    async def recover_expired(self, *, batch: int, delay_seconds: float) -> RecoveryBatch:
        """Return one batch (≤ *batch*, ≤ 100) of expired leases to ready or failed.

        Ready rows become due after *delay_seconds* × U(0.5, 1) (jittered so a
        crashed pod's jobs do not come back in one burst).
        """
        rows = await self._rows(
            query("recover_expired"),
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
            query("fail_exhausted"), {"batch": int(batch), "max_attempts": self.max_attempts}
        )
        return len(rows)

    async def prune(self, *, retention_seconds: float, batch: int) -> int:
        """Delete one batch of done/failed rows finished before the retention window."""
        rows = await self._rows(
            query("prune"), {"retention_seconds": float(retention_seconds), "batch": int(batch)}
        )
        return len(rows)

    async def queue_stats(self) -> QueueStats:
        """Read the queue gauges (one statement over the partial indexes)."""
        rows = await self._rows(query("queue_stats"), {})
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
        )

    # ----------------------------------------------------------- review

    async def state_counts(self) -> dict[JobState, int]:
        """Exact rows by state (every state present, 0 when empty)."""
        counts = dict.fromkeys(JobState, 0)
        for state, n in await self._rows(query("state_counts"), {}):
            counts[JobState(state)] = int(n)
        return counts

    async def oldest_failed(self) -> datetime | None:
        """When the oldest failed job failed, or None when none has."""
        rows = await self._rows(query("oldest_failed"), {})
        return rows[0][0] if rows else None

    async def list_jobs(
        self, state: JobState, *, limit: int = 50, since: datetime | None = None
    ) -> list[dict[str, Any]]:
        """Jobs in *state*, newest first, at most *limit*; *since* filters by finish time."""
        async with self._conn() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                query("list_jobs"), {"state": str(state), "limit": int(limit), "since": since}
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
                await cur.execute(query(name), params)
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
            query("retry_failed"), {"ids": None if ids is None else list(ids)}
        )
        return [r[0] for r in rows]
