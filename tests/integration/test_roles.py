"""Least-privilege roles on a real database, with exactly what ``--print-grants`` prints.

One database per server, made the way the README says: the owner's grants,
``receipts migrate`` as the owner (not a superuser), then every other role's
printed grants. The queue lives in schema ``shop``, named by each DSN's
``search_path``: unlike ``public``, ``PUBLIC`` has no ``USAGE`` on it, so that
grant is tested too. Every command then runs as its own role: the worker delivers
to a real provider, recovery sweeps, the review commands and page read and
act, an orders service enqueues through the SQL function and through the
Python API. The worker's heartbeat, the fleet pause and resume, bulk actions,
the console's readings, "recover now" and sign-out run as theirs too. Each
role's statements are also run one by one, first with its grants (all pass),
then once per right with that right taken away (one of them is refused): the
printed grants are all needed and enough.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import os
import re
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from receipts import grants
from receipts.embedded import free_port
from receipts.enqueue import enqueue, enqueue_many
from receipts.errors import QueueError
from receipts.heartbeat import new_tag
from receipts.jobqueue import JobQueue
from receipts.migrate import schema_status_async
from receipts.model import (
    Attempt,
    AttemptRecord,
    Job,
    JobState,
    Outcome,
    PauseReason,
    Reason,
    Reschedule,
    Verdict,
)
from receipts.operations import Operations, ReviewFilter
from receipts.statements import query
from receipts.supervisor import Supervisor, child_env, run_command
from tests.conftest import RunningProvider, Server, fetch_rows

KINDS = [k for k in grants.KINDS if k != grants.OWNER]
SCHEMA = "shop"
ADMIN_TOKEN = "admin-token-for-the-role-test-0123456789"


@dataclass
class Install:
    """A database migrated by its owner role, with every kind's printed grants applied."""

    admin: str  # the superuser, on this database, search_path shop
    roles: dict[str, str]  # kind -> role name

    def dsn(self, kind: str) -> str:
        info = conninfo_to_dict(self.admin)
        info["user"] = self.roles[kind]
        info.pop("password", None)
        return make_conninfo(**info)

    def apply(self, sql: str) -> None:
        with psycopg.connect(self.admin) as conn:  # one transaction, as `psql -1`
            conn.execute(sql.encode())

    def printed(self, *kinds: str) -> str:
        pairs = [f"{k}={self.roles[k]}" for k in kinds]
        result = run_command(["migrate", "--print-grants", *pairs],
                             {"RECEIPTS_DATABASE_URL": self.admin})  # its search_path: shop
        assert result.returncode == 0, result.stderr
        return result.stdout

    def restore(self, kind: str) -> None:
        self.apply(self.printed(kind))


def cli(dsn: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``receipts ARGS`` as the role of *dsn*."""
    return run_command(args, {"RECEIPTS_DATABASE_URL": dsn, **env}, timeout_seconds=90)


@pytest.fixture(scope="module")
def install(server: Server) -> Iterator[Install]:
    names = {kind: f"rt{os.getpid()}_{server.name}_{kind.replace('-', '_')}"
             for kind in grants.KINDS}
    with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
        for role in names.values():
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')
            conn.execute(f'CREATE ROLE "{role}" LOGIN')
    database = server.new_database(migrated=False)
    info = conninfo_to_dict(database)
    info["options"] = f"-c search_path={SCHEMA}"
    setup = Install(make_conninfo(**info), names)
    try:
        setup.apply(setup.printed(grants.OWNER))
        migrated = cli(setup.dsn(grants.OWNER), "migrate")
        assert migrated.returncode == 0, migrated.stderr
        setup.apply(setup.printed(*grants.KINDS))
        yield setup
    finally:
        server.drop_database(database)
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            for role in names.values():
                conn.execute(f'DROP ROLE IF EXISTS "{role}"')


# ------------------------------------------------------------------ the owner


def test_the_grants_name_every_function_the_migrations_create(dsn):
    """--print-grants hands grants.FUNCTIONS to the owner: a function left out stays with
    whoever migrated, who could replace it (receipts_job_rules() holds every row's rules)."""
    listed = {oid for (oid,) in fetch_rows(
        dsn, "SELECT unnest(%s::regprocedure[])::oid", (list(grants.FUNCTIONS),))}
    made = {oid for (oid,) in fetch_rows(
        dsn, "SELECT p.oid FROM pg_proc AS p WHERE p.pronamespace = current_schema()::regnamespace"
             " AND p.proname LIKE 'receipts%%'")}
    assert made == listed


@pytest.mark.slow
def test_the_owner_is_no_superuser_and_owns_every_object_it_migrated(install):
    owner = install.roles[grants.OWNER]
    rows = fetch_rows(install.admin, "SELECT rolsuper FROM pg_roles WHERE rolname = %s",
                      (owner,))
    assert rows == [(False,)]
    tables = dict(fetch_rows(
        install.admin, "SELECT c.relname, pg_get_userbyid(c.relowner) FROM pg_class AS c"
                       " WHERE c.relnamespace = 'shop'::regnamespace AND c.relkind = 'r'"))
    assert tables == dict.fromkeys(grants.TABLES, owner)
    functions = fetch_rows(install.admin, "SELECT proname, pg_get_userbyid(proowner), prosecdef,"
                                          " proconfig FROM pg_proc WHERE proname LIKE 'receipts_%%'"
                                          " ORDER BY 1")
    pinned = ["search_path=shop, pg_temp"]
    assert functions == [("receipts_enqueue", owner, False, None),  # the caller's rights
                         ("receipts_job_rules", owner, False, None),  # reads nothing
                         ("receipts_pause_reason", owner, False, None),  # reads nothing
                         ("receipts_prune", owner, True, pinned),
                         ("receipts_record_attempts", owner, True, pinned),
                         ("receipts_refuse_unguarded_done", owner, False, None)]
    check = cli(install.dsn(grants.OWNER), "migrate", "--check")
    assert check.returncode == 0 and "up to date" in check.stdout


# ------------------------------------------------------------------ enqueue


def test_an_enqueue_only_role_enqueues_through_the_function_and_the_table_refuses_the_rest(
        install):
    with psycopg.connect(install.dsn("enqueue")) as conn:
        job_id = conn.execute("SELECT receipts_enqueue('fn-order-1')").fetchone()
        assert job_id is not None and isinstance(job_id[0], uuid.UUID)
        assert conn.execute("SELECT receipts_enqueue('fn-order-1')").fetchone() == (None,)
    forged = [
        ("INSERT INTO receipt_jobs (id, order_id, state, finished_at)"
         " VALUES (gen_random_uuid(), 'forged-done', 'done', now())",
         psycopg.errors.InsufficientPrivilege),
        ("INSERT INTO receipt_jobs (id, order_id) VALUES (gen_random_uuid(), e'bad\\nid')",
         psycopg.errors.CheckViolation),
        ("INSERT INTO receipt_jobs (id, order_id, run_at)"
         " VALUES (gen_random_uuid(), 'never', 'infinity')", psycopg.errors.CheckViolation),
        ("SELECT order_id FROM receipt_jobs", psycopg.errors.InsufficientPrivilege),
        ("UPDATE receipt_jobs SET state = 'done'", psycopg.errors.InsufficientPrivilege),
    ]
    for statement, refusal in forged:
        with psycopg.connect(install.dsn("enqueue")) as conn, pytest.raises(refusal):
            conn.execute(statement)
    for call, why in (("receipts_enqueue('fn-never', 'infinity')", "finite"),
                      ("receipts_enqueue(e'fn-bad\\nid')", "control characters")):
        with psycopg.connect(install.dsn("enqueue")) as conn, pytest.raises(
                psycopg.errors.InvalidParameterValue, match=why):
            conn.execute(f"SELECT {call}")
    rows = fetch_rows(install.admin, "SELECT order_id, state FROM receipt_jobs"
                                     " WHERE order_id LIKE 'fn-%%' OR order_id LIKE 'forged%%'"
                                     " OR order_id = 'never'")
    assert rows == [("fn-order-1", "ready")]


def test_a_temporary_table_named_receipt_jobs_cannot_capture_an_enqueue(install):
    """pg_temp comes last in the function's search_path, and the table is qualified."""
    with psycopg.connect(install.dsn("enqueue")) as conn:
        conn.execute("CREATE TEMP TABLE receipt_jobs (id uuid, order_id text UNIQUE,"
                     " run_at timestamptz, traceparent text)")
        conn.execute("SET search_path = pg_temp, shop")
        conn.execute("SELECT receipts_enqueue('temp-shadow-1')")
        captured = conn.execute("SELECT count(*) FROM pg_temp.receipt_jobs").fetchone()
        conn.commit()
    assert captured == (0,)
    # The same with a copy of the real table, made by a role that may read it.
    with psycopg.connect(install.admin) as conn:
        conn.execute("CREATE TEMP TABLE receipt_jobs (LIKE shop.receipt_jobs INCLUDING ALL)")
        conn.execute("SET search_path = pg_temp, shop")
        conn.execute("SELECT receipts_enqueue('temp-shadow-2')")
        captured = conn.execute("SELECT count(*) FROM pg_temp.receipt_jobs").fetchone()
        conn.commit()
    assert captured == (0,)
    rows = fetch_rows(install.admin, "SELECT order_id FROM shop.receipt_jobs"
                                     " WHERE order_id LIKE 'temp-shadow-%%' ORDER BY 1")
    assert rows == [("temp-shadow-1",), ("temp-shadow-2",)]


@pytest.mark.slow
def test_the_python_api_role_enqueues_and_cannot_write_a_state_or_read_other_columns(install):
    with psycopg.connect(install.dsn("enqueue-python")) as conn, conn.transaction():
        first = enqueue(conn, "py-order-1", schema=SCHEMA)
        again = enqueue(conn, "py-order-1", schema=SCHEMA)
    assert isinstance(first, uuid.UUID) and again is None
    refused = [
        "INSERT INTO receipt_jobs (id, order_id, state, finished_at)"
        " VALUES (gen_random_uuid(), 'py-forged', 'done', now())",
        "SELECT state, lease_token FROM receipt_jobs",
        "SELECT order_id FROM receipt_jobs",
        "UPDATE receipt_jobs SET run_at = now()",
        "DELETE FROM receipt_jobs",
    ]
    for statement in refused:
        with psycopg.connect(install.dsn("enqueue-python")) as conn, pytest.raises(
                psycopg.errors.InsufficientPrivilege):
            conn.execute(statement)
    result = cli(install.dsn("enqueue-python"), "enqueue", "py-order-2", "py-order-1")
    assert result.returncode == 0, result.stderr
    assert "enqueued 1 job(s); 1 order(s) already had one" in result.stdout


# ------------------------------------------------- each forbidden write, each role

#: The writes no role may make, and the few each kind's work needs, as (name, SQL).
#: %(ready)s and %(running)s are a ready job with one attempt record and a running job
#: under a live lease, made by the superuser; every attempt is rolled back.
WRITES: dict[str, str] = {
    "insert a job due at 'infinity'":
        "INSERT INTO receipt_jobs (id, order_id, run_at)"
        " VALUES (gen_random_uuid(), 'fw-never', 'infinity')",
    "insert an order id with a control character":
        "INSERT INTO receipt_jobs (id, order_id) VALUES (gen_random_uuid(), e'fw-bad\\nid')",
    "insert an empty order id":
        "INSERT INTO receipt_jobs (id, order_id) VALUES (gen_random_uuid(), '')",
    "insert a 10,000-character order id":
        "INSERT INTO receipt_jobs (id, order_id) VALUES (gen_random_uuid(), repeat('x', 10000))",
    "insert a done row":
        "INSERT INTO receipt_jobs (id, order_id, state, finished_at)"
        " VALUES (gen_random_uuid(), 'fw-done', 'done', now())",
    "read every order id": "SELECT order_id FROM receipt_jobs",
    "change a job's order_id":
        "UPDATE receipt_jobs SET order_id = 'fw-stolen' WHERE id = %(ready)s",
    "mark a ready job done":
        "UPDATE receipt_jobs SET state = 'done', finished_at = now() WHERE id = %(ready)s",
    "mark a running job done without its token":
        "UPDATE receipt_jobs SET state = 'done', finished_at = now(), lease_token = NULL,"
        " lease_until = NULL WHERE id = %(running)s",
    "edit an attempt record (error)":
        "UPDATE receipt_attempts SET error = 'rewritten' WHERE job_id = %(ready)s",
    "delete an attempt record": "DELETE FROM receipt_attempts WHERE job_id = %(ready)s",
    "insert into the history directly":
        "INSERT INTO receipt_attempts (job_id, slot, seq, attempt, reason)"
        " VALUES (%(ready)s, 1, 2, 1, 'forged')",
    "delete a ready job": "DELETE FROM receipt_jobs WHERE id = %(ready)s",
    "delete a running job": "DELETE FROM receipt_jobs WHERE id = %(running)s",
    # allowed to some: each checks that nothing pending went
    "prune through receipts_prune() (retention 0)":
        "SELECT count(*) FROM receipts_prune(0, 1000)",
    "append a record through receipts_record_attempts()":
        "SELECT receipts_record_attempts(ARRAY[%(ready)s]::uuid[], ARRAY[1], ARRAY['rejected'],"
        " ARRAY[422], ARRAY['appended'], ARRAY[0.1]::float8[], ARRAY['role test'])",
    "enqueue a valid order (INSERT)":
        "INSERT INTO receipt_jobs (id, order_id) VALUES (gen_random_uuid(), 'fw-valid')"
        " ON CONFLICT DO NOTHING RETURNING id",
    "enqueue a valid order (receipts_enqueue())": "SELECT receipts_enqueue('fw-valid-fn')",
}

_P, _C, _A = "refused (no right)", "refused (check)", "allowed"
#: What each kind gets, in the order of :data:`WRITES`.
EXPECTED: dict[str, list[str]] = {
    "enqueue":        [_C, _C, _C, _C, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _A, _A],
    "enqueue-python": [_C, _C, _C, _C, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _A, _P],
    "worker":         [_P, _P, _P, _P, _P, _A, _P, _C, _C, _P, _P, _P, _P, _P, _P, _A, _P, _P],
    "recover":        [_P, _P, _P, _P, _P, _A, _P, _C, _C, _P, _P, _P, _P, _P, _A, _A, _P, _P],
    "review":         [_P, _P, _P, _P, _P, _A, _P, _C, _C, _P, _P, _P, _P, _P, _P, _A, _P, _P],
}


def _attempt_write(dsn: str, sql: str, params: dict[str, Any], *, reads_jobs: bool) -> str:
    """Run *sql* as the role of *dsn* and roll back: refused (why) or allowed. An allowed
    write by a role that may read the jobs must leave the two pending fixture jobs as they
    were, seen inside its own transaction (the enqueue kinds' allowed writes are inserts)."""
    with psycopg.connect(dsn) as conn:
        try:
            with conn.transaction(force_rollback=True):
                conn.execute(sql, params)
                if reads_jobs:
                    after = conn.execute("SELECT order_id, state FROM receipt_jobs"
                                         " WHERE id IN (%(ready)s, %(running)s) ORDER BY 1",
                                         params).fetchall()
                    assert after == [("fw-ready", "ready"), ("fw-running", "running")], sql
        except psycopg.errors.InsufficientPrivilege:
            return _P
        except psycopg.errors.CheckViolation:
            return _C
    return _A


def test_each_role_is_refused_each_forbidden_write(install):
    """The roles table of docs/design.md ("Every rule in the database, for every role"):
    every kind's printed grants, each write tried in a transaction rolled back."""
    admin = install.admin
    ((ready,),) = fetch_rows(admin, "INSERT INTO receipt_jobs (id, order_id)"
                                    " VALUES (gen_random_uuid(), 'fw-ready') RETURNING id")
    ((running,),) = fetch_rows(admin, "INSERT INTO receipt_jobs (id, order_id, state, attempts,"
                                      " lease_token, lease_until) VALUES (gen_random_uuid(),"
                                      " 'fw-running', 'running', 1, gen_random_uuid(),"
                                      " now() + interval '1 hour') RETURNING id")
    fetch_rows(admin, "SELECT receipts_record_attempts(ARRAY[%s]::uuid[], ARRAY[1],"
                      " ARRAY['provider_5xx'], ARRAY[503], ARRAY['kept'], ARRAY[0.2]::float8[],"
                      " ARRAY['t'])", (ready,))
    params = {"ready": ready, "running": running}
    try:
        seen = {kind: [_attempt_write(install.dsn(kind), sql, params,
                                      reads_jobs=not kind.startswith("enqueue"))
                       for sql in WRITES.values()]
                for kind in EXPECTED}
        table = ["| attempted write | " + " | ".join(EXPECTED) + " |",
                 "|---|" + "---|" * len(EXPECTED)]
        table += [f"| {name} | " + " | ".join(seen[kind][i] for kind in EXPECTED) + " |"
                  for i, name in enumerate(WRITES)]
        print("\n".join(table))
        assert seen == EXPECTED
        history = fetch_rows(admin, "SELECT seq, error FROM receipt_attempts WHERE job_id = %s",
                             (ready,))
        assert history == [(1, "kept")]
        rows = fetch_rows(admin, "SELECT order_id, state FROM receipt_jobs"
                                 " WHERE id IN (%s, %s) ORDER BY 1", (ready, running))
        assert rows == [("fw-ready", "ready"), ("fw-running", "running")]
    finally:
        fetch_rows(admin, "DELETE FROM receipt_attempts WHERE job_id IN (%s, %s) RETURNING 1",
                   (ready, running))
        fetch_rows(admin, "DELETE FROM receipt_jobs WHERE id IN (%s, %s) RETURNING 1",
                   (ready, running))


def test_the_ack_guard_lets_a_worker_mark_its_own_running_job_done(install):
    """The trigger's WHEN clause is the ack's guard: the worker's own ack passes it."""
    ((job, token),) = fetch_rows(
        install.admin, "INSERT INTO receipt_jobs (id, order_id, state, attempts, lease_token,"
                       " lease_until) VALUES (gen_random_uuid(), 'fw-own', 'running', 1,"
                       " gen_random_uuid(), now() + interval '1 hour') RETURNING id, lease_token")
    try:
        with psycopg.connect(install.dsn("worker")) as conn:
            done = conn.execute(query("ack", SCHEMA), {"ids": str(job), "tokens": str(token)})
            assert [row[0] for row in done.fetchall()] == [job]
        assert fetch_rows(install.admin, "SELECT state, last_token FROM receipt_jobs"
                                         " WHERE id = %s", (job,)) == [("done", token)]
    finally:
        fetch_rows(install.admin, "DELETE FROM receipt_jobs WHERE id = %s RETURNING 1", (job,))


# ------------------------------------------------------- every command, each role


def until(predicate: Callable[[], bool], what: str, timeout_seconds: float = 60) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _states(install: Install, prefix: str) -> dict[str, int]:
    return {str(s): int(n) for s, n in fetch_rows(
        install.admin, "SELECT state, count(*) FROM receipt_jobs WHERE order_id LIKE %s"
                       " GROUP BY state", (prefix + "%",))}


#: The tag of a worker whose heartbeat row is two days old: the next worker forgets it.
GONE_TAG = "0badc0de"


@pytest.mark.slow
async def test_every_command_runs_as_its_own_role(install, provider: RunningProvider, tmp_path):
    # Retries, a Retry-After pause and rejections: reschedule, attempt history and
    # flow control run too; a rate limit makes the claim charge the token bucket.
    provider.set_faults(error_rate=0.15, rate_limit_rate=0.05, retry_after_seconds=0.2,
                        reject_rate=0.1)
    with psycopg.connect(install.dsn("enqueue")) as conn:
        for i in range(40):
            conn.execute("SELECT receipts_enqueue(%s)", (f"cmd-{i:03d}",))
    fetch_rows(install.admin, "INSERT INTO receipt_workers (tag, pod, seen_at)"
                              " VALUES (%s, 'gone-pod', now() - interval '2 days') RETURNING 1",
               (GONE_TAG,))
    env = {"RECEIPTS_PROVIDER_URL": provider.url, "RECEIPTS_METRICS_PORT": str(free_port()),
           "RECEIPTS_LEASE_SECONDS": "4", "RECEIPTS_LEASE_MARGIN_SECONDS": "1",
           "RECEIPTS_DELIVERY_TIMEOUT_SECONDS": "2", "RECEIPTS_RETRY_BASE_SECONDS": "0.05",
           "RECEIPTS_RETRY_CAP_SECONDS": "0.2", "RECEIPTS_POLL_INTERVAL_SECONDS": "0.1",
           "RECEIPTS_PROVIDER_RATE_LIMIT_PER_SECOND": "500", "RECEIPTS_MAX_ATTEMPTS": "8",
           "RECEIPTS_ATTEMPT_HISTORY": "all", "RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS": "1"}
    with Supervisor(tmp_path) as sup:
        worker = sup.start("worker", ["worker"], {"RECEIPTS_DATABASE_URL": install.dsn("worker"),
                                                  **env}, port=int(env["RECEIPTS_METRICS_PORT"]))
        await asyncio.to_thread(worker.wait_healthy)
        # A rejection with no acceptance around it is held, not failed (a batch's last
        # orders have none after them): such jobs stay ready, "held rejection: …".
        await asyncio.to_thread(
            until, lambda: fetch_rows(
                install.admin, "SELECT count(*) FROM receipt_jobs WHERE state = 'running'"
                " OR (state = 'ready' AND NOT starts_with(coalesce(last_error, ''),"
                " 'held rejection: '))") == [(0,)],
            "the worker to deliver, fail or hold every job")
        done = _states(install, "")["done"]
        # Acks count once their commit is known durable (a few tenths of a second).
        await asyncio.to_thread(
            until, lambda: worker.scrape().total("receipts_acks_total") == done,
            "every ack to be counted")
        metrics = await asyncio.to_thread(worker.scrape)
        worker_pid = worker.pid
        assert sup.stop_all() == {"worker": 0}
    log = (tmp_path / "worker.log").read_text()
    for event in ("permission denied", "claim_failed", "write_failed", "admission_control_off",
                  "attempts_not_recorded", "queue_stats_failed", "Traceback"):
        assert event not in log, event
    states = _states(install, "cmd-")
    assert states.get("done", 0) >= 20 and sum(states.values()) == 40
    assert metrics.total("receipts_retries_total") > 0
    assert metrics.total("receipts_queue_stats_timestamp_seconds") > 0  # the gauges were read
    # The heartbeat: the worker forgot the row gone for two days, kept its own up to date,
    # and its last beat marked it stopped with every job it claimed.
    assert fetch_rows(install.admin, "SELECT pid, claimed_total, stopped_at IS NOT NULL"
                                     " FROM receipt_workers") == [
        (worker_pid, int(metrics.total("receipts_jobs_claimed_total")), True)]

    # recovery: an expired lease, as a crashed worker leaves it
    fetch_rows(install.admin, "UPDATE receipt_jobs SET state = 'running', attempts = 1,"
                              " lease_token = gen_random_uuid(), lease_until = now(),"
                              " finished_at = NULL WHERE order_id = 'cmd-000' RETURNING 1")
    swept = cli(install.dsn("recover"), "recover", "--json")
    assert swept.returncode == 0, swept.stderr
    assert '"expired_to_ready": 1' in swept.stdout

    # review: every subcommand (failed jobs to review, whatever the rejections did)
    review = install.dsn("review")
    fetch_rows(install.admin, "UPDATE receipt_jobs SET state = 'failed', finished_at = now(),"
                              " last_error = 'role test' WHERE order_id IN ('cmd-030', 'cmd-031')"
                              " AND state = 'done' RETURNING 1")
    failed = _failed(install)
    assert len(failed) >= 2
    for args in (("stats",), ("list", "--state", "failed"), ("show", failed[0]),
                 ("show", "cmd-001"), ("retry", failed[0]),
                 ("discard", failed[1])):
        result = cli(review, "jobs", *args, "--json")
        assert result.returncode == 0, (args, result.stderr)

    # the fleet pause an operator sets and lifts
    paused = cli(review, "jobs", "pause", "--for", "10m", "--reason", "role test", "--json")
    assert paused.returncode == 0 and json.loads(paused.stdout)["paused"], paused.stderr
    stats = cli(review, "jobs", "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["provider"]["reason"] == "manual"
    resumed = cli(review, "jobs", "resume", "--json")
    assert resumed.returncode == 0 and json.loads(resumed.stdout)["resumed"], resumed.stderr
    assert fetch_rows(install.admin, "SELECT pause_reason, pause_note FROM receipt_flow") == [
        (None, None)]

    # a bulk action from the command line: every failed job, in batches
    fetch_rows(install.admin, "UPDATE receipt_jobs SET state = 'failed', finished_at = now()"
                              " WHERE order_id BETWEEN 'cmd-010' AND 'cmd-014' RETURNING 1")
    ((failed_now,),) = fetch_rows(install.admin, "SELECT count(*) FROM receipt_jobs"
                                                 " WHERE state = 'failed'")
    retried = cli(review, "jobs", "retry", "--all-failed", "--json")
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["count"] == failed_now >= 5
    assert fetch_rows(install.admin, "SELECT action, status, changed FROM receipt_bulk_actions"
                                     ) == [("retry", "done", failed_now)]

    # the review page: its readings, then every kind of action
    await asyncio.to_thread(_review_page_reads_and_acts, install)


def _failed(install: Install) -> list[str]:
    return [str(r[0]) for r in fetch_rows(
        install.admin, "SELECT id FROM receipt_jobs WHERE state = 'failed'"
                       " AND order_id LIKE 'cmd-%%' ORDER BY id")]


def _job_id(install: Install, order_id: str) -> str:
    return str(fetch_rows(install.admin, "SELECT id FROM receipt_jobs WHERE order_id = %s",
                          (order_id,))[0][0])


def _review_page_reads_and_acts(install: Install) -> None:
    """As the review role: the console's readings (workers, a running job's holder, a live
    refresh), a discard of named jobs, "recover now", a bulk discard by filter, sign-out."""
    admin = install.admin
    ((tag, pod),) = fetch_rows(admin, "SELECT tag, pod FROM receipt_workers")
    fetch_rows(admin, "UPDATE receipt_jobs SET state = 'failed', finished_at = now(),"
                      " lease_token = NULL, lease_until = NULL"
                      " WHERE order_id = 'cmd-002' RETURNING 1")
    # A lease under the worker's tag that ran out: the running list names its pod.
    fetch_rows(admin, "UPDATE receipt_jobs SET state = 'running', attempts = 1,"
                      " finished_at = NULL, lease_until = now() - interval '1 second',"
                      " lease_token = overlay(gen_random_uuid()::text PLACING %s FROM 29)::uuid"
                      " WHERE order_id = 'cmd-003' RETURNING 1", (tag,))
    discarded, expired = _job_id(install, "cmd-002"), _job_id(install, "cmd-003")
    port = free_port()
    env = {"RECEIPTS_DATABASE_URL": install.dsn("review"), "RECEIPTS_UI_PORT": str(port),
           "RECEIPTS_UI_ADMIN_TOKEN": ADMIN_TOKEN}
    process = subprocess.Popen([sys.executable, "-m", "receipts", "ui"], env=child_env(env),
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, trust_env=False, timeout=10) as http:
            until(lambda: _healthy(http), "the review page")
            page = http.get("/?state=failed")
            assert page.status_code == 200 and "Database unavailable" not in page.text
            guest = page.headers["set-cookie"].split(";")[0]
            # Named jobs, all or nothing; the admin token signs the session in.
            done = http.post("/act", data={"action": "discard:selected", "id": discarded,
                                           "expected": "1", "csrf": _csrf(page.text),
                                           "token": ADMIN_TOKEN},
                             headers={"Cookie": guest, "Origin": url})
            assert done.status_code == 200 and "Discarded" in done.text, done.text
            session = {"Cookie": done.headers["set-cookie"].split(";")[0], "Origin": url}

            # The readings: summary, workers, running list with the holder, job, live refresh.
            home = http.get("/", headers=session)
            assert home.status_code == 200, home.text
            assert pod in home.text and "No worker has sent a heartbeat" not in home.text
            running = http.get("/?state=running", headers=session)
            assert running.status_code == 200 and "cmd-003" in running.text
            # The lease's holder, from receipt_workers by the tag the token ends in.
            assert f'<td data-label="Held by" class="holder"><bdi>{pod}</bdi>' in running.text
            assert http.get(f"/jobs/{expired}", headers=session).status_code == 200
            live = http.get("/?state=running", headers=session | {"X-Receipts-Live": "1"})
            assert live.status_code == 200 and "cmd-003" in live.text
            csrf = _csrf(home.text)

            # Recover now: the expired lease goes back to ready, with its history record.
            recovered = http.post("/recover", data={"csrf": csrf}, headers=session)
            assert recovered.status_code == 200, recovered.text
            assert "1 expired lease(s) went back to ready" in recovered.text

            # A bulk discard by filter: confirm (the count at a moment), act, progress.
            ready = fetch_rows(admin, "SELECT count(*) FROM receipt_jobs"
                                      " WHERE state = 'ready' AND order_id LIKE 'cmd-%%'")[0][0]
            assert ready >= 6
            confirm = http.post("/confirm", data={"action": "discard:filter", "state": "ready",
                                                  "q": "cmd-", "csrf": csrf}, headers=session)
            assert confirm.status_code == 200 and f"Discard {ready} jobs" in confirm.text
            form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">',
                                   confirm.text))
            started = http.post("/act", data={k: html.unescape(v) for k, v in form.items()},
                                headers=session)
            assert started.status_code == 303, started.text
            bulk_page = started.headers["location"]
            until(lambda: fetch_rows(admin, "SELECT status FROM receipt_bulk_actions"
                                            " WHERE action = 'discard'") == [("done",)],
                  "the bulk discard to finish")
            assert http.get(bulk_page, headers=session).status_code == 200

            # Sign-out: the session id is refused by every replica until it expires.
            out = http.post("/logout", data={"csrf": csrf}, headers=session)
            assert out.status_code == 303, out.text
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    for event in ("ui_database_error", "permission denied", "bulk_action_failed", "Traceback"):
        assert event not in output, output
    assert fetch_rows(admin, "SELECT count(*) FROM receipt_ui_revoked") == [(1,)]
    assert fetch_rows(admin, "SELECT state FROM receipt_jobs WHERE id = %s",
                      (discarded,)) == [("discarded",)]
    assert fetch_rows(admin, "SELECT reason FROM receipt_attempts WHERE job_id = %s"
                             " ORDER BY seq DESC LIMIT 1", (expired,)) == [("lease_expired",)]
    assert _states(install, "cmd-").keys() <= {"done", "discarded"}


def _csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, page
    return found.group(1)


def _healthy(http: httpx.Client) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return http.get("/healthz").status_code == 200
    return False


@pytest.mark.slow
def test_a_worker_missing_a_grant_refuses_to_start_and_names_the_command(install):
    role = install.roles["worker"]
    install.apply(f'REVOKE SELECT ON receipts_schema_migrations FROM "{role}"')
    try:
        result = cli(install.dsn("worker"), "worker", RECEIPTS_PROVIDER_URL="http://127.0.0.1:9/r",
                     RECEIPTS_METRICS_PORT="0")
    finally:
        install.restore("worker")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "receipts: error: permission denied for table receipts_schema_migrations: the database"
        " role lacks a right receipts needs; apply what `receipts migrate --print-grants"
        " KIND=ROLE` prints for its kind"]


# ---------------------------------------------- each statement, each right


@dataclass
class Role:
    """Connections of one role: a queue and the operator's statements on a small pool,
    and a plain connection."""

    queue: JobQueue
    limited: JobQueue
    ops: Operations
    dsn: str


@contextlib.asynccontextmanager
async def as_role(install: Install, kind: str) -> AsyncIterator[Role]:
    pool = AsyncConnectionPool(install.dsn(kind), min_size=1, max_size=2, open=False,
                               kwargs={"autocommit": True})
    await pool.open(wait=True, timeout=10)
    try:
        # The worker's claims end each token in its tag, as a running worker's do.
        yield Role(JobQueue(pool, lease_seconds=30, max_attempts=5, schema=SCHEMA,
                            worker_tag=new_tag()),
                   JobQueue(pool, lease_seconds=30, max_attempts=5, rate_limit_per_second=1e9,
                            burst=1e9, schema=SCHEMA),
                   Operations(pool, schema=SCHEMA), install.dsn(kind))
    finally:
        await pool.close()


def _attempt() -> Attempt:
    return Attempt(Job(id=uuid.uuid4(), order_id="x", token=uuid.uuid4(), attempt=1),
                   time.monotonic())


async def _schema_status(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await schema_status_async(conn, schema=SCHEMA)


async def _sql_function(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute("SELECT shop.receipts_enqueue(%s)", (f"stmt-{uuid.uuid4()}",))
        await conn.rollback()


def _python_enqueue(dsn: str, traced: bool, many: bool = False) -> None:
    """One order through the Python API (``enqueue_one``, or ``enqueue``'s batch form for
    *many*), rolled back."""
    def call(conn: psycopg.Connection[Any]) -> None:
        if many:
            enqueue_many(conn, [f"stmt-{uuid.uuid4()}"], schema=SCHEMA)
        else:
            enqueue(conn, f"stmt-{uuid.uuid4()}", schema=SCHEMA)

    with psycopg.connect(dsn) as conn:
        if traced:
            from opentelemetry import trace

            span = trace.NonRecordingSpan(trace.SpanContext(
                trace_id=1, span_id=1, is_remote=False, trace_flags=trace.TraceFlags(1)))
            with trace.use_span(span):
                call(conn)
        else:
            call(conn)
        conn.rollback()


async def _on_listen_session(dsn: str, name: str, params: dict[str, Any]) -> None:
    """Run the waker's statement *name* on a session of its own, as the LISTEN session
    does (its advisory lock, if taken, ends with the session)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(query(name, SCHEMA), params)


def _unowned_action() -> dict[str, Any]:
    """A bulk action row nobody owns: a batch of it locks nothing and changes nothing."""
    return {"id": uuid.uuid4(), "action": "retry", "job_state": "failed", "reason": None,
            "http_status": None, "since": None, "until": None, "order_contains": None,
            "cutoff": datetime.now(UTC)}


def exercises(role: Role) -> dict[str, Callable[[], Awaitable[Any]]]:
    """One call per statement of :data:`receipts.grants.STATEMENTS`, harmless to the queue."""
    q, limited, some = role.queue, role.limited, [(uuid.uuid4(), uuid.uuid4())]
    ops, nobody, soon = role.ops, uuid.uuid4(), datetime.now(UTC) + timedelta(minutes=1)
    matches_nothing = ReviewFilter(state=JobState.FAILED, order_contains=f"none-{uuid.uuid4()}",
                                   cutoff=datetime.now(UTC))
    failure = Outcome(Verdict.RETRY, Reason.PROVIDER_5XX, detail="503")
    record = AttemptRecord(job_id=uuid.uuid4(), attempt=1, reason=Reason.PROVIDER_5XX,
                           status=503, error="", duration_seconds=0.1, worker="t")
    return {
        "enqueue": lambda: asyncio.to_thread(_python_enqueue, role.dsn, False, True),
        "enqueue_traced": lambda: asyncio.to_thread(_python_enqueue, role.dsn, True, True),
        "enqueue_one": lambda: asyncio.to_thread(_python_enqueue, role.dsn, False),
        "enqueue_one_traced": lambda: asyncio.to_thread(_python_enqueue, role.dsn, True),
        "receipts_enqueue": lambda: _sql_function(role.dsn),
        "schema_status": lambda: _schema_status(role.dsn),
        "claim": lambda: q.claim(1),
        "claim_limited": lambda: limited.claim(1),
        "ack": lambda: q.ack(some),
        "reschedule": lambda: q.reschedule([Reschedule(_attempt(), failure, 1.0)]),
        "resolve_writes": lambda: q.resolve_writes(some),
        # A Retry-After pause of 0 s ends at once: the other tests' claims go on.
        "extend_pause": lambda: q.extend_pause(PauseReason.RETRY_AFTER, 0.0),
        "begin_probe": lambda: q.begin_probe(1.0),
        "resume": lambda: q.resume(datetime.now(UTC)),
        "record_attempts": lambda: q.record_attempts([record]),
        "commit_probe": lambda: q.commit_probe(),
        "wal_position": lambda: q.wal_position(),
        "waker_lock": lambda: _on_listen_session(role.dsn, "waker_lock", {
            "key": 4242, "idle_timeout_ms": "5000"}),
        "waker_probe": lambda: _on_listen_session(role.dsn, "waker_probe", {
            "max_attempts": 5, "seen_run_at": None, "seen_id": None,
            "from_run_at": None, "from_id": None, "margin_seconds": 1.0,
            "stuck_seconds": 0.15, "channels": ["receipts_ready_role"], "before": [0],
            "local": 1,
            "channel": "receipts_ready", "heartbeat": True, "waker_channel": "receipts_waker",
            "schema_name": SCHEMA, "fleet_channel": "receipts_fleet",
            "shares": '{"0000abcd": 1.0}'}),
        "waker_sweep": lambda: _on_listen_session(role.dsn, "waker_sweep", {
            "max_attempts": 5, "reach_seconds": None, "below_run_at": datetime.now(UTC),
            "below_id": uuid.uuid4()}),
        "member_lock": lambda: _on_listen_session(role.dsn, "member_lock", {
            "key": 4243, "tag": 0xabcd}),
        "fleet_members": lambda: _on_listen_session(role.dsn, "fleet_members", {"key": 4243}),
        "waker_step_down": lambda: _on_listen_session(role.dsn, "waker_step_down", {
            "key": 4242, "waker_channel": "receipts_waker", "payload": f"{SCHEMA} left"}),
        "listen_check": lambda: _on_listen_session(role.dsn, "listen_check", {}),
        "queue_stats": lambda: q.queue_stats(),
        "recover_expired": lambda: q.recover_expired(batch=1, delay_seconds=1.0),
        "fail_exhausted": lambda: q.fail_exhausted(batch=1),
        "prune": lambda: q.prune(retention_seconds=1e9, batch=1),
        "heartbeat": lambda: q.heartbeat(
            tag=new_tag(), pod="role-test", pid=1, version="0", slots=0, inflight=0,
            claimed_total=0, uptime_seconds=0.0, since_claim_seconds=None, stopped=True,
            concurrency_limit=3),
        "forget_workers": lambda: q.forget_workers(seconds=1e9),
        "fleet_concurrency_limit": lambda: q.fleet_concurrency_limit(),
        # the operator's statements (sql/operations.sql)
        "state_counts": lambda: ops.state_counts(),
        "oldest_failed": lambda: ops.oldest_failed(),
        "list_jobs": lambda: ops.list_jobs(JobState.FAILED),
        "show_job": lambda: ops.show_job(str(uuid.uuid4())),
        "show_job_by_order": lambda: ops.show_job("no-such-order"),
        "job_attempts": lambda: ops.job_attempts(uuid.uuid4()),
        "job_states": lambda: ops.job_states([uuid.uuid4()]),
        "review_jobs": lambda: ops.review_jobs(ReviewFilter(reason="rejected")),
        "review_count": lambda: ops.review_count(ReviewFilter(reason="rejected")),
        "retry_jobs": lambda: ops.retry_jobs([uuid.uuid4()], expected=1),
        "discard_jobs": lambda: ops.discard_jobs([uuid.uuid4()], expected=1),
        "provider_pause": lambda: ops.provider_pause(),
        "flow_state": lambda: ops.flow_state(),
        "fleet_flow": lambda: ops.fleet_flow(),
        # A manual pause of 0 s ends at once (and is refused beside a longer one) ...
        "pause_fleet": lambda: ops.pause_fleet(0.0, note="role test", paused_by="test"),
        # ... and a resume of a pause that ended in 2000 lifts nothing.
        "resume_fleet": lambda: ops.resume_fleet(expected_until=datetime(2000, 1, 1, tzinfo=UTC)),
        "workers_seen": lambda: ops.workers_seen(seconds=60),
        "revoke_session": lambda: ops.revoke_session(secrets.token_hex(16), expires_at=soon),
        "revoked_sessions": lambda: ops.revoked_sessions(),
        "bulk_create": lambda: ops.bulk_create(action="discard", view=matches_nothing,
                                               expected=0, runner=nobody, created_by="test"),
        "bulk_get": lambda: ops.bulk_get(nobody),
        "bulk_recent": lambda: ops.bulk_recent(seconds=60),
        "bulk_take": lambda: ops.bulk_take(nobody, runner=nobody, stale_seconds=60),
        "bulk_stop": lambda: ops.bulk_stop(nobody),
        "bulk_fail": lambda: ops.bulk_fail(nobody, runner=nobody, error="role test"),
        "bulk_step": lambda: ops.bulk_step(_unowned_action(), runner=nobody, batch=1,
                                           after=None),
        "bulk_release": lambda: ops.bulk_release(nobody, runner=nobody),
        "bulk_orphans": lambda: ops.bulk_orphans(stale_seconds=60),
        "bulk_find": lambda: ops.bulk_find(action="discard", view=matches_nothing),
        "wake_fleet": lambda: ops.wake_fleet(channel="receipts_role_test"),
        "failure_groups": lambda: ops.failure_groups(limit=1, failed_cap=1, ready_cap=1),
        "attempt_rates": lambda: ops.attempt_rates(),
        "attempt_percentiles": lambda: ops.attempt_percentiles(),
        # A sample of the year 2000: the next one deletes it (older than two hours).
        "ui_sample": lambda: ops.ui_sample(at=datetime(2000, 1, 1, tzinfo=UTC), ready=0,
                                           running=0, failed=0),
        "ui_samples": lambda: ops.ui_samples(),
        "held_jobs": lambda: ops.held_jobs(limit=1),
        "held_discard": lambda: ops.held_action("discard", batch=1),
        "held_retry": lambda: ops.held_action("retry", batch=1),
    }


def test_every_statement_has_an_exercise():
    class Dummy:
        queue = limited = ops = None
        dsn = ""

    assert set(exercises(Dummy())) == set(grants.STATEMENTS)  # type: ignore[arg-type]


def _refused(exc: BaseException) -> bool:
    return isinstance(exc, psycopg.errors.InsufficientPrivilege) or (
        isinstance(exc, QueueError) and "permission denied" in str(exc))


async def _run_statements(install: Install, kind: str) -> dict[str, BaseException | None]:
    """Every statement *kind* runs, as its role; the error of each (None: it ran)."""
    names = [n for n, need in grants.STATEMENTS.items() if kind in need.kinds]
    out: dict[str, BaseException | None] = {}
    async with as_role(install, kind) as role:
        calls = exercises(role)
        for name in names:
            try:
                await calls[name]()
                out[name] = None
            except Exception as exc:  # judged by the caller
                out[name] = exc
    return out


@pytest.mark.parametrize("kind", KINDS)
async def test_each_role_runs_all_its_statements_with_the_printed_grants(install, kind):
    errors = await _run_statements(install, kind)
    assert {n: repr(e) for n, e in errors.items() if e is not None} == {}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
async def test_without_any_one_of_its_rights_a_role_is_refused_a_statement(install, kind, server):
    if server.name != "pg18":
        pytest.skip("the rights are the same on every server; one is enough for this sweep")
    role = install.roles[kind]
    needed = grants.rights(kind)
    unneeded = []
    try:
        for right in sorted(needed):
            if right.privilege == "MEMBER":
                continue  # a visibility right: see the next test
            sql = grants.rights_sql(role, needed - {right}, SCHEMA)
            if right.obj == "schema":  # the printed text never revokes a schema's USAGE
                sql += f'\nREVOKE USAGE ON SCHEMA {SCHEMA} FROM "{role}";'
            install.apply(sql)
            errors = await _run_statements(install, kind)
            if not any(e is not None and _refused(e) for e in errors.values()):
                unneeded.append(right)
    finally:
        install.restore(kind)
    assert unneeded == []


@pytest.mark.slow
async def test_pg_read_all_stats_lets_the_worker_see_another_roles_long_transaction(install):
    role = install.roles["worker"]
    holder = await psycopg.AsyncConnection.connect(install.admin)
    try:
        await holder.execute("SELECT pg_current_xact_id()")  # an open transaction, not ours
        await asyncio.sleep(0.3)
        async with as_role(install, "worker") as seen:
            with_it = (await seen.queue.queue_stats()).oldest_transaction_age_seconds
        install.apply(f'REVOKE pg_read_all_stats FROM "{role}"')
        try:
            async with as_role(install, "worker") as blind:
                without_it = (await blind.queue.queue_stats()).oldest_transaction_age_seconds
        finally:
            install.restore("worker")
    finally:
        await holder.close()
    assert with_it >= 0.3
    assert without_it < 0.3
