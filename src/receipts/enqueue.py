"""The orders team's API: enqueue receipt jobs inside the order's transaction.

This is the light part of the package: ``import receipts`` loads this module,
psycopg and the statement loader, nothing of the worker's stack.

Connections (:func:`psycopg_connection`, :func:`psycopg_connection_async`):
a psycopg 3 ``Connection`` / ``AsyncConnection``, or a SQLAlchemy 2 Core
``Connection`` / ORM ``Session`` (``AsyncConnection`` / ``AsyncSession`` for
the async twins) on the psycopg driver (``postgresql+psycopg://``). For
SQLAlchemy the statement runs on its driver connection
(``conn.connection.driver_connection``) inside SQLAlchemy's transaction,
which is begun first when it is not yet (as SQLAlchemy's autobegin would), so
the job commits or rolls back with whatever the session commits.

Order ids (:func:`order_id_text`): ``str``, ``int`` (stored as its decimal
text, so ``42`` and ``"42"`` are the same order) or ``uuid.UUID`` (stored as
its canonical lower-case hyphenated text); anything else is refused with
:class:`InvalidOrderId`.

Autocommit: enqueueing on a connection in autocommit mode outside a
transaction block commits the job at once, on its own, before (or without)
the order. That is correct for a backfill script and a bug in the order flow,
so it is allowed with an :class:`AutocommitWarning` (shown once per calling
line); ``warnings.simplefilter("error", AutocommitWarning)`` makes it an error.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
import warnings
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import pq

from receipts.errors import InvalidOrderId
from receipts.statements import query
from receipts.tracing import current_traceparent

ORDER_ID_MAX_LENGTH = 200
#: The LISTEN/NOTIFY channel on which idle workers are woken: by the fleet's
#: waker (receipts.waker), and by enqueuers of receipts 0.2.0, which notified
#: inside the order's transaction. This API sends nothing on it.
NOTIFY_CHANNEL = "receipts_ready"
#: What :func:`order_id_text` accepts, for error messages and docs.
ACCEPTED_ORDER_ID_TYPES = "str, int or uuid.UUID"

# C0 controls and DEL: neither PostgreSQL text (NUL) nor an HTTP header (CR/LF) carries them.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: Joins the order ids into the statement's one text parameter (split again by
#: the server, ``chr(31)``): U+001F, a control character, so no valid order id
#: contains it.
_SEPARATOR = "\x1f"
_CONTROL_BYTES = bytes(range(0x20)) + b"\x7f"
#: Exact types whose ``str()`` is the stored text (:func:`order_id_text`; not bool).
_TEXT_TYPES = {str, int, uuid.UUID}
#: The low 62 bits of a job id: the statement's random start plus the row's
#: 1-based position in the call (``enqueue`` in sql/enqueue.sql).
_ID_FIELD = (1 << 62) - 1

OrderId = str | int | uuid.UUID


#: Why ``notify=`` is ignored (the :class:`DeprecationWarning` callers get).
_NOTIFY_IGNORED = (
    "receipts: enqueue(..., notify=...) is deprecated and ignored: the enqueue no longer "
    "notifies inside your transaction (a transaction with a notification holds one "
    "instance-wide lock through its commit's WAL flush, which serialised every checkout); "
    "the workers' elected waker wakes them within ~50 ms. Drop the argument."
)


class AutocommitWarning(UserWarning):
    """A job was enqueued on an autocommit connection outside a transaction block.

    The job committed on its own, not atomically with the order. Turn it into
    an error with ``warnings.simplefilter("error", AutocommitWarning)``.
    """


def check_order_id(order_id: str) -> str:
    """Validate an order id (text) for the queue and the ``Idempotency-Key`` header.

    Returns the id unchanged. Raises :class:`InvalidOrderId` when it is not a
    ``str`` or empty, longer than ``ORDER_ID_MAX_LENGTH`` characters, not
    valid UTF-8 text (lone surrogates), contains control characters (NUL,
    CR/LF, …) that neither PostgreSQL text nor an HTTP header can carry, or
    starts or ends with whitespace (``str.isspace``; an HTTP header value
    cannot carry it either). The SQL function ``receipts_enqueue`` (migration
    0004) applies the same rules.
    """
    if not isinstance(order_id, str):
        raise InvalidOrderId(
            f"order id must be {ACCEPTED_ORDER_ID_TYPES}, not {type(order_id).__name__}"
        )
    if not order_id:
        raise InvalidOrderId("order id must be a non-empty string")
    if len(order_id) > ORDER_ID_MAX_LENGTH:
        raise InvalidOrderId(f"order id is longer than {ORDER_ID_MAX_LENGTH} characters")
    if _CONTROL.search(order_id):
        raise InvalidOrderId("order id contains control characters")
    if order_id[0].isspace() or order_id[-1].isspace():
        raise InvalidOrderId(
            "order id starts or ends with whitespace (it could not be sent as an HTTP header)"
        )
    if not order_id.isascii():
        try:
            order_id.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidOrderId("order id is not valid UTF-8 text") from None
    return order_id


def order_id_text(order_id: object) -> str:
    """The stored text of an order id: a checked ``str``, an ``int``'s or ``UUID``'s text.

    ``int`` → decimal (``42`` → ``"42"``; ``bool`` is refused), ``uuid.UUID``
    → ``str(uuid)`` (lower-case, hyphenated). Raises :class:`InvalidOrderId`
    for any other type (the message names the accepted ones) and for text
    :func:`check_order_id` refuses.
    """
    if isinstance(order_id, str):
        return check_order_id(order_id)
    if isinstance(order_id, uuid.UUID):
        return str(order_id)
    if isinstance(order_id, int) and not isinstance(order_id, bool):
        try:
            text = str(order_id)
        except ValueError:  # more digits than str() converts (sys.get_int_max_str_digits)
            raise InvalidOrderId(
                f"order id is longer than {ORDER_ID_MAX_LENGTH} characters") from None
        return check_order_id(text)
    raise InvalidOrderId(
        f"order id must be {ACCEPTED_ORDER_ID_TYPES}, not {type(order_id).__name__}"
    )


def _joined_order_ids(order_ids: Iterable[object]) -> tuple[int, str]:
    """(how many, their texts joined by :data:`_SEPARATOR`) of checked *order_ids*.

    Each id is :func:`order_id_text` of it; the first bad id's error is raised,
    its message prefixed with the id's position (``order_ids[3]: order id
    contains control characters``), never with the id itself.
    The rules of :func:`check_order_id` are checked over the whole batch by
    str and bytes methods that loop in C (faster than one by one: bench/README.md);
    when any of them fails, or an
    id is not an exact ``str``, ``int`` or ``UUID``, the ids are checked one
    by one again, so the error raised is still the one of the first bad id.
    """
    ids = list(order_ids)
    texts: list[Any] | None = None
    types = set(map(type, ids))
    if types <= {str}:
        texts = ids
    elif types <= _TEXT_TYPES:
        with contextlib.suppress(ValueError):  # an int too long for str(): raised again below
            texts = [o if type(o) is str else str(o) for o in ids]
    if texts and "" not in texts and max(map(len, texts)) <= ORDER_ID_MAX_LENGTH \
            and list(map(str.strip, texts)) == texts:  # no leading or trailing whitespace
        joined = _SEPARATOR.join(texts)
        try:
            encoded = joined.encode("utf-8")  # lone surrogates raise
        except UnicodeEncodeError:
            pass
        else:
            # A control character is one byte in UTF-8 (no multi-byte sequence has one):
            # the separators must be the only ones.
            if len(encoded) - len(encoded.translate(None, _CONTROL_BYTES)) == len(texts) - 1:
                return len(texts), joined
    texts = []
    for position, order_id in enumerate(ids):
        try:
            texts.append(order_id_text(order_id))
        except InvalidOrderId as exc:
            # The position, not the id: a bad id may be huge or carry control characters.
            raise InvalidOrderId(f"order_ids[{position}]: {exc}") from None
    return len(texts), _SEPARATOR.join(texts)


# ------------------------------------------------------------------ connections


def _is_sqlalchemy(conn: object) -> bool:
    return type(conn).__module__.startswith("sqlalchemy.")


def _wrong_driver(driver: object) -> TypeError:
    return TypeError(
        "receipts enqueues through psycopg 3; this SQLAlchemy engine uses "
        f"{type(driver).__module__}.{type(driver).__name__} "
        "(use a postgresql+psycopg:// URL)"
    )


def _unsupported(conn: object, wanted: str) -> TypeError:
    return TypeError(
        f"{wanted} needs a psycopg 3 connection or a SQLAlchemy connection or session "
        f"on the psycopg driver, not {type(conn).__module__}.{type(conn).__name__}"
    )


def psycopg_connection(conn: object) -> psycopg.Connection[Any]:
    """The blocking psycopg connection behind *conn*, inside the caller's transaction.

    *conn* is a ``psycopg.Connection``, a SQLAlchemy ``Connection`` or ORM
    ``Session`` (also ``scoped_session``) on the psycopg driver; for
    SQLAlchemy its transaction is begun when it is not yet. Raises
    ``TypeError`` for anything else, naming what is accepted (an async
    connection: use the ``*_async`` twin).
    """
    if isinstance(conn, psycopg.Connection):
        return conn
    if isinstance(conn, psycopg.AsyncConnection):
        raise TypeError("an AsyncConnection needs enqueue_async / enqueue_many_async")
    if _is_sqlalchemy(conn):
        from sqlalchemy.engine import Connection

        if not isinstance(conn, Connection):
            from sqlalchemy.orm import Session, scoped_session

            if isinstance(conn, Session | scoped_session):
                conn = conn.connection()  # begins the session's transaction
            elif ".asyncio" in type(conn).__module__:
                raise TypeError(f"{type(conn).__name__} needs enqueue_async / enqueue_many_async")
        if not isinstance(conn, Connection):
            raise _unsupported(conn, "enqueue")
        if not conn.in_transaction():
            conn.begin()
        driver = conn.connection.driver_connection
        if not isinstance(driver, psycopg.Connection):
            raise _wrong_driver(driver)
        return driver
    raise _unsupported(conn, "enqueue")


async def psycopg_connection_async(conn: object) -> psycopg.AsyncConnection[Any]:
    """The async twin of :func:`psycopg_connection`.

    *conn* is a ``psycopg.AsyncConnection`` or a SQLAlchemy ``AsyncConnection``
    / ``AsyncSession`` (also ``async_scoped_session``) on the psycopg driver.
    Raises ``TypeError`` otherwise (a blocking connection: use the sync API).
    """
    if isinstance(conn, psycopg.AsyncConnection):
        return conn
    if isinstance(conn, psycopg.Connection):
        raise TypeError("a blocking Connection needs enqueue / enqueue_many")
    if _is_sqlalchemy(conn):
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session

        if isinstance(conn, AsyncSession | async_scoped_session):
            conn = await conn.connection()  # begins the session's transaction
        if not isinstance(conn, AsyncConnection):
            raise _unsupported(conn, "enqueue_async")
        if not conn.in_transaction():
            await conn.begin()
        raw = await conn.get_raw_connection()
        driver = raw.driver_connection
        if not isinstance(driver, psycopg.AsyncConnection):
            raise _wrong_driver(driver)
        return driver
    raise _unsupported(conn, "enqueue_async")


# ------------------------------------------------------------------ enqueue API


def _check_run_at(run_at: datetime | None) -> None:
    """``TypeError``/``ValueError`` unless *run_at* is None or a timezone-aware datetime."""
    if run_at is not None:
        if not isinstance(run_at, datetime):
            raise TypeError(f"run_at must be a datetime, not {type(run_at).__name__}")
        if run_at.tzinfo is None or run_at.utcoffset() is None:
            raise ValueError("run_at must be timezone-aware (a naive datetime is ambiguous)")


def _check_notify(notify: object) -> None:
    """Warn (``DeprecationWarning``, at the API's caller) when ``notify=`` was passed."""
    if notify is not None:
        # stacklevel: the caller of enqueue*, past this helper and the API function.
        warnings.warn(_NOTIFY_IGNORED, DeprecationWarning, stacklevel=3)


def new_job_id() -> uuid.UUID:
    """A fresh UUIDv7 (RFC 9562 §5.7): this machine's Unix time in ms, then 74 random bits.

    Time-ordered ids are inserted at the right edge of the primary key instead
    of scattering over it; ids made in the same millisecond are not ordered
    among themselves. Python 3.11 has no ``uuid.uuid7`` (3.14 has).
    """
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits: 12 for rand_a, 62 for rand_b
    return uuid.UUID(int=((millis & 0xFFFF_FFFF_FFFF) << 80) | (0x7 << 76)
                     | ((rand >> 62) & 0xFFF) << 64 | (0b10 << 62) | (rand & _ID_FIELD))


def _one_statement(order_id: object, run_at: datetime | None,
                   schema: str | None) -> tuple[Any, dict[str, Any]]:
    """(statement, parameters) of :func:`enqueue` for *order_id*; validated first."""
    params: dict[str, Any] = {"id": new_job_id(), "order_id": order_id_text(order_id),
                              "run_at": run_at}
    _check_run_at(run_at)
    traceparent = current_traceparent()
    if traceparent is None:
        return query("enqueue_one", schema), params
    params["traceparent"] = traceparent
    return query("enqueue_one_traced", schema), params


def _statement(
    order_ids: Iterable[object], run_at: datetime | None, schema: str | None
) -> tuple[int, Any, dict[str, Any]]:
    """(how many ids, statement, parameters) of one enqueue of *order_ids*; all validated first.

    The order ids travel as one text, joined by :data:`_SEPARATOR` (which no
    valid id contains) and split by the server: cheaper to send than a ``text[]``,
    which psycopg dumps element by element (bench/README.md).
    """
    if isinstance(order_ids, str | bytes):
        raise TypeError("order_ids must be an iterable of order ids, not one str or bytes")
    count, joined = _joined_order_ids(order_ids)
    _check_run_at(run_at)
    params: dict[str, Any] = {"order_ids": joined, "count": count, "run_at": run_at}
    traceparent = current_traceparent()
    if traceparent is None:
        return count, query("enqueue", schema), params
    params["traceparent"] = traceparent
    return count, query("enqueue_traced", schema), params


def _warn_if_autocommit(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    if conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE:
        # stacklevel: the caller of enqueue*, past this helper and the API function
        # (the async twins' frames are the same depth).
        warnings.warn(
            "receipts: enqueued on an autocommit connection outside a transaction: the job "
            "committed on its own, not atomically with the order (use conn.transaction())",
            AutocommitWarning, stacklevel=3,
        )


# The statements run with binary results (``binary=True``): the ids load from 16 bytes.


def _aligned(count: int, row: Sequence[Any] | None) -> list[uuid.UUID | None]:
    """Per input position (of *count*): the new job's id, or None (already queued or repeated).

    *row* is the statement's one row: the new ids in ascending order (an array,
    NULL when none is new) and the statement's random start. A job's id is
    that start plus its order's 1-based position in the call (the low 62
    bits, :data:`_ID_FIELD`), so ids ascend with the position: when every job
    is new the array is the answer as it stands, and otherwise each id says
    its own position.
    """
    if not row or not row[0]:
        return [None] * count
    ids, start = row
    if len(ids) == count:
        return ids  # type: ignore[no-any-return]  # psycopg loads an array as a list
    aligned: list[uuid.UUID | None] = [None] * count
    for job_id in ids:
        aligned[(job_id.int & _ID_FIELD) - start - 1] = job_id
    return aligned


def enqueue(
    conn: Any, order_id: OrderId, *, run_at: datetime | None = None,
    schema: str | None = None, notify: bool | None = None,
) -> uuid.UUID | None:
    """Enqueue the receipt job of *order_id* inside the caller's transaction.

    The orders service calls this on the connection that saves the order,
    before it commits: the job becomes durable with the order, or not at all.
    Nothing is committed here; one single-row ``INSERT`` is sent
    (``enqueue_one`` in sql/enqueue.sql), and no notification: idle workers
    are woken by their fleet's elected waker, off the order's commit path
    (docs/design.md, "The checkout's commit path").

    Args:
        conn: a ``psycopg.Connection`` or a SQLAlchemy ``Connection``/``Session``
            on psycopg (see the module docstring).
        order_id: ``str``, ``int`` or ``uuid.UUID`` (:func:`order_id_text`).
        run_at: when the job becomes due, a timezone-aware datetime; None
            (default) means the transaction's start (``now()``), i.e. at once.
        schema: the schema of the receipts tables (``RECEIPTS_DATABASE_SCHEMA``
            of the workers); None (default) leaves the table name to the
            connection's ``search_path``, as the order's own statements are.
            Name it when the connection may carry a foreign ``SET search_path``
            (a transaction-pooling PgBouncer). ``ValueError`` for a name that
            is not a lower-case identifier.
        notify: deprecated and ignored (a :class:`DeprecationWarning` when
            given): receipts 0.2.0 sent ``pg_notify`` in the caller's
            transaction when it was true, its default.

    Returns the new job's UUID (a UUIDv7, :func:`new_job_id`), or None when
    the order already had a job (``ON CONFLICT (order_id) DO NOTHING``).
    Raises :class:`InvalidOrderId` (before anything is sent, so the order
    transaction stays usable), ``TypeError`` for an unsupported connection,
    ``ValueError`` for a naive *run_at*, and psycopg errors as the caller's
    own statements would. Warns :class:`AutocommitWarning` on an autocommit
    connection outside a transaction.
    """
    _check_notify(notify)
    statement, params = _one_statement(order_id, run_at, schema)
    driver = psycopg_connection(conn)
    _warn_if_autocommit(driver)
    row = driver.execute(statement, params, binary=True).fetchone()
    return row[0] if row else None


def enqueue_many(
    conn: Any,
    order_ids: Iterable[OrderId],
    *,
    run_at: datetime | None = None,
    schema: str | None = None,
    notify: bool | None = None,
) -> list[uuid.UUID | None]:
    """Enqueue many orders' receipt jobs in ONE statement, inside the caller's transaction.

    Same arguments and rules as :func:`enqueue` (one *run_at* for all; no
    notification; *notify* deprecated and ignored); every order id is
    validated before anything is sent, and the first bad one raises
    :class:`InvalidOrderId` naming its position (``order_ids[3]: …``).

    Returns a list aligned with *order_ids*: at position ``i`` the new job's
    UUID for ``order_ids[i]``, or None when that order already had a job —
    queued before, or earlier in this same call (``42`` and ``"42"`` count as
    the same order). ``sum(x is not None for x in result)`` is the number of
    jobs created. An empty *order_ids* sends nothing and returns ``[]``.
    """
    _check_notify(notify)
    count, statement, params = _statement(order_ids, run_at, schema)
    if not count:
        return []
    driver = psycopg_connection(conn)
    _warn_if_autocommit(driver)
    return _aligned(count, driver.execute(statement, params, binary=True).fetchone())


async def enqueue_async(
    conn: Any, order_id: OrderId, *, run_at: datetime | None = None,
    schema: str | None = None, notify: bool | None = None,
) -> uuid.UUID | None:
    """Async twin of :func:`enqueue` (``psycopg.AsyncConnection``, SQLAlchemy async)."""
    _check_notify(notify)
    statement, params = _one_statement(order_id, run_at, schema)
    driver = await psycopg_connection_async(conn)
    _warn_if_autocommit(driver)
    cur = await driver.execute(statement, params, binary=True)
    row = await cur.fetchone()
    return row[0] if row else None


async def enqueue_many_async(
    conn: Any,
    order_ids: Iterable[OrderId],
    *,
    run_at: datetime | None = None,
    schema: str | None = None,
    notify: bool | None = None,
) -> list[uuid.UUID | None]:
    """Async twin of :func:`enqueue_many` (same single statement, same result)."""
    _check_notify(notify)
    count, statement, params = _statement(order_ids, run_at, schema)
    if not count:
        return []
    driver = await psycopg_connection_async(conn)
    _warn_if_autocommit(driver)
    cur = await driver.execute(statement, params, binary=True)
    return _aligned(count, await cur.fetchone())


__all__ = [
    "ACCEPTED_ORDER_ID_TYPES", "NOTIFY_CHANNEL", "ORDER_ID_MAX_LENGTH", "AutocommitWarning",
    "OrderId", "check_order_id", "enqueue", "enqueue_async", "enqueue_many",
    "enqueue_many_async", "new_job_id", "order_id_text", "psycopg_connection",
    "psycopg_connection_async",
]
