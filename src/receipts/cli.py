"""Command line: ``receipts <command>`` (argparse) → one function per command.

Settings are built once here from the environment (``RECEIPTS_*``) and passed
down. Exit status (docs/design.md §9): 0 success, 2 bad usage or settings, 1 any
other error (database unreachable, schema missing, a failed sweep). Error
messages are one line on stderr and never contain a password or token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import uuid
from collections.abc import Callable, Coroutine, Sequence
from datetime import UTC, datetime
from typing import Any

from receipts.settings import Settings, SettingsError, load_settings, redact_dsn

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
#: ``receipts migrate --check``: migrations pending / schema unknown to this version.
EXIT_PENDING, EXIT_UNKNOWN = 3, 4

SETTINGS_HELP = """\
settings (environment variables):
  RECEIPTS_DATABASE_URL             PostgreSQL DSN (secret)
  RECEIPTS_PROVIDER_URL             receipt provider endpoint (POST)
  RECEIPTS_PROVIDER_TOKEN           bearer token for the provider (secret)
  RECEIPTS_CONCURRENCY              delivery slots per process (32)
  RECEIPTS_LEASE_SECONDS            lease per attempt (60)
  RECEIPTS_LEASE_MARGIN_SECONDS     lease minus this bounds the delivery timeout (10)
  RECEIPTS_MAX_ATTEMPTS             attempts before a job fails (5)
  RECEIPTS_DELIVERY_TIMEOUT_SECONDS deadline of one provider call (10)
  RECEIPTS_POLL_INTERVAL_SECONDS    sleep when the queue looks empty, jittered (1)
  RECEIPTS_METRICS_PORT             /metrics, /healthz, /readyz; 0 disables (9464)
  RECEIPTS_LOG_LEVEL                DEBUG, INFO, WARNING, ERROR (INFO)
  see the README for the full list.
"""


class UsageError(Exception):
    """Bad command-line input; exit status 2."""


def _run(coro: Coroutine[Any, Any, int]) -> int:
    return asyncio.run(coro)


async def _with_queue(settings: Settings, role: str,
                      body: Callable[[Any], Coroutine[Any, Any, int]]) -> int:
    """Open a one-connection pool, run *body(queue)*, close the pool."""
    from receipts.db import check_connection, make_pool
    from receipts.jobqueue import JobQueue

    await check_connection(settings, role)
    pool = make_pool(settings, role, max_size=1)
    await pool.open(wait=False)
    try:
        queue = JobQueue(pool, lease_seconds=settings.lease_seconds,
                         max_attempts=settings.max_attempts)
        return await body(queue)
    finally:
        await pool.close(timeout=2.0)




# ------------------------------------------------------------------ commands


def cmd_migrate(settings: Settings | None, args: argparse.Namespace) -> int:
    """``receipts migrate``: apply pending migrations; prints what it applied.

    ``--print-sql [--pending]`` prints the migrations' SQL instead (all of them
    needs no database); ``--check`` changes nothing and exits 0 when the schema
    is current, EXIT_PENDING (3) when migrations are pending and EXIT_UNKNOWN
    (4) when the database has migrations this version does not know or an
    applied one differs.
    """
    from receipts import migrate

    if args.pending and not args.print_sql:
        raise UsageError("--pending goes with --print-sql")
    if args.print_sql and not args.pending:
        sys.stdout.write(migrate.migration_sql())
        return EXIT_OK
    assert settings is not None
    if args.print_sql or args.check:
        status = migrate.read_schema_status(settings.dsn,
                                            application_name=settings.application_name)
        if args.print_sql:
            todo = [m for m in migrate.bundled_migrations() if m.version in status.pending]
            sys.stdout.write(migrate.migration_sql(todo))
            return EXIT_OK
        print(status.describe())
        if status.unknown or status.changed:
            return EXIT_UNKNOWN
        return EXIT_PENDING if status.pending else EXIT_OK
    applied = migrate.apply_migrations(settings.dsn, application_name=settings.application_name)
    print(f"applied {len(applied)} migration(s)" + (f": {', '.join(applied)}" if applied
                                                     else "; schema is up to date"))
    return EXIT_OK


def cmd_worker(settings: Settings, args: argparse.Namespace) -> int:
    """``receipts worker``: run until SIGTERM/SIGINT, then drain; 0 on a clean stop."""
    from receipts.worker import run_worker

    asyncio.run(run_worker(settings))
    return EXIT_OK


def cmd_recover(settings: Settings, args: argparse.Namespace) -> int:
    """``receipts recover``: one sweep (or ``--loop SECONDS``); 1 when a push fails."""
    from receipts import recovery

    if args.loop is not None:

        async def loop(queue: Any) -> int:
            import signal

            stop = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            await recovery.run_loop(queue, settings, args.loop, stop)
            return EXIT_OK

        return _run(_with_queue(settings, "recover", loop))

    async def once(queue: Any) -> int:
        report = await recovery.run_once(queue, settings)
        print(json.dumps(report.as_dict()) if args.json else report.summary())
        if settings.pushgateway_url:
            try:
                recovery.push_report(report, settings.pushgateway_url)
            except OSError as exc:
                print(f"receipts: warning: push to Pushgateway failed: {exc}", file=sys.stderr)
                return EXIT_ERROR
        return EXIT_OK

    return _run(_with_queue(settings, "recover", once))


def cmd_enqueue(settings: Settings, args: argparse.Namespace) -> int:
    """``receipts enqueue``: enqueue the given orders in one transaction."""
    from receipts.db import transaction
    from receipts.enqueue import check_order_id, enqueue
    from receipts.errors import InvalidOrderId

    try:
        for order_id in args.order_ids:
            check_order_id(order_id)
    except InvalidOrderId as exc:
        raise UsageError(str(exc)) from None
    created = 0
    with transaction(settings, "cli") as conn:
        for order_id in args.order_ids:
            created += enqueue(conn, order_id) is not None
    dupes = len(args.order_ids) - created
    print(f"enqueued {created} job(s); {dupes} order(s) already had one")
    return EXIT_OK


def _positive_int(text: str) -> int:
    """argparse type: an integer from 1 to 1,000,000."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if not 1 <= number <= 1_000_000:
        raise argparse.ArgumentTypeError(
            f"must be an integer from 1 to 1000000, got {text!r}")
    return number


def _port(text: str) -> int:
    """argparse type: a TCP port number (1–65535)."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if not 1 <= number <= 65_535:
        raise argparse.ArgumentTypeError(f"must be a port from 1 to 65535, got {text!r}")
    return number


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


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[("" if r.get(c) is None else str(_jsonable(r.get(c))))[:60] for c in columns]
             for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def cmd_jobs(settings: Settings, args: argparse.Namespace) -> int:
    """``receipts jobs stats|list|show|retry``: failed-job review (see the README)."""
    from receipts.model import JobState

    async def body(queue: Any) -> int:
        if args.jobs_command == "stats":
            counts = await queue.state_counts()
            stats = await queue.queue_stats()
            oldest = await queue.oldest_failed()
            data = {
                "jobs": {str(k): v for k, v in counts.items()},
                "ready_due": stats.ready_due,
                "queue_lag_seconds": round(stats.lag_seconds, 3),
                "expired_leases": stats.expired,
                "oldest_failed_at": _jsonable(oldest),
                "oldest_transaction_age_seconds": round(stats.oldest_transaction_seconds, 3),
            }
            if args.json:
                print(json.dumps(data))
            else:
                for state in JobState:
                    print(f"{state:<8} {counts[state]}")
                print(f"due now  {stats.ready_due}")
                print(f"lag      {stats.lag_seconds:.1f}s")
                print(f"expired leases awaiting recovery  {stats.expired}")
                print(f"oldest failed  {data['oldest_failed_at'] or '-'}")
            return EXIT_OK
        if args.jobs_command == "list":
            rows = await queue.list_jobs(JobState(args.state), limit=args.limit,
                                         since=_parse_since(args.since))
            if args.json:
                print(json.dumps([{k: _jsonable(v) for k, v in r.items()} for r in rows]))
            else:
                print(_table(rows, ["id", "order_id", "state", "attempts", "run_at",
                                    "finished_at", "last_error"]))
            return EXIT_OK
        if args.jobs_command == "show":
            row = await queue.show_job(args.id)
            if row is None:
                print(f"receipts: no job with id or order id {args.id!r}", file=sys.stderr)
                return EXIT_ERROR
            row = {k: _jsonable(v) for k, v in row.items()}
            if row.get("lease_token"):
                row["lease_token"] = str(row["lease_token"])[:8] + "…"
            if args.json:
                print(json.dumps(row))
            else:
                for key, value in row.items():
                    print(f"{key:<12} {'' if value is None else value}")
            return EXIT_OK
        # retry
        return await _retry(queue, args)

    return _run(_with_queue(settings, "cli", body))


async def _retry(queue: Any, args: argparse.Namespace) -> int:
    """``jobs retry``: failed → ready (attempts reset, due now), all or nothing.

    Exit 0 when every named job (or every failed job) was retried or, with
    ``--dry-run``, would be; 1 when a named job is unknown or not failed (then
    nothing changes); 2 for bad usage.
    """
    from receipts.model import JobState

    if args.all_failed == bool(args.ids):
        raise UsageError("give job ids or --all-failed (not both)")
    ids: list[uuid.UUID] | None = None
    if args.ids:
        try:
            ids = list(dict.fromkeys(uuid.UUID(i) for i in args.ids))
        except ValueError:
            raise UsageError("job ids must be UUIDs (see `receipts jobs list`)") from None
    refused: list[dict[str, str]] = []
    if ids is None:
        targets = [r["id"] for r in await queue.list_jobs(JobState.FAILED, limit=1_000_000)]
    else:
        for job_id in ids:
            row = await queue.show_job(str(job_id))
            if row is None:
                refused.append({"id": str(job_id), "state": "unknown"})
            elif row["state"] != JobState.FAILED:
                refused.append({"id": str(job_id), "state": str(row["state"])})
        targets = ids
    if refused:
        _print_retry(args, [], refused)
        for item in refused:
            what = "no such job" if item["state"] == "unknown" else f"is {item['state']}"
            print(f"receipts: error: job {item['id']} {what}; only failed jobs can be retried",
                  file=sys.stderr)
        print("receipts: error: nothing was retried", file=sys.stderr)
        return EXIT_ERROR
    if args.dry_run:
        _print_retry(args, [str(t) for t in targets], [])
        return EXIT_OK
    changed = await queue.retry_failed(ids)
    _print_retry(args, [str(c) for c in changed], [])
    if ids is not None and len(changed) < len(ids):
        # Another operator or a recovery raced us between the check and the update.
        missed = sorted(str(i) for i in set(ids) - set(changed))
        print(f"receipts: error: not retried (no longer failed): {', '.join(missed)}",
              file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def _print_retry(args: argparse.Namespace, ids: list[str], refused: list[dict[str, str]]) -> None:
    if args.json:
        print(json.dumps({"dry_run": bool(args.dry_run), "retried": [] if args.dry_run else ids,
                          "would_retry": ids if args.dry_run else [], "refused": refused}))
    elif not refused:
        verb = "would retry" if args.dry_run else "retried"
        print(f"{verb} {len(ids)} failed job(s)")
        for job_id in ids[:20]:
            print(f"  {job_id}")
        if len(ids) > 20:
            print(f"  … and {len(ids) - 20} more")


def cmd_provider(settings: Settings | None, args: argparse.Namespace) -> int:
    """``receipts provider``: serve the reference provider until SIGTERM/SIGINT."""
    from receipts.provider import Faults, ReferenceProvider, serve

    try:
        faults = Faults(
            latency_seconds=args.latency_ms / 1000, latency_jitter_seconds=args.jitter_ms / 1000,
            error_rate=args.error_rate, rate_limit_rate=args.rate_limit_rate,
            retry_after_seconds=args.retry_after, reject_rate=args.reject_rate,
            timeout_rate=args.timeout_rate, reset_rate=args.reset_rate,
            hang_after_headers_rate=args.hang_after_headers_rate,
            hang_seconds=args.hang_seconds,
        )
        Faults.from_mapping({}, faults)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    provider = ReferenceProvider(faults, token=args.token, seed=args.seed)

    async def main() -> int:
        import signal

        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await serve(provider, args.host, args.port, stop)
        return EXIT_OK

    return _run(main())


def cmd_demo(settings: Settings | None, args: argparse.Namespace) -> int:
    """``receipts demo``: the whole service end to end; 0 when nothing was lost."""
    from receipts.demo import DemoOptions, run_demo

    if args.dsn:
        from receipts.settings import check_dsn

        try:
            check_dsn(args.dsn)
        except ValueError as exc:
            raise UsageError(f"--dsn {exc}") from None
    options = DemoOptions(dsn=args.dsn, orders=args.orders, workers=args.workers,
                          concurrency=args.concurrency, seed=args.seed)
    return run_demo(options)


# -------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The ``receipts`` argument parser (all subcommands)."""
    parser = argparse.ArgumentParser(
        prog="receipts",
        description="Deliver order receipts from a PostgreSQL job queue.",
        epilog=SETTINGS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        epilog = SETTINGS_HELP if name in NEEDS_SETTINGS else None
        return sub.add_parser(name, help=help_text, description=help_text, epilog=epilog,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    p = add("migrate", "Apply pending database migrations (safe to run again and concurrently).")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--print-sql", action="store_true",
                      help="print the migrations' SQL (with the tracking-table rows workers "
                           "check) instead of applying it; no database needed")
    mode.add_argument("--check", action="store_true",
                      help="change nothing; print the schema version; exit 0 up to date, "
                           "3 migrations pending, 4 schema unknown to this version")
    p.add_argument("--pending", action="store_true",
                   help="with --print-sql: only the migrations this database has not applied")
    add("worker", "Run a worker: claim receipt jobs, deliver them, ack (until SIGTERM).")
    p = add("recover", "Return expired leases to the queue and prune old rows (one sweep).")
    p.add_argument("--loop", type=_seconds(0.1), metavar="SECONDS",
                   help="sweep every SECONDS until SIGTERM (outside Kubernetes)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p = add("enqueue", "Enqueue receipt jobs for orders (duplicates are a no-op).")
    p.add_argument("order_ids", nargs="+", metavar="ORDER_ID")

    jobs = add("jobs", "Review jobs: stats, list, show, retry failed.")
    jsub = jobs.add_subparsers(dest="jobs_command", required=True, metavar="ACTION")
    j = jsub.add_parser("stats", help="counts by state, lag, oldest failed")
    j.add_argument("--json", action="store_true")
    j = jsub.add_parser("list", help="list jobs in a state, newest first")
    j.add_argument("--state", choices=["ready", "running", "done", "failed"], default="failed")
    j.add_argument("--limit", type=_positive_int, default=50)
    j.add_argument("--since", help="only jobs finished (or created) at/after this ISO time")
    j.add_argument("--json", action="store_true")
    j = jsub.add_parser("show", help="one job by id or order id")
    j.add_argument("id")
    j.add_argument("--json", action="store_true")
    j = jsub.add_parser(
        "retry", help="failed → ready, attempts reset, run now (all or nothing)",
        description="Make failed jobs deliverable again: state ready, attempts 0, due now; "
                    "last_error is kept, prefixed 'manual retry after: '. Named jobs are "
                    "retried only if every one is failed. Exit 0 done, 1 refused (nothing "
                    "changed) or database error, 2 bad usage.")
    j.add_argument("ids", nargs="*", metavar="ID", help="job UUIDs")
    j.add_argument("--all-failed", action="store_true", help="every failed job")
    j.add_argument("--dry-run", action="store_true", help="show what would change; change nothing")
    j.add_argument("--json", action="store_true")

    p = add("provider", "Run the reference receipt provider (idempotent, with fault injection).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8080)
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--error-rate", type=float, default=0.0, help="share answered 503")
    p.add_argument("--rate-limit-rate", type=float, default=0.0, help="share answered 429")
    p.add_argument("--retry-after", type=float, default=1.0, help="Retry-After of a 429, seconds")
    p.add_argument("--reject-rate", type=float, default=0.0, help="share of keys answered 422")
    p.add_argument("--timeout-rate", type=float, default=0.0,
                   help="share recorded, then left hanging")
    p.add_argument("--reset-rate", type=float, default=0.0,
                   help="share recorded, then connection reset")
    p.add_argument("--hang-after-headers-rate", type=float, default=0.0)
    p.add_argument("--hang-seconds", type=float, default=30.0)
    p.add_argument("--token", help="require this bearer token")
    p.add_argument("--seed", type=int)

    p = add("demo", "Run the whole service on an embedded PostgreSQL and print a summary.")
    p.add_argument("--dsn", help="use this database instead of an embedded PostgreSQL 18")
    p.add_argument("--orders", type=_positive_int, default=3000)
    p.add_argument("--workers", type=_positive_int, default=3)
    p.add_argument("--concurrency", type=_positive_int, default=32)
    p.add_argument("--seed", type=int, default=7)
    return parser


COMMANDS: dict[str, Callable[..., int]] = {
    "migrate": cmd_migrate, "worker": cmd_worker, "recover": cmd_recover,
    "enqueue": cmd_enqueue, "jobs": cmd_jobs, "provider": cmd_provider, "demo": cmd_demo,
}
NEEDS_SETTINGS = {"migrate", "worker", "recover", "enqueue", "jobs"}
LOGS_ON_STDOUT = {"worker", "provider"}


def _secrets(settings: Settings) -> list[str]:
    """The literal secrets logs must mask: the DSN password (decoded and as written), the token."""
    from urllib.parse import urlsplit

    from psycopg.conninfo import conninfo_to_dict

    found: list[str] = []
    try:
        found.append(str(conninfo_to_dict(settings.dsn).get("password") or ""))
        if "://" in settings.dsn:
            found.append(urlsplit(settings.dsn).password or "")
    except Exception:  # the settings validator already refused unparsable DSNs
        pass
    if settings.provider_token is not None:
        found.append(settings.provider_token.get_secret_value())
    return [s for s in found if s]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``receipts`` console script; returns the exit status."""
    from receipts.errors import InvalidOrderId, QueueError
    from receipts.logs import configure_logging
    from receipts.migrate import MigrationError

    args = build_parser().parse_args(argv)
    try:
        settings: Settings | None = None
        # Long-running processes log to stdout (the container log); one-shot
        # commands print their result there, so their logs go to stderr.
        stream = sys.stdout if args.command in LOGS_ON_STDOUT else sys.stderr
        print_all_sql = getattr(args, "print_sql", False) and not args.pending
        if args.command in NEEDS_SETTINGS and not print_all_sql:
            settings = load_settings()
            configure_logging(settings.log_level, stream, secrets=_secrets(settings))
        else:
            configure_logging("INFO" if args.command == "provider" else "WARNING", stream)
        return COMMANDS[args.command](settings, args)
    except (SettingsError, UsageError, InvalidOrderId) as exc:
        print(f"receipts: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (QueueError, MigrationError, OSError) as exc:
        print(f"receipts: error: {redact_dsn(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
