"""receipts: deliver order receipts from a PostgreSQL job queue.

The orders service calls :func:`enqueue` inside its own transaction; workers
(``receipts worker``) claim, deliver and ack with a lease token.
"""

from receipts.enqueue import enqueue, enqueue_async
from receipts.errors import InvalidOrderId

__all__ = ["InvalidOrderId", "enqueue", "enqueue_async"]
__version__ = "0.1.0"
