"""Migration 0009 on a queue that already has rows: what breaks the new rules is failed
before the rules hold, and the constraints are validated afterwards, outside the
migration's exclusive lock (docs/design.md, "Every rule in the database, for every role")."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest

from receipts.migrate import apply_migrations, bundled_migrations, validate_constraints
from tests.conftest import Server, fetch_rows

SHIPPED = bundled_migrations()
BEFORE_RULES = [m for m in SHIPPED if m.version < "0009"]
RULES = ("receipt_jobs_order_id_rules", "receipt_jobs_run_at_finite")


@pytest.fixture
def unmigrated(server: Server) -> Iterator[str]:
    url = server.new_database(migrated=False)
    try:
        yield url
    finally:
        server.drop_database(url)


def _execute(dsn: str, sql: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql)


def _validated(dsn: str) -> dict[str, bool]:
    return dict(fetch_rows(dsn, "SELECT conname, convalidated FROM pg_constraint"
                                " WHERE conrelid = 'receipt_jobs'::regclass AND contype = 'c'"))


def test_rows_written_before_the_rules_are_failed_when_pending_and_kept_when_finished(
        unmigrated):
    apply_migrations(unmigrated, migrations=BEFORE_RULES)
    fetch_rows(unmigrated, """
        INSERT INTO receipt_jobs (id, order_id, state, run_at, attempts, lease_token,
                                  lease_until, finished_at)
        VALUES (gen_random_uuid(), e'tab\\tid', 'ready', now(), 0, NULL, NULL, NULL),
               (gen_random_uuid(), 'never', 'ready', 'infinity', 0, NULL, NULL, NULL),
               (gen_random_uuid(), '', 'running', now(), 1, gen_random_uuid(),
                now() + interval '1 minute', NULL),
               (gen_random_uuid(), e'old\\nDone', 'done', now(), 1, NULL, NULL, now()),
               (gen_random_uuid(), 'fine', 'ready', now(), 0, NULL, NULL, NULL)
        RETURNING 1""")
    assert apply_migrations(unmigrated) == [m.version for m in SHIPPED
                                            if m not in BEFORE_RULES]
    rows = dict(fetch_rows(unmigrated, "SELECT order_id, state FROM receipt_jobs"))
    assert rows == {"tab\tid": "failed", "never": "failed", "": "failed",
                    "old\nDone": "done", "fine": "ready"}
    (error,), = fetch_rows(unmigrated, "SELECT DISTINCT last_error FROM receipt_jobs"
                                       " WHERE state = 'failed'")
    assert error.startswith("refused by the database rules (migration 0009)")
    assert fetch_rows(unmigrated, "SELECT count(*) FROM receipt_jobs WHERE NOT isfinite(run_at)"
                      ) == [(0,)]
    validated = _validated(unmigrated)
    assert all(validated[name] for name in RULES), validated
    # The rules hold from now on; the finished row with the old id may still be pruned.
    with psycopg.connect(unmigrated) as conn, pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("UPDATE receipt_jobs SET state = 'ready', finished_at = NULL"
                     " WHERE order_id = e'old\\nDone'")


def test_a_constraint_old_rows_break_stays_not_valid_enforced_and_reported(dsn, caplog):
    fetch_rows(dsn, "INSERT INTO receipt_jobs (id, order_id) VALUES (gen_random_uuid(), 'x')"
                    " RETURNING 1")
    _execute(dsn, "ALTER TABLE receipt_jobs ADD CONSTRAINT receipt_jobs_no_x"
                  " CHECK (order_id <> 'x') NOT VALID")
    with psycopg.connect(dsn, autocommit=True) as conn, caplog.at_level(logging.WARNING):
        schema = conn.execute("SELECT current_schema()").fetchone()
        assert schema is not None
        assert validate_constraints(conn, schema=schema[0]) == ["receipt_jobs_no_x"]
    assert [r.message for r in caplog.records] == ["constraint_not_validated"]
    assert _validated(dsn)["receipt_jobs_no_x"] is False
    fetch_rows(dsn, "DELETE FROM receipt_jobs WHERE order_id = 'x' RETURNING 1")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert validate_constraints(conn, schema="public") == []
    assert _validated(dsn)["receipt_jobs_no_x"] is True


def test_validation_lets_enqueues_and_claims_go_on_while_it_scans(dsn):
    """VALIDATE CONSTRAINT takes SHARE UPDATE EXCLUSIVE: a writer is not blocked by it."""
    _execute(dsn, "ALTER TABLE receipt_jobs ADD CONSTRAINT receipt_jobs_probe"
                  " CHECK (attempts < 1000) NOT VALID")
    with psycopg.connect(dsn) as validating, psycopg.connect(dsn, autocommit=True) as writer:
        validating.execute("ALTER TABLE receipt_jobs VALIDATE CONSTRAINT receipt_jobs_probe")
        # the validating transaction is still open, holding its lock
        writer.execute("SET lock_timeout = '2s'")
        writer.execute("INSERT INTO receipt_jobs (id, order_id) VALUES (gen_random_uuid(),"
                       " 'during-validate')")
        writer.execute("UPDATE receipt_jobs SET attempts = attempts WHERE order_id ="
                       " 'during-validate'")
        (mode,), = validating.execute(
            "SELECT mode FROM pg_locks WHERE relation = 'receipt_jobs'::regclass"
            " AND pid = pg_backend_pid()").fetchall()
        assert mode == "ShareUpdateExclusiveLock"
        validating.commit()
