"""The soak's CPU bill: process classes, statement classes, the baseline ratio."""

from __future__ import annotations

import pytest

from bench import dbcpu
from bench.soak import (
    CHECKOUT,
    RECOVERY,
    REPORT,
    SAMPLING,
    client_class,
    cpu_vs_baseline,
    phase_cost,
    statement_class,
    statement_name,
    statements_between,
    verdict,
)
from receipts.statements import statements


@pytest.mark.parametrize(("title", "cls"), [
    ("postgres: autovacuum worker soak", dbcpu.AUTOVACUUM),
    ("postgres: checkpointer ", dbcpu.CHECKPOINTER),
    ("postgres: 18/main: checkpointer", dbcpu.CHECKPOINTER),
    ("postgres: walwriter", dbcpu.WALWRITER),
    ("postgres: background writer ", dbcpu.BGWRITER),
    ("postgres: autovacuum launcher", dbcpu.OTHER_BACKGROUND),
    ("postgres: io worker 0", dbcpu.OTHER_BACKGROUND),
    ("postgres: logical replication launcher", dbcpu.OTHER_BACKGROUND),
    # A child just forked, before it sets its title: read again later.
    ("/usr/lib/postgresql/18/bin/postgres -D /tmp/data", None),
    ("postgres: postgres soak 127.0.0.1(37074) idle", None),
    ("postgres: 18/main: app shop [local] INSERT", None),
])
def test_a_server_process_is_classed_by_its_title(title, cls):
    assert dbcpu.process_class(title) == cls


@pytest.mark.parametrize(("app", "cls"), [
    ("soak-w0-worker", "worker 0"), ("soak-w12-check", "worker 12"),
    ("soak-w3-listen", "worker 3 listen/waker"), ("soak-recovery-recover", RECOVERY),
    ("bench-checkout", CHECKOUT), ("bench-report", REPORT), ("bench-sampler", SAMPLING),
    ("bench-cpu", SAMPLING), ("psql", "other client"),
])
def test_a_client_backend_is_classed_by_its_application_name(app, cls):
    assert client_class(app) == cls


@pytest.mark.parametrize(("query", "cls"), [
    (statements()["enqueue_one"], CHECKOUT),
    ("INSERT INTO bench_orders (id, total_cents) VALUES ($1, $2)", CHECKOUT),
    ("BEGIN", CHECKOUT), ("COMMIT", CHECKOUT),
    (statements()["claim"], "workers"), (statements()["ack"], "workers"),
    (statements()["record_attempts"], "workers"), (statements()["prune"], RECOVERY),
    (statements()["recover_expired"], RECOVERY),
    ("SELECT /* bench */ pg_current_wal_lsn() - $1", SAMPLING),
    ("SELECT /* soak report */ count(*), max(created_at) FROM receipt_jobs", REPORT),
])
def test_a_statement_is_billed_to_the_client_that_sends_it(query, cls):
    assert statement_class(query) == cls


def test_the_ratio_needs_both_phases():
    assert dbcpu.cpu_ratio(1500.0, 500.0) == 3.0
    assert dbcpu.cpu_ratio(1500.0, None) is None
    assert dbcpu.cpu_ratio(1500.0, 0.0) is None
    assert dbcpu.cpu_ratio(None, 500.0) is None


def test_cpu_between_two_marks_and_per_order():
    spent = dbcpu.between({"checkout": 1.0, "walwriter": 0.5},
                          {"checkout": 1.5, "walwriter": 0.5, "worker 0": 0.2})
    assert spent == {"checkout": 0.5, "walwriter": 0.0, "worker 0": 0.2}
    assert list(dbcpu.per_order_us(spent, 1000)) == ["checkout", "worker 0", "walwriter"]
    assert dbcpu.per_order_us(spent, 1000)["checkout"] == 500.0


def test_statements_between_two_readings_leave_out_the_ones_not_called():
    before = {(1, 10, True): {"calls": 5, "exec_ms": 1.0, "rows": 5, "wal_bytes": 0, "query": "a"}}
    after = {(1, 10, True): {"calls": 5, "exec_ms": 1.0, "rows": 5, "wal_bytes": 0, "query": "a"},
             (1, 11, True): {"calls": 2, "exec_ms": 3.0, "rows": 2, "wal_bytes": 9, "query": "b"}}
    assert statements_between(before, after) == [
        {"calls": 2, "exec_ms": 3.0, "rows": 2, "wal_bytes": 9, "plans": 0, "plan_ms": 0,
         "query": "b", "tail": ""}]
    # With planning tracked, the plans and their time between the readings too.
    after[(1, 10, True)] = {"calls": 9, "exec_ms": 2.0, "rows": 9, "wal_bytes": 0,
                            "plans": 4, "plan_ms": 1.5, "query": "a"}
    assert statements_between(before, after)[1] == {
        "calls": 4, "exec_ms": 1.0, "rows": 4, "wal_bytes": 0, "plans": 4, "plan_ms": 1.5,
        "query": "a", "tail": ""}


def test_a_phase_puts_each_workers_cpu_beside_the_workers_statements():
    cpu = {"worker 0": 0.3, "worker 0 listen/waker": 0.1, "worker 1": 0.2, CHECKOUT: 0.4,
           dbcpu.AUTOVACUUM: 0.1}
    stmts = [{"calls": 1000, "exec_ms": 100.0, "query": statements()["enqueue_one"]},
             {"calls": 500, "exec_ms": 250.0, "query": statements()["ack"]}]
    cost = phase_cost(cpu, 1.2, stmts, orders=1000, wal_bytes=2_000_000)
    assert cost["db_cpu_us_per_order"] == 1200.0 and cost["wal_bytes_per_order"] == 2000.0
    assert cost["breakdown_total_us"] == 1100.0  # what the classes saw; the rest ended unseen
    workers = cost["statements_vs_cpu"]["workers"]
    assert workers == {"cpu_us": 600.0, "exec_us": 250.0, "gap_us": 350.0,
                       "calls_per_order": 0.5}
    assert cost["statements_vs_cpu"][CHECKOUT]["gap_us"] == 300.0
    assert dbcpu.AUTOVACUUM in cost["breakdown_us_per_order"]


def _doc(queue_us, baseline_us):
    sizes = dict.fromkeys((f"{t}_{p}_bytes" for t in ("receipt_jobs", "receipt_attempts")
                           for p in ("heap", "index")), 1)
    rows = [{"t": i * 10.0, **sizes, "receipt_flow_heap_bytes": 1, "claim_p99_ms": 1.0,
             "checkout_p99_ms": 1.0, "expired": 0} for i in range(120)]
    cost = {"queue": {"db_cpu_us_per_order": queue_us}}
    if baseline_us is not None:
        cost["baseline"] = {"db_cpu_us_per_order": baseline_us}
    return {"plan": {"hours": 1200 / 3600, "hold_every_seconds": 600}, "samples": rows,
            "holds": [], "end": {"lost": 0, "left": 0}, "cost": cost}


def test_the_verdict_judges_the_queue_against_three_times_the_baseline():
    assert cpu_vs_baseline(_doc(1500.0, 500.0))["ok"] is True
    v = verdict(_doc(1600.0, 500.0))
    assert v["cpu_vs_baseline"]["ok"] is False and v["cpu_vs_baseline"]["ratio"] == 3.2
    assert v["ok"] is False
    assert verdict(_doc(1400.0, 500.0))["ok"] is True


def test_a_run_without_a_baseline_is_not_judged_on_it():
    v = verdict(_doc(1500.0, None))
    assert v["cpu_vs_baseline"]["ok"] is None and v["ok"] is True


@pytest.mark.parametrize("name", ["claim", "ack", "waker_probe", "waker_sweep"])
def test_a_statement_as_pg_stat_statements_shows_it_is_named(name):
    import itertools
    import re

    numbers = itertools.count(1)
    text = re.sub(r"%\(\w+\)s", lambda _: f"${next(numbers)}", statements()[name])
    # constants become parameters (as pg_stat_statements shows them); cut short
    text = re.sub(r"'[^']*'", lambda _: f"${next(numbers)}", text)[:200]
    assert statement_name(text) == name
    assert statement_name("INSERT INTO bench_orders (id, total_cents) VALUES ($1, $2)") == "other"
