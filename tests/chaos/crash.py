"""A PostgreSQL crash mid-drain: what asynchronous worker commits cost, and what they must not.

Run by hand (the CI test runs the same code with fewer jobs)::

    .venv/bin/python -m tests.chaos.crash --jobs 3000 --rounds 3   # off and on, interleaved

One run: an embedded PostgreSQL 18 of its own (``fsync`` off, which a process
crash does not care about: what the kernel has, survives; everything else at
its default, ``synchronous_commit`` on for every session but the workers'),
the queue with the chaos run's audit trigger, *jobs* enqueued up front,
the reference provider (a few ms of latency, no faults), *workers* ``receipts
worker`` processes with ``RECEIPTS_SYNCHRONOUS_COMMIT`` = *mode* and a
``receipts recover --loop 1``. Once a third of the jobs are done, every
PostgreSQL process gets SIGKILL at the same instant (an OOM kill, a node
lost), the server starts again (crash recovery), and the drain finishes.

It then compares what the workers counted with what the database kept and
with what the provider received:

* lost: enqueued jobs that did not end done or failed (must be 0);
* duplicates: requests to the provider beyond one per key (its idempotency
  key turns them into replays);
* counter drift: each surviving worker's ``receipts_acks_total``,
  ``receipts_retries_total`` and ``receipts_failures_total`` against the
  audit trail's writes by that worker (the trail is written in the same
  transaction, so a crash undoes both), and ``receipts_jobs_claimed_total``
  against the trail's claims plus the attempts the worker says a crash undid
  (``receipts_writes_undone_total{statement="claim"}``);
* stale acks: what the lease guard refused (``ReceiptsStaleAcks`` pages on
  these; a crash must not produce them);
* traces: every receipt the provider received more than once is accounted
  for by its row's ``attempts`` plus the records of attempts whose claim the
  crash undid (``completion.UNDONE_CLAIM``) in its history.

The end checks reuse the chaos run's (:mod:`tests.chaos.checks`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from receipts.completion import UNDONE_CLAIM
from receipts.embedded import EmbeddedPostgres, free_port
from receipts.migrate import apply_migrations
from receipts.supervisor import ChildError, Supervisor
from tests.chaos.checks import (
    AuditRow,
    Finding,
    all_passed,
    check_done_were_delivered,
    check_nothing_lost,
    check_one_receipt_per_order,
    check_outcomes_by_current_attempt,
    failed_lines,
    read_trail,
)
from tests.chaos.run import AUDIT_QUERY, AUDIT_SQL

MODES = ("off", "on")


@dataclass(slots=True)
class CrashConfig:
    """Knobs of one crash run (defaults: 3,000 jobs, 2 workers × 32 slots)."""

    jobs: int = 3000
    workers: int = 2
    concurrency: int = 32
    synchronous_commit: str = "off"
    crash_after_share: float = 1 / 3  # the crash comes once this share of jobs is done
    lease_seconds: float = 30.0  # longer than a slow crash recovery on a busy machine
    provider_latency_ms: float = 5.0
    provider_jitter_ms: float = 15.0
    seed: int = 1
    drain_timeout_seconds: float = 240.0
    workdir: Path | None = None
    quiet: bool = False


@dataclass(slots=True)
class CrashReport:
    """What one crash run measured and whether its checks passed."""

    config: CrashConfig
    figures: dict[str, float] = field(default_factory=dict)
    per_worker: dict[str, dict[str, float]] = field(default_factory=dict)
    checks: list[Finding] = field(default_factory=list)
    workdir: Path | None = None

    @property
    def ok(self) -> bool:
        """True when every check passed."""
        return all_passed(self.checks)

    @property
    def failures(self) -> list[str]:
        """The failed checks as ``name: detail`` lines."""
        return failed_lines(self.checks)

    def summary(self) -> str:
        """The figures and checks as plain text."""
        f = self.figures
        lines = [
            f"synchronous_commit={self.config.synchronous_commit}: {self.config.jobs} jobs, "
            f"{self.config.workers} workers; crash after {int(f.get('done_at_crash', 0))} done "
            f"(drain {f.get('rate_before_crash', 0):,.0f} jobs/s before it)",
            f"  lost {int(f.get('lost', 0))}, duplicates {int(f.get('duplicates', 0))} "
            f"({int(f.get('duplicate_keys', 0))} keys, {int(f.get('twice_with_one_attempt', 0))}"
            " of them delivered twice while their row says attempts = 1; "
            f"{int(f.get('undone_records', 0))} records of undone claims in the histories, "
            f"{int(f.get('untraced', 0))} resends without a trace)",
            f"  acks counted {int(f.get('acks', 0))} vs done rows {int(f.get('done', 0))} "
            f"(drift {int(f.get('ack_drift', 0))}); stale acks {int(f.get('stale_acks', 0))}; "
            f"writes undone by the crash {int(f.get('undone', 0))} "
            f"(claims {int(f.get('undone_claims', 0))}); acks rewritten after the crash "
            f"{int(f.get('redone', 0))}",
            f"  restart {f.get('restart_seconds', 0):.1f} s, "
            f"drain {f.get('drain_seconds', 0):.1f} s after it",
        ]
        lines += [f"  [{'ok' if c.passed else 'FAIL'}] {c.name}"
                  + (f" — {c.detail}" if c.detail else "") for c in self.checks]
        return "\n".join(lines)


def kill_postgres(pg: EmbeddedPostgres) -> list[int]:
    """SIGKILL the postmaster and every process it started, at the same instant.

    Returns the pids. The embedded server's processes are not our children
    (``pg_ctl`` detaches them), so they are found by their parent in /proc;
    the postmaster is stopped first, so it forks none while they are looked up.
    """
    postmaster = int((pg.data / "postmaster.pid").read_text().split()[0])
    os.kill(postmaster, signal.SIGSTOP)
    pids = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                    pids.append(int(entry.name))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (this machine's init does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def restart_after_crash(pg: EmbeddedPostgres, pids: list[int], timeout_seconds: float = 30) -> None:
    """Wait for the killed processes, drop the stale lock file, start (crash recovery)."""
    deadline = time.monotonic() + timeout_seconds
    while not all(_dead(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise RuntimeError("PostgreSQL processes survived SIGKILL")
        time.sleep(0.01)
    # The lock files name a dead postmaster; a zombie still "exists" for kill(pid, 0).
    for lock in [pg.data / "postmaster.pid", *pg.root.glob(".s.PGSQL.*.lock")]:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
    pg.start()


class CrashRun:
    """One crash run; :meth:`run` returns the :class:`CrashReport`."""

    def __init__(self, config: CrashConfig) -> None:
        self.cfg = config
        self.report = CrashReport(config)

    def say(self, text: str) -> None:
        if not self.cfg.quiet:
            print(f"  [{time.strftime('%H:%M:%S')}] {text}", flush=True)

    def _env(self, dsn: str, app: str, port: int, provider_url: str) -> dict[str, str]:
        c = self.cfg
        return {
            "RECEIPTS_DATABASE_URL": dsn,
            "RECEIPTS_PROVIDER_URL": provider_url,
            "RECEIPTS_CONCURRENCY": str(c.concurrency),
            "RECEIPTS_LEASE_SECONDS": str(c.lease_seconds),
            "RECEIPTS_LEASE_MARGIN_SECONDS": "2",
            "RECEIPTS_DELIVERY_TIMEOUT_SECONDS": "5",
            "RECEIPTS_SYNCHRONOUS_COMMIT": c.synchronous_commit,
            "RECEIPTS_RECOVERY_DELAY_SECONDS": "0.2",
            "RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS": "1",
            "RECEIPTS_METRICS_PORT": str(port),
            "RECEIPTS_APPLICATION_NAME": app,
            "RECEIPTS_LOG_LEVEL": os.environ.get("CRASH_LOG_LEVEL", "INFO"),
        }

    async def run(self) -> CrashReport:
        c = self.cfg
        workdir = Path(c.workdir or tempfile.mkdtemp(prefix="receipts-crash-"))
        workdir.mkdir(parents=True, exist_ok=True)
        self.report.workdir = workdir
        pg = EmbeddedPostgres(settings={"fsync": "off", "max_connections": "100"})
        try:
            with Supervisor(workdir, stop_timeout_seconds=20.0) as sup:
                await self._run(pg, sup)
        finally:
            await asyncio.to_thread(pg.cleanup)
        return self.report

    async def _sql(self, dsn: str, query: str,
                   params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        async with await psycopg.AsyncConnection.connect(
                dsn, autocommit=True, application_name="crash-harness", connect_timeout=3) as conn:
            cur = await conn.execute(query, params)  # type: ignore[arg-type]
            return await cur.fetchall() if cur.description else []

    async def _done(self, dsn: str) -> int | None:
        try:
            rows = await self._sql(dsn, "SELECT count(*) FILTER (WHERE state IN ('done', 'failed'))"
                                        " FROM receipt_jobs")
        except psycopg.Error:
            return None
        return int(rows[0][0])

    async def _run(self, pg: EmbeddedPostgres, sup: Supervisor) -> None:
        c = self.cfg
        await asyncio.to_thread(pg.start)
        dsn = await asyncio.to_thread(pg.create_database, "crash")
        await asyncio.to_thread(apply_migrations, dsn)
        await self._sql(dsn, AUDIT_SQL)
        orders = [f"crash{c.seed}-{i:06d}" for i in range(c.jobs)]
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            await conn.execute("SELECT receipts_enqueue(o) FROM unnest(%s::text[]) AS o", (orders,))
            await conn.commit()  # durable: the orders' own transaction

        port = free_port()
        provider = sup.start("provider", ["provider", "--port", str(port), "--seed", str(c.seed),
                                          "--latency-ms", str(c.provider_latency_ms),
                                          "--jitter-ms", str(c.provider_jitter_ms)],
                             port=port, health_path="/stats")
        await asyncio.to_thread(provider.wait_healthy)
        url = provider.url("/receipts")
        workers = []
        for i in range(c.workers):
            mport = free_port()
            workers.append(sup.start(f"worker-{i}", ["worker"],
                                     self._env(dsn, f"crash-w{i}", mport, url), port=mport))
        sup.start("recover", ["recover", "--loop", "1"], self._env(dsn, "crash-recover", 0, url))
        for w in workers:
            await asyncio.to_thread(w.wait_healthy)
        started = time.monotonic()

        target = int(c.jobs * c.crash_after_share)
        while (await self._done(dsn) or 0) < target:
            if time.monotonic() - started > c.drain_timeout_seconds:
                raise RuntimeError("the drain did not reach the crash point")
            await asyncio.sleep(0.01)
        pids = kill_postgres(pg)
        crashed = time.monotonic()
        rate = target / (crashed - started)
        self.say(f"SIGKILL to {len(pids)} PostgreSQL processes")
        await asyncio.to_thread(restart_after_crash, pg, pids)
        restarted = time.monotonic()
        done_at_crash = await self._done(dsn) or 0  # what survived of it
        self.say(f"PostgreSQL back after {restarted - crashed:.1f}s; {done_at_crash} finished "
                 "jobs survived")

        while (await self._done(dsn) or 0) < c.jobs:
            if time.monotonic() - restarted > c.drain_timeout_seconds:
                break
            await asyncio.sleep(0.1)
        drained = time.monotonic()
        metrics = await self._settle(dsn, workers)
        stats = await asyncio.to_thread(provider.get_json, "/stats")
        receipts = await asyncio.to_thread(provider.get_json, "/receipts", timeout_seconds=60)
        requests = await asyncio.to_thread(provider.get_json, "/requests", timeout_seconds=60)
        codes = await asyncio.to_thread(sup.stop_all, timeout_seconds=20)
        rows = await self._sql(dsn, "SELECT order_id, state, attempts FROM receipt_jobs")
        undone = dict(await self._sql(
            dsn, "SELECT j.order_id, count(*) FROM receipt_attempts AS a"
                 " JOIN receipt_jobs AS j ON j.id = a.job_id WHERE a.error = %s GROUP BY 1",
            (UNDONE_CLAIM,)))
        audit = [AuditRow(*r) for r in await self._sql(dsn, AUDIT_QUERY)]
        with (self.report.workdir or Path(".")).joinpath("audit.jsonl").open("w") as fh:
            for row in audit:  # what the checks judged, kept with the logs
                fh.write(json.dumps(dataclasses.asdict(row)) + "\n")
        self._judge(orders, rows, audit, metrics, stats, receipts, requests, codes,
                    outage_seconds=restarted - crashed, undone_records=undone)
        self.report.figures.update(done_at_crash=done_at_crash,
                                   restart_seconds=restarted - crashed,
                                   drain_seconds=drained - restarted, rate_before_crash=rate)

    async def _settle(self, dsn: str, workers: list[Any]) -> dict[str, Any]:
        """Scrape until the workers' counters stop moving (they count once an ack is durable)."""
        previous: dict[str, Any] = {}
        deadline = time.monotonic() + 15
        while True:
            current = {}
            for w in workers:
                with contextlib.suppress(ChildError, OSError, ValueError):
                    current[w.name] = await asyncio.to_thread(w.scrape)
            if current == previous or time.monotonic() > deadline:
                return current
            previous = current
            await asyncio.sleep(1.0)

    def _judge(self, orders: list[str], rows: list[tuple[Any, ...]], audit: list[AuditRow],
               metrics: dict[str, Any], stats: dict[str, Any], receipts: dict[str, Any],
               requests: list[list[str]], codes: dict[str, int], *,
               outage_seconds: float, undone_records: dict[str, int] | None = None) -> None:
        """The checks (see the module doc). Stale acks, and with durable commits any
        duplicate, are judged only when the server was back well within the lease:
        leases that expire during a longer outage make both, rightly."""
        states = {str(o): str(s) for o, s, _ in rows}
        attempts = {str(o): int(a) for o, _, a in rows}
        requested: dict[str, list[str]] = defaultdict(list)
        for key, attempt in requests:
            requested[key].append(attempt)
        per_key = Counter(key for key, _ in requests)
        duplicates = sum(n - 1 for n in per_key.values())
        twice_one = sum(1 for key, n in per_key.items()
                        if n > 1 and attempts.get(key.removeprefix("receipt:")) == 1)
        traced = undone_records or {}
        untraced = sorted(key for key, n in per_key.items() if n > 1 and (
            attempts.get(key.removeprefix("receipt:"), 0)
            + int(traced.get(key.removeprefix("receipt:"), 0)) < n))
        trail = read_trail(audit)
        mismatches = []
        totals: Counter[str] = Counter()
        for i in range(self.cfg.workers):
            name, app = f"worker-{i}", f"crash-w{i}-worker"
            m = metrics.get(name)
            if m is None:
                mismatches.append(f"{name}: no scrape")
                continue
            undone = m.by_label("receipts_writes_undone_total", "statement")
            figures = {
                "acks": m.total("receipts_acks_total"),
                # Jobs claimed ahead and given back unsent are reschedules in the trail.
                "retries": m.total("receipts_retries_total")
                + m.total("receipts_claims_returned_total"),
                "failures": m.total("receipts_failures_total"),
                "stale": m.total("receipts_stale_acks_total"),
                "claimed": m.total("receipts_jobs_claimed_total"),
                "undone": sum(undone.values()),
                "undone_claims": undone.get("claim", 0.0),
                "redone": m.total("receipts_writes_rewritten_total"),
                "inflight": m.total("receipts_inflight_deliveries"),
            }
            self.report.per_worker[name] = figures
            totals.update({k: int(v) for k, v in figures.items()})
            truth = {"acks": trail.done_by[app], "retries": trail.retried_by[app],
                     "failures": trail.failed_by[app],
                     "claimed": trail.claimed_by[app] + figures["undone_claims"]}
            mismatches += [f"{name} {k}={int(figures[k])} vs {int(v)} in the database"
                           for k, v in truth.items() if int(figures[k]) != int(v)]
            outcomes = (figures["acks"] + figures["retries"] + figures["failures"]
                        + figures["stale"] + figures["undone"] + figures["inflight"])
            if int(outcomes) != int(figures["claimed"]):
                mismatches.append(f"{name}: claimed {int(figures['claimed'])} but accounted "
                                  f"{int(outcomes)} outcomes")
        done = sum(1 for s in states.values() if s == "done")
        expected = set(orders)
        within_lease = outage_seconds < self.cfg.lease_seconds - 5
        outage_note = (f"the database was down {outage_seconds:.1f} s, longer than the "
                       f"{self.cfg.lease_seconds:g} s lease allows")
        self.report.checks = [
            check_nothing_lost(expected, states),
            check_done_were_delivered(states, receipts, requested),
            check_one_receipt_per_order(receipts, stats["receipts"], expected),
            check_outcomes_by_current_attempt(trail),
            Finding("each worker's counters equal what the database kept (acks, retries, "
                    "failures; claims less those the crash undid) and account for every claim",
                    not mismatches, "; ".join(mismatches[:6])),
            Finding("no stale ack: the crash's refused writes are counted as undone",
                    totals["stale"] == 0 or not within_lease,
                    f"{totals['stale']} stale" + ("" if within_lease else
                                                 f" (not judged: {outage_note})")),
            Finding("every receipt sent again leaves a trace: its row's attempts plus the "
                    "history's records of claims the crash undid cover every sending",
                    not untraced, f"{len(untraced)} keys without, e.g. {untraced[:3]}"),
            Finding("every process exited 0 on SIGTERM",
                    all(code == 0 for code in codes.values()), str(codes)),
        ]
        if self.cfg.synchronous_commit != "off":
            self.report.checks.append(Finding(
                "with durable worker commits the crash undoes nothing: no duplicate delivery",
                totals["undone"] == 0 and (duplicates == 0 or not within_lease),
                f"{duplicates} duplicates, {totals['undone']} undone"
                + ("" if within_lease else f" (duplicates not judged: {outage_note})")))
        self.report.figures.update(
            lost=len(expected - set(states)) + sum(1 for s in states.values()
                                                   if s not in ("done", "failed")),
            duplicates=duplicates, duplicate_keys=sum(1 for n in per_key.values() if n > 1),
            twice_with_one_attempt=twice_one, untraced=len(untraced),
            undone_records=sum(int(n) for n in traced.values()), done=done, acks=totals["acks"],
            ack_drift=totals["acks"] - done, stale_acks=totals["stale"],
            undone=totals["undone"], undone_claims=totals["undone_claims"],
            redone=totals["redone"], requests=stats["requests"])


async def run_crash(config: CrashConfig) -> CrashReport:
    """One crash run with *config*; see the module doc."""
    return await CrashRun(config).run()


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.chaos.crash``: runs *rounds* × (off, on), interleaved, and a table."""
    p = argparse.ArgumentParser(prog="python -m tests.chaos.crash", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=3000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--modes", default="off,on", help="synchronous_commit values, in order")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", type=Path)
    a = p.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    reports: list[CrashReport] = []
    for r in range(a.rounds):
        order = modes if r % 2 == 0 else list(reversed(modes))
        for mode in order:
            workdir = a.workdir / f"{mode}-{r}" if a.workdir else None
            report = asyncio.run(run_crash(CrashConfig(
                jobs=a.jobs, workers=a.workers, synchronous_commit=mode, seed=a.seed + r,
                workdir=workdir)))
            print(report.summary(), flush=True)
            reports.append(report)
    print()
    keys = ("lost", "duplicates", "twice_with_one_attempt", "ack_drift", "stale_acks", "undone",
            "undone_claims", "redone", "rate_before_crash")
    print("synchronous_commit  " + "  ".join(k for k in keys) + "   (median, min-max over rounds)")
    for mode in modes:
        runs = [r.figures for r in reports if r.config.synchronous_commit == mode]
        cells = []
        for k in keys:
            values = [int(f.get(k, 0)) for f in runs]
            cells.append(f"{statistics.median(values):g} ({min(values)}-{max(values)})")
        print(f"{mode:<18}  " + "  ".join(cells))
    failed = [r for r in reports if not r.ok]
    for r in failed:
        print(f"\nFAILED ({r.config.synchronous_commit}): logs in {r.workdir}", file=sys.stderr)
        for line in r.failures:
            print(f"  {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
