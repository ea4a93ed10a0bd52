"""Apply ``migrations/NNNN_name.sql`` in order, once each (``receipts migrate``).

Rules (docs/design.md §1): forward-only plain SQL files; each file runs in its own
transaction together with its row in ``receipts_schema_migrations``; runners
are serialised by a transaction-level advisory lock taken per file, so
concurrent runners (several pods starting at once) apply each file exactly
once; running again is a no-op. The files ship inside the wheel as package
data, so an installed package or the image needs no path setting.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

import psycopg

from receipts.db import translate

# pg_advisory_xact_lock key: "receipts" as a stable 64-bit number.
LOCK_KEY = int.from_bytes(hashlib.sha256(b"receipts.migrate").digest()[:8], "big", signed=True)

_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

_TRACKING = """
CREATE TABLE IF NOT EXISTS receipts_schema_migrations (
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


class MigrationError(Exception):
    """A migration could not be applied, or an applied one was edited since."""


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


def apply_migrations(
    dsn: str, *, migrations: list[Migration] | None = None, application_name: str = "receipts"
) -> list[str]:
    """Apply every pending migration to the database at *dsn*.

    Returns the versions applied by this call (empty when up to date).
    Raises :class:`MigrationError` when an applied file's checksum changed or
    a statement fails (that file's transaction is rolled back; earlier files
    stay applied), and ``DatabaseUnavailable`` when the database is unreachable.
    """
    todo = bundled_migrations() if migrations is None else migrations
    applied: list[str] = []
    try:
        with psycopg.connect(
            dsn, autocommit=True, application_name=f"{application_name}-migrate"
        ) as conn:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
                conn.execute(_TRACKING)
            for migration in todo:
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
                    row = conn.execute(
                        "SELECT checksum FROM receipts_schema_migrations WHERE version = %s",
                        (migration.version,),
                    ).fetchone()
                    if row is not None:
                        if row[0] != migration.checksum:
                            raise MigrationError(
                                f"migration {migration.version} was changed after it was "
                                "applied; add a new migration instead"
                            )
                        continue
                    try:
                        conn.execute(migration.sql.encode())
                    except psycopg.errors.DatabaseError as exc:
                        if isinstance(exc, psycopg.OperationalError):
                            raise
                        raise MigrationError(f"{migration.version} failed: {exc}") from exc
                    conn.execute(
                        "INSERT INTO receipts_schema_migrations (version, checksum)"
                        " VALUES (%s, %s)",
                        (migration.version, migration.checksum),
                    )
                    applied.append(migration.version)
    except MigrationError:
        raise
    except psycopg.Error as exc:
        raise translate(exc) from exc
    return applied
