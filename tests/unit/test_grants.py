"""The least-privilege table: every statement has its rights, the printed text is exact."""

from __future__ import annotations

import pytest

from receipts import grants
from receipts.grants import (
    ENQUEUE_FUNCTION,
    JOBS,
    KINDS,
    STATEMENTS,
    GrantsError,
    Right,
    grants_sql,
    parse_assignments,
    rights,
)
from receipts.statements import statements


def test_every_statement_of_queries_sql_has_its_rights_and_no_other_name_is_listed():
    blocks = set(statements())
    assert set(STATEMENTS) - grants.ELSEWHERE == blocks - grants.FRAGMENTS
    assert blocks >= grants.FRAGMENTS
    assert not grants.ELSEWHERE & blocks


def test_every_statement_is_run_by_a_known_kind_and_names_known_objects():
    objects = set(grants.TABLES)
    for name, need in STATEMENTS.items():
        assert need.kinds and need.kinds <= set(KINDS) - {grants.OWNER}, name
        named = {*need.select, *need.insert, *need.update, *need.delete,
                 *need.insert_columns, *need.select_columns}
        assert named <= objects, name


def test_an_enqueue_only_role_gets_execute_on_the_function_and_nothing_on_any_table():
    assert rights("enqueue") == {Right("schema", "USAGE"), Right(ENQUEUE_FUNCTION, "EXECUTE")}


def test_the_python_enqueue_role_gets_column_rights_that_leave_state_and_lease_alone():
    python = rights("enqueue-python")
    assert {r for r in python if r.obj == JOBS} == {
        Right(JOBS, "INSERT", c) for c in ("id", "order_id", "run_at", "traceparent")
    } | {Right(JOBS, "SELECT", c) for c in ("id", "order_id")}
    assert not any(r.column in ("state", "attempts", "lease_token") for r in python)


def test_no_kind_but_recovery_may_delete_and_no_service_may_insert_jobs():
    for kind in set(KINDS) - {"owner"}:
        deletes = {r.obj for r in rights(kind) if r.privilege == "DELETE"}
        assert deletes == ({JOBS, "receipt_attempts"} if kind == "recover" else set()), kind
        whole_inserts = {r.obj for r in rights(kind) if r.privilege == "INSERT" and not r.column}
        assert JOBS not in whole_inserts, kind


def test_the_printed_text_revokes_first_then_grants_each_table_once():
    text = grants_sql(parse_assignments(["worker=receipts_worker"]), schema="shop",
                      version="9.9")
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("--")]
    assert lines[0] == 'CREATE SCHEMA IF NOT EXISTS "shop";'
    assert lines[1].startswith('REVOKE ALL ON TABLE "shop".receipts_schema_migrations, '
                               '"shop".receipt_jobs, "shop".receipt_flow, '
                               '"shop".receipt_attempts FROM "receipts_worker"')
    assert 'GRANT SELECT, UPDATE ON TABLE "shop".receipt_jobs TO "receipts_worker";' in lines
    assert 'GRANT pg_read_all_stats TO "receipts_worker";' in lines
    assert sum("receipt_jobs TO" in ln for ln in lines) == 1


def test_role_names_are_quoted_as_identifiers():
    text = grants_sql({'odd"name': ["review"]}, schema="public")
    assert 'TO "odd""name";' in text


@pytest.mark.parametrize(("pairs", "message"), [
    (["worker"], "is not KIND=ROLE"),
    (["worker="], "is not KIND=ROLE"),
    (["janitor=x"], "unknown kind 'janitor'"),
    (["worker=pg_monitor"], "reserved"),
    (["worker=public"], "reserved"),
    (["worker=" + "x" * 64], "longer than 63 bytes"),
    (["worker=a", "worker=b"], "given twice"),
    (["owner=a", "worker=a"], "the owner has every right"),
])
def test_bad_assignments_are_refused_in_one_line(pairs, message):
    with pytest.raises(GrantsError, match=message):
        parse_assignments(pairs)


def test_one_role_may_hold_several_kinds_and_gets_one_block():
    roles = parse_assignments(["worker=svc", "recover=svc"])
    assert roles == {"svc": ["worker", "recover"]}
    text = grants_sql(roles, schema="public")
    assert text.count('REVOKE ALL ON TABLE') == 1
    assert 'GRANT SELECT, UPDATE, DELETE ON TABLE "public".receipt_jobs TO "svc";' in text
