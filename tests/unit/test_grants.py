"""The least-privilege table: every statement has its rights, the printed text is exact."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from receipts import grants
from receipts.grants import (
    ATTEMPTS,
    BULK_ACTIONS,
    ENQUEUE_FUNCTION,
    FLOW,
    JOBS,
    KINDS,
    STATEMENTS,
    UI_REVOKED,
    WORKERS,
    GrantsError,
    Right,
    grants_sql,
    parse_assignments,
    rights,
)
from receipts.statements import statements

ROOT = Path(__file__).resolve().parents[2]


def test_every_statement_of_the_sql_files_has_its_rights_and_no_other_name_is_listed():
    blocks = set(statements())
    assert set(STATEMENTS) - grants.ELSEWHERE == blocks - grants.FRAGMENTS
    assert blocks >= grants.FRAGMENTS
    assert not grants.ELSEWHERE & blocks


def _tables(need: grants.Need, *rights: str) -> set[str]:
    named: set[str] = set()
    for right in rights:
        named |= set(getattr(need, right))
        named |= set(getattr(need, f"{right}_columns", {}))
    return named


def test_every_statement_names_exactly_the_tables_its_line_gives_rights_on():
    """The line of a statement lists every table its text names, and only those; a table
    it inserts into, updates or deletes from has that right (whole or on columns)."""
    texts = statements("q")
    for name, need in STATEMENTS.items():
        if name in grants.ELSEWHERE:
            continue
        text = texts[name]
        called = set(re.findall(r'"q"\.(\w+)\(', text))
        named = set(re.findall(r'"q"\.(\w+)', text)) - called
        assert named == _tables(need, "select", "insert", "update", "delete"), name
        # every function its line lets it execute is one it calls (a function PUBLIC may
        # execute needs no line)
        assert {f.split("(")[0] for f in need.execute} <= called, name
        inserted = set(re.findall(r'INSERT INTO "q"\.(\w+)', text))
        updated = set(re.findall(r'UPDATE "q"\.(\w+)', text))
        if "DO UPDATE" in text:
            updated |= inserted
        deleted = set(re.findall(r'DELETE FROM "q"\.(\w+)', text))
        assert inserted <= _tables(need, "insert"), name
        assert updated <= _tables(need, "update"), name
        assert deleted == _tables(need, "delete"), name
        if "FOR UPDATE" in text:
            assert _tables(need, "update"), name


def test_a_bulk_batch_may_write_what_either_effect_sets_and_no_more():
    texts = statements()
    effects = {name: set(re.findall(r"^(\w+) =", texts[f"{name}_effect"], re.M))
               for name in ("retry", "discard")}
    assert effects["retry"] == set(grants._RETRIED[JOBS])
    assert effects["discard"] == set(grants._DISCARDED[JOBS]) < effects["retry"]
    assert STATEMENTS["bulk_step"].update_columns == {JOBS: grants._RETRIED[JOBS]}


def test_every_statement_is_run_by_a_known_kind_and_names_known_objects():
    objects = set(grants.TABLES)
    for name, need in STATEMENTS.items():
        assert need.kinds and need.kinds <= set(KINDS) - {grants.OWNER}, name
        named = {*need.select, *need.insert, *need.update, *need.delete,
                 *need.insert_columns, *need.select_columns}
        assert named <= objects, name


def test_the_function_role_gets_execute_and_the_column_rights_of_the_insert_it_runs():
    """receipts_enqueue() runs with its caller's rights (migration 0009): the table's
    constraints, not the function, stand between the role and a bad row."""
    assert rights("enqueue") == rights("enqueue-python") | {Right(ENQUEUE_FUNCTION, "EXECUTE")}


def test_the_enqueue_roles_get_column_rights_that_leave_state_and_lease_alone():
    for kind in ("enqueue", "enqueue-python"):
        mine = rights(kind)
        assert {r for r in mine if r.obj == JOBS} == {
            Right(JOBS, "INSERT", c) for c in ("id", "order_id", "run_at", "traceparent")
        } | {Right(JOBS, "SELECT", "id")}  # RETURNING id; never order_id: no reading orders
        assert not any(r.column in ("state", "attempts", "lease_token") for r in mine)


def test_no_kind_may_delete_jobs_or_history_and_no_service_may_insert_jobs():
    """Pruning goes through receipts_prune() (finished rows past retention only)."""
    own = {"worker": {WORKERS}, "review": {BULK_ACTIONS, UI_REVOKED}}
    for kind in set(KINDS) - {"owner"}:
        deletes = {r.obj for r in rights(kind) if r.privilege == "DELETE"}
        assert deletes == own.get(kind, set()), kind
        whole_inserts = {r.obj for r in rights(kind) if r.privilege == "INSERT" and not r.column}
        assert JOBS not in whole_inserts, kind
    assert Right(grants.PRUNE_FUNCTION, "EXECUTE") in rights("recover")


def test_the_attempt_history_is_append_only_for_every_service_kind():
    for kind in set(KINDS) - {"owner"}:
        writes = {r.privilege for r in rights(kind)
                  if r.obj == ATTEMPTS and r.privilege != "SELECT"}
        assert writes == set(), kind
    for kind in ("worker", "recover", "review"):
        assert Right(grants.RECORD_FUNCTION, "EXECUTE") in rights(kind), kind


def test_the_worker_updates_named_columns_of_a_job_never_its_order_or_identity():
    worker = rights("worker")
    assert Right(JOBS, "UPDATE") not in worker
    jobs = {r.column for r in worker if r.obj == JOBS and r.privilege == "UPDATE"}
    assert jobs == {"state", "attempts", "in_progress_count", "run_at", "finished_at",
                    "lease_token", "lease_until", "last_token", "last_error"}


def test_the_review_role_updates_only_the_columns_its_actions_write():
    review = rights("review")
    jobs = {r.column for r in review if r.obj == JOBS and r.privilege == "UPDATE"}
    assert jobs == {"state", "attempts", "run_at", "finished_at", "last_error", "lease_token",
                    "lease_until"}  # never order_id, traceparent or last_token
    flow = {r.column for r in review if r.obj == FLOW and r.privilege == "UPDATE"}
    assert flow == {"pause_reason", "paused_until", "pause_seconds", "probe_until",
                    "pause_cause", "pause_cause_until", "pause_note", "paused_by", "paused_at"}
    assert not flow & {"tokens", "tokens_at", "last_probe_at", "last_probe_outcome"}
    # Recover now: the history record of an expired lease, through the function.
    assert Right(grants.RECORD_FUNCTION, "EXECUTE") in review
    assert {r.obj for r in review if r.privilege == "SELECT"} == {
        JOBS, FLOW, ATTEMPTS, WORKERS, BULK_ACTIONS, UI_REVOKED}


def test_the_worker_alone_writes_heartbeats_and_nothing_of_the_console():
    worker = rights("worker")
    assert {r for r in worker if r.obj == WORKERS} == {
        Right(WORKERS, p) for p in ("SELECT", "INSERT", "UPDATE", "DELETE")}
    assert not any(r.obj in (BULK_ACTIONS, UI_REVOKED) for r in worker)
    for kind in set(KINDS) - {"owner", "worker"}:
        assert not any(r.obj == WORKERS and r.privilege != "SELECT" for r in rights(kind)), kind


def test_the_printed_text_revokes_first_then_grants_each_table_once():
    text = grants_sql(parse_assignments(["worker=receipts_worker"]), schema="shop",
                      version="9.9")
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("--")]
    assert lines[0] == 'CREATE SCHEMA IF NOT EXISTS "shop";'
    assert lines[1] == ('REVOKE ALL ON TABLE "shop".receipts_schema_migrations, '
                        '"shop".receipt_jobs, "shop".receipt_flow, "shop".receipt_attempts, '
                        '"shop".receipt_workers, "shop".receipt_bulk_actions, '
                        '"shop".receipt_ui_revoked FROM "receipts_worker";')
    assert ('GRANT SELECT, UPDATE (attempts, finished_at, in_progress_count, last_error, '
            'last_token, lease_token, lease_until, run_at, state) ON TABLE "shop".receipt_jobs '
            'TO "receipts_worker";') in lines
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
    # A line break would end the comment naming the role and run the rest as SQL.
    (["worker=x\nGRANT ALL ON TABLE receipt_jobs TO PUBLIC; --"], "control character"),
    (["worker=x\ty"], "control character"),
    (["worker= bob"], "surrounding spaces"),
])
def test_bad_assignments_are_refused_in_one_line(pairs, message):
    with pytest.raises(GrantsError, match=message):
        parse_assignments(pairs)


def test_one_role_may_hold_several_kinds_and_gets_one_block():
    roles = parse_assignments(["worker=svc", "recover=svc"])
    assert roles == {"svc": ["worker", "recover"]}
    text = grants_sql(roles, schema="public")
    assert text.count('REVOKE ALL ON TABLE') == 1
    assert ('GRANT SELECT, UPDATE (attempts, finished_at, in_progress_count, last_error, '
            'last_token, lease_token, lease_until, run_at, state) ON TABLE '
            '"public".receipt_jobs TO "svc";') in text
    assert "DELETE ON TABLE \"public\".receipt_jobs" not in text


def test_a_role_of_two_kinds_gets_the_whole_table_right_instead_of_the_columns():
    text = grants_sql(parse_assignments(["worker=ops", "review=ops"]), schema="public")
    assert 'GRANT SELECT, UPDATE ON TABLE "public".receipt_flow TO "ops";' in text
    assert 'UPDATE (pause' not in text
    # the worker's job columns cover the review kind's: still no order_id
    assert ('UPDATE (attempts, finished_at, in_progress_count, last_error, last_token, '
            'lease_token, lease_until, run_at, state) ON TABLE "public".receipt_jobs') in text


def test_the_review_role_gets_column_updates_in_one_readable_line_per_table():
    text = grants_sql(parse_assignments(["review=queue_review"]), schema="public")
    assert ('GRANT SELECT, UPDATE (attempts, finished_at, last_error, lease_token, lease_until,'
            ' run_at, state) ON TABLE "public".receipt_jobs TO "queue_review";') in text
    assert 'GRANT SELECT, INSERT, DELETE ON TABLE "public".receipt_ui_revoked' in text


def test_the_grants_the_readme_quotes_are_what_print_grants_prints():
    """Every GRANT or REVOKE line the README quotes in full is printed as quoted; an elided
    line (…) starts as printed."""
    text = (ROOT / "README.md").read_text("utf-8")
    quoted = [ln.strip() for ln in text.splitlines() if re.match(r"\s*(GRANT|REVOKE) ", ln)]
    assert quoted
    printed = grants_sql({"orders_app": ["enqueue"], "queue_worker": ["worker"]},
                         schema="public").splitlines()
    for line in quoted:
        if "…" in line:
            assert any(p.startswith(line.split("…")[0]) for p in printed), line
        else:
            assert line in printed, line


def test_the_design_tables_rows_name_the_tables_each_kind_gets_rights_on():
    text = (ROOT / "docs/design.md").read_text("utf-8")
    section = text[text.index("### Least-privilege roles"):]
    section = section[:section.index("\n## ")]
    rows = dict(re.findall(r"^\| `([a-z-]+)` \| [^|]* \| (.*) \|$", section, re.M))
    assert set(rows) == set(KINDS)
    for kind in set(KINDS) - {"owner"}:
        named = set(re.findall(r"`(receipts?_\w+)`", rows[kind])) - {
            f.split("(")[0] for f in grants.FUNCTIONS}
        tables = {r.obj for r in rights(kind) if r.obj in grants.TABLES}
        assert named == tables, kind
        member = any(r.privilege == "MEMBER" for r in rights(kind))
        assert ("pg_read_all_stats" in rows[kind]) == member, kind
