"""The chaos run: real processes, real faults, and the invariants checked at the end.

Run by hand (the CI test runs the same code with 2,000 jobs)::

    .venv/bin/python -m tests.chaos.run --jobs 50000 --seed 1

What runs: an embedded PostgreSQL 18 of its own (so it may be restarted), the
reference provider (``receipts provider``), several ``receipts worker``
processes (one of them reaches PostgreSQL through :class:`PgProxy`) and a
``receipts recover --loop`` process. Jobs are enqueued at a steady rate, in
order-style transactions, while faults fire on a schedule drawn from the seed
(one round of every kind per ``cycle_seconds`` of enqueueing):

==================  ==========================================================
sigkill             SIGKILL a worker that has deliveries in flight; start a
                    replacement
sigstop             SIGSTOP a worker with deliveries in flight for lease + 2 s,
                    then SIGCONT (its late acks/reschedules must be refused)
pg_restart          ``pg_ctl restart -m fast``
terminate           ``pg_terminate_backend`` of worker backends caught running
                    a claim or an ack
claim_cut           the proxy lets a claim commit, then drops the connection
                    instead of forwarding the answer
write_cut           the same for an ack or a reschedule: it commits, its answer
                    is lost; the worker must count it as written, not stale
half_open           the proxy moves nothing on any of the proxied worker's
                    connections, new ones included, for longer than the
                    statement deadline, closing nothing (no RST, no error)
db_stall            right after the proxied worker's next claim is answered,
                    the proxy holds its statements for lease + 1.5 s: the jobs
                    are delivered, their acks arrive after the lease expired
latency_spike       provider latency past the delivery timeout
burst_5xx           a burst of 503
burst_429           a burst of 429 with ``Retry-After``
hang_after_headers  200 headers, then no body
reset               receipt recorded, then the connection is reset
hang                receipt recorded, then no answer at all
==================  ==========================================================

The database keeps an audit trail (a trigger on ``receipt_jobs`` that records
every state or token change with the session's ``application_name``), so the
end checks compare the workers' counters, logs and the provider's request log
with what the database actually did. See docs/chaos.md.

This module orchestrates (start, enqueue, drain, gather); the faults are in
``tests/chaos/faults.py``, the end checks, pure functions of what was
gathered, in ``tests/chaos/checks.py``, and every child process runs under
one :class:`receipts.supervisor.Supervisor`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg

from receipts.embedded import EmbeddedPostgres, free_port
from receipts.enqueue import enqueue
from receipts.migrate import apply_migrations
from receipts.supervisor import Child, ChildError, Supervisor
from tests.chaos.checks import (
    AuditRow,
    Evidence,
    ProxiedClaims,
    WorkerView,
    counter_mismatches,
    evaluate,
    read_trail,
)
from tests.chaos.faults import PROVIDER_BASELINE, FaultInjector
from tests.chaos.pgproxy import PgProxy
from tests.chaos.report import ChaosReport

AUDIT_SQL = """
CREATE TABLE chaos_audit (
  seq              bigserial PRIMARY KEY,
  stmt_at          timestamptz NOT NULL DEFAULT statement_timestamp(),
  job_id           uuid NOT NULL,
  order_id         text NOT NULL,
  old_state        text NOT NULL,
  new_state        text NOT NULL,
  old_token        uuid,
  new_token        uuid,
  old_lease_until  timestamptz,
  attempts         integer NOT NULL,
  last_error       text,
  app              text NOT NULL
);
CREATE FUNCTION chaos_audit_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF OLD.state IS DISTINCT FROM NEW.state OR OLD.lease_token IS DISTINCT FROM NEW.lease_token
  THEN
    INSERT INTO chaos_audit (job_id, order_id, old_state, new_state, old_token, new_token,
                             old_lease_until, attempts, last_error, app)
    VALUES (NEW.id, NEW.order_id, OLD.state, NEW.state, OLD.lease_token, NEW.lease_token,
            OLD.lease_until, NEW.attempts, NEW.last_error,
            current_setting('application_name'));
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER chaos_audit AFTER UPDATE ON receipt_jobs
  FOR EACH ROW EXECUTE FUNCTION chaos_audit_row();
"""

AUDIT_QUERY = (
    "SELECT job_id::text, old_state, new_state, old_token::text, new_token::text,"
    " coalesce(old_lease_until > stmt_at, false), attempts, app,"
    " extract(epoch FROM stmt_at)::float8 FROM chaos_audit ORDER BY seq"
)
STALE_EVENTS = {"stale_ack", "stale_reschedule"}
UNCONFIRMED_EVENTS = {"lease_lost"}
UNDONE_EVENTS = {"write_undone"}


@dataclass(slots=True)
class ChaosConfig:
    """Knobs of one run; the defaults are the CI run (about 40 s on 2 cores)."""

    jobs: int = 2000
    seed: int = 1
    workers: int = 4
    concurrency: int = 16
    enqueue_rate: float = 100.0  # jobs per second
    cycle_seconds: float = 20.0  # one round of every fault kind per cycle
    lease_seconds: float = 3.0
    delivery_timeout_seconds: float = 1.0
    max_attempts: int = 12
    reject_rate: float = 0.003  # share of orders the provider rejects (422, permanent)
    drain_timeout_seconds: float = 180.0
    workdir: Path | None = None
    keep_logs: bool = False
    quiet: bool = False


@dataclass(slots=True, kw_only=True)
class WorkerProc(WorkerView):
    """One worker process of the run: its child, and what the checks see of it."""

    child: Child

    def read_stale(self) -> None:
        """Read its refused acks and reschedules, and the writes it gave up unconfirmed,
        from its log (killed ones keep theirs)."""
        records = read_events(self.child.log_path,
                              STALE_EVENTS | UNCONFIRMED_EVENTS | UNDONE_EVENTS)
        self.stale = tuple(r for r in records if r["event"] in STALE_EVENTS)
        self.unconfirmed = tuple(r for r in records if r["event"] in UNCONFIRMED_EVENTS
                                 and r.get("outcome") == "write_unconfirmed")
        self.undone = tuple(r for r in records if r["event"] in UNDONE_EVENTS
                            and "undone" in r)


def read_events(path: Path | None, names: set[str]) -> list[dict[str, Any]]:
    """JSON log lines of *path* whose ``event`` is in *names*."""
    found = []
    if path is None:
        return found
    with contextlib.suppress(FileNotFoundError), path.open("rb") as fh:
        for raw in fh:
            if not raw.startswith(b"{"):
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if record.get("event") in names:
                found.append(record)
    return found


class ChaosRun:
    """One chaos run; :meth:`run` returns the :class:`ChaosReport`."""

    def __init__(self, config: ChaosConfig) -> None:
        self.cfg = config
        self.report = ChaosReport(config)
        self.injector = FaultInjector(self, random.Random(config.seed))
        self.workers: list[WorkerProc] = []
        self.sup = Supervisor()
        self._pg: EmbeddedPostgres | None = None
        self._proxy: PgProxy | None = None
        self._provider: Child | None = None
        self.dsn = ""
        self.workdir = Path(".")
        self.enqueued = 0
        self.enqueue_done = threading.Event()
        self.enqueue_error: list[BaseException] = []
        self.violations: list[str] = []
        self.order_prefix = f"chaos{config.seed}-"
        self._worker_seq = 0

    @property
    def pg(self) -> EmbeddedPostgres:
        """The run's own PostgreSQL server (started by :meth:`run`)."""
        assert self._pg is not None
        return self._pg

    @property
    def proxy(self) -> PgProxy:
        """The wire-protocol proxy in front of worker-0's database link."""
        assert self._proxy is not None
        return self._proxy

    @property
    def provider(self) -> Child:
        """The reference provider process."""
        assert self._provider is not None
        return self._provider

    def say(self, text: str) -> None:
        """A progress line (not when quiet)."""
        if not self.cfg.quiet:
            print(f"  [{time.strftime('%H:%M:%S')}] {text}", flush=True)

    # ------------------------------------------------------------ processes

    def _worker_env(self, dsn: str, port: int, app: str) -> dict[str, str]:
        c = self.cfg
        return {
            "RECEIPTS_DATABASE_URL": dsn,
            "RECEIPTS_PROVIDER_URL": self.provider.url("/receipts"),
            "RECEIPTS_CONCURRENCY": str(c.concurrency),
            "RECEIPTS_LEASE_SECONDS": str(c.lease_seconds),
            "RECEIPTS_LEASE_MARGIN_SECONDS": "1",
            "RECEIPTS_DELIVERY_TIMEOUT_SECONDS": str(c.delivery_timeout_seconds),
            "RECEIPTS_POLL_INTERVAL_SECONDS": "0.2",
            "RECEIPTS_RETRY_BASE_SECONDS": "0.1",
            "RECEIPTS_RETRY_CAP_SECONDS": "1",
            "RECEIPTS_RETRY_AFTER_MAX_SECONDS": "1.5",
            "RECEIPTS_MAX_ATTEMPTS": str(c.max_attempts),
            "RECEIPTS_SHUTDOWN_GRACE_SECONDS": "3",
            "RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS": "1",
            "RECEIPTS_RECOVERY_DELAY_SECONDS": "0.3",
            # Short flow-control pauses and statement deadlines, to match the short lease.
            "RECEIPTS_OUTAGE_PAUSE_SECONDS": "0.5",
            "RECEIPTS_AUTH_PAUSE_SECONDS": "0.5",
            "RECEIPTS_PAUSE_MAX_SECONDS": "2",
            "RECEIPTS_STATEMENT_TIMEOUT_SECONDS": "2",
            "RECEIPTS_METRICS_PORT": str(port),
            "RECEIPTS_APPLICATION_NAME": app,
            "RECEIPTS_LOG_LEVEL": "INFO",
        }

    async def start_worker(self, *, proxied: bool = False) -> WorkerProc:
        """Start the next ``worker-N`` (through the proxy when *proxied*); wait for /healthz."""
        index = self._worker_seq
        self._worker_seq += 1
        port = free_port()
        app = f"chaos-w{index}"
        dsn = self.dsn
        if proxied:
            dsn = (f"postgresql://postgres@127.0.0.1:{self.proxy.port}/chaos"
                   "?sslmode=disable&gssencmode=disable")
        child = self.sup.start(f"worker-{index}", ["worker"],
                               self._worker_env(dsn, port, app), port=port)
        proc = WorkerProc(name=child.name, app=f"{app}-worker", proxied=proxied, child=child)
        self.workers.append(proc)
        await asyncio.to_thread(child.wait_healthy)
        return proc

    def live_workers(self) -> list[WorkerProc]:
        """Workers neither killed nor exited (paused ones included)."""
        return [w for w in self.workers if not w.killed and w.child.running]

    async def _scrape_all(self) -> None:
        for w in self.live_workers():
            if w.child.paused:
                continue
            with contextlib.suppress(httpx.HTTPError, ChildError, ValueError):
                w.metrics = await asyncio.to_thread(w.child.scrape)

    # -------------------------------------------------------------- database

    async def _sql(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        async with await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, application_name="chaos-harness", connect_timeout=3
        ) as conn:
            cur = await conn.execute(query, params)  # type: ignore[arg-type]
            return await cur.fetchall() if cur.description else []

    def _enqueue_thread(self) -> None:
        """Enqueue every job at the configured rate; survives database restarts."""
        c = self.cfg
        chunk = max(1, int(c.enqueue_rate / 10))
        start = time.monotonic()
        n = 0
        conn: psycopg.Connection[Any] | None = None
        try:
            while n < c.jobs:
                due = start + n / c.enqueue_rate
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                batch = [f"{self.order_prefix}{i:07d}" for i in range(n, min(n + chunk, c.jobs))]
                began = time.monotonic()
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(self.dsn, application_name="chaos-orders",
                                               connect_timeout=3)
                    with conn.transaction():
                        for order_id in batch:
                            enqueue(conn, order_id)
                except psycopg.OperationalError as exc:
                    self.say(f"enqueue: {type(exc).__name__} after"
                             f" {time.monotonic() - began:.1f}s; reconnecting")
                    if conn is not None:
                        conn.close()
                    conn = None
                    time.sleep(0.2)
                    continue  # ON CONFLICT makes a repeated batch a no-op
                if time.monotonic() - began > 0.15:
                    self.say(f"enqueue: a batch took {time.monotonic() - began:.2f}s")
                n += len(batch)
                self.enqueued = n
        except BaseException as exc:  # reported at the end
            self.enqueue_error.append(exc)
        finally:
            if conn is not None:
                conn.close()
            self.enqueue_done.set()

    async def _counts(self) -> dict[str, int]:
        rows = await self._sql("SELECT state, count(*) FROM receipt_jobs GROUP BY state")
        return {str(s): int(n) for s, n in rows}

    async def _audit(self) -> list[AuditRow]:
        return [AuditRow(*row) for row in await self._sql(AUDIT_QUERY)]

    async def _monitor(self, stop: asyncio.Event) -> None:
        """Check the at-any-moment invariants and scrape metrics until *stop*."""
        while not stop.is_set():
            try:
                rows = await self._sql(
                    "SELECT count(*) FILTER (WHERE state = 'ready' AND attempts >= %s),"
                    " count(*) FILTER (WHERE state = 'running'"
                    "   AND (lease_token IS NULL OR lease_until IS NULL))"
                    " FROM receipt_jobs", (self.cfg.max_attempts,))
                bad_ready, bad_running = rows[0]
                if bad_ready or bad_running:
                    self.violations.append(
                        f"{time.strftime('%H:%M:%S')}: {bad_ready} ready with attempts >= max,"
                        f" {bad_running} running without token/deadline")
            except psycopg.Error:
                pass  # the database is being restarted
            await self._scrape_all()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def _settle_counters(self, timeout_seconds: float = 5.0) -> None:
        """Scrape until the workers' counters agree with the audit trail (or time is up).

        A worker bumps its counters just after its write commits, so the
        last acks of a drained queue may not be counted yet at the first
        scrape; the end check judges the final scrape either way.
        """
        deadline = time.monotonic() + timeout_seconds
        while True:
            await self._scrape_all()
            trail = read_trail(await self._audit())
            for w in self.workers:
                w.read_stale()
            if (not counter_mismatches(self.workers, trail, self._proxied_claims())
                    or time.monotonic() > deadline):
                return
            await asyncio.sleep(0.1)

    def _proxied_claims(self) -> ProxiedClaims:
        p = self.proxy
        return ProxiedClaims(
            answered=list(p.answered.values()),
            cut=[row for cut in p.cuts for row in cut.rows],
            lost=[row for cut in p.lost for row in cut.rows],
            unsure=[row for cut in p.unsure for row in cut.rows],
        )

    def _dump(self, audit: list[AuditRow]) -> None:
        """Write what the checks judged into the work directory (kept when a check fails):
        the audit trail, and the proxy's record of holds, stalls, cuts and claim answers."""
        p = self.proxy
        with (self.workdir / "audit.jsonl").open("w") as fh:
            for row in audit:
                fh.write(json.dumps(dataclasses.asdict(row)) + "\n")
        records: list[dict[str, Any]] = [
            *({"event": "hold", "start": a, "end": b} for a, b in p.holds),
            *({"event": "stall", "start": a, "end": b} for a, b in p.stalls),
            *({"event": "write_cut", "at": t} for t in p.write_cuts),
            *({"event": event, **dataclasses.asdict(c)}
              for event, cuts in (("claim_cut", p.cuts), ("claim_lost", p.lost),
                                  ("claim_unsure", p.unsure)) for c in cuts),
        ]
        records.sort(key=lambda r: r.get("at", r.get("start", 0.0)))
        records.append({"event": "answered",
                        "rows": [dataclasses.asdict(r) for r in p.answered.values()]})
        summary = {"event": "summary", "connections": p.connections, "claims": p.claims,
                   "claims_with_rows": p.claims_with_rows, "cancels": p.cancels,
                   "answered_jobs": len(p.answered)}
        with (self.workdir / "proxy.jsonl").open("w") as fh:
            for record in [summary, *records]:
                fh.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ run

    async def run(self) -> ChaosReport:
        """Start everything, inject the faults, drain, stop and check; never raises on a
        failed check (see :attr:`ChaosReport.ok`)."""
        c = self.cfg
        self.workdir = Path(c.workdir or tempfile.mkdtemp(prefix="receipts-chaos-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.sup = Supervisor(self.workdir, stop_timeout_seconds=20.0)
        self.report.workdir = self.workdir
        wall = time.monotonic()
        try:
            await self._run()
        finally:
            await self._teardown()
            self.report.wall_seconds = time.monotonic() - wall
        return self.report

    async def _run(self) -> None:
        c = self.cfg
        self._pg = EmbeddedPostgres(fast=True, settings={"max_connections": "300",
                                                          "track_activity_query_size": "4096"})
        await asyncio.to_thread(self.pg.start)
        self.dsn = await asyncio.to_thread(self.pg.create_database, "chaos")
        await asyncio.to_thread(apply_migrations, self.dsn)
        await self._sql(AUDIT_SQL)
        self.say(f"PostgreSQL 18 on :{self.pg.port}; logs in {self.workdir}")

        provider_port = free_port()
        self._provider = self.sup.start(
            "provider", ["provider", "--port", str(provider_port), "--seed", str(c.seed),
                         "--reject-rate", str(c.reject_rate), "--hang-seconds", "3"],
            port=provider_port, health_path="/stats")
        await asyncio.to_thread(self.provider.wait_healthy)
        await self.injector.set_provider(**PROVIDER_BASELINE)

        self._proxy = PgProxy(self.pg.port, free_port())
        await self.proxy.start()
        await self.start_worker(proxied=True)
        for _ in range(c.workers - 1):
            await self.start_worker()
        self.sup.start("recover", ["recover", "--loop", "0.5"],
                       self._worker_env(self.dsn, 0, "chaos-recover"))
        self.say(f"{c.workers} workers × {c.concurrency} slots (worker-0 through the proxy),"
                 f" recovery every 0.5s; enqueueing {c.jobs} jobs at {c.enqueue_rate:g}/s")

        started = time.monotonic()
        threading.Thread(target=self._enqueue_thread, daemon=True).start()
        stop_monitor = asyncio.Event()
        monitor = asyncio.create_task(self._monitor(stop_monitor))
        await self.injector.inject(c.jobs / c.enqueue_rate)
        await asyncio.to_thread(self.enqueue_done.wait)
        if self.enqueue_error:
            raise self.enqueue_error[0]
        self.say(f"all {c.jobs} jobs enqueued; draining")
        drain_start = time.monotonic()
        while time.monotonic() - drain_start < c.drain_timeout_seconds:
            with contextlib.suppress(psycopg.Error):
                counts = await self._counts()
                if counts.get("ready", 0) + counts.get("running", 0) == 0:
                    break
            await asyncio.sleep(0.25)
        self.report.drain_seconds = time.monotonic() - drain_start
        elapsed = time.monotonic() - started
        stop_monitor.set()
        await monitor
        await self._settle_counters()
        provider_stats = await asyncio.to_thread(self.provider.get_json, "/stats")
        receipts = await asyncio.to_thread(self.provider.get_json, "/receipts",
                                           timeout_seconds=60)
        requests = await asyncio.to_thread(self.provider.get_json, "/requests",
                                           timeout_seconds=60)
        exit_codes = await asyncio.to_thread(self.sup.stop_all, timeout_seconds=20)
        self.say(f"drained in {self.report.drain_seconds:.1f}s; checking")

        for w in self.workers:
            w.read_stale()
        rows = await self._sql("SELECT order_id, state FROM receipt_jobs")
        states = {str(o): str(s) for o, s in rows}
        audit = await self._audit()
        claims = self._proxied_claims()
        evidence = Evidence(
            expected={f"{self.order_prefix}{i:07d}" for i in range(c.jobs)},
            states=states, audit=audit,
            workers=list(self.workers),
            provider_stats=provider_stats, receipts=receipts, requests=requests,
            violations=self.violations + self.injector.crashes,
            cut_rows=list(claims.cut), cuts=len(self.proxy.cuts),
            answered_rows=list(claims.answered), lost_rows=list(claims.lost),
            unsure_rows=list(claims.unsure),
            faults=self.injector.faults, exit_codes=dict(exit_codes),
        )
        with contextlib.suppress(OSError):
            self._dump(audit)
        verdict = evaluate(evidence)
        r = self.report
        r.states = dict(Counter(states.values()))
        r.faults = self.injector.faults
        r.checks = verdict.findings
        r.figures = verdict.figures | {"throughput": c.jobs / elapsed if elapsed else 0.0}
        r.effects = dict(self.injector.effects) | verdict.effects

    async def _teardown(self) -> None:
        # Off the event loop: the proxied worker's last statements go through the
        # proxy, which runs in this loop.
        await asyncio.to_thread(self.sup.close)
        if self._proxy is not None:
            await self._proxy.close()
        if self._pg is not None:
            await asyncio.to_thread(self._pg.cleanup)
        if self.report.ok and not self.cfg.keep_logs and self.cfg.workdir is None:
            shutil.rmtree(self.workdir, ignore_errors=True)


async def run_chaos(config: ChaosConfig) -> ChaosReport:
    """Run one chaos run with *config*; see the module doc."""
    return await ChaosRun(config).run()


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.chaos.run``: run, print the table, exit 0 when every check passed."""
    p = argparse.ArgumentParser(prog="python -m tests.chaos.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rate", type=float, default=None,
                   help="jobs enqueued per second (default: 100, or 400 above 10,000 jobs)")
    p.add_argument("--cycle-seconds", type=float, default=20.0)
    p.add_argument("--workdir", type=Path, help="keep logs here")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    rate = a.rate or (400.0 if a.jobs > 10_000 else 100.0)
    cfg = ChaosConfig(jobs=a.jobs, seed=a.seed, workers=a.workers, concurrency=a.concurrency,
                      enqueue_rate=rate, cycle_seconds=a.cycle_seconds, workdir=a.workdir,
                      quiet=a.quiet, drain_timeout_seconds=max(180.0, a.jobs / 50))
    report = asyncio.run(run_chaos(cfg))
    print()
    print(report.table())
    if not report.ok:
        print(f"\nlogs kept in {report.workdir}", file=sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
