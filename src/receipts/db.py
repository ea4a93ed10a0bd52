"""The connection seam: connection options, pools, direct connections, the LISTEN session.

Every connection the service opens is made here, with the same protections
(``application_name``, statement/lock/idle-in-transaction timeouts), and this
is the only module that catches psycopg's errors: :func:`translate` maps them
to :mod:`receipts.errors`, keeping the driver error as ``__cause__``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg
import psycopg.errors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from receipts.dsn import redact_dsn
from receipts.errors import (
    DatabaseUnavailable,
    QueueError,
    SchemaMissing,
    StatementTimeout,
    refuse_encoding,
)
from receipts.settings import Settings

CONNECT_TIMEOUT_SECONDS = 5
#: Added to the server's statement_timeout to make the client-side deadline.
DEADLINE_SLACK_SECONDS = 5.0
#: The roles RECEIPTS_SYNCHRONOUS_COMMIT applies to: their writes are the lease
#: protocol's, which redoes what a database crash undoes (docs/design.md §4),
#: and the LISTEN session's wake-up notifications (a lost one costs a poll).
#: Operator commands, the review page and migrations always commit durably.
ASYNC_COMMIT_ROLES = frozenset({"worker", "recover", "listen"})
#: Roles whose sessions use PostgreSQL's generic plan for every prepared statement
#: (``plan_cache_mode=force_generic_plan``): the worker's pool and its LISTEN session,
#: whose few statements run many times a second. psycopg prepares a statement on its
#: fifth run; the server's plan cache then keeps planning a custom plan on every call
#: when it judges that cheaper than the generic one, as it does for statements whose
#: index conditions all take parameters. Measured on PostgreSQL 15: the waker's probe
#: (every 70 ms) was planned afresh 34 times of 34, 1.8 ms a probe against 0.6 ms
#: with the generic plan; the ack 25 of 25. At 50 orders/s that planning was most of
#: the waker session's database CPU (about 360 µs per order) and much of the workers'.
#: Each statement's generic plan is the index scans its comment names (``EXPLAIN
#: (GENERIC_PLAN)``; ``tests/integration/test_wakeups.py`` holds the probe to it): the
#: claim's batch size is a literal, not a parameter, so that its generic plan stays on
#: the ready index (docs/design.md §10). Recovery, operator and checkout sessions
#: keep the server's choice: their statements run once a minute or once an order.
GENERIC_PLAN_ROLES = frozenset({"worker", "listen"})
#: How long one of the pool's reconnection attempts keeps retrying, seconds.
#: psycopg_pool doubles the wait between tries (1, 2, 4 s…) with no cap but
#: this window, so after a long outage its next try could be minutes away (a
#: worker took 32–65 s to be ready after an 11-minute outage). With 4 s the
#: tries come 1–2 s apart; when a window runs out, the next borrow that finds
#: no connection starts a new one at once (docs/design.md §4, "Database outage").
RECONNECT_WINDOW_SECONDS = 4.0


def translate(exc: BaseException) -> QueueError:
    """Map a driver or pool error to the package's errors (the one choke point).

    Returns :class:`SchemaMissing` for a missing table,
    :class:`StatementTimeout` for a statement the server stopped
    (``statement_timeout``, ``lock_timeout``, a cancel: the database is up,
    the statement was slow), :class:`DatabaseUnavailable` for other
    connection-level failures and pool timeouts, :class:`QueueError`
    otherwise (a missing right names the ``--print-grants`` command);
    messages are redacted. Callers
    ``raise translate(exc) from exc`` so the driver error stays ``__cause__``.
    """
    if isinstance(exc, psycopg.errors.UndefinedTable):
        # The server's words name the schema-qualified table that was looked up.
        what = exc.diag.message_primary or "a receipts table does not exist"
        return SchemaMissing(
            f"{what}; run `receipts migrate` first, or set RECEIPTS_DATABASE_SCHEMA to the "
            "schema that holds the receipts tables"
        )
    if isinstance(exc, psycopg.errors.QueryCanceled | psycopg.errors.LockNotAvailable):
        first = (exc.diag.message_primary or type(exc).__name__).strip()
        return StatementTimeout(f"statement stopped by the server: {redact_dsn(first)}")
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        what = exc.diag.message_primary or "permission denied"
        return QueueError(
            f"{what}: the database role lacks a right receipts needs; apply what "
            "`receipts migrate --print-grants KIND=ROLE` prints for its kind")
    if isinstance(exc, PoolTimeout | psycopg.OperationalError | psycopg.InterfaceError):
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return DatabaseUnavailable(f"database unavailable: {redact_dsn(first)}")
    return QueueError(redact_dsn(f"{type(exc).__name__}: {exc}"))


def connection_kwargs(settings: Settings, role: str) -> dict[str, Any]:
    """libpq/psycopg connection options for a *role* (``worker``, ``recover``, …).

    Sets ``application_name`` and, unless behind PgBouncer transaction pooling
    (which refuses startup options), ``statement_timeout``, ``lock_timeout``
    and ``idle_in_transaction_session_timeout`` from the settings (seconds →
    milliseconds), ``synchronous_commit`` for the roles in ``ASYNC_COMMIT_ROLES``
    and ``plan_cache_mode`` for those in ``GENERIC_PLAN_ROLES``, added to any
    ``options`` the DSN already carries.
    Behind PgBouncer set them on the role (``ALTER ROLE … SET``).
    """
    kwargs: dict[str, Any] = {
        "application_name": f"{settings.application_name}-{role}",
        "autocommit": True,
        "connect_timeout": CONNECT_TIMEOUT_SECONDS,
        # Our text is UTF-8 whatever the database's encoding (see check_encoding).
        "client_encoding": "UTF8",
        # A peer that vanished without a RST (a half-open connection) is found by
        # keepalives on an idle connection and by tcp_user_timeout on a busy one;
        # a peer that still ACKs but never answers is found by statement_deadline.
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": round(statement_deadline(settings) * 1000),
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
        if role in ASYNC_COMMIT_ROLES:
            ours += f" -c synchronous_commit={settings.synchronous_commit}"
        if role in GENERIC_PLAN_ROLES:
            ours += " -c plan_cache_mode=force_generic_plan"
        # A keyword argument replaces the DSN's own `options` (say, a
        # search_path): keep those and add ours.
        theirs = conninfo_to_dict(settings.dsn).get("options")
        kwargs["options"] = f"{theirs} {ours}" if theirs else ours
    return kwargs


def commits_asynchronously(settings: Settings, role: str) -> bool:
    """Whether *role*'s sessions commit without waiting for the WAL flush.

    True for the roles of ``ASYNC_COMMIT_ROLES`` with ``RECEIPTS_SYNCHRONOUS_COMMIT=off``
    on a direct connection. Behind PgBouncer the setting is the database
    role's, unknown here (and the connection a worker holds is not the
    server's, so the completer's durability proof would not hold): False.
    """
    return (not settings.pgbouncer and role in ASYNC_COMMIT_ROLES
            and settings.synchronous_commit == "off")


def make_pool(settings: Settings, role: str, *, max_size: int | None = None) -> AsyncConnectionPool:
    """An unopened pool of autocommit connections (``await pool.open()`` before use).

    *max_size* defaults to ``settings.pool_max_size``. Connections are borrowed
    for one statement at a time. Never raises for an unreachable database:
    the pool keeps reconnecting while borrowers wait (tries 1–2 s apart, in
    windows of ``RECONNECT_WINDOW_SECONDS``) and borrowers get
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
        reconnect_timeout=RECONNECT_WINDOW_SECONDS,
        max_idle=300.0,
        name=f"receipts-{role}",
    )


def statement_deadline(settings: Settings) -> float:
    """The client-side deadline of one round trip, seconds.

    The server's ``statement_timeout`` plus ``DEADLINE_SLACK_SECONDS``: a
    server that is alive ends a slow statement itself first; a connection
    that has not answered by then is half-open or wedged, and is discarded.
    """
    return settings.statement_timeout_seconds + DEADLINE_SLACK_SECONDS


@asynccontextmanager
async def borrow(pool: AsyncConnectionPool, deadline_seconds: float | None = None
                 ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """Borrow one pooled connection for one statement; driver errors are translated.

    With *deadline_seconds*, the whole block (waiting for a connection, the
    round trip, reading rows) must end in time: otherwise the statement is
    cancelled, the connection closed by the driver (so the pool discards it)
    and :class:`DatabaseUnavailable` raised; the statement's effect is
    unknown, as after any broken connection.
    """
    try:
        async with asyncio.timeout(deadline_seconds), pool.connection() as conn:
            yield conn
    except QueueError:
        raise
    except TimeoutError as exc:
        raise DatabaseUnavailable(
            f"database unavailable: no answer within {deadline_seconds:g}s "
            "(connection discarded)") from exc
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

    Raises :class:`DatabaseUnavailable` instead of a pool timeout after 5 s,
    and :class:`~receipts.errors.UnusableDatabase` for a database receipts
    refuses (:func:`check_encoding`).
    """
    conn = await connect(settings, role)
    try:
        check_encoding(conn)
    finally:
        await conn.close()


class ListenSession:
    """One dedicated session-level connection: LISTEN, notifications, single statements.

    The worker's wake-ups live on it (:mod:`receipts.waker`): it LISTENs, and
    the pod elected as the fleet's waker also holds a session advisory lock
    and runs its probe on it, so it must be a real session (never through a
    transaction-pooling PgBouncer). Every round trip has the statement
    deadline (:func:`statement_deadline`); every failure is raised as
    :class:`DatabaseUnavailable` or another :class:`QueueError`, and the
    session is then unusable (close it and open another).

    Use :meth:`open`; ``async with`` closes it.
    """

    def __init__(self, conn: psycopg.AsyncConnection[Any], deadline_seconds: float) -> None:
        self.conn = conn
        self.deadline_seconds = deadline_seconds

    @classmethod
    async def open(cls, settings: Settings) -> ListenSession:
        """Connect (role ``listen``); raises :class:`DatabaseUnavailable`."""
        return cls(await connect(settings, "listen"), statement_deadline(settings))

    async def __aenter__(self) -> ListenSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection (the server then ends the session and frees its locks)."""
        with contextlib.suppress(psycopg.Error):
            await self.conn.close()

    async def listen(self, *channels: str) -> None:
        """LISTEN on each of *channels* (plain identifiers, never user input)."""
        for channel in channels:
            await self.fetchone(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    async def fetchone(self, statement: sql.SQL | sql.Composed,
                       params: dict[str, Any] | None = None
                       ) -> tuple[Any, ...] | None:
        """Run one autocommit statement; its first row, or None (no row, or no result)."""
        try:
            async with asyncio.timeout(self.deadline_seconds):
                cur = await self.conn.execute(statement, params)
                return await cur.fetchone() if cur.rownumber is not None else None
        except TimeoutError as exc:
            raise DatabaseUnavailable(
                f"database unavailable: LISTEN session silent for {self.deadline_seconds:g}s"
            ) from exc
        except psycopg.Error as exc:
            raise translate(exc) from exc

    async def fetchall(self, statement: sql.SQL | sql.Composed,
                       params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Run one autocommit statement; all its rows (errors as :meth:`fetchone`)."""
        try:
            async with asyncio.timeout(self.deadline_seconds):
                cur = await self.conn.execute(statement, params)
                return await cur.fetchall() if cur.rownumber is not None else []
        except TimeoutError as exc:
            raise DatabaseUnavailable(
                f"database unavailable: LISTEN session silent for {self.deadline_seconds:g}s"
            ) from exc
        except psycopg.Error as exc:
            raise translate(exc) from exc

    async def notifications(self, timeout_seconds: float) -> list[tuple[str, str]]:
        """(channel, payload) of the notifications that arrive within *timeout_seconds*.

        Returns as soon as some have arrived (those received meanwhile by a
        statement of this session first), or an empty list when none did.
        Raises :class:`QueueError` when the connection fails.
        """
        try:
            return [(n.channel, n.payload) async for n in self.conn.notifies(
                timeout=max(0.0, timeout_seconds), stop_after=1)]
        except psycopg.Error as exc:
            raise translate(exc) from exc


#: Python codecs for the server encodings that cannot store every character.
_NARROW_ENCODINGS = {"LATIN1": "latin-1", "LATIN9": "iso8859-15", "WIN1252": "cp1252",
                     "WIN1250": "cp1250", "WIN1251": "cp1251", "KOI8R": "koi8-r"}


def storable(conn: psycopg.AsyncConnection[Any], text: str) -> str:
    """*text* as the connected database can store it (unstorable characters become ``?``).

    A provider's error message may hold any character; a LATIN1 database
    refuses most of them, and a failed write would strand the job until its
    lease expired. UTF8 databases (the normal case) get *text* unchanged.
    """
    codec = _NARROW_ENCODINGS.get(conn.info.parameter_status("server_encoding") or "")
    if codec is None:
        return text
    return text.encode(codec, "replace").decode(codec)


def check_encoding(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Refuse a database that cannot keep our text apart from bytes (no round trip).

    Raises :class:`~receipts.errors.UnusableDatabase` naming the encoding for
    ``SQL_ASCII`` (:func:`receipts.errors.refuse_encoding`: it stores bytes
    without checking them, so order ids and errors written by other clients
    could be anything). Narrow encodings such as LATIN1 are accepted: error
    texts are stored lossily (see :func:`storable`).
    """
    refuse_encoding(conn.info.dbname, conn.info.parameter_status("server_encoding"))


@contextmanager
def transaction(settings: Settings, role: str) -> Iterator[psycopg.Connection[Any]]:
    """A blocking connection inside one transaction, committed on a clean exit.

    For one-shot commands (``receipts enqueue``). Driver errors, including
    the connection attempt's, are raised as :mod:`receipts.errors`; a database
    receipts refuses raises :class:`~receipts.errors.UnusableDatabase` before
    anything is written (:func:`check_encoding`).
    """
    kwargs = connection_kwargs(settings, role) | {"autocommit": False}
    try:
        with psycopg.connect(settings.dsn, **kwargs) as conn:
            check_encoding(conn)
            with conn.transaction():
                yield conn
    except psycopg.Error as exc:
        raise translate(exc) from exc
