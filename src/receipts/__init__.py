"""receipts: deliver order receipts from a PostgreSQL job queue.

The orders service calls :func:`enqueue` inside its own transaction; workers
(``receipts worker``) claim, deliver and ack with a lease token.
"""

from receipts.jobqueue import InvalidOrderId, enqueue, enqueue_async

__all__ = ["InvalidOrderId", "enqueue", "enqueue_async"]
__version__ = "0.1.0"
