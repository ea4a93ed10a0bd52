"""The connection seam: connection options, pools, direct connections, LISTEN.

Every connection the service opens is made here, with the same protections
(``application_name``, statement/lock/idle-in-transaction timeouts), and this
is the only module that catches psycopg's errors: :func:`translate` maps them
to :mod:`receipts.errors`, keeping the driver error as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg
import psycopg.errors
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from receipts.enqueue import NOTIFY_CHANNEL
from receipts.errors import DatabaseUnavailable, QueueError, SchemaMissing
from receipts.settings import Settings, redact_dsn


def translate(exc: BaseException) -> QueueError:
    """Map a driver or pool error to the package's errors (the one choke point).

    Returns :class:`SchemaMissing` for a missing table,
    :class:`DatabaseUnavailable` for connection-level failures and pool
    timeouts, :class:`QueueError` otherwise; messages are redacted. Callers
    ``raise translate(exc) from exc`` so the driver error stays ``__cause__``.
    """
    if isinstance(exc, psycopg.errors.UndefinedTable):
        return SchemaMissing(
            "table receipt_jobs does not exist; run `receipts migrate` first"
        )
    if isinstance(exc, PoolTimeout | psycopg.OperationalError | psycopg.InterfaceError):
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return DatabaseUnavailable(f"database unavailable: {redact_dsn(first)}")
    return QueueError(redact_dsn(f"{type(exc).__name__}: {exc}"))


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


@asynccontextmanager
async def borrow(pool: AsyncConnectionPool) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """Borrow one pooled connection for one statement; driver errors are translated."""
    try:
        async with pool.connection() as conn:
            yield conn
    except QueueError:
        raise
    except (psycopg.Error, PoolTimeout) as exc:
        raise translate(exc) from exc


async def connect(settings: Settings, role: str) -> psycopg.AsyncConnection[Any]:
    """Open one direct autocommit connection for *role* (fails fast, unlike a pool).

    Raises :class:`DatabaseUnavailable` (connection refused, bad password,
    unknown database, …; the message is redacted).
    """
    try:
        return await psycopg.AsyncConnection.connect(
            settings.dsn, **connection_kwargs(settings, role)
        )
    except psycopg.Error as exc:
        raise translate(exc) from exc


async def check_connection(settings: Settings, role: str) -> None:
    """Connect once and close, so a one-shot command fails fast with the real reason.

    Raises :class:`DatabaseUnavailable` instead of a pool timeout after 5 s.
    """
    conn = await connect(settings, role)
    await conn.close()


async def notifications(settings: Settings) -> AsyncIterator[None]:
    """LISTEN on the enqueue channel on a dedicated connection; yield per notification.

    Yields once right after LISTEN succeeds (anything enqueued while nobody
    listened) and once per notification. Raises :class:`DatabaseUnavailable`
    when the connection fails; the caller reconnects with backoff.
    """
    conn = await connect(settings, "listen")
    try:
        async with conn:
            await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            yield None
            async for _ in conn.notifies():
                yield None
    except psycopg.Error as exc:
        raise translate(exc) from exc


@contextmanager
def transaction(settings: Settings, role: str) -> Iterator[psycopg.Connection[Any]]:
    """A blocking connection inside one transaction, committed on a clean exit.

    For one-shot commands (``receipts enqueue``). Driver errors, including
    the connection attempt's, are raised as :mod:`receipts.errors`.
    """
    kwargs = connection_kwargs(settings, role) | {"autocommit": False}
    try:
        with psycopg.connect(settings.dsn, **kwargs) as conn, conn.transaction():
            yield conn
    except psycopg.Error as exc:
        raise translate(exc) from exc
