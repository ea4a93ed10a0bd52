"""Schema version and check, and the SQL for teams that own their migrations.

``check_schema`` is what a worker calls at start-up: it must accept exactly
the shipped migrations, and those plus a later release's (the rollback contract:
migrations only add within a major version), and refuse, in one line, a database
with pending ones, with a breaking or foreign migration it does not know, or with
an applied file that differs. ``receipts migrate --print-sql`` applied by psql
must give a database that passes the same check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import psycopg
import pytest

from receipts.embedded import bin_dir
from receipts.migrate import (
    SchemaMismatch,
    apply_migrations,
    bundled_migrations,
    check_schema,
    check_schema_async,
    migration_sql,
    schema_status,
)
from tests.conftest import fetch_rows

SHIPPED = bundled_migrations()
NEWEST = SHIPPED[-1].version


@pytest.fixture
def empty_dsn(server):
    url = server.new_database(migrated=False)
    yield url
    server.drop_database(url)


def status_of(dsn: str):
    with psycopg.connect(dsn, autocommit=True) as conn:
        return schema_status(conn)


def check(dsn: str):
    with psycopg.connect(dsn, autocommit=True) as conn:
        return check_schema(conn)


def receipts(*args: str, dsn: str | None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")}
    env = clean | (env or {})
    if dsn is not None:
        env["RECEIPTS_DATABASE_URL"] = dsn
    return subprocess.run([sys.executable, "-m", "receipts", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def psql_file(dsn: str, sql: str) -> subprocess.CompletedProcess[str]:
    """Apply *sql* with psql in one transaction, stopping at the first error."""
    return subprocess.run(
        [str(bin_dir() / "psql"), "-X", "-q", "-1", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", "-"],
        input=sql, capture_output=True, text=True, timeout=60,
    )


# ------------------------------------------------------------ check_schema


@pytest.mark.slow
def test_a_migrated_database_passes_and_reports_its_version(dsn):
    status = check(dsn)
    assert status.current and status.version == NEWEST == status.expected
    assert status.applied == tuple(m.version for m in SHIPPED)
    assert status.describe() == f"schema version {NEWEST} (up to date)"


def test_an_empty_database_is_refused_in_one_line(empty_dsn):
    with pytest.raises(SchemaMismatch) as refused:
        check(empty_dsn)
    message = str(refused.value)
    assert "no receipts tables" in message and "run `receipts migrate`" in message
    assert "\n" not in message
    assert status_of(empty_dsn).version is None


def test_pending_migrations_are_refused_naming_them(empty_dsn):
    apply_migrations(empty_dsn, migrations=SHIPPED[:1])
    status = status_of(empty_dsn)
    assert status.version == SHIPPED[0].version
    assert status.pending == tuple(m.version for m in SHIPPED[1:])
    with pytest.raises(SchemaMismatch, match=f"expects {NEWEST}: {len(SHIPPED) - 1} "
                                             r"migration\(s\) pending") as refused:
        check(empty_dsn)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_a_later_release_s_migrations_are_accepted_as_a_newer_schema(dsn):
    # The rollback contract: migrations only add within a major version, so this version
    # runs on the schema a later release left behind.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO receipts_schema_migrations (version, checksum)"
                     " VALUES ('9999_from_the_future.sql', 'x')")
    status = status_of(dsn)
    assert status.unknown == ("9999_from_the_future.sql",) and not status.pending
    assert status.version == "9999_from_the_future.sql"
    assert status.newer and status.usable and not status.current
    assert check(dsn) == status
    assert "newer than receipts" in status.describe() and "runs on it" in status.describe()


@pytest.mark.parametrize("version", [
    "9999_breaking_drop_the_token.sql",  # a new major version says so in its name
    "0000_from_another_lineage.sql",  # not after ours: not a later release of this one
])
def test_a_breaking_or_foreign_migration_is_refused(dsn, version):
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO receipts_schema_migrations (version, checksum)"
                     " VALUES (%s, 'x')", (version,))
    status = status_of(dsn)
    assert status.unknown == (version,) and not status.newer
    with pytest.raises(SchemaMismatch, match="migrated by a newer version; upgrade receipts"):
        check(dsn)


def test_an_applied_migration_that_differs_is_refused(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE receipts_schema_migrations SET checksum = 'edited'"
                     " WHERE version = %s", (SHIPPED[0].version,))
    with pytest.raises(SchemaMismatch, match=f"{SHIPPED[0].version} differ"):
        check(dsn)


@pytest.mark.slow
async def test_the_async_check_gives_the_same_answers(dsn, empty_dsn):
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        assert (await check_schema_async(conn)).version == NEWEST
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as conn:
        with pytest.raises(SchemaMismatch, match="no receipts tables"):
            await check_schema_async(conn)


@pytest.mark.slow
def test_the_check_only_reads_and_leaves_a_transaction_usable(empty_dsn):
    with psycopg.connect(empty_dsn) as conn:
        assert not schema_status(conn).current  # no tracking table: no error raised
        conn.execute("SELECT 1")


# ------------------------------------------------------------ --print-sql


@pytest.mark.slow
def test_print_sql_applied_by_psql_gives_the_same_schema_as_migrate(dsn, empty_dsn):
    result = psql_file(empty_dsn, migration_sql())
    assert result.returncode == 0, result.stderr
    assert check(empty_dsn).version == NEWEST

    def shape(url: str) -> list[tuple[object, ...]]:
        return fetch_rows(url, """
            SELECT 'column', table_name || '.' || column_name || ' ' || data_type
              FROM information_schema.columns WHERE table_schema = 'public'
            UNION ALL SELECT 'index', indexdef FROM pg_indexes WHERE schemaname = 'public'
            UNION ALL SELECT 'constraint', conname || ' ' || pg_get_constraintdef(oid)
              FROM pg_constraint WHERE connamespace = 'public'::regnamespace
            UNION ALL SELECT 'function', p.oid::regprocedure::text
              FROM pg_proc p WHERE pronamespace = 'public'::regnamespace
            UNION ALL SELECT 'reloptions', array_to_string(reloptions, ',')
              FROM pg_class WHERE relname = 'receipt_jobs'
            ORDER BY 1, 2""")

    assert shape(empty_dsn) == shape(dsn)
    # Running `receipts migrate` afterwards finds nothing to do.
    assert apply_migrations(empty_dsn) == []


def test_print_sql_validates_only_constraints_the_schema_still_has(dsn):
    """0009 added two constraints NOT VALID and 0012 dropped them: the printed
    VALIDATE statements name what the migrated schema holds, nothing it dropped."""
    named = re.findall(r"VALIDATE CONSTRAINT (\w+);", migration_sql())
    held = {name for (name,) in fetch_rows(
        dsn, "SELECT conname FROM pg_constraint WHERE connamespace = 'public'::regnamespace")}
    assert named == ["receipt_jobs_rules"] and set(named) <= held
    after_0009 = migration_sql(migrations=[m for m in SHIPPED if m.version < "0012"])
    assert re.findall(r"VALIDATE CONSTRAINT (\w+);", after_0009) == [
        "receipt_jobs_traceparent_format", "receipt_jobs_order_id_rules",
        "receipt_jobs_run_at_finite"]


@pytest.mark.slow
def test_print_sql_pending_prints_only_what_the_database_lacks(empty_dsn):
    apply_migrations(empty_dsn, migrations=SHIPPED[:2])
    result = receipts("migrate", "--print-sql", "--pending", dsn=empty_dsn)
    assert result.returncode == 0, result.stderr
    printed = [line.removeprefix("-- ---- ") for line in result.stdout.splitlines()
               if line.startswith("-- ---- ")]
    assert printed == [m.version for m in SHIPPED[2:]]
    applied = psql_file(empty_dsn, result.stdout)
    assert applied.returncode == 0, applied.stderr
    assert check(empty_dsn).current


@pytest.mark.slow
def test_print_sql_of_everything_needs_no_database():
    result = receipts("migrate", "--print-sql", dsn=None)
    assert result.returncode == 0, result.stderr
    assert result.stdout == migration_sql()
    # No transaction control: the applying tool owns the transaction.
    assert not re.search(r"^\s*(BEGIN|COMMIT|START TRANSACTION|ROLLBACK)\b\s*;", result.stdout,
                         re.IGNORECASE | re.MULTILINE)


# ------------------------------------------------------------ --check


@pytest.mark.slow
def test_migrate_check_exit_codes(dsn, empty_dsn):
    up_to_date = receipts("migrate", "--check", dsn=dsn)
    assert (up_to_date.returncode, up_to_date.stdout.strip()) == (
        0, f"schema version {NEWEST} (up to date)")

    pending = receipts("migrate", "--check", dsn=empty_dsn)
    assert pending.returncode == 3 and "no receipts tables" in pending.stdout
    assert fetch_rows(empty_dsn, "SELECT to_regclass('receipts_schema_migrations')") == [(None,)]

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO receipts_schema_migrations (version, checksum)"
                     " VALUES ('9998_future.sql', 'x')")
    newer = receipts("migrate", "--check", dsn=dsn)
    assert newer.returncode == 0 and "runs on it" in newer.stdout  # a later release's

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO receipts_schema_migrations (version, checksum)"
                     " VALUES ('9999_breaking_future.sql', 'x')")
    unknown = receipts("migrate", "--check", dsn=dsn)
    assert unknown.returncode == 4 and "upgrade receipts" in unknown.stdout


@pytest.mark.slow
def test_pending_without_print_sql_is_bad_usage(dsn):
    result = receipts("migrate", "--pending", dsn=dsn)
    assert result.returncode == 2 and "--pending goes with --print-sql" in result.stderr


# ------------------------------------------------------------ the configured schema


@pytest.mark.slow
def test_the_missing_table_hint_says_what_was_looked_up_and_where(empty_dsn):
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA shop")
    assert apply_migrations(empty_dsn, schema="shop")  # public stays empty
    stats = receipts("jobs", "stats", dsn=empty_dsn)
    assert stats.returncode == 1
    assert 'relation "public.receipt_jobs" does not exist' in stats.stderr
    assert "RECEIPTS_DATABASE_SCHEMA" in stats.stderr
    checked = receipts("migrate", "--check", dsn=empty_dsn)
    assert checked.returncode == 3, checked.stdout + checked.stderr
    assert 'schema "public" of database' in checked.stdout
    assert "set RECEIPTS_DATABASE_SCHEMA=shop" in checked.stdout
    env = {"RECEIPTS_DATABASE_SCHEMA": "shop"}
    assert receipts("migrate", "--check", dsn=empty_dsn, env=env).returncode == 0
    fixed = receipts("enqueue", "in-shop", dsn=empty_dsn, env=env)
    assert fixed.returncode == 0, fixed.stderr
    assert fetch_rows(empty_dsn, "SELECT order_id FROM shop.receipt_jobs") == [("in-shop",)]


@pytest.mark.slow
def test_a_bad_schema_name_is_refused_in_one_line(empty_dsn):
    result = receipts("jobs", "stats", dsn=empty_dsn, env={"RECEIPTS_DATABASE_SCHEMA": "Shop;"})
    assert result.returncode == 2
    assert "lower-case SQL identifier" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_migrations_and_statements_ignore_the_sessions_search_path(empty_dsn):
    from psycopg.conninfo import make_conninfo

    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA elsewhere")
    # The session's search_path points at another schema; the tables still go to
    # (and are found in) the configured one, and none appears in the other.
    misled = make_conninfo(empty_dsn, options="-c search_path=elsewhere")
    apply_migrations(misled, schema="public")
    env = {"RECEIPTS_DATABASE_SCHEMA": "public"}
    assert receipts("enqueue", "o-1", "o-2", dsn=misled, env=env).returncode == 0
    assert receipts("migrate", "--check", dsn=misled, env=env).returncode == 0
    assert fetch_rows(empty_dsn, "SELECT count(*) FROM public.receipt_jobs") == [(2,)]
    assert fetch_rows(empty_dsn, "SELECT count(*) FROM pg_class WHERE relnamespace ="
                                 " 'elsewhere'::regnamespace") == [(0,)]
    # The SQL function keeps the schema it was created in, whatever the caller's path.
    with psycopg.connect(misled, autocommit=True) as conn:
        conn.execute("SELECT public.receipts_enqueue('o-3')")
    assert fetch_rows(empty_dsn, "SELECT count(*) FROM public.receipt_jobs") == [(3,)]


@pytest.mark.slow
def test_print_sql_in_a_configured_schema_applies_there(empty_dsn):
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA shop")
    printed = receipts("migrate", "--print-sql", dsn=None,
                       env={"RECEIPTS_DATABASE_SCHEMA": "shop"})
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == migration_sql(schema="shop")
    applied = psql_file(empty_dsn, printed.stdout)
    assert applied.returncode == 0, applied.stderr
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert check_schema(conn, schema="shop").version == NEWEST
        assert conn.execute("SELECT to_regclass('public.receipt_jobs')").fetchone() == (None,)


@pytest.mark.slow
def test_migrate_refuses_to_split_the_queue_when_its_tables_are_in_another_schema(empty_dsn):
    # An existing installation whose tables were found through a role's
    # search_path: they live in "shop", the DSN names no schema.
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA shop")
    apply_migrations(empty_dsn, schema="shop")
    refused = receipts("migrate", dsn=empty_dsn)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert 'schema "shop"' in refused.stderr
    assert "RECEIPTS_DATABASE_SCHEMA=shop" in refused.stderr
    assert "RECEIPTS_DATABASE_SCHEMA=public" in refused.stderr
    assert fetch_rows(empty_dsn, "SELECT to_regclass('public.receipts_schema_migrations')") == [
        (None,)]
    # Naming the schema upgrades that queue; naming public on purpose makes a second one.
    upgraded = receipts("migrate", dsn=empty_dsn, env={"RECEIPTS_DATABASE_SCHEMA": "shop"})
    assert upgraded.returncode == 0 and "up to date" in upgraded.stdout, upgraded.stderr
    second = receipts("migrate", dsn=empty_dsn, env={"RECEIPTS_DATABASE_SCHEMA": "public"})
    assert second.returncode == 0, second.stderr
    assert check(empty_dsn).current


@pytest.mark.slow
def test_print_sql_takes_the_schema_from_the_dsn_and_creates_it(empty_dsn):
    from psycopg.conninfo import make_conninfo

    in_shop = make_conninfo(empty_dsn, options="-c search_path=shop,public")
    printed = receipts("migrate", "--print-sql", dsn=in_shop)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == migration_sql(schema="shop")
    assert 'CREATE SCHEMA IF NOT EXISTS "shop";' in printed.stdout
    # The schema does not exist yet: the printed text creates it.
    applied = psql_file(empty_dsn, printed.stdout)
    assert applied.returncode == 0, applied.stderr
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert check_schema(conn, schema="shop").version == NEWEST
    assert "CREATE SCHEMA" not in migration_sql(schema="public")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pg_catalog", "pg_temp", "information_schema"])
def test_schemas_reserved_by_postgresql_are_refused(empty_dsn, name):
    result = receipts("migrate", dsn=empty_dsn, env={"RECEIPTS_DATABASE_SCHEMA": name})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "reserved by PostgreSQL" in result.stderr
    printed = receipts("migrate", "--print-sql", dsn=None, env={"RECEIPTS_DATABASE_SCHEMA": name})
    assert printed.returncode == 2 and "reserved by PostgreSQL" in printed.stderr
