"""Scenario 1, the raw limit: pgbench running this project's own claim and ack.

The statements are taken from ``receipts/sql/queries.sql`` (the very text the
worker runs) with the service's defaults filled in: a literal ``LIMIT`` per
batch size, ``max_attempts`` 5, a 60 s lease. One pgbench transaction is what
a worker does per batch: one autocommit claim, then one autocommit batched
ack of everything it claimed (the ids and tokens go from the first statement
to the second through ``\\gset``). pgbench runs with ``-M prepared``, as
psycopg does after a statement's fifth execution, and with the worker
sessions' ``synchronous_commit`` (off by default). jobs/s = rows that became
done during the run / its duration.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.pg import Bench, fill_ready, settle
from receipts.settings import Settings
from receipts.statements import statements

MAX_ATTEMPTS = 5
#: The worker sessions' synchronous_commit default, which pgbench's sessions copy.
WORKER_SYNCHRONOUS_COMMIT = Settings.model_fields["synchronous_commit"].default
LEASE_SECONDS = 60


def strip_flow_check(claim: str) -> str:
    """The ``claim`` statement without its fleet-pause check (the ``flow`` CTE).

    Derived from the statement text, so it follows queries.sql: the ``flow``
    CTE, the candidate's ``NOT EXISTS (… flow …)`` condition and the final
    SELECT's join on ``flow`` go; everything else stays byte for byte. It is
    what the claim would cost if it did not read ``receipt_flow`` once per
    statement (the rate-limit scenario's "overhead with no limit set").
    Raises ``RuntimeError`` when the statement no longer has that shape.
    """
    head, sep, rest = claim.partition("WITH flow AS (")
    _, sep2, tail = rest.partition("), candidate AS (")
    if not sep or not sep2:
        raise RuntimeError("the claim statement no longer starts with the flow CTE")
    stripped = f"{head}WITH candidate AS ({tail}"
    stripped, n = re.subn(r"\n\s*AND \(%\(probe\)s OR NOT EXISTS \(SELECT 1 FROM flow"
                          r" WHERE pause_reason IS NOT NULL\)\)", "", stripped)
    if n != 1:
        raise RuntimeError("the claim statement no longer has one pause condition")
    # The final SELECT reads flow too; pgbench_script replaces it anyway.
    last = stripped.rpartition("\nSELECT c.id")
    return last[0] + "\nSELECT c.id FROM claimed AS c" if last[1] else stripped


def pgbench_script(batch: int, *, name: str = "claim", strip_flow: bool = False,
                   rate_per_second: float = 0.0, burst: float = 0.0) -> str:
    """The pgbench script: claim *batch* jobs, then ack them in one statement.

    *name*: ``claim`` or ``claim_limited`` (the fleet-wide token bucket, at
    *rate_per_second* jobs/s and *burst* jobs). *strip_flow*: ``claim``
    without its pause check (:func:`strip_flow_check`).
    """
    claim = statements()[name].format(limit=batch)
    if strip_flow:
        claim = strip_flow_check(claim)
    claim = claim.replace("%(max_attempts)s", str(MAX_ATTEMPTS))
    claim = claim.replace("%(lease_seconds)s", str(LEASE_SECONDS))
    claim = claim.replace("%(probe)s", "false")  # no fleet pause in a benchmark
    # No watermark: pgbench drains from the index's start, as a claim without a waker.
    claim = claim.replace("%(after_run_at)s", "NULL").replace("%(after_id)s", "NULL")
    claim = claim.replace("%(rate)s", repr(float(rate_per_second)))
    claim = claim.replace("%(burst)s", repr(float(burst)))
    # Keep every CTE (the flow check, candidate, claimed, spent); replace only the
    # final SELECT by one that hands the ids and tokens to the ack through \gset.
    head, sep, _ = claim.rpartition("\nSELECT c.id")
    if not sep or "claimed AS (" not in head or "%(" in head:
        raise RuntimeError("the claim statement no longer has the expected shape")
    claim_sql = (
        f"{head}\n"
        "SELECT coalesce(string_agg(id::text, ','), '') AS ids,"
        " coalesce(string_agg(lease_token::text, ','), '') AS tokens FROM claimed \\gset"
    )
    ack = statements()["ack"]
    ack = ack.replace("%(ids)s", ":ids").replace("%(tokens)s", ":tokens")
    return f"{claim_sql}\n{ack};\n"


def _done(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM receipt_jobs WHERE state = 'done'"
        ).fetchone()
        return int(row[0]) if row else 0


def flow_row_stats(dsn: str) -> dict[str, Any]:
    """Update counters of the one-row ``receipt_flow`` table (pg_stat_user_tables).

    Waits (≤ 30 s) until every other session of the database has ended: a
    backend flushes its pending statistics when it exits, before it leaves
    ``pg_stat_activity``, so then they are all in. ``hot_share`` is HOT updates /
    updates (None without updates).
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        deadline = time.monotonic() + 30.0
        while conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid()").fetchone() != (0,):
            if time.monotonic() > deadline:
                raise TimeoutError("sessions of the benchmark database did not end")
            time.sleep(0.05)
        row = conn.execute(
            "SELECT n_tup_upd, n_tup_hot_upd, n_dead_tup, n_live_tup,"
            " pg_relation_size('receipt_flow') FROM pg_stat_user_tables"
            " WHERE relname = 'receipt_flow'").fetchone()
    upd, hot, dead, live, size = (int(v) for v in row) if row else (0, 0, 0, 0, 0)
    return {"n_tup_upd": upd, "n_tup_hot_upd": hot, "n_dead_tup": dead, "n_live_tup": live,
            "table_bytes": size, "hot_share": hot / upd if upd else None}


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's reaped children (pgbench)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _wait_for_sessions_to_end(dsn: str, timeout_seconds: float = 10.0) -> None:
    """Wait until no other session of *dsn*'s database is left (pgbench's backends)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE"
                               " datname = current_database() AND pid <> pg_backend_pid()"
                               ).fetchone()
            if not row or row[0] == 0:
                return
            time.sleep(0.01)


def pgbench_argv(bench: Bench, dsn: str, script_path: str, *, clients: int,
                 seconds: float | None = None, transactions: int | None = None) -> list[str]:
    """The pgbench command line: *script_path* on *dsn*'s database, *clients*
    sessions, prepared statements, for *seconds* (``-T``) or *transactions*
    per client (``-t``)."""
    dbname = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
    length = ["-t", str(transactions)] if transactions is not None else [
        "-T", str(int(seconds or 1))]
    return [
        str(Path(bench.bin_dir) / "pgbench"), "-n", "-M", "prepared",
        "-h", "127.0.0.1", "-p", str(bench.port), "-U", "postgres",
        "-c", str(clients), "-j", str(min(clients, 2)), *length,
        "-f", script_path, dbname,
    ]


def pgbench_env() -> dict[str, str]:
    """pgbench's environment: its sessions commit as the worker's do (``PGOPTIONS``)."""
    return {**os.environ, "PGOPTIONS": f"-c synchronous_commit={WORKER_SYNCHRONOUS_COMMIT}"}


def run_pgbench(bench: Bench, *, batch: int, clients: int, seconds: float,
                fill: int, script: dict[str, Any] | None = None,
                flow_stats: bool = False) -> dict[str, Any]:
    """One pgbench run (*seconds* s) on a fresh database holding *fill* ready jobs.

    *script*: keyword arguments of :func:`pgbench_script` (the statement
    variant); *flow_stats*: also return :func:`flow_row_stats` after the run.
    pgbench's sessions commit as the worker's do (``synchronous_commit`` of
    :class:`receipts.settings.Settings`' default, through ``PGOPTIONS``), so
    the raw limit and the worker are measured alike.
    """
    with bench.database("raw") as dsn:
        fill_ready(dsn, fill)
        settle(dsn, "receipt_jobs")
        with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as fh:
            fh.write(pgbench_script(batch, **(script or {})))
            script_path = fh.name
        cmd = pgbench_argv(bench, dsn, script_path, clients=clients, seconds=seconds)
        start = time.monotonic()
        env = pgbench_env()
        db_before = bench.server_cpu_seconds()
        client_before = _children_cpu_seconds()
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120,
                                env=env)
        _wait_for_sessions_to_end(dsn)  # a reaped backend's CPU is then the postmaster's
        db_seconds = bench.server_cpu_seconds() - db_before
        client_seconds = _children_cpu_seconds() - client_before
        elapsed = time.monotonic() - start
        Path(script_path).unlink(missing_ok=True)
        if result.returncode != 0:
            raise RuntimeError(f"pgbench failed: {result.stderr.strip()[-600:]}")
        done = _done(dsn)
        match = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", result.stdout)
        tps = float(match.group(1)) if match else 0.0
        failed = re.search(r"number of failed transactions: (\d+)", result.stdout)
        flow = flow_row_stats(dsn) if flow_stats else None
    return {
        **({"flow_row": flow} if flow is not None else {}),
        "script": script or {},
        "batch": batch,
        "clients": clients,
        "jobs_per_second": done / seconds,
        "tps": tps,
        "jobs_done": done,
        "drained": done >= fill,
        "failed_transactions": int(failed.group(1)) if failed else 0,
        # CPU per job done: the server's (all its processes) and pgbench's own
        "db_cpu_us_per_job": round(db_seconds / done * 1e6, 1) if done else None,
        "client_cpu_us_per_job": round(client_seconds / done * 1e6, 1) if done else None,
        "wall_seconds": round(elapsed, 2),
    }
