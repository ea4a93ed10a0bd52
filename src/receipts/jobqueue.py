"""The queue: one method per named statement in ``sql/queries.sql``.

This module is the only place that talks SQL to ``receipt_jobs`` and the only
place that translates driver errors (into :class:`DatabaseUnavailable`,
:class:`SchemaMissing` and :class:`QueueError`, keeping ``__cause__``).

Every statement is one short autocommit transaction: a pool connection is
borrowed for exactly one statement and returned (docs/design.md §4), never held while a
provider is called. The lease protocol (docs/design.md §2):

* claim sets ``running``, ``attempts + 1``, a fresh random token and
  ``lease_until = statement_timestamp() + lease``;
* ack, reschedule and confirm are guarded by id + token + unexpired lease, so a
  stale worker can never complete or reschedule a newer attempt;
* recovery returns expired leases to ``ready`` (or ``failed`` at max attempts).
"""

from __future__ import annotations

import contextlib
import enum
import re
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from importlib import resources
from typing import Any

import psycopg
import psycopg.errors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from receipts.settings import Settings, redact_dsn

ORDER_ID_MAX_LENGTH = 200
NOTIFY_CHANNEL = "receipts_ready"


class JobState(enum.StrEnum):
    """The four states of a receipt job, spelled as in the table's CHECK."""

    READY = "ready"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class QueueError(Exception):
    """A queue operation failed for a reason other than availability."""


class DatabaseUnavailable(QueueError):
    """The database could not be reached or the connection broke mid-statement.

    The statement's effect is unknown; callers retry later. A claim that
    raises this delivers nothing: whatever it may have committed is left to
    lease expiry and recovery (the "uncertain commit" rule, docs/design.md §2).
    """


class SchemaMissing(QueueError):
    """``receipt_jobs`` does not exist: run ``receipts migrate`` first."""


class InvalidOrderId(ValueError):
    """An order id the queue refuses (empty, too long, control characters)."""


@dataclass(frozen=True, slots=True)
class Job:
    """One claimed attempt.

    Attributes:
        id: the job's UUID.
        order_id: the order it delivers a receipt for.
        token: this attempt's lease token (new on every claim).
        attempt: 1-based attempt number (the row's ``attempts`` after claim).
    """

    id: uuid.UUID
    order_id: str
    token: uuid.UUID
    attempt: int

    @property
    def idempotency_key(self) -> str:
        """``receipt:<order_id>``: the same on every attempt (docs/design.md §3)."""
        return f"receipt:{self.order_id}"

    @property
    def token_prefix(self) -> str:
        """First 8 hex characters of the token: enough to correlate logs."""
        return self.token.hex[:8]


@dataclass(frozen=True, slots=True)
class QueueStats:
    """A snapshot of the queue read by :meth:`JobQueue.queue_stats`.

    Counts are rows; ``done_estimate`` comes from table statistics, not a
    count. ``lag_seconds`` is the age of the oldest due ready job (0 when none);
    ``oldest_transaction_seconds`` the age of the oldest open transaction in
    the whole database (the xmin horizon that slows claims, docs/design.md §10).
    """

    ready_due: int
    ready: int
    running: int
    expired: int
    failed: int
    lag_seconds: float
    done_estimate: int
    dead_tuples: int
    oldest_transaction_seconds: float


@dataclass(frozen=True, slots=True)
class RecoveryBatch:
    """What one recovery batch did: leases expired back to ready / to failed."""

    to_ready: int
    to_failed: int


# --------------------------------------------------------------------------- SQL


@cache
def statements() -> dict[str, str]:
    """All named statements of ``sql/queries.sql`` keyed by name (loaded once)."""
    text = resources.files("receipts").joinpath("sql/queries.sql").read_text("utf-8")
    blocks: dict[str, str] = {}
    for chunk in re.split(r"^-- name: ", text, flags=re.M)[1:]:
        name, _, body = chunk.partition("\n")
        lines = [ln for ln in body.splitlines() if not ln.lstrip().startswith("--")]
        blocks[name.strip()] = "\n".join(lines).strip().rstrip(";")
    return blocks


@cache
def _query(name: str) -> sql.SQL:
    """The named statement as a composable, built once (ack and reschedule are hot)."""
    return sql.SQL(statements()[name])  # type: ignore[arg-type,unused-ignore]


@cache
def _claim_query(limit: int) -> sql.Composed:
    """The claim statement with *limit* as a literal (docs/design.md §10: no bind LIMIT)."""
    return sql.SQL(statements()["claim"]).format(limit=sql.Literal(limit))  # type: ignore[arg-type,unused-ignore]


# ------------------------------------------------------------------- error seam


def _translate(exc: BaseException) -> QueueError:
    """Map a driver/pool error to the queue's exceptions (the one choke point)."""
    if isinstance(exc, psycopg.errors.UndefinedTable):
        return SchemaMissing(
            "table receipt_jobs does not exist; run `receipts migrate` first"
        )
    if isinstance(exc, PoolTimeout | psycopg.OperationalError | psycopg.InterfaceError):
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return DatabaseUnavailable(f"database unavailable: {redact_dsn(first)}")
    return QueueError(redact_dsn(f"{type(exc).__name__}: {exc}"))


def check_order_id(order_id: str) -> str:
    """Validate an order id for the queue and the ``Idempotency-Key`` header.

    Returns the id unchanged. Raises :class:`InvalidOrderId` when it is empty,
    longer than ``ORDER_ID_MAX_LENGTH`` characters, not valid UTF-8 text,
    contains control characters (NUL, CR/LF, …) that neither PostgreSQL text
    nor an HTTP header can carry, or starts or ends with whitespace (which an
    HTTP header value cannot carry either).
    """
    if not isinstance(order_id, str) or not order_id:
        raise InvalidOrderId("order id must be a non-empty string")
    if len(order_id) > ORDER_ID_MAX_LENGTH:
        raise InvalidOrderId(f"order id is longer than {ORDER_ID_MAX_LENGTH} characters")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in order_id):
        raise InvalidOrderId("order id contains control characters")
    if order_id != order_id.strip():
        raise InvalidOrderId(
            "order id starts or ends with whitespace (it could not be sent as an HTTP header)"
        )
    try:
        order_id.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidOrderId("order id is not valid UTF-8 text") from None
    return order_id


# ------------------------------------------------------------------ enqueue API


def enqueue(conn: psycopg.Connection[Any], order_id: str, *, notify: bool = True) -> bool:
    """Enqueue the receipt job of *order_id* inside the caller's transaction.

    The orders service calls this on the connection that saves the order,
    before it commits: the job becomes durable with the order, or not at all.
    Nothing is committed here. With *notify*, listening workers are woken when
    that transaction commits.

    Returns True when a job was created, False when the order already had one
    (``ON CONFLICT (order_id) DO NOTHING``). Raises :class:`InvalidOrderId`,
    and psycopg errors as the caller's own statements would.
    """
    check_order_id(order_id)
    cur = conn.execute(_query("enqueue"), {"id": uuid.uuid4(), "order_id": order_id})
    created = cur.fetchone() is not None
    if created and notify:
        conn.execute(_query("notify_ready"))
    return created


async def enqueue_async(
    conn: psycopg.AsyncConnection[Any], order_id: str, *, notify: bool = True
) -> bool:
    """Async twin of :func:`enqueue` for asyncio order services (same contract)."""
    check_order_id(order_id)
    cur = await conn.execute(_query("enqueue"), {"id": uuid.uuid4(), "order_id": order_id})
    created = await cur.fetchone() is not None
    if created and notify:
        await conn.execute(_query("notify_ready"))
    return created


# ------------------------------------------------------------------- the pool


def connection_kwargs(settings: Settings, role: str) -> dict[str, Any]:
    """libpq/psycopg connection options for a *role* (``worker``, ``recover``, …).

    Sets ``application_name`` and, unless behind PgBouncer transaction pooling
    (which refuses startup options), ``statement_timeout``, ``lock_timeout``
    and ``idle_in_transaction_session_timeout`` from the settings (seconds →
    milliseconds), added to any ``options`` the DSN already carries. Behind
    PgBouncer set them on the role (``ALTER ROLE … SET``).
    """
    kwargs: dict[str, Any] = {
        "application_name": f"{settings.application_name}-{role}",
        "autocommit": True,
        "connect_timeout": 5,
    }
    if settings.pgbouncer:
        kwargs["prepare_threshold"] = None
    else:
        ms = {
            "statement_timeout": settings.statement_timeout_seconds,
            "lock_timeout": settings.lock_timeout_seconds,
            "idle_in_transaction_session_timeout": settings.idle_in_transaction_timeout_seconds,
        }
        ours = " ".join(f"-c {k}={round(v * 1000)}" for k, v in ms.items())
        # A keyword argument replaces the DSN's own `options` (say, a
        # search_path): keep those and add ours.
        theirs = conninfo_to_dict(settings.dsn).get("options")
        kwargs["options"] = f"{theirs} {ours}" if theirs else ours
    return kwargs


def make_pool(settings: Settings, role: str, *, max_size: int | None = None) -> AsyncConnectionPool:
    """An unopened pool of autocommit connections (``await pool.open()`` before use).

    *max_size* defaults to ``settings.pool_max_size``. Connections are borrowed
    for one statement at a time. Never raises for an unreachable database:
    the pool keeps reconnecting in the background and borrowers get
    :class:`DatabaseUnavailable` after a short wait.
    """
    size = max_size or settings.pool_max_size
    return AsyncConnectionPool(
        settings.dsn,
        min_size=1,
        max_size=size,
        kwargs=connection_kwargs(settings, role),
        open=False,
        timeout=5.0,
        reconnect_timeout=24 * 3600.0,
        max_idle=300.0,
        name=f"receipts-{role}",
    )


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
        try:
            async with self.pool.connection() as conn:
                yield conn
        except QueueError:
            raise
        except (psycopg.Error, PoolTimeout) as exc:
            raise _translate(exc) from exc

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
            _claim_query(limit),
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
            _query("ack"), {"ids": [p[0] for p in pairs], "tokens": [p[1] for p in pairs]}
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
            _query("reschedule"),
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

    async def confirm_lease(self, job: Job) -> bool:
        """True while *job*'s token still owns its row under an unexpired lease."""
        return bool(await self._rows(_query("confirm_lease"), {"id": job.id, "token": job.token}))

    async def recover_expired(self, *, batch: int, delay_seconds: float) -> RecoveryBatch:
        """Return one batch (≤ *batch*, ≤ 100) of expired leases to ready or failed.

        Ready rows become due after *delay_seconds* × U(0.5, 1) (jittered so a
        crashed pod's jobs do not come back in one burst).
        """
        rows = await self._rows(
            _query("recover_expired"),
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
            _query("fail_exhausted"), {"batch": int(batch), "max_attempts": self.max_attempts}
        )
        return len(rows)

    async def prune(self, *, retention_seconds: float, batch: int) -> int:
        """Delete one batch of done/failed rows finished before the retention window."""
        rows = await self._rows(
            _query("prune"), {"retention_seconds": float(retention_seconds), "batch": int(batch)}
        )
        return len(rows)

    async def queue_stats(self) -> QueueStats:
        """Read the queue gauges (one statement over the partial indexes)."""
        rows = await self._rows(_query("queue_stats"), {})
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
            oldest_transaction_seconds=float(r[8]),
        )

    # ----------------------------------------------------------- review

    async def state_counts(self) -> dict[JobState, int]:
        """Exact rows by state (every state present, 0 when empty)."""
        counts = dict.fromkeys(JobState, 0)
        for state, n in await self._rows(_query("state_counts"), {}):
            counts[JobState(state)] = int(n)
        return counts

    async def oldest_failed(self) -> datetime | None:
        """When the oldest failed job failed, or None when none has."""
        rows = await self._rows(_query("oldest_failed"), {})
        return rows[0][0] if rows else None

    async def list_jobs(
        self, state: JobState, *, limit: int = 50, since: datetime | None = None
    ) -> list[dict[str, Any]]:
        """Jobs in *state*, newest first, at most *limit*; *since* filters by finish time."""
        async with self._conn() as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                _query("list_jobs"), {"state": str(state), "limit": int(limit), "since": since}
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
                await cur.execute(_query(name), params)
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
            _query("retry_failed"), {"ids": None if ids is None else list(ids)}
        )
        return [r[0] for r in rows]
