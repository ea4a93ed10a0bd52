"""The package's errors: small, precise, and free of any dependency.

The driver's own errors never escape the connection seam
(:func:`receipts.db.translate` turns them into these, keeping ``__cause__``),
so callers catch exactly these five classes. Messages never contain a password.
"""

from __future__ import annotations


class QueueError(Exception):
    """A queue operation failed for a reason other than availability."""


class DatabaseUnavailable(QueueError):
    """The database could not be reached or the connection broke mid-statement.

    The statement's effect is unknown; callers retry later. A claim that
    raises this delivers nothing: whatever it may have committed is left to
    lease expiry and recovery (the "uncertain commit" rule, docs/design.md §2).
    """


class StatementTimeout(DatabaseUnavailable):
    """The server stopped a statement: it ran past ``statement_timeout``, waited
    past ``lock_timeout``, or was cancelled.

    The database answered, so this means "slow" or "busy", not "down"; the
    statement's transaction rolled back. A subclass of
    :class:`DatabaseUnavailable`, so callers that retry an outage retry this
    the same way.
    """


class SchemaMissing(QueueError):
    """A table of the queue does not exist: run ``receipts migrate`` first."""


class InvalidOrderId(ValueError):
    """An order id the queue refuses (empty, too long, control characters)."""
