"""The orders team's API: enqueue a receipt job inside the order's transaction.

This is the light part of the package: ``import receipts`` loads this module,
psycopg and the statement loader, nothing of the worker's stack.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

from receipts.errors import InvalidOrderId
from receipts.statements import query

ORDER_ID_MAX_LENGTH = 200
#: The LISTEN/NOTIFY channel that wakes idle workers after an enqueue commits.
NOTIFY_CHANNEL = "receipts_ready"


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
    cur = conn.execute(query("enqueue"), {"id": uuid.uuid4(), "order_id": order_id})
    created = cur.fetchone() is not None
    if created and notify:
        conn.execute(query("notify_ready"), {"channel": NOTIFY_CHANNEL})
    return created


async def enqueue_async(
    conn: psycopg.AsyncConnection[Any], order_id: str, *, notify: bool = True
) -> bool:
    """Async twin of :func:`enqueue` for asyncio order services (same contract)."""
    check_order_id(order_id)
    cur = await conn.execute(query("enqueue"), {"id": uuid.uuid4(), "order_id": order_id})
    created = await cur.fetchone() is not None
    if created and notify:
        await conn.execute(query("notify_ready"), {"channel": NOTIFY_CHANNEL})
    return created
