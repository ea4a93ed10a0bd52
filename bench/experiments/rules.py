"""What the database rules cost the worker's claim and ack, and the checkout's enqueue.

``python -m bench.experiments.rules`` (``--rounds``, ``--seconds``, ``--batch``, ``--clients``;
``--trickle``).

pgbench running the project's own claim and batched ack (:func:`bench.raw.pgbench_script`,
the raw-limit scenario's script: claim *batch* jobs, ``\\gset``, one ack of them all, with
the worker sessions' ``synchronous_commit``), on a fresh database of *fill* ready jobs per
run, in variants of the schema made on the clone before the run:

* ``as shipped``: every migration, the rules included (migration 0012: one CHECK
  constraint, ``receipt_jobs_rules``, calling ``receipts_job_rules()``);
* ``the nine CHECKs of 0011``: that constraint replaced by the nine it replaced
  (:data:`NINE_CHECKS`), as the schema was before migration 0012;
* ``without the done guard``: the ``receipt_jobs_done_guard`` trigger dropped;
* ``without the CHECK rules``: ``receipt_jobs_rules`` dropped;
* ``without any rule``: both.

``--trickle`` measures the fixed, per-statement part instead, where a calm day's bill
is: one session enqueues ``--batch`` jobs (``enqueue_one`` each, in its own
transaction) and another claims and acks them, ``--loops`` times per run, nothing
else running; it prints each statement's mean execution time (``pg_stat_statements``,
microseconds per call, median of the runs).

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
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from bench.checkout import interleaved
from bench.pg import NINE_CHECKS, Bench, fill_ready, settle
from bench.raw import _done, _wait_for_sessions_to_end, pgbench_argv, pgbench_env, pgbench_script
from bench.report import write_json
from bench.run import machine
from receipts.jobqueue import ack_params
from receipts.statements import claim_query, query

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "results" / "rules.json"
_GUARD = "DROP TRIGGER receipt_jobs_done_guard ON receipt_jobs"
_CHECKS = "ALTER TABLE receipt_jobs DROP CONSTRAINT receipt_jobs_rules"
#: Variant name → DDL run on the clone before the fill.
VARIANTS: dict[str, str] = {
    "as shipped": "",
    "the nine CHECKs of 0011": NINE_CHECKS,
    "without the done guard": _GUARD,
    "without the CHECK rules": _CHECKS,
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


def trickle_once(bench: Bench, ddl: str, *, batch: int, loops: int) -> dict[str, float]:
    """Mean execution time per call (µs) of ``enqueue_one``, ``claim`` and ``ack``.

    *loops* rounds on a fresh clone altered by *ddl*: *batch* single-row
    enqueues (each its own transaction, as a checkout's), one claim of up to 32
    and one ack of what it returned, on two sessions, back to back, nothing
    else running. Read from ``pg_stat_statements``, reset at the start.
    """
    enqueue, claim, ack = query("enqueue_one"), claim_query(32), query("ack")
    claim_params = {"max_attempts": 25, "lease_seconds": 60.0, "probe": False,
                    "after_run_at": None, "after_id": None}
    with bench.database("rules") as dsn, psycopg.connect(dsn, autocommit=True) as checkout, \
            psycopg.connect(dsn, autocommit=True) as worker:
        if ddl:
            checkout.execute(ddl.encode())
        checkout.execute("SELECT pg_stat_statements_reset()")
        for _ in range(loops):
            for _ in range(batch):
                checkout.execute(enqueue, {"id": uuid.uuid4(), "order_id": uuid.uuid4().hex,
                                           "run_at": None}, prepare=True)
            rows = worker.execute(claim, claim_params, prepare=True).fetchall()
            pairs = [(r[0], r[2]) for r in rows if r[0] is not None]
            worker.execute(ack, ack_params(pairs), prepare=True).fetchall()
        stats = checkout.execute(
            "SELECT query, calls, total_exec_time FROM pg_stat_statements"
            " WHERE calls >= %s", (loops,)).fetchall()
    out: dict[str, float] = {}
    for text, calls, total_ms in stats:
        name = ("claim" if "candidate AS" in text else "ack" if "WITH done AS" in text
                else "enqueue_one" if text.startswith("INSERT INTO") else None)
        if name is not None:
            out[name] = round(total_ms * 1000 / calls, 1)
    return out


def _run_variants(variants: list[str], rounds: int,
                  once: Callable[[Bench, str], dict[str, Any]],
                  show: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    """*once* (bench, the variant's DDL) per variant and round, interleaved; every run."""
    bench = Bench()
    runs: list[dict[str, Any]] = []
    try:
        for r, name in interleaved(variants, rounds):
            run = once(bench, VARIANTS[name])
            runs.append({"variant": name, "round": r, **run})
            print(f"  {name}: {show(run)}", flush=True)
    finally:
        bench.cleanup()
    return runs


def _medians(runs: list[dict[str, Any]], variants: list[str],
             keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Variant → key → the median of its runs (a missing figure counts as 0)."""
    return {name: {k: statistics.median(x[k] or 0 for x in runs if x["variant"] == name)
                   for k in keys} for name in variants}


def _write(args: argparse.Namespace, started: datetime, summary: dict[str, Any],
           runs: list[dict[str, Any]]) -> None:
    write_json({"started": started.isoformat(timespec="seconds"),
                "finished": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": machine(), "args": vars(args) | {"out": str(args.out)},
                "summary": summary, "runs": runs}, args.out)


def trickle(args: argparse.Namespace, variants: list[str]) -> int:
    """``--trickle``: :func:`trickle_once` per variant, interleaved; prints the medians."""
    started = datetime.now(UTC)
    runs = _run_variants(
        variants, args.rounds,
        lambda bench, ddl: trickle_once(bench, ddl, batch=args.batch, loops=args.loops), str)
    print(f"\n{args.batch} enqueues, a claim and an ack per loop, {args.loops} loops,"
          f" median of {args.rounds}: execution time per call (us)")
    summary = _medians(runs, variants, ("enqueue_one", "claim", "ack"))
    for name in variants:
        print(f"{name:28} " + "  ".join(f"{k} {v:7.1f}" for k, v in summary[name].items()))
    _write(args, started, summary, runs)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.rules",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--batch", type=int, default=10, help="jobs per claim (10)")
    p.add_argument("--clients", type=int, default=4, help="pgbench sessions (4)")
    p.add_argument("--fill", type=int, default=200_000, help="ready jobs per run (200,000)")
    p.add_argument("--only", nargs="+", choices=sorted(VARIANTS), metavar="VARIANT",
                   help="run only these variants (default: all)")
    p.add_argument("--trickle", action="store_true",
                   help="measure the per-statement part at a trickle instead (see above)")
    p.add_argument("--loops", type=int, default=800, help="loops per --trickle run (800)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file (results/rules.json; results/rules-trickle.json)")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = DEFAULT_OUT.with_name("rules-trickle.json") if args.trickle else DEFAULT_OUT
    variants = [v for v in VARIANTS if args.only is None or v in args.only]
    if args.trickle:
        return trickle(args, variants)
    started = datetime.now(UTC)
    runs = _run_variants(
        variants, args.rounds,
        lambda bench, ddl: run_once(bench, ddl, batch=args.batch, clients=args.clients,
                                    seconds=args.seconds, fill=args.fill),
        lambda run: (f"{run['jobs_per_second']:,.0f} jobs/s, "
                     f"{run['db_cpu_us_per_job']} us db CPU/job"))
    print(f"\nclaim {args.batch} + ack, {args.clients} clients, {args.seconds:g} s, "
          f"median of {args.rounds}: jobs/s, database CPU per job (us)")
    summary = _medians(runs, variants, ("jobs_per_second", "db_cpu_us_per_job"))
    for name in variants:
        print(f"{name:28} {summary[name]['jobs_per_second']:10,.0f} "
              f"{summary[name]['db_cpu_us_per_job']:8.1f}")
    _write(args, started, summary, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
