"""Scenario 1, the raw limit: pgbench running this project's own claim and ack.

The statements are taken from ``receipts/sql/queries.sql`` (the very text the
worker runs) with the service's defaults filled in: a literal ``LIMIT`` per
batch size, ``max_attempts`` 5, a 60 s lease. One pgbench transaction is what
a worker does per batch: one autocommit claim, then one autocommit batched
ack of everything it claimed (the ids and tokens go from the first statement
to the second through ``\\gset``). pgbench runs with ``-M prepared``, as
psycopg does after a statement's fifth execution. jobs/s = rows that became
done during the run / its duration.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.pg import Bench, fill_ready, settle
from receipts.statements import statements

MAX_ATTEMPTS = 5
LEASE_SECONDS = 60


def pgbench_script(batch: int) -> str:
    """The pgbench script: claim *batch* jobs, then ack them in one statement."""
    claim = statements()["claim"].format(limit=batch)
    claim = claim.replace("%(max_attempts)s", str(MAX_ATTEMPTS))
    claim = claim.replace("%(lease_seconds)s", str(LEASE_SECONDS))
    claim = claim.replace("%(probe)s", "false")  # no fleet pause in a benchmark
    # Keep every CTE (the flow check, candidate, claimed); replace only the final
    # SELECT by one that hands the ids and tokens to the ack through \gset.
    head, sep, _ = claim.rpartition("\nSELECT c.id")
    if not sep or "claimed AS (" not in head:
        raise RuntimeError("the claim statement no longer has the expected shape")
    claim_sql = (
        f"{head}\n"
        "SELECT coalesce(array_agg(id), '{}') AS ids,"
        " coalesce(array_agg(lease_token), '{}') AS tokens FROM claimed \\gset"
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


def run_pgbench(bench: Bench, *, batch: int, clients: int, seconds: float,
                fill: int) -> dict[str, Any]:
    """One pgbench run on a fresh database holding *fill* ready jobs."""
    with bench.database("raw") as dsn:
        fill_ready(dsn, fill)
        settle(dsn, "receipt_jobs")
        with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as fh:
            fh.write(pgbench_script(batch))
            script = fh.name
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        cmd = [
            str(Path(bench.bin_dir) / "pgbench"), "-n", "-M", "prepared",
            "-h", "127.0.0.1", "-p", str(bench.port), "-U", "postgres",
            "-c", str(clients), "-j", str(min(clients, 2)), "-T", str(int(seconds)),
            "-f", script, str(info["dbname"]),
        ]
        start = time.monotonic()
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
        elapsed = time.monotonic() - start
        Path(script).unlink(missing_ok=True)
        if result.returncode != 0:
            raise RuntimeError(f"pgbench failed: {result.stderr.strip()[-600:]}")
        done = _done(dsn)
        match = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", result.stdout)
        tps = float(match.group(1)) if match else 0.0
        failed = re.search(r"number of failed transactions: (\d+)", result.stdout)
    return {
        "batch": batch,
        "clients": clients,
        "jobs_per_second": done / seconds,
        "tps": tps,
        "jobs_done": done,
        "drained": done >= fill,
        "failed_transactions": int(failed.group(1)) if failed else 0,
        "wall_seconds": round(elapsed, 2),
    }
