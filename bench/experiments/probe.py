"""What one waker probe costs the database: its backend's CPU per call.

``python -m bench.experiments.probe`` (``--rounds``, ``--probes``, ``--sql FILE``,
``--perf SECONDS``).

At 50 orders/s the elected waker runs ``waker_probe`` about 14 times a
second, and its session was the largest fixed cost of a calm day that
receipts owns (bench/README.md, "Where the backends' CPU goes"). This
reproduces that session's work at the soak's shape, alone, so that the
probe's CPU can be read precisely and a change to it compared in one run:

* the schema holds ``--done`` finished jobs and a short ready queue;
* before each probe a feeder session enqueues ``--per-probe`` jobs due now
  and claims the ones the previous probe saw (leases of an hour), so the
  tail is new at every probe, the probe notifies, and the ready index
  carries the dead entries of a day's work;
* the probing session is configured as the waker's (generic plans,
  asynchronous commit, prepared statements), LISTENs on the ready channel
  and a member channel, and names 4 members of 8 free slots each, with the
  watermark and the tail carried from one probe to the next as
  :class:`receipts.waker.Wakeups` carries them; with ``--local`` the waker's
  own pod is a fifth member, first, with 8 free slots: it takes the new work
  in-process and the probe notifies nobody.

The probing backend's CPU comes from ``/proc/<pid>/schedstat`` (nanoseconds
on the CPU) around the whole loop; the feeder's is not counted. Each
``--sql FILE`` is another text of the probe (``{schema}`` for the schema;
the parameters of either the current text or the one before 2026-12-06's,
which took each member's free slots instead of the slots ahead of it),
measured in the same rounds, interleaved with the current one. Prints the
µs per probe of each text, median of ``--rounds``, and writes every run to
``--out``. The figures are a hot loop's: in the fleet the probe runs every
70 ms among other processes and costs about three times as much, so read
them as a ratio.
With ``--perf SECONDS`` it also records the probing backend with ``perf``
for that long in one extra run and prints the report's top symbols.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import psycopg.sql

from bench.pg import Bench, execute, fill_ready, settle
from bench.report import write_json
from bench.run import machine
from receipts.enqueue import NOTIFY_CHANNEL
from receipts.statements import query
from receipts.waker import (
    FLEET_CHANNEL,
    MARGIN_SECONDS,
    MEMBER_CHANNEL_PREFIX,
    STUCK_SECONDS,
    WAKER_CHANNEL,
)

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "results" / "probe.json"
SCHEMA = "public"
MEMBERS = 4
FREE_SLOTS = 8


def backend_cpu_ns(pid: int) -> int:
    """Nanoseconds process *pid* has run on a CPU (``/proc/<pid>/schedstat``)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def waker_session(dsn: str) -> psycopg.Connection[Any]:
    """A session set up as the waker's LISTEN session (:mod:`receipts.db`, role listen)."""
    conn = psycopg.connect(dsn, autocommit=True, options="-c plan_cache_mode=force_generic_plan"
                           " -c synchronous_commit=off")
    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
    conn.execute(f'LISTEN "{MEMBER_CHANNEL_PREFIX}m0"')
    return conn


def run_once(bench: Bench, *, probes: int, per_probe: int, done: int,
             perf_seconds: float = 0.0, sql_file: Path | None = None,
             local: bool = False) -> dict[str, Any]:
    """One run of *probes* probes; the probing backend's CPU per probe (µs).

    *local*: the waker's own pod is a member with free slots for the new work, so
    the current text wakes it in-process and notifies nobody.
    """
    with bench.database("probe") as dsn:
        fill_ready(dsn, done, prefix="d", state="done")
        settle(dsn, "receipt_jobs")
        sql = query("waker_probe", SCHEMA) if sql_file is None else \
            psycopg.sql.SQL(sql_file.read_text().replace("{schema}", SCHEMA))
        with waker_session(dsn) as waker, psycopg.connect(dsn, autocommit=True) as feeder:
            row = waker.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            pid = int(row[0])
            seen: tuple[Any, Any] = (None, None)
            mark: tuple[Any, Any] = (None, None)
            fed = 0
            woken = 0
            perf: subprocess.Popen[str] | None = None
            # The first probes prepare the statement (psycopg: on the 5th run).
            warmup = 20
            start_ns = 0
            for i in range(warmup + probes):
                if i == warmup:
                    start_ns = backend_cpu_ns(pid)
                    if perf_seconds:
                        perf = subprocess.Popen(
                            ["perf", "record", "-F", "999", "--call-graph", "dwarf,16384",
                             "-o", "/tmp/probe.perf", "-p", str(pid), "--", "sleep",
                             str(perf_seconds)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
                feeder.execute(
                    "WITH gone AS (UPDATE receipt_jobs SET state = 'running',"
                    "  lease_token = gen_random_uuid(), lease_until = now() + interval '1 hour',"
                    "  attempts = attempts + 1 WHERE state = 'ready' AND run_at <= now()),"
                    " new AS (INSERT INTO receipt_jobs (id, order_id)"
                    "  SELECT gen_random_uuid(), 'o-' || (%(fed)s + g)"
                    "  FROM generate_series(1, %(n)s) AS g)"
                    " SELECT 1", {"fed": fed, "n": per_probe}, prepare=True)
                fed += per_probe
                params = {
                    "max_attempts": 10,
                    "seen_run_at": seen[0], "seen_id": seen[1],
                    "from_run_at": mark[0], "from_id": mark[1],
                    "margin_seconds": MARGIN_SECONDS, "stuck_seconds": STUCK_SECONDS,
                    "channels": [f"{MEMBER_CHANNEL_PREFIX}m{k}" for k in range(MEMBERS)],
                    "before": [FREE_SLOTS * k for k in range(MEMBERS)],
                    "local": FREE_SLOTS if local else None,
                    "free": [FREE_SLOTS] * MEMBERS,  # (the text before 2026-12-07)
                    "channel": NOTIFY_CHANNEL, "heartbeat": False,
                    "waker_channel": WAKER_CHANNEL, "schema_name": SCHEMA,
                    "fleet_channel": FLEET_CHANNEL, "shares": None,
                }
                got = waker.execute(sql, params, prepare=True).fetchone()
                assert got is not None
                seen, mark = (got[0], got[1]), (got[3], got[4])
                woken += int(got[6] or 0) + bool(local and len(got) > 10 and got[10])
                # The waker receives its own notifications, as in the fleet.
                for _ in waker.notifies(timeout=0, stop_after=8):
                    pass
            spent_ns = backend_cpu_ns(pid) - start_ns
            if perf is not None:
                perf.wait()
        execute(dsn, "SELECT 1")
    return {"us_per_probe": round(spent_ns / 1000 / probes, 1), "probes": probes,
            "woken_per_probe": round(woken / (warmup + probes), 2)}


def perf_report(top: int = 40) -> str:
    """The top *top* symbols of the recorded run, children included."""
    out = subprocess.run(["perf", "report", "-i", "/tmp/probe.perf", "--children", "--stdio",
                          "--no-demangle", "-g", "none", "--percent-limit", "1"],
                         capture_output=True, text=True, check=False).stdout
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("#")]
    return "\n".join(lines[:top])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.probe",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--probes", type=int, default=5_000)
    p.add_argument("--per-probe", type=int, default=4,
                   help="jobs enqueued (and finished) per probe (4: 50 jobs/s, 14 probes/s)")
    p.add_argument("--done", type=int, default=100_000, help="finished jobs in the table")
    p.add_argument("--perf", type=float, default=0.0, metavar="SECONDS",
                   help="also record the probing backend with perf for SECONDS")
    p.add_argument("--sql", type=Path, action="append", default=[],
                   help="also measure this text of the probe (interleaved with the current)")
    p.add_argument("--local", action="store_true",
                   help="the waker's own pod is a member with free slots (no notification)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.probes < 1 or args.per_probe < 1 or args.done < 0:
        p.error("--rounds, --probes and --per-probe must be at least 1, --done at least 0")
    started = datetime.now(UTC)
    bench = Bench()
    runs: list[dict[str, Any]] = []
    try:
        texts: list[Path | None] = [None, *args.sql]
        for r in range(args.rounds):
            for text in texts:
                run = run_once(bench, probes=args.probes, per_probe=args.per_probe,
                               done=args.done, sql_file=text, local=args.local)
                runs.append({"round": r, "sql": str(text or "waker_probe"), **run})
                print(f"  round {r} {text or 'waker_probe'}: {run}", flush=True)
        if args.perf:
            t0 = time.monotonic()
            run_once(bench, probes=args.probes, per_probe=args.per_probe, done=args.done,
                     perf_seconds=args.perf)
            print(f"  perf run: {time.monotonic() - t0:.0f} s\n{perf_report()}")
    finally:
        bench.cleanup()
    medians = {name: statistics.median(x["us_per_probe"] for x in runs if x["sql"] == name)
               for name in dict.fromkeys(x["sql"] for x in runs)}
    for name, median in medians.items():
        print(f"\n{name}: the waker's backend {median:.1f} us per probe, median of"
              f" {args.rounds} runs of {args.probes} probes", end="")
    print()
    median = medians["waker_probe"]
    write_json({"started": started.isoformat(timespec="seconds"),
                "finished": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": machine(), "args": vars(args) | {"out": str(args.out)},
                "us_per_probe": medians, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
