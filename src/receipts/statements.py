"""The named SQL statements of ``sql/queries.sql``, loaded once.

Each runtime statement is a ``-- name: NAME`` block in one file; a method of
:class:`receipts.jobqueue.JobQueue` (or :mod:`receipts.enqueue`) carries the
name of the block it runs, so a reader goes from the method to the SQL
without a search. This module needs only psycopg's ``sql`` composer.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql


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
def query(name: str) -> sql.SQL:
    """The named statement as a composable, built once (ack and reschedule are hot).

    Raises ``KeyError`` for a name that ``sql/queries.sql`` does not define.
    """
    return sql.SQL(statements()[name])  # type: ignore[arg-type,unused-ignore]


@cache
def claim_query(limit: int, *, limited: bool = False) -> sql.Composed:
    """The claim statement with *limit* as a literal (docs/design.md §10: no bind LIMIT).

    *limited* selects the variant that charges the fleet-wide token bucket.
    """
    name = "claim_limited" if limited else "claim"
    return sql.SQL(statements()[name]).format(limit=sql.Literal(limit))  # type: ignore[arg-type,unused-ignore]
