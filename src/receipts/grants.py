"""Least-privilege roles: the rights each kind of role needs, derived from its statements.

One table (:data:`STATEMENTS`) says, for every statement receipts runs, which
kinds of role run it and which rights it needs; a kind's rights are the union
over its statements, so a role gets exactly what its commands run (the role
tests run every command under exactly these grants, and take each right away
in turn to show it is needed; docs/design.md "Least-privilege roles").
Adding a statement is one line here; a test fails while a named block of
``sql/*.sql`` (:data:`receipts.statements.STATEMENT_FILES`) has none, or names a table its
line does not.

Kinds (``receipts migrate --print-grants KIND=ROLE …``):

* ``owner``: runs ``receipts migrate``; creates and owns the queue's tables and
  functions; ``receipts_record_attempts()`` and ``receipts_prune()`` run with its
  rights (``SECURITY DEFINER``). Needs ``USAGE, CREATE`` on the schema; not a
  superuser.
* ``enqueue``: an orders service that calls the SQL function
  ``receipts_enqueue()``, which runs with its caller's rights (migration 0009):
  ``EXECUTE`` on it, ``INSERT`` on the four columns an enqueue writes and
  ``SELECT`` on ``id`` (``RETURNING id``).
* ``enqueue-python``: an orders service that uses the Python API
  (``receipts.enqueue()``, ``enqueue_many()``) or ``receipts enqueue``: the
  same column rights, without the function. Column rights keep ``state``,
  ``attempts`` and the lease at their defaults, so no done row can be forged;
  the table's CHECK constraints refuse what the API and the function refuse
  (an empty, over-long or control-character order id, a ``run_at`` that is
  not finite), whoever inserts; the conflict has no target column, so
  neither kind may read ``order_id``.
* ``worker``: ``receipts worker``, its heartbeat (``receipt_workers``) included.
  Its updates of ``receipt_jobs`` name columns (never ``id``, ``order_id``,
  ``created_at``, ``traceparent``), a trigger holds ``done`` to the ack's guard,
  and it appends to the attempt history through ``receipts_record_attempts()``
  only.
* ``recover``: ``receipts recover``: column updates for the sweeps, and
  ``receipts_prune()`` instead of ``DELETE`` (finished rows past retention only).
* ``review``: ``receipts jobs …`` and ``receipts ui``: reads, retry, discard,
  bulk actions (``receipt_bulk_actions``), the fleet pause and resume,
  sign-out (``receipt_ui_revoked``), and the page's "recover now". That
  button runs ``recover_expired``, the statement of ``receipts recover``, so
  this kind runs it too (docs/design.md "Least-privilege roles" says why it
  belongs here rather than to a second connection of the page's).

Where a ``review`` statement writes a few columns of a table a more privileged
kind shares (``receipt_jobs`` with the worker and recovery, ``receipt_flow``
with the worker), its right is column-level (:attr:`Need.update_columns`): a
``review`` role may move a job's state, attempts, times, error and lease, and
write the pause's columns, but not a job's order id, trace context or
last-outcome token, nor the fleet's token bucket or probe record. Tables the
kind alone writes (``receipt_bulk_actions``, ``receipt_ui_revoked``; the
worker's ``receipt_workers``) get whole-table rights. No service kind may
write ``receipt_attempts`` (append-only: the definer function appends) or
delete from ``receipt_jobs``.

This module needs nothing but the standard library and :mod:`receipts.statements`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from receipts.statements import qualifier

# ------------------------------------------------------------ the objects

JOBS = "receipt_jobs"
ATTEMPTS = "receipt_attempts"
FLOW = "receipt_flow"
MIGRATIONS = "receipts_schema_migrations"
WORKERS = "receipt_workers"
BULK_ACTIONS = "receipt_bulk_actions"
UI_REVOKED = "receipt_ui_revoked"
UI_SAMPLES = "receipt_ui_samples"
#: Every table the migrations create, in creation order.
TABLES = (MIGRATIONS, JOBS, FLOW, ATTEMPTS, WORKERS, BULK_ACTIONS, UI_REVOKED, UI_SAMPLES)
#: The SQL function of the enqueue API (migrations 0004, 0006, 0009), by signature.
ENQUEUE_FUNCTION = "receipts_enqueue(text, timestamptz, text)"
#: The effective pause reason (migration 0008), which the statements that read the
#: pause call: it reads and writes nothing, so it keeps PostgreSQL's default EXECUTE
#: for PUBLIC and no kind needs a grant for it.
PAUSE_FUNCTION = "receipts_pause_reason(text, timestamptz, text, timestamptz, timestamptz)"
#: The only door to the attempt history for service roles (migration 0009): it appends.
RECORD_FUNCTION = "receipts_record_attempts(uuid[], int[], text[], int[], text[], float8[], text[])"
#: The only door to deleting jobs for service roles (migration 0009): finished rows past
#: the retention, never a ready or running one.
PRUNE_FUNCTION = "receipts_prune(float8, integer)"
#: The trigger function of the ack's guard on ``done`` (migration 0009); nobody calls it.
GUARD_FUNCTION = "receipts_refuse_unguarded_done()"
#: The job row's rules, which the table's one CHECK constraint calls on every write
#: (migration 0012). Like the pause function it reads and writes nothing and keeps
#: PostgreSQL's default EXECUTE for PUBLIC; its owner could replace it, so it is
#: handed to the owner with the tables.
RULES_FUNCTION = ("receipts_job_rules(text, integer, integer, uuid, timestamptz, timestamptz,"
                  " text, timestamptz, text)")
#: Every function the migrations create, by signature.
FUNCTIONS = (ENQUEUE_FUNCTION, PAUSE_FUNCTION, RECORD_FUNCTION, PRUNE_FUNCTION, GUARD_FUNCTION,
             RULES_FUNCTION)
#: Predefined role whose members see every session in ``pg_stat_activity``
#: (``xact_start``, ``backend_xmin``); without it a role sees only its own.
READ_ALL_STATS = "pg_read_all_stats"

# --------------------------------------------------------------- the kinds

OWNER = "owner"
ENQUEUE = "enqueue"
ENQUEUE_PYTHON = "enqueue-python"
WORKER = "worker"
RECOVER = "recover"
REVIEW = "review"
#: Every kind, in the order ``--print-grants`` prints them, with what it is for.
KINDS: dict[str, str] = {
    OWNER: "receipts migrate: creates and owns the queue's tables and receipts_enqueue() "
           "(which runs with its rights); not a superuser",
    ENQUEUE: "an orders service calling SELECT receipts_enqueue(...), which runs with its "
             "caller's rights: column rights for its INSERT",
    ENQUEUE_PYTHON: "an orders service using the Python API (receipts.enqueue, enqueue_many) "
                    "or `receipts enqueue`: column rights for its INSERT",
    WORKER: "receipts worker (claims, outcomes, flow control, queue gauges, attempt history, "
            "heartbeats)",
    RECOVER: "receipts recover (expired leases, exhausted jobs, pruning)",
    REVIEW: "receipts jobs ... and receipts ui (read, retry, discard, bulk actions, fleet "
            "pause and resume, recover now, sign-out)",
}

# ---------------------------------------------------------- the statements


@dataclass(frozen=True, slots=True)
class Need:
    """The rights one statement needs and the kinds of role that run it.

    Attributes:
        kinds: the kinds whose commands run the statement.
        select, insert, update, delete: tables it needs that right on (the
            whole table).
        insert_columns, select_columns, update_columns: ``{table: columns}``
            where a column right is enough (the Python enqueue API; the
            review kind's writes to tables a more privileged kind shares).
        execute: functions of the queue schema it calls, by signature.
        member_of: predefined roles it needs to see what it reads.
    """

    kinds: frozenset[str]
    select: tuple[str, ...] = ()
    insert: tuple[str, ...] = ()
    update: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()
    insert_columns: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    select_columns: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    update_columns: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    execute: tuple[str, ...] = ()
    member_of: tuple[str, ...] = ()


def _by(*kinds: str) -> frozenset[str]:
    return frozenset(kinds)


_W, _R, _V = _by(WORKER), _by(RECOVER), _by(REVIEW)
_ENQUEUED = {JOBS: ("id", "order_id", "run_at", "traceparent")}
#: ``RETURNING id``. The conflict has no target (``ON CONFLICT DO NOTHING``): naming
#: ``order_id`` there would need ``SELECT`` on it, and so the right to read every order id.
_READ_BACK = {JOBS: ("id",)}
#: What the worker's claim, ack and reschedule write on a job: never ``id``,
#: ``order_id``, ``created_at`` or ``traceparent`` (a worker cannot make a job deliver
#: another order's receipt). ``done`` is further held to the ack's guard by a trigger.
_CLAIMED = {JOBS: ("state", "attempts", "lease_token", "lease_until")}
_ACKED = {JOBS: ("state", "lease_token", "lease_until", "last_token", "finished_at")}
_RESCHEDULED = {JOBS: ("state", "attempts", "in_progress_count", "run_at", "finished_at",
                       "lease_token", "lease_until", "last_token", "last_error")}
#: What fail_exhausted writes.
_EXHAUSTED = {JOBS: ("state", "finished_at", "last_error")}
#: What an operator's retry writes (retry_jobs, retry_effect); a
#: discard (discard_jobs, discard_effect) writes the first two of them.
_RETRIED = {JOBS: ("state", "finished_at", "attempts", "run_at", "last_error")}
_DISCARDED = {JOBS: ("state", "finished_at")}
#: What recover_expired writes on a job (recovery and the page's "recover now").
_RECOVERED = {JOBS: ("state", "run_at", "finished_at", "lease_token", "lease_until",
                     "last_error")}
#: What pause_fleet and resume_fleet write: the pause, never the token bucket
#: (tokens, tokens_at) or the last probe's record.
_PAUSE = {FLOW: ("pause_reason", "paused_until", "pause_seconds", "probe_until", "pause_cause",
                 "pause_cause_until", "pause_note", "paused_by", "paused_at")}

#: Every statement receipts runs against the queue: the named blocks of
#: ``sql/*.sql`` (enqueue, queries, operations; fragments excluded) and the
#: few that live elsewhere. An ``UPDATE``/``DELETE`` with a ``WHERE`` or
#: ``RETURNING`` also needs ``SELECT``; ``INSERT … ON CONFLICT DO UPDATE``
#: needs ``UPDATE``; ``SELECT … FOR UPDATE`` needs ``UPDATE`` on a column.
STATEMENTS: dict[str, Need] = {
    # -- enqueue (the orders service)
    "enqueue": Need(_by(ENQUEUE_PYTHON), insert_columns=_ENQUEUED, select_columns=_READ_BACK),
    "enqueue_traced": Need(_by(ENQUEUE_PYTHON), insert_columns=_ENQUEUED,
                           select_columns=_READ_BACK),
    "enqueue_one": Need(_by(ENQUEUE_PYTHON), insert_columns=_ENQUEUED,
                        select_columns=_READ_BACK),
    "enqueue_one_traced": Need(_by(ENQUEUE_PYTHON), insert_columns=_ENQUEUED,
                               select_columns=_READ_BACK),
    "receipts_enqueue": Need(_by(ENQUEUE), insert_columns=_ENQUEUED, select_columns=_READ_BACK,
                             execute=(ENQUEUE_FUNCTION,)),
    # -- worker
    "schema_status": Need(_W, select=(MIGRATIONS,)),  # migrate.schema_status_async at start
    "claim": Need(_W, select=(JOBS, FLOW), update_columns=_CLAIMED),
    "claim_limited": Need(_W, select=(JOBS, FLOW), update=(FLOW,), update_columns=_CLAIMED),
    "ack": Need(_W, select=(JOBS,), update_columns=_ACKED),
    "reschedule": Need(_W, select=(JOBS,), update_columns=_RESCHEDULED),
    "resolve_writes": Need(_W, select=(JOBS,)),
    "extend_pause": Need(_W, select=(FLOW,), update=(FLOW,)),
    "begin_probe": Need(_W, select=(FLOW,), update=(FLOW,)),
    "resume": Need(_W, select=(FLOW,), update=(FLOW,)),
    "record_attempts": Need(_W, execute=(RECORD_FUNCTION,)),  # append-only: no table right
    "heartbeat": Need(_W, select=(WORKERS,), insert=(WORKERS,), update=(WORKERS,)),
    "forget_workers": Need(_W, select=(WORKERS,), delete=(WORKERS,)),
    "fleet_concurrency_limit": Need(_W, select=(WORKERS,)),
    "commit_probe": Need(_W),  # pg_logical_emit_message: any role
    "wal_position": Need(_W),  # pg_current_wal_insert_lsn, _flush_lsn: any role
    # the fleet's waker, on the LISTEN session: advisory locks, pg_notify and
    # set_config are any role's; the probe reads the ready index and the pause.
    "waker_lock": Need(_W),
    "waker_probe": Need(_W, select=(JOBS, FLOW)),
    "waker_sweep": Need(_W, select=(JOBS,)),
    "member_lock": Need(_W),  # a session advisory lock: any role's
    "fleet_members": Need(_W, select=(WORKERS,)),  # pg_locks: any role's
    "waker_step_down": Need(_W),
    "listen_check": Need(_W),
    "queue_stats": Need(_by(WORKER, REVIEW), select=(JOBS,), member_of=(READ_ALL_STATS,)),
    # -- recovery (recover_expired also from the review page's "recover now")
    "recover_expired": Need(_by(RECOVER, REVIEW), select=(JOBS,), update_columns=_RECOVERED,
                            execute=(RECORD_FUNCTION,)),
    "fail_exhausted": Need(_R, select=(JOBS,), update_columns=_EXHAUSTED),
    # Finished rows past retention only, through the definer function: no DELETE right.
    "prune": Need(_R, execute=(PRUNE_FUNCTION,)),
    # -- review: receipts jobs …, receipts ui (the operator's statements, sql/operations.sql)
    "state_counts": Need(_V, select=(JOBS,)),
    "oldest_failed": Need(_V, select=(JOBS,)),
    "list_jobs": Need(_V, select=(JOBS,)),
    "show_job": Need(_V, select=(JOBS,)),
    "show_job_by_order": Need(_V, select=(JOBS,)),
    "job_attempts": Need(_V, select=(ATTEMPTS,)),
    "job_states": Need(_V, select=(JOBS,)),
    "review_jobs": Need(_V, select=(JOBS, ATTEMPTS, WORKERS)),  # the lease holder's pod
    "review_count": Need(_V, select=(JOBS, ATTEMPTS)),
    "retry_jobs": Need(_V, select=(JOBS, ATTEMPTS), update_columns=_RETRIED),
    "discard_jobs": Need(_V, select=(JOBS, ATTEMPTS), update_columns=_DISCARDED),
    "provider_pause": Need(_V, select=(FLOW,)),
    "flow_state": Need(_V, select=(FLOW,)),
    # -- review: the fleet pause, workers seen, sessions, bulk actions
    "fleet_flow": Need(_V, select=(FLOW,)),
    "pause_fleet": Need(_V, select=(FLOW,), update_columns=_PAUSE),
    "resume_fleet": Need(_V, select=(FLOW,), update_columns=_PAUSE),
    "workers_seen": Need(_V, select=(WORKERS,)),
    "revoke_session": Need(_V, select=(UI_REVOKED,), insert=(UI_REVOKED,),
                           delete=(UI_REVOKED,)),
    "revoked_sessions": Need(_V, select=(UI_REVOKED,)),
    "bulk_create": Need(_V, select=(BULK_ACTIONS,), insert=(BULK_ACTIONS,),
                        delete=(BULK_ACTIONS,)),
    "bulk_get": Need(_V, select=(BULK_ACTIONS,)),
    "bulk_recent": Need(_V, select=(BULK_ACTIONS,)),
    "bulk_take": Need(_V, select=(BULK_ACTIONS,), update=(BULK_ACTIONS,)),
    "bulk_stop": Need(_V, select=(BULK_ACTIONS,), update=(BULK_ACTIONS,)),
    "wake_fleet": Need(_V),
    "bulk_release": Need(_V, select=(BULK_ACTIONS,), update=(BULK_ACTIONS,)),
    "bulk_orphans": Need(_V, select=(BULK_ACTIONS,)),
    "bulk_find": Need(_V, select=(BULK_ACTIONS,)),
    "failure_groups": Need(_V, select=(JOBS, ATTEMPTS)),
    "attempt_rates": Need(_V, select=(ATTEMPTS,)),
    "attempt_percentiles": Need(_V, select=(ATTEMPTS,)),
    "ui_sample": Need(_V, select=(UI_SAMPLES,), insert=(UI_SAMPLES,), delete=(UI_SAMPLES,)),
    "ui_samples": Need(_V, select=(UI_SAMPLES,)),
    "bulk_fail": Need(_V, select=(BULK_ACTIONS,), update=(BULK_ACTIONS,)),
    # One batch: the jobs get retry_effect (_RETRIED) or discard_effect (_DISCARDED).
    "bulk_step": Need(_V, select=(BULK_ACTIONS, JOBS, ATTEMPTS), update=(BULK_ACTIONS,),
                      update_columns=_RETRIED),
    # The held rejections as one group (jobs list|discard|retry --held).
    "held_jobs": Need(_V, select=(JOBS,)),
    "held_discard": Need(_V, select=(JOBS,), update_columns=_DISCARDED),
    "held_retry": Need(_V, select=(JOBS,), update_columns={JOBS: ("run_at", "last_error")}),
}
#: Named blocks of the SQL files that are fragments composed into others.
FRAGMENTS = frozenset({"review_matching", "retry_effect", "discard_effect"})
#: Statements of :data:`STATEMENTS` that are not blocks of the SQL files: the SQL
#: function an orders service calls, and migrate.py's read of the tracking table.
ELSEWHERE = frozenset({"receipts_enqueue", "schema_status"})


# ---------------------------------------------------------------- rights


@dataclass(frozen=True, slots=True, order=True)
class Right:
    """One right: *privilege* (``SELECT``, ``EXECUTE``, ``USAGE``, ``MEMBER`` …) on *obj*.

    *obj* is a table name, a function signature, ``"schema"`` or a predefined
    role (``MEMBER``); *column* narrows a table right to one column.
    """

    obj: str
    privilege: str
    column: str = ""


def rights(kind: str) -> frozenset[Right]:
    """Every right a role of *kind* needs (not ``owner``: it owns the objects).

    Raises ``KeyError`` for an unknown kind.
    """
    if kind not in KINDS:
        raise KeyError(kind)
    out = {Right("schema", "USAGE")}
    for need in STATEMENTS.values():
        if kind not in need.kinds:
            continue
        for privilege, tables in (("SELECT", need.select), ("INSERT", need.insert),
                                  ("UPDATE", need.update), ("DELETE", need.delete)):
            out.update(Right(t, privilege) for t in tables)
        for privilege, columns in (("INSERT", need.insert_columns),
                                   ("SELECT", need.select_columns),
                                   ("UPDATE", need.update_columns)):
            out.update(Right(t, privilege, c) for t, cols in columns.items() for c in cols)
        out.update(Right(f, "EXECUTE") for f in need.execute)
        out.update(Right(r, "MEMBER") for r in need.member_of)
    return _without_moot_columns(out)


def _without_moot_columns(wanted: Iterable[Right]) -> frozenset[Right]:
    """*wanted* less the column rights that the same right on the whole table covers."""
    wanted = set(wanted)
    whole = {(r.obj, r.privilege) for r in wanted if not r.column}
    return frozenset(r for r in wanted if not r.column or (r.obj, r.privilege) not in whole)


# ------------------------------------------------------------- the text

#: A role name ``--print-grants`` accepts: what PostgreSQL keeps whole (at most
#: 63 bytes, no NUL), not a name it reserves (``pg_…``, ``public``).
_RESERVED = re.compile(r"^(pg_|public$|none$|current_user$|session_user$|current_role$)", re.I)


class GrantsError(ValueError):
    """A ``KIND=ROLE`` pair that cannot be printed; ``str()`` is one line."""


def parse_assignments(pairs: Sequence[str]) -> dict[str, list[str]]:
    """``["worker=receipts_worker", …]`` → ``{role: [kinds]}`` in the order given.

    Raises :class:`GrantsError` for a pair without ``=``, an unknown kind, a
    role name PostgreSQL would truncate or reserves, one with a control
    character or surrounding spaces, a kind given twice, or
    an ``owner`` role that is also given another kind (the owner has every
    right on the queue already; least privilege wants separate roles).
    """
    roles: dict[str, list[str]] = {}
    seen: set[str] = set()
    for pair in pairs:
        kind, sep, role = pair.partition("=")
        kind = kind.strip().lower()
        if not sep or not role:
            raise GrantsError(f"{pair!r} is not KIND=ROLE (kinds: {', '.join(KINDS)})")
        if kind not in KINDS:
            raise GrantsError(f"unknown kind {kind!r} in {pair!r} (kinds: {', '.join(KINDS)})")
        if "\x00" in role or len(role.encode()) > 63 or _RESERVED.match(role):
            raise GrantsError(f"role name {role!r} is reserved by PostgreSQL or longer than 63 "
                              "bytes")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in role) or role != role.strip():
            # Legal in a quoted name, but never meant: a line break would also end the
            # comment line the role is named in, and what follows would run as SQL.
            raise GrantsError(f"role name {role!r} has a control character or surrounding "
                              "spaces")
        if kind in seen:
            raise GrantsError(f"kind {kind!r} is given twice")
        seen.add(kind)
        roles.setdefault(role, []).append(kind)
    for role, kinds in roles.items():
        if OWNER in kinds and len(kinds) > 1:
            raise GrantsError(f"role {role!r} is the owner and {', '.join(kinds[1:])}: the owner "
                              "has every right on the queue; give the others their own roles")
    return roles


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _target(schema: str, obj: str) -> str:
    """The SQL name of *obj* (a table or a function signature) in *schema*."""
    return f"{qualifier(schema)}{obj}"


def role_sql(role: str, kinds: Iterable[str], schema: str) -> str:
    """The statements that give *role* exactly the rights of *kinds* in *schema*.

    For any kind but ``owner``: :func:`rights_sql` of the union of the kinds'
    :func:`rights`. For ``owner``: ``USAGE, CREATE`` on the schema, and
    ownership of the queue's objects that already exist (made earlier by
    another role).
    """
    kinds = list(kinds)
    who = _ident(role)
    head = f"-- {', '.join(kinds)} {who}: " + "; ".join(KINDS[k] for k in kinds)
    if OWNER in kinds:
        return "\n".join([head, f"GRANT USAGE, CREATE ON SCHEMA {qualifier(schema)[:-1]} "
                                 f"TO {who};", _ownership_sql(role, schema)])
    wanted: set[Right] = set()
    for kind in kinds:
        wanted |= rights(kind)
    return head + "\n" + rights_sql(role, _without_moot_columns(wanted), schema)


def rights_sql(role: str, wanted: Iterable[Right], schema: str) -> str:
    """Revoke every right *role* holds on the queue's tables and function, then grant *wanted*.

    The revoke makes the result exact: what the role held before (say
    ``INSERT`` on the table, from before the SQL function existed) goes.
    Rights held through ``PUBLIC`` or through another role's membership are
    not touched, nor memberships. Grants are grouped by object.
    """
    who = _ident(role)
    wanted = set(wanted)
    tables = ", ".join(_target(schema, t) for t in TABLES)
    functions = ", ".join(_target(schema, f) for f in FUNCTIONS)
    lines = [f"REVOKE ALL ON TABLE {tables} FROM {who};",
             f"REVOKE ALL ON FUNCTION {functions} FROM {who};"]
    if Right("schema", "USAGE") in wanted:
        lines.append(f"GRANT USAGE ON SCHEMA {qualifier(schema)[:-1]} TO {who};")
    order = {"SELECT": 0, "INSERT": 1, "UPDATE": 2, "DELETE": 3}
    for table in TABLES:
        on_table = sorted((r for r in wanted if r.obj == table),
                          key=lambda r: (order.get(r.privilege, 9), r.column))
        if not on_table:
            continue
        whole = [r.privilege for r in on_table if not r.column]
        by_column: dict[str, list[str]] = {}
        for r in on_table:
            if r.column:
                by_column.setdefault(r.privilege, []).append(r.column)
        parts = whole + [f"{p} ({', '.join(cols)})" for p, cols in by_column.items()]
        lines.append(f"GRANT {', '.join(parts)} ON TABLE {_target(schema, table)} TO {who};")
    for r in sorted(r for r in wanted if r.privilege == "EXECUTE"):
        lines.append(f"GRANT EXECUTE ON FUNCTION {_target(schema, r.obj)} TO {who};")
    for r in sorted(r for r in wanted if r.privilege == "MEMBER"):
        lines.append(f"-- {r.obj}: the queue gauges then see every session's open transaction\n"
                     "-- (receipts_oldest_transaction_age_seconds, the xmin horizon); it also\n"
                     "-- shows their query texts. Without it they see only this role's sessions.")
        lines.append(f"GRANT {r.obj} TO {who};")
    return "\n".join(lines)


def _ownership_sql(role: str, schema: str) -> str:
    """A DO block handing the queue objects that exist in *schema* over to *role*."""
    tables = ", ".join(_literal(t) for t in TABLES)
    functions = ", ".join(_literal(_target(schema, f)) for f in FUNCTIONS)
    return (
        "-- Objects an earlier `receipts migrate` created as another role pass to the owner\n"
        "-- (the definer functions then run with the owner's rights, not a superuser's).\n"
        "DO $owner$\n"
        "DECLARE\n"
        "  t text;\n"
        "  f text;\n"
        "BEGIN\n"
        f"  FOREACH t IN ARRAY ARRAY[{tables}] LOOP\n"
        f"    IF to_regclass(format('%I.%I', {_literal(schema)}, t)) IS NOT NULL THEN\n"
        f"      EXECUTE format('ALTER TABLE %I.%I OWNER TO %I', {_literal(schema)}, t, "
        f"{_literal(role)});\n"
        "    END IF;\n"
        "  END LOOP;\n"
        f"  FOREACH f IN ARRAY ARRAY[{functions}] LOOP\n"
        "    IF to_regprocedure(f) IS NOT NULL THEN\n"
        f"      EXECUTE format('ALTER FUNCTION %s OWNER TO %I', f, {_literal(role)});\n"
        "    END IF;\n"
        "  END LOOP;\n"
        "END\n"
        "$owner$;"
    )


def grants_sql(roles: Mapping[str, Sequence[str]], *, schema: str, version: str = "") -> str:
    """The whole ``receipts migrate --print-grants`` text for ``{role: [kinds]}``.

    A header saying when and how to apply it, then one block per role
    (:func:`role_sql`), owner first. No ``BEGIN``/``COMMIT``: apply it in one
    transaction (``psql -1``). Raises ``ValueError`` for a bad *schema*.
    """
    qualifier(schema)
    header = (
        f"-- receipts {version}: least-privilege grants in schema {_ident(schema)}, generated "
        "by `receipts migrate --print-grants`.\n"
        "-- Apply as a superuser (or the objects' owner) in one transaction (psql -1), after\n"
        "-- `receipts migrate` has created the objects, and again after every upgrade. The\n"
        "-- roles must exist (CREATE ROLE ... LOGIN) and may CONNECT to the database (PUBLIC\n"
        "-- may, unless that was revoked).\n"
    )
    if schema != "public":
        header += f"CREATE SCHEMA IF NOT EXISTS {_ident(schema)};\n"
    order = sorted(roles.items(), key=lambda kv: OWNER not in kv[1])
    return header + "\n" + "\n\n".join(role_sql(role, kinds, schema)
                                       for role, kinds in order) + "\n"
