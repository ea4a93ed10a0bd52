"""Apply ``migrations/NNNN_name.sql`` in order, once each (``receipts migrate``).

Rules (docs/design.md §1): forward-only plain SQL files; each file runs in its own
transaction together with its row in ``receipts_schema_migrations``; runners
are serialised by a transaction-level advisory lock taken per file, so
concurrent runners (several pods starting at once) apply each file exactly
once; running again is a no-op. The files ship inside the wheel as package
data, so an installed package or the image needs no path setting.

Teams that own their migrations (Alembic, Flyway, sqitch, …) apply the text of
:func:`migration_sql` instead (``receipts migrate --print-sql``): it records
each version in the same tracking table, so :func:`check_schema` — which the
worker calls at start-up to refuse a schema it does not know — works the same
either way. The schema version is the newest applied file name
(:attr:`SchemaStatus.version`, ``receipts migrate --check``). Like the enqueue
API, this module needs only psycopg (the base install): an Alembic revision
can ``op.execute(migration_sql(...))``.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

import psycopg

from receipts import __version__
from receipts.dsn import schema_for
from receipts.errors import refuse_encoding
from receipts.statements import qualifier

log = logging.getLogger("receipts.migrate")

# pg_advisory_xact_lock key: "receipts" as a stable 64-bit number.
LOCK_KEY = int.from_bytes(hashlib.sha256(b"receipts.migrate").digest()[:8], "big", signed=True)

_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

_TRACKING = """
CREATE TABLE IF NOT EXISTS {schema}.receipts_schema_migrations (
  version     TEXT PRIMARY KEY,
  checksum    TEXT NOT NULL,
  applied_at  TIMESTAMPTZ NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True, slots=True)
class Migration:
    """One migration file: ``version`` is its file name, ``sql`` its text."""

    version: str
    sql: str

    @property
    def checksum(self) -> str:
        """SHA-256 of the file text, recorded to detect edited migrations."""
        return hashlib.sha256(self.sql.encode()).hexdigest()


def _qualified(schema: str) -> str:
    """``"schema".`` for SQL text; ``ValueError`` for a name that is not an identifier."""
    return qualifier(schema)


def _tracking(schema: str) -> str:
    return _TRACKING.replace("{schema}.", _qualified(schema))


def _resolve(dsn: str, schema: str | None) -> str:
    if schema is not None:
        return schema
    return schema_for(dsn)


class MigrationError(Exception):
    """A migration could not be applied, or an applied one was edited since."""


class SchemaMismatch(MigrationError):
    """The database schema is not the one this version of receipts knows.

    ``str()`` is one line saying what differs and what to do (run
    ``receipts migrate``, or upgrade receipts). Raised by :func:`check_schema`.
    """


def bundled_migrations(folder: Traversable | None = None) -> list[Migration]:
    """The packaged migrations sorted by version (``NNNN_description.sql``).

    Raises :class:`MigrationError` for a file name that does not follow the
    pattern or a duplicate number.
    """
    folder = folder or resources.files("receipts").joinpath("migrations")
    found: list[Migration] = []
    seen: set[str] = set()
    for entry in folder.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = _NAME.match(entry.name)
        if not match:
            raise MigrationError(f"migration file name {entry.name!r} is not NNNN_name.sql")
        if match.group(1) in seen:
            raise MigrationError(f"two migrations share the number {match.group(1)}")
        seen.add(match.group(1))
        found.append(Migration(entry.name, entry.read_text("utf-8")))
    return sorted(found, key=lambda m: m.version)


def _timeouts(dsn: str, lock_seconds: float, statement_seconds: float) -> str:
    """Startup ``options`` with the migration's timeouts, after any the DSN carries."""
    from psycopg.conninfo import conninfo_to_dict

    ours = (f"-c lock_timeout={round(lock_seconds * 1000)} "
            f"-c statement_timeout={round(statement_seconds * 1000)}")
    theirs = conninfo_to_dict(dsn).get("options")
    return f"{theirs} {ours}" if theirs else ours


def _lock_message(seconds: float) -> str:
    return (f"a lock was not granted within {seconds:g}s: another `receipts migrate` is "
            "running, or a session holds a lock on the queue's tables (see pg_locks and "
            "pg_stat_activity); nothing of the waiting migration was applied")


def apply_migrations(
    dsn: str, *, migrations: list[Migration] | None = None, application_name: str = "receipts",
    connect_timeout_seconds: float = 10.0, lock_timeout_seconds: float = 120.0,
    statement_timeout_seconds: float = 1800.0, schema: str | None = None,
    beside_existing: bool = False,
) -> list[str]:
    """Apply every pending migration to the database at *dsn*, in *schema*.

    *schema* (default: :func:`receipts.dsn.schema_for` of *dsn*) is
    created when missing; each file runs with ``SET LOCAL search_path`` to it
    alone, so whatever search_path the session has, the tables land where
    the workers' qualified statements look for them.

    A *new* queue is not created in *schema* while another schema of the
    database already holds one (its tables were found through a role's or a
    session's search_path before receipts named its schema): that would
    split producers and workers between two queues. :class:`MigrationError`
    names the schema(s) found and the setting that picks one, unless
    *beside_existing* says a second queue is intended (the CLI passes it
    when ``RECEIPTS_DATABASE_SCHEMA`` is set explicitly).

    Then every CHECK constraint a migration added ``NOT VALID`` is validated,
    each in a transaction of its own (:func:`validate_constraints`).

    Needs the ``worker`` extra (errors are translated by :mod:`receipts.db`).
    Returns the versions applied by this call (empty when up to date).
    Raises :class:`MigrationError` when an applied file's checksum changed or
    a statement fails (that file's transaction is rolled back; earlier files
    stay applied), ``DatabaseUnavailable`` when the database is unreachable, and
    ``UnusableDatabase`` for a database no worker would serve (SQL_ASCII;
    :func:`receipts.errors.refuse_encoding`), before anything is created.

    Every wait is bounded: connecting by *connect_timeout_seconds*, waiting for
    a lock (the advisory lock another runner holds, or a table lock for DDL)
    by *lock_timeout_seconds* (then :class:`MigrationError` says who to look
    for), each statement by *statement_timeout_seconds*.
    """
    todo = bundled_migrations() if migrations is None else migrations
    schema = _resolve(dsn, schema)
    prefix = _qualified(schema)
    applied: list[str] = []
    try:
        with psycopg.connect(
            dsn, autocommit=True, application_name=f"{application_name}-migrate",
            connect_timeout=max(1, round(connect_timeout_seconds)),
            options=_timeouts(dsn, lock_timeout_seconds, statement_timeout_seconds),
        ) as conn:
            # Nothing is created where no worker would serve it (SQL_ASCII).
            refuse_encoding(conn.info.dbname, conn.info.parameter_status("server_encoding"))
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
                exists = conn.execute("SELECT FROM pg_namespace WHERE nspname = %s",
                                      (schema,)).fetchone()
                if not beside_existing:
                    _refuse_second_queue(conn, schema)
                if exists is None:
                    conn.execute(f"CREATE SCHEMA IF NOT EXISTS {prefix[:-1]}".encode())
                conn.execute(_tracking(schema).encode())
            for migration in todo:
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
                    row = conn.execute(
                        f"SELECT checksum FROM {prefix}receipts_schema_migrations"  # type: ignore[arg-type,unused-ignore]
                        " WHERE version = %s",
                        (migration.version,),
                    ).fetchone()
                    if row is not None:
                        if row[0] != migration.checksum:
                            raise MigrationError(
                                f"migration {migration.version} was changed after it was "
                                "applied; add a new migration instead"
                            )
                        continue
                    conn.execute(f"SET LOCAL search_path TO {prefix[:-1]}".encode())
                    try:
                        conn.execute(migration.sql.encode())
                    except psycopg.errors.LockNotAvailable as exc:
                        raise MigrationError(_lock_message(lock_timeout_seconds)) from exc
                    except psycopg.errors.DatabaseError as exc:
                        if isinstance(exc, psycopg.OperationalError):
                            raise
                        raise MigrationError(f"{migration.version} failed: {exc}") from exc
                    conn.execute(
                        f"INSERT INTO {prefix}receipts_schema_migrations"  # type: ignore[arg-type,unused-ignore]
                        " (version, checksum) VALUES (%s, %s)",
                        (migration.version, migration.checksum),
                    )
                    applied.append(migration.version)
            validate_constraints(conn, schema=schema)
    except MigrationError:
        raise
    except psycopg.errors.LockNotAvailable as exc:
        raise MigrationError(_lock_message(lock_timeout_seconds)) from exc
    except psycopg.Error as exc:
        from receipts.db import translate  # extra: worker (psycopg_pool), only on failure

        raise translate(exc) from exc
    return applied


#: The queue's CHECK constraints that are not validated yet (added NOT VALID by a migration).
_UNVALIDATED = """
SELECT c.conrelid::regclass::text, c.conname
FROM pg_constraint AS c
JOIN pg_class AS t ON t.oid = c.conrelid
WHERE t.relnamespace = %s::regnamespace AND c.contype = 'c' AND NOT c.convalidated
  AND t.relname LIKE 'receipt%%'
ORDER BY 1, 2
"""


def validate_constraints(conn: psycopg.Connection[Any], *, schema: str) -> list[str]:
    """Validate the queue's CHECK constraints that a migration added ``NOT VALID``.

    A migration adds a constraint to a big table ``NOT VALID``: it is enforced on
    every row written from its commit on, and adding it holds the table's ACCESS
    EXCLUSIVE lock for no scan. ``VALIDATE CONSTRAINT`` then proves the rows
    written before; it scans the table under a SHARE UPDATE EXCLUSIVE lock only,
    so claims, acks and enqueues go on meanwhile. Each constraint is validated
    in its own transaction on *conn* (autocommit). One that existing rows break
    stays ``NOT VALID`` (still enforced on new writes), logged as
    ``constraint_not_validated`` with the rows' description, and validated by a
    later ``receipts migrate`` once they are gone (pruned). Returns the names of
    the constraints left unvalidated. Other errors propagate.
    """
    left: list[str] = []
    rows = conn.execute(_UNVALIDATED, (schema,)).fetchall()
    for table, name in rows:
        try:
            with conn.transaction():
                conn.execute(f'ALTER TABLE {table} VALIDATE CONSTRAINT "{name}"'.encode())
        except psycopg.errors.CheckViolation as exc:
            left.append(str(name))
            log.warning("constraint_not_validated", extra={
                "constraint": str(name), "table": str(table),
                "detail": f"{str(exc).splitlines()[0]}; it holds for every row written since "
                          "the migration; finished rows that break it are deleted by pruning "
                          "and the next `receipts migrate` validates it"})
    return left


def _refuse_second_queue(conn: psycopg.Connection[Any], schema: str) -> None:
    """:class:`MigrationError` when *schema* holds no receipts queue but another schema does."""
    has = _HAS_TRACKING.replace("{schema}.", _qualified(schema))
    row = conn.execute(has.encode()).fetchone()
    if row is not None and row[0]:
        return
    others = [str(r[0]) for r in conn.execute(_ELSEWHERE).fetchall() if r[0] != schema]
    if not others:
        return
    found = ", ".join(f'"{name}"' for name in others)
    picks = " or ".join(f"RECEIPTS_DATABASE_SCHEMA={name}" for name in others)
    raise MigrationError(
        f'the receipts queue of this database is in schema {found}, not in "{schema}" '
        f"(the schema chosen from the DSN; the tables were probably found through a role's "
        f"search_path until now); nothing was created. Set {picks} to migrate that queue, "
        f"or RECEIPTS_DATABASE_SCHEMA={schema} to create a second, separate queue")


# ------------------------------------------------------------ schema version


#: In a migration's file name, this marks a breaking change (a new major version): the
#: schema it makes is no longer one an older version can run on. Migrations without it
#: only add (expand-only), so older versions of the same major version run on the result.
BREAKING_MARK = "_breaking_"

_HAS_TRACKING = "SELECT to_regclass('{schema}.receipts_schema_migrations') IS NOT NULL"
_APPLIED = "SELECT version, checksum FROM {schema}.receipts_schema_migrations ORDER BY version"
# Where else a receipts schema lives (for the hint when *schema* has none).
_ELSEWHERE = ("SELECT n.nspname FROM pg_class AS c JOIN pg_namespace AS n"
              " ON n.oid = c.relnamespace WHERE c.relname = 'receipts_schema_migrations'"
              " AND c.relkind = 'r' ORDER BY 1")


@dataclass(frozen=True, slots=True)
class SchemaStatus:
    """The database's migrations compared with the ones this package ships.

    Attributes:
        applied: versions recorded in ``receipts_schema_migrations``, sorted.
        pending: shipped versions not applied yet, in order.
        unknown: applied versions this package does not ship (a newer
            receipts migrated the database).
        changed: applied versions whose recorded checksum differs from the
            shipped file's.
        expected: the newest shipped version (what this package needs), or None.
        schema: the schema that was looked in.
        database: the database's name (for messages).
        elsewhere: other schemas of this database that hold a receipts
            schema (read only when *schema* holds none), for the hint.
    """

    applied: tuple[str, ...]
    pending: tuple[str, ...]
    unknown: tuple[str, ...]
    changed: tuple[str, ...]
    expected: str | None
    schema: str = "public"
    database: str = ""
    elsewhere: tuple[str, ...] = ()

    @property
    def version(self) -> str | None:
        """The schema version: the newest applied migration's file name, or None."""
        return self.applied[-1] if self.applied else None

    @property
    def current(self) -> bool:
        """True when the database has exactly the shipped migrations."""
        return not (self.pending or self.unknown or self.changed)

    @property
    def newer(self) -> bool:
        """True when the database is this version's schema plus a later release's migrations
        of the same major version: every shipped migration applied unchanged, and every
        unknown one sorting after them without :data:`BREAKING_MARK` in its name.
        Migrations only add within a major version, so this version runs on that schema
        (what a ``helm rollback`` to it needs; docs/design.md, Upgrades and rollbacks)."""
        return bool(self.unknown) and not (self.pending or self.changed) and all(
            version > (self.expected or "") and BREAKING_MARK not in version
            for version in self.unknown)

    @property
    def usable(self) -> bool:
        """True when this version can run on the schema: :attr:`current` or :attr:`newer`."""
        return self.current or self.newer

    def describe(self) -> str:
        """One line: the version and, when not current, what differs and what to do."""
        ours = f"receipts {__version__}"
        if self.newer:
            return (f"schema version {self.version}, newer than {ours} ({self.expected}) by "
                    f"{len(self.unknown)} migration(s) of a later release "
                    f"({', '.join(self.unknown)}); {ours} runs on it (migrations only add "
                    "within a major version)")
        if self.unknown:
            return (f"schema version {self.version} has migration(s) {ours} does not know "
                    f"({', '.join(self.unknown)}): the database was migrated by a newer "
                    "version; upgrade receipts")
        if self.changed:
            return (f"schema migration(s) {', '.join(self.changed)} differ from the ones "
                    f"{ours} ships: the database was migrated by a different build")
        if self.pending and not self.applied:
            where = f'schema "{self.schema}" of database "{self.database}"'
            hint = "run `receipts migrate`"
            if self.elsewhere:
                found = ", ".join(f'"{name}"' for name in self.elsewhere)
                picks = " or ".join(f"RECEIPTS_DATABASE_SCHEMA={name}"
                                    for name in self.elsewhere)
                hint = (f"the queue is in schema {found}: set {picks}, or "
                        f"RECEIPTS_DATABASE_SCHEMA={self.schema} and {hint} to create a "
                        f"second one in {self.schema}")
            return (f"no receipts tables in {where} (looked up "
                    f"{self.schema}.receipts_schema_migrations; {ours} expects "
                    f"{self.expected}): {hint}")
        if self.pending:
            return (f"schema version {self.version}, {ours} expects {self.expected}: "
                    f"{len(self.pending)} migration(s) pending ({', '.join(self.pending)}); "
                    "run `receipts migrate`")
        return f"schema version {self.version} (up to date)"


def _status(rows: list[tuple[str, str]], shipped: list[Migration], *, schema: str,
            database: str, elsewhere: tuple[str, ...]) -> SchemaStatus:
    recorded = dict(rows)
    known = {m.version: m for m in shipped}
    return SchemaStatus(
        applied=tuple(sorted(recorded)),
        pending=tuple(m.version for m in shipped if m.version not in recorded),
        unknown=tuple(sorted(v for v in recorded if v not in known)),
        changed=tuple(sorted(v for v, checksum in recorded.items()
                             if v in known and known[v].checksum != checksum)),
        expected=shipped[-1].version if shipped else None,
        schema=schema, database=database, elsewhere=elsewhere,
    )


def schema_status(
    conn: psycopg.Connection[Any], *, migrations: list[Migration] | None = None,
    schema: str = "public",
) -> SchemaStatus:
    """Compare *schema* of the database behind *conn* with the shipped (or given) *migrations*.

    Reads only (two statements, three when *schema* has no tracking table:
    that is "nothing applied", not an error), so it is safe on any
    connection. psycopg errors propagate; ``ValueError`` for a bad *schema*.
    """
    shipped = bundled_migrations() if migrations is None else migrations
    has, applied = (q.replace("{schema}.", _qualified(schema)) for q in (_HAS_TRACKING, _APPLIED))
    row = conn.execute(has.encode()).fetchone()
    rows = conn.execute(applied.encode()).fetchall() if row and row[0] else []
    elsewhere = () if rows else tuple(
        str(r[0]) for r in conn.execute(_ELSEWHERE).fetchall() if r[0] != schema)
    return _status([(str(v), str(c)) for v, c in rows], shipped, schema=schema,
                   database=conn.info.dbname, elsewhere=elsewhere)


async def schema_status_async(
    conn: psycopg.AsyncConnection[Any], *, migrations: list[Migration] | None = None,
    schema: str = "public",
) -> SchemaStatus:
    """Async twin of :func:`schema_status` (same statements, same result)."""
    shipped = bundled_migrations() if migrations is None else migrations
    has, applied = (q.replace("{schema}.", _qualified(schema)) for q in (_HAS_TRACKING, _APPLIED))
    row = await (await conn.execute(has.encode())).fetchone()
    rows = await (await conn.execute(applied.encode())).fetchall() if row and row[0] else []
    elsewhere = () if rows else tuple(
        str(r[0]) for r in await (await conn.execute(_ELSEWHERE)).fetchall() if r[0] != schema)
    return _status([(str(v), str(c)) for v, c in rows], shipped, schema=schema,
                   database=conn.info.dbname, elsewhere=elsewhere)


def check_schema(
    conn: psycopg.Connection[Any], *, migrations: list[Migration] | None = None,
    schema: str = "public",
) -> SchemaStatus:
    """Return the :class:`SchemaStatus` when this version can run on it; raise otherwise.

    Usable (:attr:`SchemaStatus.usable`): exactly the shipped migrations, or those plus a
    later release's of the same major version (expand-only, :attr:`SchemaStatus.newer`).
    Raises :class:`SchemaMismatch` (one line: :meth:`SchemaStatus.describe`)
    when migrations are pending, when the database has migrations this
    package does not ship that are not a later, non-breaking release's, or when an applied
    migration differs from the shipped file. psycopg errors propagate.
    """
    status = schema_status(conn, migrations=migrations, schema=schema)
    if not status.usable:
        raise SchemaMismatch(status.describe())
    return status


async def check_schema_async(
    conn: psycopg.AsyncConnection[Any], *, migrations: list[Migration] | None = None,
    schema: str = "public",
) -> SchemaStatus:
    """Async twin of :func:`check_schema`, for the worker's start-up."""
    status = await schema_status_async(conn, migrations=migrations, schema=schema)
    if not status.usable:
        raise SchemaMismatch(status.describe())
    return status


def read_schema_status(dsn: str, *, application_name: str = "receipts",
                       schema: str | None = None) -> SchemaStatus:
    """Connect to *dsn*, read *schema*'s :class:`SchemaStatus`, disconnect (``worker`` extra).

    *schema* defaults to :func:`receipts.dsn.schema_for` of *dsn*.

    Raises ``DatabaseUnavailable`` (or another ``QueueError``) when the
    database cannot be read, ``UnusableDatabase`` for a SQL_ASCII database;
    the message is redacted.
    """
    try:
        with psycopg.connect(
            dsn, autocommit=True, application_name=f"{application_name}-migrate",
            connect_timeout=10, options=_timeouts(dsn, 10.0, 30.0),
        ) as conn:
            refuse_encoding(conn.info.dbname, conn.info.parameter_status("server_encoding"))
            return schema_status(conn, schema=_resolve(dsn, schema))
    except psycopg.Error as exc:
        from receipts.db import translate  # extra: worker (psycopg_pool), only on failure

        raise translate(exc) from exc


def migration_sql(migrations: list[Migration] | None = None, *, schema: str = "public") -> str:
    """The SQL text of *migrations* (default: all shipped), for teams that own migrations.

    Every part starts with ``SET LOCAL search_path TO`` *schema* (so apply it
    in a transaction: outside one, PostgreSQL ignores ``SET LOCAL`` with a
    warning) and names *schema* in the tracking statements, like
    :func:`apply_migrations`. A *schema* other than ``public`` is created
    first (``CREATE SCHEMA IF NOT EXISTS``), as ``receipts migrate`` does.

    Starts with the tracking table (``CREATE TABLE IF NOT EXISTS``); each file
    follows with the ``INSERT`` that records its version and checksum, exactly
    as ``receipts migrate`` does, so :func:`check_schema` accepts the result.
    No ``BEGIN``/``COMMIT``: the applying tool owns the transaction (apply the
    whole text in one, or each file's part in its own).
    """
    todo = bundled_migrations() if migrations is None else migrations
    names = ", ".join(m.version for m in todo) or "none"
    prefix = _qualified(schema)
    parts = [
        f"-- receipts {__version__}: schema migrations {names}, in schema {schema}\n"
        "-- Generated by `receipts migrate --print-sql`; apply in order, in a transaction.\n"
        "-- Each part records its version in receipts_schema_migrations, which workers\n"
        "-- check at start-up.\n"
        + (f"CREATE SCHEMA IF NOT EXISTS {prefix[:-1]};\n" if schema != "public" else "")
        + f"{_tracking(schema).strip()};\n"
    ]
    for m in todo:
        literal = "'" + m.version.replace("'", "''") + "'"
        parts.append(
            f"-- ---- {m.version}\nSET LOCAL search_path TO {prefix[:-1]};\n{m.sql.strip()}\n"
            f"INSERT INTO {prefix}receipts_schema_migrations (version, checksum)\n"
            f"VALUES ({literal}, '{m.checksum}');\n"
        )
    unvalidated: list[tuple[str, str]] = []
    for m in todo:  # a later file may drop what an earlier one added (0012 does)
        dropped = _dropped(m.sql)
        unvalidated = [c for c in unvalidated if c not in dropped] + _not_valid(m.sql)
    later = [f"ALTER TABLE {prefix}{table} VALIDATE CONSTRAINT {name};"
             for table, name in unvalidated]
    if later:
        parts.append(
            "-- After the parts above have committed, each in a transaction of its own\n"
            "-- (receipts migrate does the same): validate what they added NOT VALID. Each\n"
            "-- scans the table holding SHARE UPDATE EXCLUSIVE only, so the queue keeps\n"
            "-- working; one that old rows break stays NOT VALID, enforced on new rows.\n"
            + "\n".join(later) + "\n")
    return "\n".join(parts)


def _altered(sql: str) -> Iterator[tuple[str, str]]:
    """(table, statement) of each ``ALTER TABLE`` statement in *sql*, comments removed."""
    for statement in re.split(r";\s*\n", re.sub(r"--[^\n]*", "", sql)):
        table = re.match(r"\s*ALTER TABLE (\w+)", statement)
        if table is not None:
            yield table.group(1), statement


def _dropped(sql: str) -> set[tuple[str, str]]:
    """(table, constraint) of each constraint *sql* drops."""
    return {(table, name) for table, statement in _altered(sql)
            for name in re.findall(r"\bDROP CONSTRAINT (?:IF EXISTS )?(\w+)", statement)}


def _not_valid(sql: str) -> list[tuple[str, str]]:
    """(table, constraint) of each constraint *sql* adds ``NOT VALID``, in order."""
    return [(table, clause.split()[0]) for table, statement in _altered(sql)
            for clause in re.split(r"\bADD CONSTRAINT\b", statement)[1:]
            if re.search(r"\bNOT VALID\s*,?\s*$", clause.strip())]
