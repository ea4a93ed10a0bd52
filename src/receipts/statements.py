"""The named SQL statements of ``sql/*.sql``, loaded once: one file per audience.

Each runtime statement is a ``-- name: NAME`` block: the worker's and
recovery's (claim, ack, flow control, gauges, heartbeat, recovery;
:mod:`receipts.jobqueue`) in ``queries.sql``, the operator's (review, retry,
discard, bulk actions, the fleet pause; :mod:`receipts.operations`) in
``operations.sql``, the orders service's (:mod:`receipts.enqueue`) in
``enqueue.sql``. A method carries the name of the block it runs, so a reader
goes from the method to the SQL without a search. This module needs only
psycopg's ``sql`` composer.

Every table is written ``{schema}.receipt_jobs`` in the file and qualified
here with the configured schema (:func:`receipts.dsn.schema_for`), so a
``SET search_path`` that another client leaked onto a pooled server
connection (PgBouncer transaction pooling) cannot send a statement to another
table, or to none (docs/design.md, "Schema").
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql

#: The schema the tables are created in when nothing else is configured.
DEFAULT_SCHEMA = "public"
#: A schema name as receipts accepts it: an unquoted lower-case identifier
#: (PostgreSQL folds unquoted names to lower case; at most 63 bytes), and not
#: one PostgreSQL reserves for itself (``pg_…``, ``information_schema``).
SCHEMA_NAME = re.compile(r"^(?!pg_|information_schema$)[a-z_][a-z0-9_]{0,62}$")
#: What :data:`SCHEMA_NAME` accepts, for messages.
SCHEMA_RULE = ("a lower-case SQL identifier (letters, digits and _, at most 63), "
               "not pg_… or information_schema (reserved by PostgreSQL)")


def qualifier(schema: str | None) -> str:
    """The text that prefixes a table name: ``"schema".``, or ``""`` for *None*.

    *None* leaves names unqualified (resolved by the session's search_path);
    only the enqueue API offers it, for callers whose transaction decides.
    Raises ``ValueError`` for a name that is not a plain lower-case identifier
    (so the text needs no further quoting).
    """
    if schema is None:
        return ""
    if not SCHEMA_NAME.match(schema):
        raise ValueError(f"schema {schema!r} is not {SCHEMA_RULE}")
    return f'"{schema}".'


#: The files of named statements, one per audience, in load order (a name may be
#: defined once across them).
STATEMENT_FILES = ("sql/enqueue.sql", "sql/queries.sql", "sql/operations.sql")


@cache
def statements(schema: str | None = DEFAULT_SCHEMA) -> dict[str, str]:
    """All named statements of :data:`STATEMENT_FILES` keyed by name, tables in *schema*.

    Loaded once per schema. Raises ``ValueError`` for a bad schema name
    (:func:`qualifier`) or a name defined twice.
    """
    prefix = qualifier(schema)
    blocks: dict[str, str] = {}
    for path in STATEMENT_FILES:
        text = resources.files("receipts").joinpath(path).read_text("utf-8")
        text = text.replace("{schema}.", prefix)
        for chunk in re.split(r"^-- name: ", text, flags=re.M)[1:]:
            name, _, body = chunk.partition("\n")
            lines = [ln for ln in body.splitlines() if not ln.lstrip().startswith("--")]
            if name.strip() in blocks:
                raise ValueError(f"statement {name.strip()!r} is defined twice ({path})")
            blocks[name.strip()] = "\n".join(lines).strip().rstrip(";")
    return blocks


@cache
def query(name: str, schema: str | None = DEFAULT_SCHEMA) -> sql.SQL:
    """The named statement as a composable, built once (ack and reschedule are hot).

    Raises ``KeyError`` for a name that no file of :data:`STATEMENT_FILES` defines.
    """
    return sql.SQL(statements(schema)[name])  # type: ignore[arg-type,unused-ignore]


#: The lease token expression of the claim statements, as ``queries.sql`` writes it.
RANDOM_TOKEN = "lease_token = gen_random_uuid(),"
#: A worker's tag: 8 lower-case hex digits (``receipt_workers.tag``).
WORKER_TAG = re.compile(r"^[0-9a-f]{8}$")


#: Where the ack statement's CTEs end and its own answer begins, as ``queries.sql`` writes it.
ACK_ANSWER = "\nSELECT d.id, w.insert_lsn, w.flush_lsn\n"
#: Where the ack statement's ``wal`` CTE begins its select list.
ACK_WAL = "wal AS (\n  SELECT "
#: Where the claim statements' answer names its last column and its first table.
CLAIM_TAIL = "c.traceparent\nFROM flow AS f "


def riding_acks(claim: str, ack: str) -> str:
    """The claim statement *claim* carrying the ack statement *ack* (both texts).

    The ack's CTEs (``done``, ``wal``) go first, so its rows are written in the
    same statement as the claim's, and each answer row gains three columns:
    ``acked`` (the ids the ack completed, a uuid[], NULL for none) and the
    ack's ``insert_lsn`` and ``flush_lsn``. The two write disjoint rows (an
    ack's are running, a claim's ready), so neither sees the other's change.
    Raises ``ValueError`` when either text no longer has the shape this relies
    on (:data:`ACK_ANSWER`, :data:`CLAIM_TAIL`, a leading ``WITH``).
    """
    if (not ack.startswith("WITH ") or ack.count(ACK_ANSWER) != 1
            or not claim.startswith("WITH ") or claim.count(CLAIM_TAIL) != 1):
        raise ValueError("the claim or ack statement no longer has the shape a riding ack needs")
    ctes = ack[len("WITH "):ack.index(ACK_ANSWER)]
    if ctes.count(ACK_WAL) != 1:
        raise ValueError("the ack statement no longer reads the WAL positions in a CTE")
    # The acked ids are read where the positions are, in the row the claim's answer
    # is joined to first: so the ack's update runs to its end before the claim locks
    # a candidate (were an acked row locked by someone else, the claim would wait
    # holding nothing another pod could claim).
    ctes = ctes.replace(ACK_WAL, ACK_WAL + "(SELECT array_agg(id) FROM done) AS acked, ")
    claim = claim.replace(CLAIM_TAIL, "c.traceparent,\n       w.acked, w.insert_lsn, w.flush_lsn\n"
                          "FROM wal AS w CROSS JOIN flow AS f ")
    return f"WITH {ctes},\n{claim[len('WITH '):]}"


@cache
def claim_query(limit: int, *, limited: bool = False, schema: str | None = DEFAULT_SCHEMA,
                tag: str | None = None, acks: bool = False) -> sql.Composed:
    """The claim statement with *limit* as a literal (docs/design.md §10: no bind LIMIT).

    *limited* selects the variant that charges the fleet-wide token bucket.
    With *acks*, the statement also carries an ack (:func:`riding_acks`: the
    ``ack`` statement's parameters ``ids`` and ``tokens``, and three more
    answer columns), so at a trickle a worker's acks cost no statement of
    their own (:mod:`receipts.completion`).
    With *tag* (a worker's 8 hex digits, :data:`WORKER_TAG`), each lease token
    the claim writes ends in those digits instead of random ones (90 random
    bits stay), so whoever reads a running job's token can name the worker
    that holds it (``receipt_workers``; the review page). The tag is an
    argument here rather than a parameter of the statement, so the text in
    ``queries.sql`` stays a complete statement for pgbench and EXPLAIN.
    Raises ``ValueError`` for a tag that is not 8 lower-case hex digits.
    """
    text = statements(schema)["claim_limited" if limited else "claim"]
    if acks:
        text = riding_acks(text, statements(schema)["ack"])
    if tag is not None:
        if not WORKER_TAG.match(tag):
            raise ValueError(f"a worker tag is 8 lower-case hex digits, not {tag!r}")
        if text.count(RANDOM_TOKEN) != 1:
            raise ValueError("the claim statement no longer writes one gen_random_uuid() token")
        # The token's text is 8-4-4-4-12 hex digits: characters 29-36 are its last 8.
        text = text.replace(RANDOM_TOKEN, "lease_token = overlay(gen_random_uuid()::text"
                            f" PLACING '{tag}' FROM 29)::uuid,")
    return sql.SQL(text).format(limit=sql.Literal(limit))  # type: ignore[arg-type,unused-ignore]
