"""``receipts_enqueue(order_id, run_at, traceparent)``: enqueue from any language.

Called from ``psql`` (the client the embedded PostgreSQL ships) as an order
service in another language would, and compared rule by rule with the Python
API's order id check.
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import psycopg
import pytest

from receipts.embedded import bin_dir
from receipts.enqueue import check_order_id
from receipts.errors import InvalidOrderId
from tests.conftest import fetch_rows
from tests.integration.test_enqueue_api import Listener


def psql(dsn: str, sql: str) -> subprocess.CompletedProcess[str]:
    """Run *sql* with psql (stop at the first error; unaligned, tuples only)."""
    return subprocess.run(
        [str(bin_dir() / "psql"), "-X", "-v", "ON_ERROR_STOP=1", "-At", "-d", dsn, "-c", sql],
        capture_output=True, text=True, timeout=60,
    )


def test_psql_enqueues_returns_the_id_then_null_for_a_duplicate(dsn):
    first = psql(dsn, "SELECT receipts_enqueue('psql-1')")
    assert first.returncode == 0, first.stderr
    job_id = uuid.UUID(first.stdout.strip())
    again = psql(dsn, "SELECT receipts_enqueue('psql-1') IS NULL")
    assert again.returncode == 0 and again.stdout.strip() == "t"
    rows = fetch_rows(dsn, "SELECT id, state, attempts, run_at <= now() FROM receipt_jobs")
    assert rows == [(job_id, "ready", 0, True)]


@pytest.mark.slow
def test_psql_enqueue_is_part_of_the_callers_transaction(dsn):
    result = psql(dsn, "BEGIN; SELECT receipts_enqueue('psql-rolled-back'); ROLLBACK;")
    assert result.returncode == 0, result.stderr
    result = psql(dsn, "BEGIN; SELECT receipts_enqueue('psql-kept'); COMMIT;")
    assert result.returncode == 0, result.stderr
    assert fetch_rows(dsn, "SELECT order_id FROM receipt_jobs") == [("psql-kept",)]


@pytest.mark.slow
def test_psql_named_arguments_run_at_and_traceparent(dsn):
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    result = psql(dsn, "SELECT receipts_enqueue(order_id => 'later',"
                       " run_at => '2031-01-02 03:04:05+00',"
                       f" traceparent => '{traceparent}')")
    assert result.returncode == 0, result.stderr
    assert psql(dsn, "SELECT receipts_enqueue('no-run-at', NULL)").returncode == 0
    rows = dict((r[0], r[1:]) for r in fetch_rows(
        dsn, "SELECT order_id, to_char(run_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS'),"
             " traceparent, run_at <= now() FROM receipt_jobs"))
    assert rows["later"] == ("2031-01-02 03:04:05", traceparent, False)
    assert rows["no-run-at"][1:] == (None, True)


@pytest.mark.slow
def test_psql_refuses_a_malformed_traceparent(dsn):
    result = psql(dsn, "SELECT receipts_enqueue('x', now(), 'not-a-traceparent')")
    assert result.returncode != 0 and "receipt_jobs_traceparent_format" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("order_id", "message"), [
    ("", "must not be empty"),  # Python: "must be a non-empty string"
    ("x" * 201, "is longer than 200 characters"),
    ("tab\there", "contains control characters"),
    ("del\x7f", "contains control characters"),
    (" lead", "starts or ends with whitespace"),
    ("trail\u3000", "starts or ends with whitespace"),
])
def test_psql_gets_the_same_refusals_as_the_python_api(dsn, order_id, message):
    literal = "'" + order_id.replace("'", "''") + "'"
    result = psql(dsn, f"SELECT receipts_enqueue({literal})")
    assert result.returncode != 0
    assert f"receipts: order id {message}" in result.stderr
    with pytest.raises(InvalidOrderId):
        check_order_id(order_id)
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs") == [(0,)]


def test_a_null_order_id_is_refused_with_sqlstate_22023(dsn):
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("SELECT receipts_enqueue(NULL)")


def _edge_cases() -> list[str]:
    spaces = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]
    cases = ["plain", "x" * 200, "x" * 201, "ørder-日本", "o'quote\"", "a b", "a\u00a0b",
             "\u0080c1", "m\u0085id"]
    cases += [f"{s}edge" for s in spaces] + [f"edge{s}" for s in spaces]
    cases += [f"in{chr(c)}side" for c in [*range(1, 0x20), 0x7F]]
    return cases


@pytest.mark.slow
def test_sql_and_python_accept_exactly_the_same_order_ids(dsn):
    """Rule parity over every whitespace character, every control character and lengths."""
    disagreements = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for order_id in _edge_cases():
            try:
                check_order_id(order_id)
                python_ok = True
            except InvalidOrderId:
                python_ok = False
            try:
                conn.execute("SELECT receipts_enqueue(%s)", (order_id,))
                sql_ok = True
            except psycopg.errors.InvalidParameterValue:
                sql_ok = False
            if python_ok != sql_ok:
                disagreements.append((order_id, python_ok, sql_ok))
    assert disagreements == []


@pytest.mark.slow
def test_psql_enqueue_sends_no_notification_from_the_callers_transaction(dsn):
    # A pending notification serialises the commits of every notifying
    # transaction in the instance: the checkout's commit must not carry one.
    listener = Listener(dsn)
    try:
        result = psql(dsn, "BEGIN; SELECT receipts_enqueue('w-' || g)"
                           " FROM generate_series(1, 50) g; COMMIT;")
        assert result.returncode == 0, result.stderr
        assert listener.count() == 0
        assert psql(dsn, "SELECT receipts_enqueue('w-51')").returncode == 0
        assert listener.count() == 0
    finally:
        listener.close()
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs") == [(51,)]


@pytest.mark.slow
def test_the_function_finds_its_table_whatever_the_callers_search_path(dsn):
    result = psql(dsn, "SET search_path = pg_catalog; SELECT public.receipts_enqueue('sp-1');")
    assert result.returncode == 0, result.stderr
    assert fetch_rows(dsn, "SELECT order_id FROM receipt_jobs") == [("sp-1",)]
