"""What an ack riding on the next claim saves at a trickle: one statement or two.

``python -m bench.experiments.ride`` (``--rounds``, ``--loops``, ``--batch``, ``--gap``).

One session enqueues ``--batch`` jobs (``enqueue_one`` each, its own
transaction, as a checkout's); another claims them (up to 32) and acks the
jobs it claimed the round before, ``--loops`` times per run on a fresh
database, ``--gap`` seconds apart (0: back to back; the calm day's pods claim
a few times a second, so their statements start on a cold cache):

* ``two statements``: the claim, then the ack on its own (as before riding acks);
* ``one statement``: the claim carrying the ack (``claim_query(acks=True)``,
  as :meth:`receipts.completion.Completer.carried_by` sends it).

Both modes write the same rows. Prints the execution time of the claims and
acks together per job (``pg_stat_statements``, µs), median of the runs; the
modes are interleaved (A B, B A, …). Writes every run to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from bench.checkout import interleaved
from bench.pg import Bench
from bench.report import write_json
from bench.run import machine
from receipts.jobqueue import ack_params
from receipts.statements import claim_query, query

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "results" / "ride.json"
MODES = ("two statements", "one statement")
_CLAIM = {"max_attempts": 25, "lease_seconds": 60.0, "probe": False,
          "after_run_at": None, "after_id": None}


def run_once(bench: Bench, mode: str, *, batch: int, loops: int, gap: float) -> dict[str, Any]:
    """One run of *mode* on a fresh database: claim and ack execution µs per job."""
    enqueue, ack = query("enqueue_one"), query("ack")
    claim, riding = claim_query(32), claim_query(32, acks=True)
    with bench.database("ride") as dsn, psycopg.connect(dsn, autocommit=True) as checkout, \
            psycopg.connect(dsn, autocommit=True) as worker:
        checkout.execute("SELECT pg_stat_statements_reset()")
        pending: list[tuple[uuid.UUID, uuid.UUID]] = []
        for _ in range(loops):
            for _ in range(batch):
                checkout.execute(enqueue, {"id": uuid.uuid4(), "order_id": uuid.uuid4().hex,
                                           "run_at": None}, prepare=True)
            if mode == "two statements" or not pending:
                rows = worker.execute(claim, _CLAIM, prepare=True).fetchall()
                if pending:
                    worker.execute(ack, ack_params(pending), prepare=True).fetchall()
            else:
                rows = worker.execute(riding, _CLAIM | ack_params(pending),
                                      prepare=True).fetchall()
            pending = [(r[0], r[2]) for r in rows if r[0] is not None]
            if gap:
                time.sleep(gap)
        stats = checkout.execute(
            "SELECT query, calls, total_exec_time FROM pg_stat_statements").fetchall()
    exec_ms = {"claim": 0.0, "ack": 0.0}
    calls = {"claim": 0, "ack": 0}
    for text, n, total_ms in stats:
        name = ("claim" if "candidate AS" in text else "ack" if "WITH done AS" in text else None)
        if name is not None:
            exec_ms[name] += total_ms
            calls[name] += n
    jobs = loops * batch
    return {"us_per_job": round((exec_ms["claim"] + exec_ms["ack"]) * 1000 / jobs, 1),
            "statements_per_job": round((calls["claim"] + calls["ack"]) / jobs, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.ride",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loops", type=int, default=200, help="claims per run (200)")
    p.add_argument("--batch", type=int, default=4, help="jobs enqueued per claim (4)")
    p.add_argument("--gap", type=float, default=0.1,
                   help="seconds between claims (0.1; 0: back to back)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file (results/ride.json)")
    args = p.parse_args(argv)
    started = datetime.now(UTC)
    bench = Bench()
    runs: list[dict[str, Any]] = []
    try:
        for r, mode in interleaved(list(MODES), args.rounds):
            run = run_once(bench, mode, batch=args.batch, loops=args.loops, gap=args.gap)
            runs.append({"mode": mode, "round": r, **run})
            print(f"  {mode}: {run}", flush=True)
    finally:
        bench.cleanup()
    summary = {m: {k: statistics.median(x[k] for x in runs if x["mode"] == m)
                   for k in ("us_per_job", "statements_per_job")} for m in MODES}
    print(f"\n{args.batch} jobs per claim, {args.loops} claims {args.gap} s apart,"
          f" median of {args.rounds}: claim and ack execution per job")
    for mode in MODES:
        print(f"{mode:16} {summary[mode]['us_per_job']:7.1f} us"
              f"  {summary[mode]['statements_per_job']:.3f} statements per job")
    write_json({"started": started.isoformat(timespec="seconds"),
                "finished": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": machine(), "args": vars(args) | {"out": str(args.out)},
                "summary": summary, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
