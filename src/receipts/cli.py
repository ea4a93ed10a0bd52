"""Command line: ``receipts <command>`` (argparse) → one function per command.

This module parses and prints; the work is elsewhere (review in
:mod:`receipts.review`, recovery in :mod:`receipts.recovery`, …). The order
of :func:`main` is fixed: parse the arguments and check their values (usage),
then read the settings (``RECEIPTS_*``, built once and passed down), and only
then touch a database, so bad usage is exit 2 even with the database down.

Exit status (docs/design.md §9): 0 success, 2 bad usage or settings, 1 any
other error (database unreachable, schema missing, a failed sweep). Error
messages are one line on stderr and never contain a password or token. A
closed stdout (``receipts jobs list | head -1``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from receipts import fleet, migrate, planner, recovery, review
from receipts.check import run_checks
from receipts.db import check_connection, make_pool, transaction
from receipts.demo import DemoOptions, run_demo
from receipts.embedded import EmbeddedPostgresError, bin_dir
from receipts.enqueue import check_order_id, enqueue
from receipts.errors import (
    DatabaseUnavailable,
    InvalidOrderId,
    QueueError,
    SchemaMissing,
    UnusableDatabase,
)
from receipts.grants import GrantsError, grants_sql, parse_assignments
from receipts.jobqueue import JobQueue
from receipts.logs import configure_logging, get_logger
from receipts.migrate import MigrationError
from receipts.model import JobState
from receipts.operations import BulkStep, FleetFlow, Operations, ReviewFilter
from receipts.provider import Faults, ReferenceProvider, serve
from receipts.proxy import environment_secrets
from receipts.runtime import make_operations, run_on_loop, run_worker
from receipts.settings import (
    ENV_PREFIX,
    Settings,
    SettingsError,
    check_dsn,
    check_ui_settings,
    check_worker_settings,
    load_settings,
    package_version,
    redact_dsn,
    schema_for,
    unknown_variables,
)
from receipts.statements import DEFAULT_SCHEMA, SCHEMA_NAME, SCHEMA_RULE
from receipts.ui import run_ui

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
#: ``receipts migrate --check``: migrations pending / schema unknown to this version.
EXIT_PENDING, EXIT_UNKNOWN = 3, 4

# ------------------------------------------------------------ settings help

_CONNECTION = ("database_url", "database_schema", "application_name", "pgbouncer",
               "statement_timeout_seconds", "lock_timeout_seconds",
               "idle_in_transaction_timeout_seconds", "log_level")
_RECOVERY_ONLY = ("recovery_delay_seconds", "recovery_batch_size", "retention_days",
                  "prune_batch_size", "pushgateway_url")
# The settings each command reads; the worker reads every other one.
COMMAND_SETTINGS: dict[str, tuple[str, ...]] = {
    "migrate": ("database_url", "database_schema", "application_name", "log_level",
                "migrate_lock_timeout_seconds"),
    "recover": (*_CONNECTION, "max_attempts", "synchronous_commit", *_RECOVERY_ONLY),
    "enqueue": _CONNECTION,
    "jobs": (*_CONNECTION, "provider_rate_limit_per_second", "provider_burst"),
    "ui": (*_CONNECTION, "ui_host", "ui_port", "ui_admin_token", "ui_viewer_token",
           "ui_anonymous_read", "ui_pool_max_size", "ui_refresh_seconds", "ui_user_header",
           "ui_trusted_proxies", "max_attempts",
           "lease_seconds", "recovery_delay_seconds", "recovery_batch_size",
           "provider_rate_limit_per_second", "provider_burst"),
}


# Read only by the console (`receipts ui`, its ui_* settings) and by `receipts migrate`
# (its lock timeout): never by the worker.
_OTHERS_ONLY = frozenset(
    {n for n in COMMAND_SETTINGS["ui"] if n.startswith("ui_")} | {"migrate_lock_timeout_seconds"})


def settings_for(command: str) -> list[str]:
    """Names of the :class:`Settings` fields *command* reads (the worker: all but recovery's)."""
    if command in COMMAND_SETTINGS:
        return list(COMMAND_SETTINGS[command])
    return [name for name in Settings.model_fields
            if name not in _RECOVERY_ONLY and name not in _OTHERS_ONLY]


def _default_text(name: str) -> str:
    info = Settings.model_fields[name]
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None or value == "":
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def settings_help(command: str) -> str:
    """The epilog of *command*'s ``--help``: each variable it reads, its default, and its
    field's description (the same text as docs/reference/settings.md)."""
    column, width = 40, 100
    lines = ["settings (environment variables):"]
    for name in settings_for(command):
        variable = f"  {ENV_PREFIX}{name.upper()}"
        text = Settings.model_fields[name].description or ""  # the one source of help
        wrapped = textwrap.wrap(f"{text} [{_default_text(name)}]", width - column,
                                break_on_hyphens=False)
        if len(variable) + 2 > column:
            lines.append(variable)
        else:
            lines.append(variable.ljust(column) + wrapped.pop(0))
        lines += [" " * column + more for more in wrapped]
    lines.append("docs/configuration.md explains them; docs/reference/settings.md lists all.")
    return "\n".join(lines) + "\n"


TOP_EPILOG = (
    "Settings come from RECEIPTS_* environment variables; `receipts COMMAND --help` lists\n"
    "those the command reads, with their defaults.\n"
)


class UsageError(Exception):
    """Bad command-line input; exit status 2."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's layout and appends ``(default: …)`` to options that have one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS
        if "%(default)" not in text and action.option_strings and not unset:
            text += " (default: %(default)s)"
        return text


# -------------------------------------------------------------- plumbing


def _run(coro: Coroutine[Any, Any, int]) -> int:
    return asyncio.run(coro)


async def _with_queue(settings: Settings, role: str,
                      body: Callable[[JobQueue], Coroutine[Any, Any, int]], *,
                      check: bool = True) -> int:
    """Open a one-connection pool, run *body(queue)* (recovery's statements), close the pool.

    First connects once (*check*), so a one-shot command fails fast when the
    database cannot be reached (:class:`DatabaseUnavailable`) or is one
    receipts refuses; ``recover --loop`` checks for itself (:func:`_first_check`).
    """
    if check:
        await check_connection(settings, role)
    pool = make_pool(settings, role, max_size=1)
    await pool.open(wait=False)
    try:
        queue = JobQueue(pool, lease_seconds=settings.lease_seconds,
                         max_attempts=settings.max_attempts, schema=settings.db_schema)
        return await body(queue)
    finally:
        await pool.close(timeout=2.0)


async def _with_operations(settings: Settings, role: str,
                           body: Callable[[Operations], Coroutine[Any, Any, int]]) -> int:
    """Open a one-connection pool, run *body(operations)* (the operator's statements,
    :func:`receipts.runtime.make_operations`, no statement deadline), close the pool."""
    await check_connection(settings, role)
    pool = make_pool(settings, role, max_size=1)
    await pool.open(wait=False)
    try:
        return await body(make_operations(settings, pool, deadline=False))
    finally:
        await pool.close(timeout=2.0)


def _error(text: str) -> None:
    print(f"receipts: error: {text}", file=sys.stderr)


# ------------------------------------------------------------------ commands


def _schema_from_environment() -> str:
    """The queue schema chosen as the worker chooses it, without connecting or loading
    settings: ``RECEIPTS_DATABASE_SCHEMA``, else the ``search_path`` of
    ``RECEIPTS_DATABASE_URL``, else ``public``. Raises :class:`UsageError` for a bad name."""
    schema = os.environ.get("RECEIPTS_DATABASE_SCHEMA", "").strip()
    source = "RECEIPTS_DATABASE_SCHEMA"
    if not schema:
        dsn = os.environ.get("RECEIPTS_DATABASE_URL", "").strip()
        schema = schema_for(dsn) if dsn else DEFAULT_SCHEMA
        source = "the DSN's search_path"
    if not SCHEMA_NAME.match(schema):
        raise UsageError(f"schema {schema!r} (from {source}) is not {SCHEMA_RULE}")
    return schema


def check_migrate(args: argparse.Namespace) -> None:
    """Usage of ``migrate``: ``--pending`` only with ``--print-sql``; ``--print-grants``
    pairs parsed into ``args.grant_roles`` ({role: [kinds]})."""
    if args.pending and not args.print_sql:
        raise UsageError("--pending goes with --print-sql")
    args.grant_roles = None
    if args.print_grants is not None:
        try:
            args.grant_roles = parse_assignments(args.print_grants)
        except GrantsError as exc:
            raise UsageError(f"--print-grants: {exc}") from None


def cmd_migrate(settings: Settings | None, args: argparse.Namespace) -> int:
    """``receipts migrate``: apply pending migrations; prints what it applied.

    ``--print-sql [--pending]`` prints the migrations' SQL instead (all of them
    needs no database); ``--print-grants KIND=ROLE…`` prints the least-privilege
    grants of those roles (no database; :mod:`receipts.grants`); ``--check``
    changes nothing and exits 0 when the schema is current (or a later release's
    of the same major version, which this one runs on), EXIT_PENDING (3) when
    migrations are pending and EXIT_UNKNOWN (4) when the database has migrations
    this version cannot run on (breaking or foreign) or an applied one differs.
    """
    if args.grant_roles is not None:
        sys.stdout.write(grants_sql(args.grant_roles, schema=_schema_from_environment(),
                                    version=package_version()))
        return EXIT_OK
    if args.print_sql and not args.pending:
        # No database is read, so no settings are loaded: only the schema's name,
        # chosen as the worker chooses it (the setting, else the DSN's search_path).
        sys.stdout.write(migrate.migration_sql(schema=_schema_from_environment()))
        return EXIT_OK
    assert settings is not None
    if args.print_sql or args.check:
        status = migrate.read_schema_status(settings.dsn,
                                            application_name=settings.application_name,
                                            schema=settings.db_schema)
        if args.print_sql:
            todo = [m for m in migrate.bundled_migrations() if m.version in status.pending]
            sys.stdout.write(migrate.migration_sql(todo, schema=settings.db_schema))
            return EXIT_OK
        print(status.describe())
        if status.changed or (status.unknown and not status.newer):
            return EXIT_UNKNOWN
        return EXIT_PENDING if status.pending else EXIT_OK
    applied = migrate.apply_migrations(
        settings.dsn, application_name=settings.application_name,
        lock_timeout_seconds=settings.migrate_lock_timeout_seconds, schema=settings.db_schema,
        beside_existing=settings.database_schema is not None)
    print(f"applied {len(applied)} migration(s)" + (f": {', '.join(applied)}" if applied
                                                     else "; schema is up to date"))
    return EXIT_OK


def cmd_worker(settings: Settings, args: argparse.Namespace) -> int:
    """``receipts worker``: run until SIGTERM/SIGINT, then drain; 0 on a clean stop."""
    run_on_loop(settings, run_worker(settings))
    return EXIT_OK


async def _first_check(settings: Settings, role: str, stop: asyncio.Event) -> bool:
    """``recover --loop``'s first connection: False when *stop* was set first.

    The loop is a long-running process, like the worker: a database it cannot
    reach as it starts (one restarting after a crash answers "the database
    system is starting up") is logged as ``recovery_failed``, as a failed sweep
    is, and the sweeps that follow try again; exit 1 there ended the loop in
    the crash test. A database receipts refuses (:class:`UnusableDatabase`)
    still ends it. A stop signal during the attempt ends it at once (the
    signal handlers are the loop's own from its start).
    """
    attempt = asyncio.ensure_future(check_connection(settings, role))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({attempt, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not attempt.done():
        attempt.cancel()
        with contextlib.suppress(asyncio.CancelledError, QueueError):
            await attempt
        return False
    try:
        attempt.result()
    except DatabaseUnavailable as exc:
        get_logger("recovery").warning("recovery_failed", extra={"error": str(exc)[:300]})
    return not stop.is_set()


def cmd_recover(settings: Settings, args: argparse.Namespace) -> int:
    """``receipts recover``: one sweep (or ``--loop SECONDS``); a failed push still exits 0."""
    if args.loop is not None:

        async def loop() -> int:
            stop = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            if not await _first_check(settings, "recover", stop):
                return EXIT_OK

            async def sweeps(queue: JobQueue) -> int:
                await recovery.run_loop(queue, settings, args.loop, stop)
                return EXIT_OK

            return await _with_queue(settings, "recover", sweeps, check=False)

        return _run(loop())

    async def once(queue: JobQueue) -> int:
        report = await recovery.run_once(queue, settings)
        print(json.dumps(report.as_dict()) if args.json
              else report.summary(delay_seconds=settings.recovery_delay_seconds))
        # A failed push is logged (push_failed) but does not fail a sweep that
        # worked: the sweep's own work is done, and a Pushgateway that stays
        # unreachable shows as ReceiptsRecoveryNotRunning (its last success ages).
        recovery.push_if_configured(report, settings)
        return EXIT_OK

    return _run(_with_queue(settings, "recover", once))


def cmd_check(settings: Settings, args: argparse.Namespace) -> int:
    """``receipts check``: the database and the provider reachable (:mod:`receipts.check`);
    one line per check, 0 when both pass, 1 otherwise."""
    results = asyncio.run(run_checks(settings))
    for result in results:
        print(result.line())
    return EXIT_OK if all(result.ok for result in results) else EXIT_ERROR


def check_enqueue(args: argparse.Namespace) -> None:
    """Usage of ``enqueue``: every order id valid (before any connection)."""
    for n, order_id in enumerate(args.order_ids, 1):
        try:
            check_order_id(order_id)
        except InvalidOrderId as exc:
            raise UsageError(f"argument ORDER_ID #{n} ({order_id[:40]!r}): {exc}") from None


def cmd_enqueue(settings: Settings, args: argparse.Namespace) -> int:
    """``receipts enqueue``: enqueue the given orders in one transaction."""
    created = 0
    with transaction(settings, "cli") as conn:
        for order_id in args.order_ids:
            created += enqueue(conn, order_id, schema=settings.db_schema) is not None
    dupes = len(args.order_ids) - created
    print(f"enqueued {created} job(s); {dupes} order(s) already had one")
    return EXIT_OK


def _planner_default(name: str) -> float:
    """A default of the capacity planner (a bench figure), for help texts."""
    return float(getattr(planner, name))


def _int_between(text: str, low: int, high: int, what: str) -> int:
    """*text* as an integer from *low* to *high*; else argparse's error naming *what*."""
    try:
        number = int(text)
    except ValueError:
        number = low - 1
    if not low <= number <= high:
        raise argparse.ArgumentTypeError(f"must be {what} from {low} to {high}, got {text!r}")
    return number


def _http_status(text: str) -> int:
    """argparse type: an HTTP status code, 100 to 599 (RFC 9110 §15)."""
    return _int_between(text, 100, 599, "an HTTP status")


def _positive_int(text: str) -> int:
    """argparse type: an integer from 1 to 1,000,000."""
    return _int_between(text, 1, 1_000_000, "an integer")


def _port(text: str) -> int:
    """argparse type: a TCP port number (1–65535)."""
    return _int_between(text, 1, 65_535, "a port")


def _seconds(minimum: float) -> Callable[[str], float]:
    """argparse type: a finite number of seconds, at least *minimum*."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(
                f"must be a number of seconds >= {minimum:g}, got {text!r}")
        return value

    return parse


def _parse_since(text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"--since must be an ISO 8601 time, got {text!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[("" if r.get(c) is None else str(r.get(c)))[:60] for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def check_jobs(args: argparse.Namespace) -> None:
    """Usage of ``jobs``: turn ``--since`` and retry ids into values (before any connection).

    Sets ``args.since_at`` (aware datetime or None) and ``args.uuids`` (list of
    UUIDs, or None for ``--all-failed``); raises :class:`UsageError`.
    """
    args.since_at = _parse_since(getattr(args, "since", None))
    args.uuids = None
    if getattr(args, "held", False) and args.jobs_command == "list" and (
            args.since is not None or args.state is not None):
        raise UsageError("--held lists the held rejections only: no --state or --since")
    if args.jobs_command == "list" and args.state is None:
        args.state = "failed"
    if args.jobs_command == "pause":
        try:
            args.pause_seconds = fleet.parse_duration(args.duration)
            args.note = fleet.check_note(args.reason)
        except fleet.PauseError as exc:
            raise UsageError(str(exc)) from None
    if args.jobs_command == "retry":
        if args.held:
            if args.all_failed or args.ids:
                raise UsageError("give job ids, --all-failed or --held (one of them)")
            return
        if args.all_failed == bool(args.ids):
            raise UsageError("give job ids or --all-failed (not both)")
        if args.ids:
            try:
                args.uuids = [uuid.UUID(i) for i in args.ids]
            except ValueError:
                raise UsageError("job ids must be UUIDs (see `receipts jobs list`)") from None
    if args.jobs_command == "discard":
        if args.held:
            if (args.ids or args.failed or args.ready or args.reason
                    or args.status is not None or args.since is not None):
                raise UsageError("--held takes no job ids and no other filter")
            args.discard_target = None
        elif args.ids:
            if args.failed or args.ready or args.reason or args.status is not None:
                raise UsageError("give job ids, or --failed/--ready with filters (not both)")
            try:
                args.discard_target = list(dict.fromkeys(uuid.UUID(i) for i in args.ids))
            except ValueError:
                raise UsageError("job ids must be UUIDs (see `receipts jobs list`)") from None
        elif args.failed == args.ready:
            raise UsageError("give job ids, or one of --failed/--ready with optional filters")
        else:
            args.discard_target = ReviewFilter(
                state=JobState.FAILED if args.failed else JobState.READY,
                reason=args.reason, status=args.status, since=args.since_at)


def cmd_jobs(settings: Settings, args: argparse.Namespace) -> int:
    """``receipts jobs stats|list|show|retry|discard``: failed-job review (docs/operations.md)."""
    async def body(operations: Operations) -> int:
        if args.jobs_command in ("pause", "resume"):
            return await _fleet_command(operations, args)
        if args.jobs_command == "stats":
            stats = await review.stats(operations)
            flow = await _fleet_flow(settings, operations)
            if args.json:
                print(json.dumps(stats.as_dict() | {"provider": _flow_dict(flow)}))
            else:
                table = [(str(state), str(stats.jobs[state])) for state in JobState] + [
                    ("due now", str(stats.ready_due)),
                    ("lag", f"{stats.queue_lag_seconds:.1f}s"),
                    ("oldest undelivered",
                     f"{stats.oldest_undelivered_age_seconds:.1f}s since enqueue"),
                    ("expired leases", f"{stats.expired_leases} (awaiting recovery)"),
                    ("oldest failed", str(review.jsonable(stats.oldest_failed_at) or "-")),
                    ("provider", _describe_flow(flow)),
                ]
                width = max(len(label) for label, _ in table)
                for label, value in table:
                    print(f"{label:<{width}}  {value}")
            return EXIT_OK
        if args.jobs_command in ("list", "discard", "retry") and getattr(args, "held", False):
            return await _held_command(operations, args)
        if args.jobs_command == "list":
            rows = await review.list_jobs(operations, JobState(args.state), limit=args.limit,
                                          since=args.since_at)
            if args.json:
                print(json.dumps(rows))
            else:
                print(_table(rows, ["id", "order_id", "state", "attempts", "run_at",
                                    "finished_at", "last_error"]))
            return EXIT_OK
        if args.jobs_command == "show":
            row = await review.show(operations, args.id)
            if row is None:
                _error(f"no job with id or order id {args.id!r}")
                return EXIT_ERROR
            if args.json:
                print(json.dumps(row))
            else:
                attempts = row.pop("attempts")
                for key, value in row.items():
                    print(f"{key:<12} {'' if value is None else value}")
                for a in attempts:
                    print(f"attempt {a['attempt']:<4} {a['at']}  {a['reason']}"
                          f"  {a['status'] or '-'}  {(a['error'] or '')[:60]}")
            return EXIT_OK
        progress = _BulkProgress()
        if args.jobs_command == "discard":
            outcome = await review.discard(operations, args.discard_target,
                                           dry_run=args.dry_run, author=fleet.cli_author(),
                                           on_step=progress)
            _print_discard(args, outcome)
            return EXIT_OK if outcome.ok else EXIT_ERROR
        result = await review.retry(operations, args.uuids, dry_run=args.dry_run,
                                    author=fleet.cli_author(), on_step=progress)
        _print_retry(args, result)
        return EXIT_OK if result.ok else EXIT_ERROR

    return _run(_with_operations(settings, "cli", body))


#: Pauses that end when a probe of the provider is accepted (docs/design.md §11); the
#: others (``retry_after``, ``manual``) end when their time is up.
PROBED_PAUSES = frozenset({"outage", "auth", "rejecting"})


async def _held_command(operations: Operations, args: argparse.Namespace) -> int:
    """``jobs list|discard|retry --held``: the held rejections as one group (docs/operations.md)."""
    if args.jobs_command == "list":
        rows = [{k: review.jsonable(v) for k, v in row.items()}
                for row in await operations.held_jobs(limit=args.limit)]
        if args.json:
            print(json.dumps(rows))
        else:
            held = rows[0]["held"] if rows else 0
            shown = f" (showing {len(rows)})" if len(rows) < held else ""
            print(f"{held} held rejection(s){shown}", file=sys.stderr)
            print(_table(rows, ["id", "order_id", "attempts", "run_at", "last_error"]))
        return EXIT_OK
    verb = "discard" if args.jobs_command == "discard" else "retry"
    if args.dry_run:
        rows = await operations.held_jobs(limit=1)
        count = rows[0]["held"] if rows else 0
        print(json.dumps({"action": verb, "dry_run": True, "count": count}) if args.json
              else f"would {verb} {count} held rejection(s)")
        return EXIT_OK
    changed = await operations.held_action(args.jobs_command)
    if verb == "discard":
        print(json.dumps({"action": verb, "dry_run": False, "count": changed}) if args.json
              else f"{changed} held rejection(s) discarded")
        return EXIT_OK
    # Every held rejection is due now: those made due by this command, and those that
    # were due already (the dry run counts both, and so does this answer).
    rows = await operations.held_jobs(limit=1)
    due = rows[0]["held"] if rows else 0
    if args.json:
        print(json.dumps({"action": verb, "dry_run": False, "count": due,
                          "made_due": changed}))
    else:
        already = due - changed
        print(f"{due} held rejection(s) due now" + (
            f" ({changed} made due by this command, {already} due already)"
            if changed and already > 0 else " (all due already)" if due and not changed
            else ""))
    pause = await operations.provider_pause() if due else {"pause_reason": None}
    if pause["pause_reason"] is not None:
        ends = ("when a probe is accepted" if pause["pause_reason"] in PROBED_PAUSES
                else f"in {float(pause['remaining_seconds'] or 0):.0f} s")
        print(f"the fleet is paused ({pause['pause_reason']}): nothing is claimed until the "
              f"pause ends ({ends}) or `receipts jobs resume` lifts it", file=sys.stderr)
    return EXIT_OK


class _BulkProgress:
    """Prints a bulk action's progress on stderr, at most every few seconds."""

    EVERY_SECONDS = 5.0

    def __init__(self) -> None:
        self._clock = time.monotonic
        self._last = self._clock()

    def __call__(self, step: BulkStep) -> None:
        now = self._clock()
        if step.status == "running" and now - self._last >= self.EVERY_SECONDS:
            self._last = now
            print(f"receipts: {step.changed:,} job(s) changed so far "
                  f"({step.examined:,} examined)", file=sys.stderr, flush=True)


async def _fleet_flow(settings: Settings, operations: Operations) -> FleetFlow | None:
    """The fleet's flow state (``fleet_flow``), or None before migration 0007."""
    try:
        return await operations.fleet_flow(rate=settings.provider_rate_limit_per_second,
                                           burst=settings.burst)
    except SchemaMissing:
        return None


def _flow_dict(flow: FleetFlow | None) -> dict[str, Any] | None:
    jsonable = review.jsonable
    if flow is None:
        return None
    return {"paused": flow.paused, "reason": flow.reason,
            "paused_until": jsonable(flow.paused_until),
            "remaining_seconds": round(flow.remaining_seconds, 3), "note": flow.note,
            "paused_by": flow.paused_by, "paused_at": jsonable(flow.paused_at),
            "last_probe_at": jsonable(flow.last_probe_at),
            "last_probe_outcome": flow.last_probe_outcome}


def _describe_flow(flow: FleetFlow | None) -> str:
    """One line: whether deliveries are paused, why, until when, by whom."""
    if flow is None:
        return "unknown (run receipts migrate)"
    if not flow.paused:
        return "delivering (not paused)"
    if flow.awaiting_probe:
        return f"paused ({flow.reason}); a probe decides when it resumes"
    assert flow.paused_until is not None
    text = (f"paused ({flow.reason}) for {fleet.describe_seconds(flow.remaining_seconds)} "
            f"more, until {flow.paused_until.isoformat()}")
    if flow.note:
        text += f": {flow.note!r} by {flow.paused_by}"
    return text


async def _fleet_command(operations: Operations, args: argparse.Namespace) -> int:
    """``receipts jobs pause`` / ``resume``: the fleet-wide manual pause (receipts.fleet)."""
    if args.jobs_command == "pause":
        outcome = await fleet.pause(operations, seconds=args.pause_seconds, note=args.note,
                                    author=fleet.cli_author(), replace=args.replace)
        if args.json:
            print(json.dumps({"paused": outcome.paused,
                              "paused_until": review_json(outcome.paused_until),
                              "previous_reason": outcome.previous_reason,
                              "previous_until": review_json(outcome.previous_until)}))
        elif outcome.paused:
            assert outcome.paused_until is not None
            print(f"paused every worker's deliveries until {outcome.paused_until.isoformat()} "
                  f"({fleet.describe_seconds(args.pause_seconds)}); workers stop claiming within "
                  "a few seconds; `receipts jobs resume` ends it sooner")
        if not outcome.paused:
            _error(fleet.refusal(outcome) + " (--replace)")
            return EXIT_ERROR
        return EXIT_OK
    resumed = await fleet.resume(operations, author=fleet.cli_author())
    if args.json:
        print(json.dumps({"resumed": resumed.lifted, "reason": resumed.reason,
                          "paused_until": review_json(resumed.paused_until),
                          "note": resumed.note}))
    elif resumed.lifted:
        print(f"resumed deliveries (lifted a {resumed.reason} pause"
              + (f": {resumed.note!r})" if resumed.note else ")"))
    else:
        print("not paused; nothing to resume")
    return EXIT_OK


def review_json(value: Any) -> Any:
    """A datetime as ISO 8601 text (None stays None), for JSON output."""
    return review.jsonable(value)


def _print_retry(args: argparse.Namespace, result: review.RetryResult) -> None:
    """Print what ``jobs retry`` did: JSON or lines on stdout; refusals on stderr."""
    if args.json:
        print(json.dumps(result.as_dict()))
    elif not result.refused:
        ids = result.would_retry if result.dry_run else result.retried
        verb = "would retry" if result.dry_run else "retried"
        print(f"{verb} {result.count} failed job(s)")
        for job_id in ids[:20]:
            print(f"  {job_id}")
        if result.count > 20:
            print(f"  … and {result.count - 20} more")
    for refusal in result.refused:
        _error(refusal.reason)
    if result.changed:
        # Another operator, a worker or recovery acted on a job between the check and
        # the update, which then changed nothing (all or nothing, as on the page).
        _error("the jobs changed meanwhile; nothing was retried")
    elif result.refused:
        _error("nothing was retried")


def _print_discard(args: argparse.Namespace, result: review.DiscardResult) -> None:
    """Print what ``jobs discard`` did: JSON or lines on stdout; refusals on stderr."""
    for refusal in result.refused:
        _error(refusal.discard_reason)
    if result.refused:
        _error("nothing was discarded")
    elif result.changed:
        _error("the jobs changed meanwhile; nothing was discarded")
    if args.json:
        print(json.dumps(result.as_dict()))
    elif result.ok:
        verb = "would discard" if result.dry_run else "discarded"
        print(f"{verb} {result.expected} job(s)")
        for job_id in result.discarded[:20]:
            print(f"  {job_id}")
        if result.expected > 20:
            print(f"  … and {result.expected - 20} more")


def cmd_ui(settings: Settings, args: argparse.Namespace) -> int:
    """``receipts ui``: serve the review page until SIGTERM/SIGINT."""
    asyncio.run(run_ui(settings))
    return EXIT_OK


def check_provider(args: argparse.Namespace) -> None:
    """Usage of ``provider``: the fault options form valid :class:`Faults` (``args.faults``)."""
    try:
        faults = Faults(
            latency_seconds=args.latency_ms / 1000, latency_jitter_seconds=args.jitter_ms / 1000,
            error_rate=args.error_rate, rate_limit_rate=args.rate_limit_rate,
            retry_after_seconds=args.retry_after, reject_rate=args.reject_rate,
            timeout_rate=args.timeout_rate, reset_rate=args.reset_rate,
            hang_after_headers_rate=args.hang_after_headers_rate,
            hang_seconds=args.hang_seconds, capacity=args.capacity,
            capacity_answer=args.capacity_answer,
        )
        args.faults = Faults.from_mapping({}, faults)
    except ValueError as exc:
        text = str(exc)
        field = text.split(" ", 1)[0]
        flag = _PROVIDER_FLAGS.get(field)
        raise UsageError(f"{flag}: {text}" if flag else text) from None


#: The fault each ``provider`` option sets, so that an error names the option typed.
_PROVIDER_FLAGS = {
    "latency_seconds": "--latency-ms (in milliseconds; the fault is in seconds)",
    "latency_jitter_seconds": "--jitter-ms (in milliseconds; the fault is in seconds)",
    "error_rate": "--error-rate", "rate_limit_rate": "--rate-limit-rate",
    "retry_after_seconds": "--retry-after", "reject_rate": "--reject-rate",
    "timeout_rate": "--timeout-rate", "reset_rate": "--reset-rate",
    "hang_after_headers_rate": "--hang-after-headers-rate", "hang_seconds": "--hang-seconds",
    "capacity": "--capacity", "capacity_answer": "--capacity-answer",
}


def cmd_provider(settings: Settings | None, args: argparse.Namespace) -> int:
    """``receipts provider``: serve the reference provider until SIGTERM/SIGINT."""
    provider = ReferenceProvider(args.faults, token=args.token, seed=args.seed)

    async def main() -> int:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await serve(provider, args.host, args.port, stop)
        return EXIT_OK

    return _run(main())


def check_demo(args: argparse.Namespace) -> None:
    """Usage of ``demo``: a valid ``--dsn``, or the embedded PostgreSQL installed."""
    if args.dsn:
        try:
            check_dsn(args.dsn)
        except ValueError as exc:
            raise UsageError(f"--dsn {exc}") from None
        return
    try:
        bin_dir()
    except EmbeddedPostgresError as exc:
        raise UsageError(f"receipts demo: {exc}") from None


def cmd_demo(settings: Settings | None, args: argparse.Namespace) -> int:
    """``receipts demo``: the whole service end to end; 0 when nothing was lost."""
    options = DemoOptions(dsn=args.dsn, orders=args.orders, workers=args.workers,
                          concurrency=args.concurrency, seed=args.seed)
    return run_demo(options)


def cmd_plan(settings: Settings | None, args: argparse.Namespace) -> int:
    """``receipts plan``: print a capacity plan (pure arithmetic, no connection)."""
    def number(option: str, text: str | None) -> float:
        if text is None:
            raise UsageError(f"{option} is required")
        try:
            return float(text)
        except ValueError:
            raise UsageError(f"{option} must be a number, not {text!r}") from None

    try:
        result = planner.plan(number("--rate", args.rate), number("--latency", args.latency),
                      utilisation=number("--utilisation", args.utilisation),
                      db_ceiling=number("--db-ceiling", args.db_ceiling
                                        or str(planner.DB_CEILING_BATCHED_JOBS_PER_SECOND)),
                      cpu_per_delivery_seconds=number(
                          "--cpu-per-delivery", args.cpu_per_delivery
                          or str(planner.HTTP_DELIVERY_CPU_SECONDS * 1e6)) / 1e6,
                      provider_capacity=None if args.provider_capacity is None else number(
                          "--provider-capacity", args.provider_capacity))
    except planner.PlanError as exc:
        raise UsageError(str(exc)) from None
    print(planner.describe(result))
    return EXIT_OK


# -------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The ``receipts`` argument parser (all subcommands).

    Each subcommand is one ``add(name, help)`` call plus its options; a
    command that reads settings lists them in its ``--help`` epilog
    (:data:`COMMAND_SETTINGS`). Usage checks that need more than argparse
    types go in :data:`CHECKS` (they run before settings are read).
    """
    parser = argparse.ArgumentParser(
        prog="receipts",
        description="Deliver order receipts from a PostgreSQL job queue.",
        epilog=TOP_EPILOG,
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"receipts {package_version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        epilog = settings_help(name) if name in NEEDS_SETTINGS else None
        return sub.add_parser(name, help=help_text, description=help_text, epilog=epilog,
                              formatter_class=_Formatter)

    p = add("migrate", "Apply pending database migrations (safe to run again and concurrently).")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--print-sql", action="store_true",
                      help="print the migrations' SQL (with the tracking-table rows workers "
                           "check) instead of applying it; no database needed")
    mode.add_argument("--print-grants", nargs="+", metavar="KIND=ROLE",
                      help="print the least-privilege GRANTs of each role (kinds: owner, "
                           "enqueue, enqueue-python, worker, recover, review), e.g. "
                           "worker=receipts_worker; no database needed")
    mode.add_argument("--check", action="store_true",
                      help="change nothing; print the schema version; exit 0 up to date, "
                           "3 migrations pending, 4 schema unknown to this version")
    p.add_argument("--pending", action="store_true",
                   help="with --print-sql: only the migrations this database has not applied")
    add("worker", "Run a worker: claim receipt jobs, deliver them, ack (until SIGTERM).")
    add("check", "Check that the database (schema usable) and the provider answer, with the "
                 "worker's settings; no receipt is sent. Exit 0 both, 1 not (helm test).")
    p = add("recover", "Return expired leases to the queue and prune old rows (one sweep).")
    p.add_argument("--loop", type=_seconds(0.1), metavar="SECONDS",
                   help="sweep every SECONDS until SIGTERM (outside Kubernetes); "
                        "default: one sweep")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p = add("enqueue", "Enqueue receipt jobs for orders (duplicates are a no-op).")
    p.add_argument("order_ids", nargs="+", metavar="ORDER_ID",
                   help="order ids, enqueued in one transaction")

    jobs = add("jobs", "Review jobs (stats, list, show, retry, discard); pause or resume "
                       "deliveries.")
    jsub = jobs.add_subparsers(dest="jobs_command", required=True, metavar="ACTION")

    def action(name: str, help_text: str, description: str | None = None
               ) -> argparse.ArgumentParser:
        j = jsub.add_parser(name, help=help_text, description=description or help_text,
                            epilog=settings_help("jobs"), formatter_class=_Formatter)
        j.add_argument("--json", action="store_true", help="print one JSON document on stdout")
        return j

    action("stats", "counts by state, lag, age of the oldest undelivered job, oldest failed")
    j = action("list", "list jobs in a state, newest first (with --held: the held "
                       "rejections, oldest due first)")
    j.add_argument("--state", choices=["ready", "running", "done", "failed", "discarded"],
                   default=None,
                   help="the state to list (default: failed)")
    j.add_argument("--limit", type=_positive_int, default=50, help="at most this many jobs")
    j.add_argument("--since", metavar="TIME",
                   help="only jobs finished (or created, while unfinished) at or after this "
                        "ISO 8601 time (UTC unless it has an offset); default: any time")
    j.add_argument("--held", action="store_true",
                   help="the held rejections instead: ready jobs whose last 4xx had no "
                        "evidence that the provider accepts other orders")
    j = action("show", "one job by id or order id")
    j.add_argument("id", metavar="ID", help="a job UUID or an order id")
    j = action(
        "retry", "failed → ready, attempts reset, run now (all or nothing)",
        "Make failed jobs deliverable again: state ready, attempts 0, due now; "
        "last_error is kept, prefixed 'manual retry after: '. Named jobs are "
        "retried only if every one is failed. With --held, the held rejections "
        "instead (ready jobs whose 4xx awaits evidence): each is made due now and "
        "keeps its attempts and last_error. Exit 0 done, 1 refused (nothing "
        "changed) or database error, 2 bad usage.")
    j.add_argument("ids", nargs="*", metavar="ID", help="job UUIDs (or use --all-failed)")
    j.add_argument("--all-failed", action="store_true", help="every failed job")
    j.add_argument("--held", action="store_true",
                   help="every held rejection (ready): send them again now")
    j.add_argument("--dry-run", action="store_true", help="show what would change; change nothing")
    j = action(
        "discard", "ready/failed → discarded (terminal; the order stays deduplicated)",
        "Give up on jobs: state discarded, kept until retention prunes it, so the "
        "order cannot be enqueued again meanwhile. Running jobs are never touched. "
        "All or nothing. Exit 0 done, 1 refused (nothing changed), 2 bad usage.")
    j.add_argument("ids", nargs="*", metavar="ID", help="job UUIDs")
    j.add_argument("--failed", action="store_true", help="every failed job matching the filters")
    j.add_argument("--ready", action="store_true", help="every ready job matching the filters")
    j.add_argument("--held", action="store_true",
                   help="every held rejection (see `jobs list --held`): give up on them")
    j.add_argument("--reason", help="latest attempt's reason, e.g. rejected; default: any")
    j.add_argument("--status", type=_http_status,
                   help="latest attempt's HTTP status, e.g. 422; default: any")
    j.add_argument("--since", metavar="TIME",
                   help="finished (ready: due) at or after this ISO 8601 time; default: any")
    j.add_argument("--dry-run", action="store_true", help="show what would change; change nothing")

    j = action(
        "pause", "stop every worker's deliveries for a while, with a reason",
        "Pause every worker's claims for DURATION (10s to 7d): deliveries in flight finish, "
        "nothing new is claimed until the pause ends by itself or `receipts jobs resume`. "
        "Every worker honours it within a few seconds, released versions too. A longer "
        "automatic pause (provider outage, bad credentials, Retry-After) is kept unless "
        "--replace. Exit 0 paused, 1 refused, 2 bad usage.")
    j.add_argument("--for", dest="duration", required=True, metavar="DURATION",
                   help="how long, e.g. 90s, 15m, 2h, 1h30m")
    j.add_argument("--reason", required=True, metavar="TEXT",
                   help="why (one line, at most 200 characters; shown to every operator)")
    j.add_argument("--replace", action="store_true",
                   help="end a longer automatic pause at this pause's end instead")
    action("resume", "lift the fleet's pause now (manual or automatic); workers claim again",
           "Lift the fleet-wide pause, whatever set it: every worker claims again at its next "
           "claim (within a few seconds), without a probe. Exit 0 (also when not paused).")

    add("ui", "Serve the review web page (read-only unless RECEIPTS_UI_ADMIN_TOKEN is set).")

    p = add("provider", "Run the reference receipt provider (idempotent, with fault injection).")
    p.epilog = (
        "Receipts are POSTed to /receipts (point RECEIPTS_PROVIDER_URL at\n"
        "http://HOST:PORT/receipts), with an Idempotency-Key header; GET /receipts lists\n"
        "those it holds, GET /healthz answers 200 while it serves.\n"
        "While it runs, its faults change with PUT /faults (a JSON object of the settings to\n"
        "change; it answers with them all): latency_seconds, latency_jitter_seconds,\n"
        "error_rate, rate_limit_rate, retry_after_seconds, retry_after_raw, reject_rate,\n"
        "timeout_rate, reset_rate, hang_after_headers_rate, hang_seconds, status, body_bytes,\n"
        "reject_statuses (a list of 4xx), reject_body (json, json_ids, html, text),\n"
        "flap_seconds, invalid_pattern, capacity (requests at once; null: unlimited),\n"
        "capacity_answer (503, 429, latency). A bad value is refused with 400.\n"
        "GET /stats: requests, receipts, concurrent and max_concurrent requests; GET /loads:\n"
        "the load each request found (the last 100,000). More in docs/operations.md.\n")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8080, help="port to listen on")
    p.add_argument("--latency-ms", type=float, default=0.0, help="added latency per request")
    p.add_argument("--jitter-ms", type=float, default=0.0,
                   help="random extra latency, up to this")
    p.add_argument("--error-rate", type=float, default=0.0, help="share answered 503")
    p.add_argument("--rate-limit-rate", type=float, default=0.0, help="share answered 429")
    p.add_argument("--retry-after", type=float, default=1.0, help="Retry-After of a 429, seconds")
    p.add_argument("--reject-rate", type=float, default=0.0, help="share of keys answered 422")
    p.add_argument("--timeout-rate", type=float, default=0.0,
                   help="share recorded, then left hanging")
    p.add_argument("--reset-rate", type=float, default=0.0,
                   help="share recorded, then connection reset")
    p.add_argument("--hang-after-headers-rate", type=float, default=0.0,
                   help="share that sends headers, then hangs before the body")
    p.add_argument("--hang-seconds", type=float, default=30.0,
                   help="how long a hanging answer hangs, seconds")
    p.add_argument("--capacity", type=_positive_int, default=None,
                   help="requests worked on at once; beyond it, --capacity-answer; "
                        "default: unlimited")
    p.add_argument("--capacity-answer", choices=("503", "429", "latency"), default="503",
                   help="what a request beyond the capacity gets: 503, 429 with Retry-After, "
                        "or latency (slowed by load / capacity)")
    p.add_argument("--token", help="require this bearer token; default: none required")
    p.add_argument("--seed", type=int, help="random seed of the faults; default: random")

    p = add("demo", "Run the whole service on an embedded PostgreSQL and print a summary.")
    p.add_argument("--dsn", help="use this database (in a scratch schema, dropped at the end) "
                                 "instead of an embedded PostgreSQL 18")
    p.add_argument("--orders", type=_positive_int, default=3000, help="orders to place")
    p.add_argument("--workers", type=_positive_int, default=3, help="worker processes")
    p.add_argument("--concurrency", type=_positive_int, default=32,
                   help="delivery slots per worker")
    p.add_argument("--seed", type=int, default=7, help="random seed of the run")

    p = add("plan", "Print a capacity plan: pods, slots, connections, KEDA target, Helm values.")
    p.add_argument("--rate", metavar="JOBS_PER_SECOND", help="peak receipts per second (required)")
    p.add_argument("--latency", metavar="SECONDS",
                   help="mean seconds one delivery takes at the provider (required)")
    p.add_argument("--utilisation", metavar="SHARE", default="0.8",
                   help="share of the slots kept busy, above 0 and at most 1")
    p.add_argument("--db-ceiling", metavar="JOBS_PER_SECOND",
                   help="claim+ack jobs/s one queue database sustains (default: the bench's "
                        f"{_planner_default('DB_CEILING_BATCHED_JOBS_PER_SECOND'):,.0f} on "
                        "2 vCPU)")
    p.add_argument("--cpu-per-delivery", metavar="MICROSECONDS",
                   help="worker CPU one HTTP delivery costs, µs (default: the bench's "
                        f"{_planner_default('HTTP_DELIVERY_CPU_SECONDS') * 1e6:,.0f}; "
                        "bench/run.sh on your nodes measures yours)")
    p.add_argument("--provider-capacity", metavar="REQUESTS",
                   help="requests the provider takes at once, when known: the plan says the "
                        "rate it allows and turns adaptive concurrency on")
    return parser


COMMANDS: dict[str, Callable[..., int]] = {
    "migrate": cmd_migrate, "worker": cmd_worker, "recover": cmd_recover,
    "enqueue": cmd_enqueue, "jobs": cmd_jobs, "provider": cmd_provider, "demo": cmd_demo,
    "plan": cmd_plan,
    "ui": cmd_ui, "check": cmd_check,
}
# Usage checks beyond argparse, run before settings are read or a database is touched.
CHECKS: dict[str, Callable[[argparse.Namespace], None]] = {
    "migrate": check_migrate, "enqueue": check_enqueue, "jobs": check_jobs,
    "provider": check_provider, "demo": check_demo,
}
NEEDS_SETTINGS = {"migrate", "worker", "recover", "enqueue", "jobs", "ui", "check"}
LOGS_ON_STDOUT = {"worker", "provider", "ui"}


def warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """Log one ``unknown_setting`` warning per ``RECEIPTS_*`` variable that is no setting.

    The value is never logged (it may be a secret); Kubernetes service-link
    variables are not reported (:func:`receipts.settings.unknown_variables`).
    """
    log = get_logger("cli")
    for name, suggestion in unknown_variables(environ):
        log.warning("unknown_setting", extra={"variable": name, "did_you_mean": suggestion})


def _quiet_broken_pipe() -> int:
    """stdout's reader went away (``| head``): point stdout at /dev/null and end quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``receipts`` console script; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        if args.command not in LONG_RUNNING:
            _stop_on_signals()
        if args.command in CHECKS:
            CHECKS[args.command](args)
        settings: Settings | None = None
        # Long-running processes log to stdout (the container log); one-shot
        # commands print their result there, so their logs go to stderr.
        stream = sys.stdout if args.command in LOGS_ON_STDOUT else sys.stderr
        offline = args.command == "migrate" and (
            (args.print_sql and not args.pending) or args.grant_roles is not None)
        if args.command in NEEDS_SETTINGS and not offline:
            settings = load_settings()
            if args.command == "worker":
                check_worker_settings(settings)
            if args.command == "ui":
                check_ui_settings(settings)
            configure_logging(settings.log_level, stream,
                              secrets=[*settings.secrets(), *environment_secrets(os.environ)])
            warn_unknown_variables(os.environ)
        else:
            configure_logging("INFO" if args.command == "provider" else "WARNING", stream)
        status = COMMANDS[args.command](settings, args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except (SettingsError, UsageError, InvalidOrderId) as exc:
        _error(str(exc))
        return EXIT_USAGE
    except UnusableDatabase as exc:  # the DSN names a database receipts refuses
        _error(redact_dsn(str(exc)))
        return EXIT_USAGE
    except (QueueError, MigrationError, OSError) as exc:
        _error(redact_dsn(str(exc)))
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except Terminated as exc:
        _error(f"stopped by {exc}; nothing half-done is kept (each migration and each "
               "statement is its own transaction)")
        return 128 + exc.signum


class Terminated(BaseException):
    """A one-shot command was asked to stop by a signal (SIGTERM, SIGHUP, SIGQUIT)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: Commands that run until told to stop, with their own drain on SIGTERM/SIGHUP.
LONG_RUNNING = {"worker", "provider", "ui", "demo"}


def _stop_on_signals() -> None:
    """Make SIGTERM, SIGHUP and SIGQUIT end a one-shot command cleanly.

    As PID 1 in a container a process has no default action for SIGTERM: without
    a handler ``migrate`` or ``recover`` would ignore the pod's stop. The
    handler raises :class:`Terminated` wherever the command is (a statement in
    flight is abandoned; its transaction rolls back when the connection closes),
    and :func:`main` exits 128 + the signal number. ``recover --loop`` installs
    its own, gentler handler (it finishes the sweep's current batch).
    """
    def stop(signum: int, _frame: object) -> None:
        raise Terminated(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, stop)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
