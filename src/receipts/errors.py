"""The package's errors: small, precise, and free of any dependency.

The driver's own errors never escape the connection seam
(:func:`receipts.db.translate` turns them into these, keeping ``__cause__``),
so callers catch a handful of classes. Messages never contain a password.
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


class UnusableDatabase(QueueError):
    """The database answers, but receipts refuses to run on it (its encoding).

    A settings problem, not an outage: the commands exit 2 with this one-line
    message. Raised by :func:`refuse_encoding`.
    """


#: Server encodings receipts refuses: SQL_ASCII stores bytes without checking
#: them, so text written by other clients (order ids, errors) could be anything.
REFUSED_ENCODINGS = frozenset({"SQL_ASCII"})


def refuse_encoding(database: str, encoding: str | None) -> None:
    """Raise :class:`UnusableDatabase` when *database*'s server *encoding* is refused.

    The one rule behind every command's refusal (the worker at start,
    ``receipts migrate``, ``enqueue``, ``jobs``, ``recover``; docs/design.md
    §4 "Connection protections"), so they all say the same words. Narrow
    encodings such as LATIN1 are accepted (the worker stores error texts
    lossily there). *encoding* is the ``server_encoding`` parameter status.
    """
    if encoding in REFUSED_ENCODINGS:
        raise UnusableDatabase(
            f"database {database!r} uses encoding {encoding}, which stores text "
            "unchecked; create it with ENCODING 'UTF8'")


class InvalidOrderId(ValueError):
    """An order id the queue refuses (empty, too long, control characters)."""
