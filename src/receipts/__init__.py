"""receipts: deliver order receipts from a PostgreSQL job queue.

The orders service calls :func:`enqueue` (or :func:`enqueue_many`, and their
async twins) inside its own transaction; workers (``receipts worker``) claim,
deliver and ack with a lease token. ``import receipts`` loads psycopg and the
statement loader only — nothing of the worker's stack (the ``worker`` extra).
"""

from receipts.enqueue import (
    AutocommitWarning,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)
from receipts.errors import InvalidOrderId

__all__ = [
    "AutocommitWarning", "InvalidOrderId", "__version__", "enqueue", "enqueue_async",
    "enqueue_many", "enqueue_many_async",
]
#: The package version (the distribution ``receipts-queue`` reads it from here).
__version__ = "0.3.0"
