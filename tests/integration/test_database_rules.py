"""The job row's rules in the database (docs/design.md, "Every rule in the database, for
every role"). Migration 0009 on a queue that already has rows: what breaks the new rules is
failed before the rules hold, and the constraints are validated afterwards, outside the
migration's exclusive lock. Migration 0012's one constraint: each rule refuses by name,
exactly the rows the nine constraints it replaced refused, whatever the caller's
search_path."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bench.pg import NINE_CHECKS
from receipts.migrate import apply_migrations, bundled_migrations, validate_constraints
from tests.conftest import Server, fetch_rows

SHIPPED = bundled_migrations()
BEFORE_RULES = [m for m in SHIPPED if m.version < "0009"]
RULES = ("receipt_jobs_rules",)


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


# ------------------------------------------------------ the rules in one check (0012)

_PENDING = ("INSERT INTO receipt_jobs (id, order_id, state, run_at, attempts, in_progress_count,"
            " lease_token, lease_until, finished_at, traceparent) VALUES (gen_random_uuid(),"
            " %(order_id)s, %(state)s, %(run_at)s, %(attempts)s, %(in_progress)s,"
            " CASE WHEN %(token)s THEN gen_random_uuid() END,"
            " CASE WHEN %(until)s THEN now() + interval '1 minute' END,"
            " CASE WHEN %(finished)s THEN now() END, %(traceparent)s)")
_GOOD = {"order_id": "secret-order-7", "state": "ready", "run_at": "2026-01-01T00:00:00Z",
         "attempts": 0, "in_progress": 0, "token": False, "until": False, "finished": False,
         "traceparent": None}
BROKEN_ROWS = {
    "receipt_jobs_state_check": {"state": "lost"},
    "receipt_jobs_attempts_check": {"attempts": -1},
    "receipt_jobs_in_progress_count_check": {"in_progress": -1},
    "receipt_jobs_check": {"state": "running"},
    "receipt_jobs_check1": {"until": True},
    "receipt_jobs_finished_check": {"state": "done", "token": False},
    "receipt_jobs_order_id_rules": {"order_id": " secret-order-7"},
    "receipt_jobs_run_at_finite": {"run_at": "infinity"},
    "receipt_jobs_traceparent_format": {"traceparent": "secret-not-a-traceparent"},
}


def test_the_rules_are_one_constraint_and_every_one_is_validated(dsn):
    assert _validated(dsn) == {"receipt_jobs_rules": True}


@pytest.mark.parametrize("rule", sorted(BROKEN_ROWS))
def test_each_rule_refuses_its_row_by_name_and_echoes_no_value(dsn, rule):
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(_PENDING, _GOOD)  # the base row keeps every rule
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            conn.execute(_PENDING, _GOOD | {"order_id": "secret-order-8"} | BROKEN_ROWS[rule])
    error = refused.value
    assert error.diag.constraint_name == "receipt_jobs_rules"
    assert error.diag.table_name == "receipt_jobs"
    assert f"breaks the rule {rule} (" in str(error)
    assert "secret" not in str(error) and "secret" not in (error.diag.message_detail or "")


@pytest.mark.parametrize("rule", ["receipt_jobs_order_id_rules", "receipt_jobs_run_at_finite"])
def test_finished_rows_are_exempt_from_the_enqueue_rules(dsn, rule):
    finished = {"state": "failed", "finished": True}
    fetch_rows(dsn, _PENDING + " RETURNING 1", _GOOD | BROKEN_ROWS[rule] | finished)


def test_an_update_is_held_to_the_rules_too(dsn):
    fetch_rows(dsn, _PENDING + " RETURNING 1", _GOOD)
    with psycopg.connect(dsn, autocommit=True) as conn, \
            pytest.raises(psycopg.errors.CheckViolation, match="receipt_jobs_check1"):
        conn.execute("UPDATE receipt_jobs SET lease_until = now()")


def test_a_role_s_own_operators_and_functions_on_its_search_path_change_no_rule(dsn):
    """The rules' function is resolved with the caller's search_path (PL/pgSQL), so it names
    pg_catalog's operators and functions itself: shadowing `=`, `>=`, `!~` or length() in a
    schema searched first lets no broken row through."""
    _execute(dsn, """
        CREATE SCHEMA shadow;
        CREATE FUNCTION shadow.yes(text, text) RETURNS boolean LANGUAGE sql
          AS 'SELECT true';
        CREATE FUNCTION shadow.yes_int(integer, integer) RETURNS boolean LANGUAGE sql
          AS 'SELECT true';
        CREATE FUNCTION shadow.length(text) RETURNS integer LANGUAGE sql AS 'SELECT 5';
        CREATE OPERATOR shadow.= (LEFTARG = text, RIGHTARG = text, FUNCTION = shadow.yes);
        CREATE OPERATOR shadow.!~ (LEFTARG = text, RIGHTARG = text, FUNCTION = shadow.yes);
        CREATE OPERATOR shadow.>= (LEFTARG = integer, RIGHTARG = integer,
                                   FUNCTION = shadow.yes_int);
        CREATE DOMAIN shadow.text AS pg_catalog.text CHECK (false);
        CREATE DOMAIN shadow.bool AS pg_catalog.bool CHECK (false);""")
    with psycopg.connect(dsn, autocommit=True) as conn:  # its own types: no denial either
        conn.execute("SET search_path = shadow, pg_catalog, public")
        conn.execute(_PENDING.replace("receipt_jobs", "public.receipt_jobs"), _GOOD)
    for rule in ("receipt_jobs_state_check", "receipt_jobs_attempts_check",
                 "receipt_jobs_order_id_rules"):
        broken = BROKEN_ROWS[rule] | ({"order_id": ""} if rule.endswith("order_id_rules") else {})
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET search_path = shadow, pg_catalog, public")
            assert conn.execute("SELECT 'a' = 'b', length('')").fetchone() == (True, 5)
            with pytest.raises(psycopg.errors.CheckViolation, match=rule):
                conn.execute(_PENDING.replace("receipt_jobs", "public.receipt_jobs"),
                             _GOOD | broken)


_ORDER_IDS = ["o-1", "", "x" * 200, "x" * 201, " lead", "trail ", "tab\tin", "bell\x07",
              "del\x7f", "\u00a0nbsp", "ideo\u3000", "mid space ok", "ünïcødé", "\u2028line"]
_TRACEPARENTS = [None, "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "01-" + "a" * 32 + "-" + "b" * 16
                 + "-01", "00-" + "A" * 32 + "-" + "b" * 16 + "-01", "junk"]
_CHOICES: dict[str, list[object]] = {
    "order_id": _ORDER_IDS,
    "state": ["ready", "running", "done", "failed", "discarded", "lost"],
    "run_at": ["2026-01-01T00:00:00Z", "infinity", "-infinity"],
    "attempts": [-1, 0, 3], "in_progress": [-1, 0, 2],
    "token": [False, True], "until": [False, True], "finished": [False, True],
    "traceparent": _TRACEPARENTS,
}
_BASES = [_GOOD, _GOOD | {"state": "running", "token": True, "until": True},
          _GOOD | {"state": "done", "finished": True},
          _GOOD | {"state": "failed", "finished": True}]


@st.composite
def _rows(draw: st.DrawFn) -> dict[str, object]:
    """A row that keeps every rule, with up to three of its fields changed (so that
    most rows sit next to a rule's edge rather than far across several)."""
    row = dict(draw(st.sampled_from(_BASES)))
    for field in draw(st.lists(st.sampled_from(sorted(_CHOICES)), max_size=3)):
        row[field] = draw(st.sampled_from(_CHOICES[field]))
    return row


@pytest.fixture
def twin_tables(dsn: str) -> Iterator[psycopg.Connection]:
    """Two empty copies of receipt_jobs: ``now_rules`` with migration 0012's constraint,
    ``old_rules`` with the nine constraints it replaced (bench.pg.NINE_CHECKS)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE now_rules (LIKE receipt_jobs INCLUDING DEFAULTS"
                     " INCLUDING CONSTRAINTS)")
        conn.execute("CREATE TABLE old_rules (LIKE receipt_jobs INCLUDING DEFAULTS"
                     " INCLUDING CONSTRAINTS)")
        conn.execute(NINE_CHECKS.replace("ALTER TABLE receipt_jobs", "ALTER TABLE old_rules"))
        yield conn


def _accepted(conn: psycopg.Connection, table: str, row: dict[str, object]) -> bool:
    try:
        with conn.transaction(force_rollback=True):
            conn.execute(_PENDING.replace("receipt_jobs", table), row)
    except psycopg.errors.CheckViolation:
        return False
    return True


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(row=_rows())
@example(row=_GOOD)
@example(row=_GOOD | {"state": "running", "token": True, "until": True})
@example(row=_GOOD | {"state": "discarded", "finished": True, "order_id": "", "run_at": "infinity"})
@example(row=_GOOD | {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
def test_the_one_check_accepts_exactly_the_rows_the_nine_accepted(twin_tables, row):
    """The explicit examples are rows both accept; drawn rows are near a rule's edge."""
    assert _accepted(twin_tables, "now_rules", row) == _accepted(twin_tables, "old_rules", row)


def test_every_single_change_of_a_good_row_is_judged_as_the_nine_judged_it(twin_tables):
    """Every row one field away from a row that keeps every rule, exhaustively."""
    judged = 0
    for base in _BASES:
        for field, values in _CHOICES.items():
            for value in values:
                row = base | {field: value}
                assert _accepted(twin_tables, "now_rules", row) == \
                    _accepted(twin_tables, "old_rules", row), row
                judged += 1
    assert judged == 4 * sum(len(v) for v in _CHOICES.values())
