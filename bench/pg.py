"""The benchmark's PostgreSQL: one durable embedded server, databases, fills, probes.

Every scenario gets a fresh database (``CREATE DATABASE … TEMPLATE``) so no
run inherits another's dead tuples; fills are one ``INSERT … SELECT`` followed
by ``VACUUM (ANALYZE)`` and a ``CHECKPOINT``, so each measured run starts from
the same state (visibility map set, statistics current, no checkpoint due).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from receipts.embedded import EmbeddedPostgres
from receipts.migrate import apply_migrations

TEMPLATE = "bench_template"
_names = itertools.count()

#: Server settings: durability stays at the defaults (fsync, synchronous_commit,
#: full_page_writes on). Only room for the peers' connections and for
#: 1.1 M-row fills without a forced checkpoint mid-run is added, and
#: pg_stat_statements, which the database's bill (``bench.bill``) reads: it
#: costs every statement about the same small amount, the raw limit's as much
#: as the worker's.
SERVER_SETTINGS = {
    "max_connections": "300",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "30min",
    "shared_preload_libraries": "'pg_stat_statements'",
    "pg_stat_statements.track_utility": "on",
    "pg_stat_statements.track_planning": "on",
}


_SPACE = "[ \\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]"
#: The job table's CHECK constraints as migrations 0001-0011 left them, in place of
#: migration 0012's one constraint (the same rules, one expression each).
NINE_CHECKS = (
    "ALTER TABLE receipt_jobs DROP CONSTRAINT receipt_jobs_rules,"
    " ADD CONSTRAINT receipt_jobs_state_check"
    "   CHECK (state IN ('ready', 'running', 'done', 'failed', 'discarded')),"
    " ADD CONSTRAINT receipt_jobs_attempts_check CHECK (attempts >= 0),"
    " ADD CONSTRAINT receipt_jobs_in_progress_count_check CHECK (in_progress_count >= 0),"
    " ADD CONSTRAINT receipt_jobs_check CHECK ((state = 'running') = (lease_token IS NOT NULL)),"
    " ADD CONSTRAINT receipt_jobs_check1 CHECK ((lease_token IS NULL) = (lease_until IS NULL)),"
    " ADD CONSTRAINT receipt_jobs_finished_check"
    "   CHECK ((state IN ('done', 'failed', 'discarded')) = (finished_at IS NOT NULL)),"
    " ADD CONSTRAINT receipt_jobs_order_id_rules CHECK ("
    "   state IN ('done', 'failed', 'discarded')"
    "   OR (length(order_id) BETWEEN 1 AND 200"
    "       AND order_id !~ ('[\\u0001-\\u001f\\u007f]'"
    f"\n                        '|^{_SPACE}'"
    f"\n                        '|{_SPACE}$'))),"
    " ADD CONSTRAINT receipt_jobs_run_at_finite"
    "   CHECK (state IN ('done', 'failed', 'discarded') OR isfinite(run_at)),"
    " ADD CONSTRAINT receipt_jobs_traceparent_format"
    "   CHECK (traceparent ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$')"
)


class Bench:
    """The one server of a benchmark run and its databases."""

    def __init__(self, base_dir: str | None = None, *, env: dict[str, str] | None = None,
                 settings: dict[str, str] | None = None) -> None:
        """Start the server; *env*: extra environment of its processes (an ``LD_PRELOAD``);
        *settings*: instead of :data:`SERVER_SETTINGS`."""
        self.server = EmbeddedPostgres(fast=False, settings=SERVER_SETTINGS if settings is None
                                       else settings, base_dir=base_dir, env=env)
        self.server.start()
        self._template_ready = False
        #: The claim-cost template database (1 M done + 100 k ready), once built.
        self.scale_template: str | None = None

    @property
    def bin_dir(self) -> str:
        return str(self.server.bin)

    @property
    def port(self) -> int:
        return self.server.port

    def durability(self) -> dict[str, str]:
        """The server's durability settings as it reports them (for the report)."""
        with psycopg.connect(self.server.dsn, autocommit=True) as conn:
            return {
                name: str(conn.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
                for name in ("server_version", "fsync", "synchronous_commit",
                             "full_page_writes", "wal_sync_method", "shared_buffers")
            }

    def _ensure_template(self) -> None:
        if self._template_ready:
            return
        with psycopg.connect(self.server.dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE}"')
            conn.execute(f'CREATE DATABASE "{TEMPLATE}"')
        dsn = self.server.dsn_for(TEMPLATE)
        apply_migrations(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            conn.execute(
                "CREATE TABLE bench_orders (id text PRIMARY KEY, total_cents integer NOT NULL,"
                " created_at timestamptz NOT NULL DEFAULT now())"
            )
        self._template_ready = True

    def new_database(self, prefix: str, *, template: str | None = None) -> str:
        """A fresh database (migrated, with ``bench_orders``); returns its DSN."""
        self._ensure_template()
        name = f"{prefix}_{os.getpid()}_{next(_names)}"
        with psycopg.connect(self.server.dsn, autocommit=True) as conn:
            conn.execute(
                f'CREATE DATABASE "{name}" TEMPLATE "{template or TEMPLATE}" STRATEGY FILE_COPY'
            )
        return self.server.dsn_for(name)

    def drop_database(self, dsn: str) -> None:
        name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
        with psycopg.connect(self.server.dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    @contextmanager
    def database(self, prefix: str, *, template: str | None = None) -> Iterator[str]:
        dsn = self.new_database(prefix, template=template)
        try:
            yield dsn
        finally:
            self.drop_database(dsn)

    def cleanup(self) -> None:
        self.server.cleanup()

    def server_pid(self) -> int | None:
        """The postmaster's pid (None when it cannot be read)."""
        try:
            return int((self.server.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def server_processes(self) -> dict[int, tuple[str, float]]:
        """The server's live child processes: pid → (kind, CPU seconds so far).

        *kind* is the process title's first word after ``postgres:`` for
        auxiliary processes (``walwriter``, ``checkpointer``, ``autovacuum``,
        ``io``, ``background``…) and ``backend`` for client backends.
        Linux ``/proc`` only; empty elsewhere.
        """
        pid = self.server_pid()
        out: dict[int, tuple[str, float]] = {}
        if pid is None:
            return out
        tick = os.sysconf("SC_CLK_TCK")
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                if int(fields[1]) != pid:
                    continue
                with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                    title = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except (OSError, ValueError, IndexError):
                continue
            out[int(entry.name)] = (_process_kind(title),
                                    (int(fields[11]) + int(fields[12])) / tick)
        return out

    def server_cpu_seconds(self) -> float:
        """CPU seconds (user + system) the whole server has used so far.

        The postmaster, its live children (backends, WAL writer, checkpointer,
        autovacuum, …) and the children it has already reaped, whose time the
        kernel adds to the postmaster's ``cutime``/``cstime``; so the
        difference of two readings is the server's CPU between them, whether
        backends lived through the interval or not. Linux ``/proc`` only;
        0.0 elsewhere.
        """
        pid = self.server_pid()
        if pid is None:
            return 0.0
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        # after the command: state ppid … utime(12) stime(13) cutime(14) cstime(15)
        own = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
        return own + sum(cpu for _, cpu in self.server_processes().values())


def _process_kind(title: str) -> str:
    """``backend`` or the auxiliary process's name, from its title (see ``server_processes``)."""
    words = title.split()
    if len(words) < 2 or words[0] != "postgres:":
        return "other"
    aux = {"walwriter", "checkpointer", "background", "autovacuum", "logical", "io",
           "walsummarizer", "walreceiver", "walsender", "archiver", "startup"}
    return words[1] if words[1] in aux else "backend"


def execute(dsn: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run one statement in autocommit; return its rows (empty when none)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


def settle(dsn: str, *tables: str) -> None:
    """VACUUM (ANALYZE) *tables* and CHECKPOINT: the same start for every run."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in tables:
            conn.execute(f"VACUUM (ANALYZE) {table}")
        conn.execute("CHECKPOINT")


def fill_ready(dsn: str, count: int, *, prefix: str = "o", state: str = "ready",
               run_at_offset_seconds: float = 0.0) -> None:
    """Insert *count* receipt jobs (order ids ``<prefix>-<n>``) in one statement.

    *state* ``done`` rows get ``finished_at``; *run_at_offset_seconds* shifts
    ``run_at`` (negative: due earlier than the rest, so claims meet them first).
    """
    execute(
        dsn,
        "INSERT INTO receipt_jobs (id, order_id, state, run_at, finished_at)"
        " SELECT gen_random_uuid(), %(prefix)s || '-' || g, %(state)s,"
        "        now() + make_interval(secs => %(offset)s) + g * interval '1 microsecond',"
        "        CASE WHEN %(state)s IN ('done', 'failed') THEN now() END"
        " FROM generate_series(1, %(count)s) AS g",
        {"prefix": prefix, "state": state, "count": count, "offset": run_at_offset_seconds},
    )


def remaining_jobs(conn: psycopg.Connection[Any]) -> int:
    """Ready + running receipt jobs (each count walks one small partial index)."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM receipt_jobs WHERE state = 'ready')"
        " + (SELECT count(*) FROM receipt_jobs WHERE state = 'running')"
    ).fetchone()
    return int(row[0]) if row else 0


def wait_until(probe: Any, *, timeout_seconds: float, interval_seconds: float = 0.02) -> float:
    """Call *probe()* until it is true; return the monotonic time it first was.

    Raises ``TimeoutError`` after *timeout_seconds*.
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        if probe():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError("the benchmark run did not finish in time")
        time.sleep(interval_seconds)
