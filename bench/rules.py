"""What the database rules of migration 0009 cost the worker's claim and ack.

``python -m bench.rules`` (``--rounds``, ``--seconds``, ``--batch``, ``--clients``).

pgbench running the project's own claim and batched ack (:func:`bench.raw.pgbench_script`,
the raw-limit scenario's script: claim *batch* jobs, ``\\gset``, one ack of them all, with
the worker sessions' ``synchronous_commit``), on a fresh database of *fill* ready jobs per
run, in variants of the schema made on the clone before the run:

* ``as shipped``: every migration, the rules included;
* ``without the done guard``: the ``receipt_jobs_done_guard`` trigger dropped;
* ``without the enqueue CHECKs``: ``receipt_jobs_order_id_rules`` and
  ``receipt_jobs_run_at_finite`` dropped (the claim evaluates the order-id rule on
  every row it writes; the ack does not, a done row is exempt);
* ``without any rule``: both.

Variants are interleaved (A B C D, D C B A, …). Per run: jobs done per second, the
database server's CPU per job (all its processes), and pgbench's. Prints the medians;
writes every run to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from bench.checkout import interleaved
from bench.pg import Bench, fill_ready, settle
from bench.raw import _done, _wait_for_sessions_to_end, pgbench_argv, pgbench_env, pgbench_script
from bench.report import write_json
from bench.run import machine

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "rules.json"
_GUARD = "DROP TRIGGER receipt_jobs_done_guard ON receipt_jobs"
_CHECKS = ("ALTER TABLE receipt_jobs DROP CONSTRAINT receipt_jobs_order_id_rules,"
           " DROP CONSTRAINT receipt_jobs_run_at_finite")
#: Variant name → DDL run on the clone before the fill.
VARIANTS: dict[str, str] = {
    "as shipped": "",
    "without the done guard": _GUARD,
    "without the enqueue CHECKs": _CHECKS,
    "without any rule": f"{_GUARD}; {_CHECKS}",
}


def run_once(bench: Bench, ddl: str, *, batch: int, clients: int, seconds: float,
             fill: int) -> dict[str, Any]:
    """One pgbench run of claim *batch* + ack on a fresh clone altered by *ddl*."""
    with bench.database("rules") as dsn:
        if ddl:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(ddl.encode())
        fill_ready(dsn, fill)
        settle(dsn, "receipt_jobs")
        with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as fh:
            fh.write(pgbench_script(batch))
            path = fh.name
        db_before = bench.server_cpu_seconds()
        started = time.monotonic()
        result = subprocess.run(pgbench_argv(bench, dsn, path, clients=clients, seconds=seconds),
                                capture_output=True, text=True, timeout=seconds + 120,
                                env=pgbench_env())
        _wait_for_sessions_to_end(dsn)
        db_seconds = bench.server_cpu_seconds() - db_before
        Path(path).unlink(missing_ok=True)
        if result.returncode != 0:
            raise RuntimeError(f"pgbench failed: {result.stderr.strip()[-600:]}")
        done = _done(dsn)
    return {"jobs_per_second": done / seconds, "jobs_done": done,
            "db_cpu_us_per_job": round(db_seconds / done * 1e6, 1) if done else None,
            "wall_seconds": round(time.monotonic() - started, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rules", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--batch", type=int, default=10, help="jobs per claim (10)")
    p.add_argument("--clients", type=int, default=4, help="pgbench sessions (4)")
    p.add_argument("--fill", type=int, default=200_000, help="ready jobs per run (200,000)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    started = datetime.now(UTC)
    bench = Bench()
    runs: list[dict[str, Any]] = []
    try:
        for r, name in interleaved(list(VARIANTS), args.rounds):
            run = run_once(bench, VARIANTS[name], batch=args.batch, clients=args.clients,
                           seconds=args.seconds, fill=args.fill)
            runs.append({"variant": name, "round": r, **run})
            print(f"  {name}: {run['jobs_per_second']:,.0f} jobs/s, "
                  f"{run['db_cpu_us_per_job']} us db CPU/job", flush=True)
    finally:
        bench.cleanup()
    print(f"\nclaim {args.batch} + ack, {args.clients} clients, {args.seconds:g} s, "
          f"median of {args.rounds}: jobs/s, database CPU per job (us)")
    summary = {}
    for name in VARIANTS:
        mine = [x for x in runs if x["variant"] == name]
        summary[name] = {
            "jobs_per_second": statistics.median(x["jobs_per_second"] for x in mine),
            "db_cpu_us_per_job": statistics.median(x["db_cpu_us_per_job"] or 0 for x in mine)}
        print(f"{name:28} {summary[name]['jobs_per_second']:10,.0f} "
              f"{summary[name]['db_cpu_us_per_job']:8.1f}")
    write_json({"started": started.isoformat(timespec="seconds"),
                "finished": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": machine(), "args": vars(args) | {"out": str(args.out)},
                "summary": summary, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
