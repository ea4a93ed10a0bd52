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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from receipts.embedded import EmbeddedPostgres, free_port
from receipts.enqueue import enqueue
from receipts.migrate import apply_migrations
from tests.chaos.pgproxy import PgProxy

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

FAULT_KINDS = (
    "sigkill", "sigstop", "pg_restart", "terminate", "claim_cut", "db_stall",
    "latency_spike", "burst_5xx", "burst_429", "hang_after_headers", "reset", "hang",
)
PROVIDER_BASELINE: dict[str, Any] = {
    "latency_seconds": 0.005, "latency_jitter_seconds": 0.02, "error_rate": 0.0,
    "rate_limit_rate": 0.0, "retry_after_seconds": 1.0, "timeout_rate": 0.0,
    "reset_rate": 0.0, "hang_after_headers_rate": 0.0,
}


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


@dataclass(slots=True)
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    port: int | None = None
    app: str | None = None
    killed: bool = False
    stopped: bool = False
    proxied: bool = False
    last_metrics: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class ChaosReport:
    """What a run did and whether its checks passed."""

    config: ChaosConfig
    wall_seconds: float = 0.0
    drain_seconds: float = 0.0
    states: dict[str, int] = field(default_factory=dict)
    faults: Counter[str] = field(default_factory=Counter)
    effects: dict[str, int] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    workdir: Path | None = None

    @property
    def ok(self) -> bool:
        """True when every check passed."""
        return all(passed for _, passed, _ in self.checks)

    @property
    def failures(self) -> list[str]:
        """The failed checks as ``name: detail`` lines."""
        return [f"{name}: {detail}" for name, passed, detail in self.checks if not passed]

    def check(self, name: str, passed: bool, detail: str = "") -> None:
        """Record one named check."""
        self.checks.append((name, bool(passed), detail))

    def table(self) -> str:
        """The run's figures as a plain-text table."""
        f, e = self.figures, self.effects
        rows: list[tuple[str, str]] = [
            ("jobs enqueued", f"{self.config.jobs}"),
            ("done / failed", f"{self.states.get('done', 0)} / {self.states.get('failed', 0)}"),
            ("lost (not done or failed)", f"{int(f.get('lost', 0))}"),
            ("worker processes (incl. replacements)", f"{int(f.get('worker_processes', 0))}"),
        ]
        labels = {
            "sigkill": ("SIGKILL mid-delivery (+ replacement)", "jobs_abandoned"),
            "sigstop": ("SIGSTOP past the lease, then SIGCONT", "stale_from_sigstop"),
            "pg_restart": ("PostgreSQL restart (fast)", ""),
            "terminate": ("pg_terminate_backend bursts", ""),
            "claim_cut": ("claim committed, answer cut (proxy)", "cut_jobs"),
            "db_stall": ("DB link stalled past the lease (proxy)", "stale_from_stall"),
            "latency_spike": ("provider latency > delivery timeout", "timeouts"),
            # timeouts: every worker's retries{reason="timeout"} (hangs included)
            "burst_5xx": ("provider 503 bursts", "status_503"),
            "burst_429": ("provider 429 + Retry-After bursts", "status_429"),
            "hang_after_headers": ("provider hang after headers", "fault_hang_after_headers"),
            "reset": ("provider reset after recording", "fault_reset"),
            "hang": ("provider hang after recording", "fault_timeout"),
        }
        rows.append(("faults injected", "windows/events   effect"))
        for kind in FAULT_KINDS:
            label, effect = labels[kind]
            extra = f"{e.get(effect, 0)} {effect.replace('_', ' ')}" if effect else ""
            rows.append((f"  {label}", f"{self.faults.get(kind, 0):<16} {extra}".rstrip()))
        rows.append(("  backends terminated mid-claim / mid-ack",
                     f"{e.get('terminated_claim', 0)} / {e.get('terminated_ack', 0)}"))
        rows += [
            ("provider requests", f"{int(f.get('provider_requests', 0))}"),
            ("receipts recorded by the provider", f"{int(f.get('receipts', 0))}"),
            ("redeliveries (repeat requests for a key)", f"{int(f.get('redeliveries', 0))}"),
            ("duplicates suppressed by the provider",
             f"{int(f.get('duplicates_suppressed', 0))}"),
            ("stale acks/reschedules refused (logs, all workers)",
             f"{int(f.get('stale_refused_logged', 0))}"),
            ("  of which delivered, then ack refused", f"{int(f.get('stale_acks_logged', 0))}"),
            ("stale acks (metric, surviving workers)", f"{int(f.get('stale_metric', 0))}"),
            ("leases expired and recovered", f"{int(f.get('recovered', 0))}"),
            ("acks accepted from a non-current token", f"{int(f.get('foreign_acks', 0))}"),
            ("wall time", f"{self.wall_seconds:.1f} s (drain {self.drain_seconds:.1f} s)"),
            ("throughput", f"{f.get('throughput', 0):.0f} jobs/s"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
        lines.append("")
        lines += [f"[{'ok' if p else 'FAIL'}] {n}" + (f" — {d}" if d else "")
                  for n, p, d in self.checks]
        return "\n".join(lines)


# --------------------------------------------------------------------- helpers


def _http_json(url: str, *, method: str = "GET", body: Any = None, timeout: float = 10) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def scrape(port: int) -> dict[str, float]:
    """One worker's ``/metrics`` as {series: value} (``receipts_*`` series only)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("receipts_"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def metric_sum(values: dict[str, float], name: str) -> float:
    """Sum of every series of *name* (all label values)."""
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))


def read_events(path: Path, names: set[str]) -> list[dict[str, Any]]:
    """JSON log lines of *path* whose ``event`` is in *names*."""
    found = []
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
        self.rng = random.Random(config.seed)
        self.report = ChaosReport(config)
        self.procs: list[_Proc] = []
        self.workers: list[_Proc] = []
        self.pg: EmbeddedPostgres | None = None
        self.proxy: PgProxy | None = None
        self.dsn = ""
        self.provider_url = ""
        self.workdir = Path(".")
        self.enqueued = 0
        self.enqueue_done = threading.Event()
        self.enqueue_error: list[BaseException] = []
        self.violations: list[str] = []
        self.effects: Counter[str] = Counter()
        self.stopped_names: set[str] = set()
        self.provider_windows = 0  # provider fault windows open now
        self.stalling = False  # a db_stall is in progress (provider windows wait)
        self.provider_quiet_at = 0.0  # monotonic time the last window's requests are over
        self.order_prefix = f"chaos{config.seed}-"
        self._worker_seq = 0

    def say(self, text: str) -> None:
        if not self.cfg.quiet:
            print(f"  [{time.strftime('%H:%M:%S')}] {text}", flush=True)

    # ------------------------------------------------------------ processes

    def _spawn(self, name: str, args: list[str], env: dict[str, str],
               port: int | None = None) -> _Proc:
        log = self.workdir / f"{name}.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")}
        full_env |= env
        with log.open("wb") as fh:
            popen = subprocess.Popen([sys.executable, "-m", "receipts", *args], env=full_env,
                                     stdout=fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        proc = _Proc(name, popen, log, port)
        self.procs.append(proc)
        return proc

    def _worker_env(self, dsn: str, port: int, app: str) -> dict[str, str]:
        c = self.cfg
        return {
            "RECEIPTS_DATABASE_URL": dsn,
            "RECEIPTS_PROVIDER_URL": self.provider_url,
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
            "RECEIPTS_METRICS_PORT": str(port),
            "RECEIPTS_APPLICATION_NAME": app,
            "RECEIPTS_LOG_LEVEL": "INFO",
        }

    async def _start_worker(self, *, proxied: bool = False) -> _Proc:
        index = self._worker_seq
        self._worker_seq += 1
        port = free_port()
        app = f"chaos-w{index}"
        dsn = self.dsn
        if proxied:
            assert self.proxy is not None and self.pg is not None
            dsn = (f"postgresql://postgres@127.0.0.1:{self.proxy.port}/chaos"
                   "?sslmode=disable&gssencmode=disable")
        proc = self._spawn(f"worker-{index}", ["worker"], self._worker_env(dsn, port, app), port)
        proc.app, proc.proxied = f"{app}-worker", proxied
        self.workers.append(proc)
        await self._wait_http(f"http://127.0.0.1:{port}/healthz")
        return proc

    async def _wait_http(self, url: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await asyncio.to_thread(_http_json, url, timeout=1)
                return
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    def _live_workers(self) -> list[_Proc]:
        return [w for w in self.workers if not w.killed and w.popen.poll() is None]

    async def _scrape_all(self) -> None:
        for w in self._live_workers():
            if w.stopped or w.port is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                w.last_metrics = await asyncio.to_thread(scrape, w.port)

    async def _provider_faults(self, **changes: Any) -> None:
        await asyncio.to_thread(_http_json, f"{self.provider_url.rsplit('/', 1)[0]}/faults",
                                method="PUT", body=changes)

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

    # ---------------------------------------------------------------- faults

    def _schedule(self, duration: float) -> list[tuple[float, str]]:
        cycles = max(1, math.ceil(duration / self.cfg.cycle_seconds))
        span = duration / cycles
        events = []
        for c in range(cycles):
            lo = c * span + (1.0 if c == 0 else 0.0)
            for kind in FAULT_KINDS:
                # The stall needs jobs still flowing to the proxied worker: early in the cycle.
                hi = lo + 0.4 * span if kind == "db_stall" else (c + 1) * span - 0.5
                events.append((self.rng.uniform(lo, max(lo + 0.1, hi)), kind))
        return sorted(events)

    async def _faults(self, duration: float) -> None:
        started = time.monotonic()
        tasks = []
        for at, kind in self._schedule(duration):
            pause = started + at - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            tasks.append(asyncio.create_task(self._fault(kind), name=kind))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for task, result in zip(tasks, results, strict=True):
            if isinstance(result, BaseException):
                self.violations.append(f"fault {task.get_name()} crashed: {result!r}")

    async def _fault(self, kind: str) -> None:
        handler = getattr(self, f"_fault_{kind}", None)
        if handler is not None:
            await handler()
            return
        windows: dict[str, tuple[dict[str, Any], float]] = {
            "latency_spike": ({"latency_seconds": self.cfg.delivery_timeout_seconds + 0.5}, 1.5),
            "burst_5xx": ({"error_rate": 0.6}, 1.0),
            "burst_429": ({"rate_limit_rate": 0.5, "retry_after_seconds": 1.0}, 1.0),
            "hang_after_headers": ({"hang_after_headers_rate": 0.15}, 1.5),
            "reset": ({"reset_rate": 0.15}, 1.5),
            "hang": ({"timeout_rate": 0.15}, 1.5),
        }
        changes, seconds = windows[kind]
        self.report.faults[kind] += 1
        deadline = time.monotonic() + 15
        while self.stalling and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # keep the stall's deliveries successful
        self.say(f"provider: {kind} for {seconds:g}s")
        self.provider_windows += 1
        try:
            await self._provider_faults(**changes)
            await asyncio.sleep(seconds)
            await self._provider_faults(**{k: PROVIDER_BASELINE[k] for k in changes})
        finally:
            self.provider_windows -= 1
            self.provider_quiet_at = max(
                self.provider_quiet_at,
                time.monotonic() + self.cfg.delivery_timeout_seconds + 0.3)

    async def _victim(self, exclude_stopped: bool = True) -> _Proc | None:
        """A direct (unproxied) live worker with deliveries in flight, if one shows up."""
        deadline = time.monotonic() + 3.0
        candidates = [w for w in self._live_workers()
                      if not w.proxied and not (exclude_stopped and w.stopped)]
        if not candidates:
            return None
        self.rng.shuffle(candidates)
        while time.monotonic() < deadline:
            for w in candidates:
                assert w.port is not None
                with contextlib.suppress(OSError, ValueError):
                    m = await asyncio.to_thread(scrape, w.port)
                    if m.get("receipts_inflight_deliveries", 0) > 0:
                        w.last_metrics = m
                        return w
            await asyncio.sleep(0.02)
        return candidates[0]

    async def _fault_sigkill(self) -> None:
        victim = await self._victim()
        if victim is None:
            return
        inflight = int(victim.last_metrics.get("receipts_inflight_deliveries", 0))
        victim.popen.send_signal(signal.SIGKILL)
        victim.killed = True
        await asyncio.to_thread(victim.popen.wait)
        self.report.faults["sigkill"] += 1
        self.effects["jobs_abandoned"] += inflight
        replacement = await self._start_worker()
        self.say(f"SIGKILL {victim.name} ({inflight} in flight); replacement {replacement.name}")

    async def _fault_sigstop(self) -> None:
        victim = await self._victim()
        if victim is None:
            return
        hold = self.cfg.lease_seconds + 2.0
        victim.stopped = True
        self.stopped_names.add(victim.name)
        victim.popen.send_signal(signal.SIGSTOP)
        self.report.faults["sigstop"] += 1
        self.say(f"SIGSTOP {victim.name} for {hold:g}s (lease {self.cfg.lease_seconds:g}s)")
        await asyncio.sleep(hold)
        victim.popen.send_signal(signal.SIGCONT)
        victim.stopped = False
        self.say(f"SIGCONT {victim.name}")

    async def _fault_pg_restart(self) -> None:
        assert self.pg is not None
        self.report.faults["pg_restart"] += 1
        started = time.monotonic()
        await asyncio.to_thread(self.pg.restart, "fast")
        self.say(f"PostgreSQL restarted (fast) in {time.monotonic() - started:.1f}s")

    async def _fault_terminate(self) -> None:
        """Terminate worker backends caught mid-claim and mid-ack (≤ 2 each, ≤ 3 s)."""
        self.report.faults["terminate"] += 1
        wanted = {"claim": 2, "ack": 2}
        patterns = {"claim": "WITH candidate AS%", "ack": "UPDATE receipt_jobs AS j%"}
        deadline = time.monotonic() + 3.0
        try:
            async with await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, application_name="chaos-harness", connect_timeout=3
            ) as conn:
                while time.monotonic() < deadline and any(wanted.values()):
                    for what, pattern in patterns.items():
                        if not wanted[what]:
                            continue
                        cur = await conn.execute(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                            " WHERE state = 'active' AND application_name LIKE 'chaos-w%%'"
                            " AND query LIKE %s LIMIT 1", (pattern,))
                        if await cur.fetchone():
                            wanted[what] -= 1
                            self.effects[f"terminated_{what}"] += 1
                    await asyncio.sleep(0.002)
        except psycopg.Error:
            pass
        self.say(f"terminated backends: {self.effects['terminated_claim']} mid-claim,"
                 f" {self.effects['terminated_ack']} mid-ack so far")

    async def _fault_claim_cut(self) -> None:
        assert self.proxy is not None
        self.report.faults["claim_cut"] += 1
        before = len(self.proxy.cuts)
        self.proxy.arm_cut(1)
        deadline = time.monotonic() + 5
        while len(self.proxy.cuts) == before and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if len(self.proxy.cuts) > before:
            rows = self.proxy.cuts[-1].rows
            self.say(f"proxy cut a committed claim of {len(rows)} job(s)")

    async def _fault_db_stall(self) -> None:
        """Stall the proxied worker's link right after a claim, while the provider is sane."""
        assert self.proxy is not None
        hold = self.cfg.lease_seconds + 1.5
        deadline = time.monotonic() + 10
        while ((self.provider_windows or time.monotonic() < self.provider_quiet_at)
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)  # deliveries must succeed, so that acks are late
        self.stalling = True
        try:
            self.proxy.arm_stall(hold)
            while self.proxy.stall_armed and time.monotonic() < deadline + 5:
                await asyncio.sleep(0.02)
            if self.proxy.stall_armed:  # no claim with rows came: nothing injected
                self.proxy.arm_stall(0.0)
                self.say("proxy stall not triggered (no claim with rows)")
                return
            self.report.faults["db_stall"] += 1
            self.say(f"proxy stalls the proxied worker's database link for {hold:g}s"
                     " right after a claim")
            await asyncio.sleep(hold)
        finally:
            self.stalling = False

    # ------------------------------------------------------------------ run

    async def run(self) -> ChaosReport:
        c = self.cfg
        self.workdir = Path(c.workdir or tempfile.mkdtemp(prefix="receipts-chaos-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
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
        self.pg = EmbeddedPostgres(fast=True, settings={"max_connections": "300"})
        await asyncio.to_thread(self.pg.start)
        self.dsn = await asyncio.to_thread(self.pg.create_database, "chaos")
        await asyncio.to_thread(apply_migrations, self.dsn)
        await self._sql(AUDIT_SQL)
        self.say(f"PostgreSQL 18 on :{self.pg.port}; logs in {self.workdir}")

        provider_port = free_port()
        self.provider_url = f"http://127.0.0.1:{provider_port}/receipts"
        self._spawn("provider", ["provider", "--port", str(provider_port), "--seed", str(c.seed),
                                 "--reject-rate", str(c.reject_rate), "--hang-seconds", "3"], {})
        await self._wait_http(f"http://127.0.0.1:{provider_port}/stats")
        await self._provider_faults(**PROVIDER_BASELINE)

        self.proxy = PgProxy(self.pg.port, free_port())
        await self.proxy.start()
        await self._start_worker(proxied=True)
        for _ in range(c.workers - 1):
            await self._start_worker()
        self._spawn("recover", ["recover", "--loop", "0.5"],
                    self._worker_env(self.dsn, 0, "chaos-recover"))
        self.say(f"{c.workers} workers × {c.concurrency} slots (worker-0 through the proxy),"
                 f" recovery every 0.5s; enqueueing {c.jobs} jobs at {c.enqueue_rate:g}/s")

        started = time.monotonic()
        threading.Thread(target=self._enqueue_thread, daemon=True).start()
        stop_monitor = asyncio.Event()
        monitor = asyncio.create_task(self._monitor(stop_monitor))
        await self._faults(c.jobs / c.enqueue_rate)
        while not self.enqueue_done.is_set():
            await asyncio.sleep(0.1)
        if self.enqueue_error:
            raise self.enqueue_error[0]
        self.say(f"all {c.jobs} jobs enqueued; draining")
        drain_start = time.monotonic()
        counts: dict[str, int] = {}
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
        await asyncio.sleep(0.3)  # let the last acks' counters land
        await self._scrape_all()
        base = self.provider_url.rsplit("/", 1)[0]
        provider_stats = await asyncio.to_thread(_http_json, f"{base}/stats")
        receipts = await asyncio.to_thread(_http_json, f"{base}/receipts", timeout=60)
        requests = await asyncio.to_thread(_http_json, f"{base}/requests", timeout=60)
        exit_codes = await self._stop_processes()
        self.say(f"drained in {self.report.drain_seconds:.1f}s; checking")
        await self._checks(elapsed, provider_stats, receipts, requests, exit_codes)

    async def _stop_processes(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for p in self.procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.popen.send_signal(signal.SIGCONT)
                    p.popen.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                codes[p.name] = await asyncio.to_thread(p.popen.wait, 20)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                codes[p.name] = None
        return codes

    async def _teardown(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.popen.kill()
                    p.popen.wait(5)
        if self.proxy is not None:
            await self.proxy.close()
        if self.pg is not None:
            await asyncio.to_thread(self.pg.cleanup)
        if self.report.ok and not self.cfg.keep_logs and self.cfg.workdir is None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ---------------------------------------------------------------- checks

    async def _checks(self, elapsed: float, provider_stats: dict[str, Any],
                      receipts: dict[str, Any], requests: list[list[str]],
                      exit_codes: dict[str, int | None]) -> None:
        r, c = self.report, self.cfg
        rows = await self._sql("SELECT order_id, state, attempts FROM receipt_jobs")
        state_of = {str(o): str(s) for o, s, _ in rows}
        r.states = dict(Counter(state_of.values()))
        expected = {f"{self.order_prefix}{i:07d}" for i in range(c.jobs)}
        missing = expected - set(state_of)
        unfinished = [o for o, s in state_of.items() if s not in ("done", "failed")]
        r.figures["lost"] = len(missing) + len(unfinished)
        r.check("no job lost or stuck: every job is done or failed",
                not missing and not unfinished,
                f"{len(missing)} missing, {len(unfinished)} not finished")
        r.check("invariants held at every sample (no ready job with attempts >= max, "
                "no running job without token and deadline)", not self.violations,
                "; ".join(self.violations[:5]))

        # --- the provider's view
        done = {o for o, s in state_of.items() if s == "done"}
        keys = {f"receipt:{o}" for o in done}
        requested: dict[str, list[str]] = defaultdict(list)
        for key, attempt in requests:
            requested[key].append(attempt)
        no_receipt = [k for k in keys if k not in receipts]
        never_requested = [k for k in keys if k not in requested]
        r.check("every done job was delivered with key receipt:<order_id>",
                not no_receipt and not never_requested,
                f"{len(no_receipt)} done without a receipt, {len(never_requested)} never requested")
        orders = [v["order_id"] for v in receipts.values()]
        strangers = [k for k in receipts if k.removeprefix("receipt:") not in expected]
        r.check("the provider's deduplicated view holds exactly one receipt per delivered order",
                len(orders) == len(set(orders)) == len(receipts) == provider_stats["receipts"]
                and all(receipts[k]["order_id"] == k.removeprefix("receipt:") for k in receipts)
                and not strangers,
                f"{len(receipts)} receipts, {len(set(orders))} orders, {len(strangers)} unknown")
        failed_with_receipt = [k for k in receipts if state_of.get(k[8:]) == "failed"]
        r.figures.update(
            provider_requests=provider_stats["requests"], receipts=len(receipts),
            duplicates_suppressed=provider_stats["duplicates_suppressed"],
            redeliveries=sum(len(v) - 1 for v in requested.values()),
            failed_with_receipt=len(failed_with_receipt),
        )
        for stat in ("status_503", "status_429", "fault_hang_after_headers", "fault_reset",
                     "fault_timeout"):
            self.effects[stat] = int(provider_stats.get(stat, 0))

        # --- the audit trail
        audit = await self._sql(
            "SELECT seq, job_id::text, order_id, old_state, new_state, old_token::text,"
            " new_token::text, old_lease_until > stmt_at, attempts, app, last_error"
            " FROM chaos_audit ORDER BY seq")
        claim_app: dict[str, str] = {}
        claim_attempt: dict[str, int] = {}
        done_by: Counter[str] = Counter()
        claimed_by: Counter[str] = Counter()
        retried_by: Counter[str] = Counter()
        failed_by: Counter[str] = Counter()
        completed_tokens: set[str] = set()
        recovered_tokens: set[str] = set()
        foreign, expired_acks = [], []
        for (_, _job, _order, old, new, old_tok, new_tok, lease_ok, attempts, app,
             _err) in audit:
            if old != "running" and new == "running":
                claim_app[new_tok] = app
                claim_attempt[new_tok] = attempts
                claimed_by[app] += 1
                continue
            if old == "running":
                if app.endswith("-recover"):
                    recovered_tokens.add(old_tok)
                    continue
                if claim_app.get(old_tok) != app:
                    foreign.append((old_tok, claim_app.get(old_tok), app))
                if not lease_ok:
                    expired_acks.append(old_tok)
                if new == "done":
                    completed_tokens.add(old_tok)
                    done_by[app] += 1
                elif new == "ready":
                    retried_by[app] += 1
                elif new == "failed":
                    failed_by[app] += 1
        r.figures["foreign_acks"] = len(foreign)
        r.figures["recovered"] = len(recovered_tokens)
        r.check("every ack or reschedule the database accepted came from the attempt that "
                "held the current token, under an unexpired lease",
                not foreign and not expired_acks,
                f"{len(foreign)} from another process, {len(expired_acks)} after expiry")

        # --- cut claims: committed, never confirmed, never delivered by that attempt
        assert self.proxy is not None
        cut_rows = [row for cut in self.proxy.cuts for row in cut.rows]
        self.effects["cut_jobs"] = len(cut_rows)
        delivered_cut = [row for row in cut_rows
                         if str(row.attempt) in requested.get(f"receipt:{row.order_id}", [])]
        unrecovered_cut = [row for row in cut_rows if row.token not in recovered_tokens]
        r.check("no attempt whose claim answer was cut reached the provider; recovery took "
                "each one back",
                bool(cut_rows) and not delivered_cut and not unrecovered_cut,
                f"{len(cut_rows)} cut job(s) in {len(self.proxy.cuts)} cut(s), "
                f"{len(delivered_cut)} delivered by the cut attempt, "
                f"{len(unrecovered_cut)} not recovered")

        # --- stale attempts, from every worker's log (killed ones included)
        stale: list[dict[str, Any]] = []
        for w in self.workers:
            for rec in read_events(w.log, {"stale_ack", "stale_reschedule"}):
                rec["_worker"] = w.name
                stale.append(rec)
        completed_prefixes = {t.replace("-", "")[:8] for t in completed_tokens}
        completed_stale = [s for s in stale if s.get("token") in completed_prefixes]
        stale_acks = [s for s in stale if s["event"] == "stale_ack"]
        # A refused ack's attempt reached the provider (it was delivered), and the job
        # was finished by another attempt.
        acked_elsewhere = [s for s in stale_acks
                           if state_of.get(s["order_id"]) in ("done", "failed")]
        r.figures["stale_refused_logged"] = len(stale)
        r.figures["stale_acks_logged"] = len(stale_acks)
        self.effects["stale_from_sigstop"] = sum(1 for s in stale
                                                 if s["_worker"] in self.stopped_names)
        self.effects["stale_from_stall"] = sum(
            1 for s in stale if s["_worker"] == self.workers[0].name)
        delivered_stale = [s for s in stale_acks
                           if str(s.get("attempt")) in requested.get(
                               f"receipt:{s['order_id']}", [])]
        r.check("stale acks are refused: late acks of delivered receipts and late reschedules "
                "were issued, none completed its job, each of those receipts reached the "
                "provider, and each job was finished by a newer attempt",
                bool(stale_acks) and not completed_stale
                and len(acked_elsewhere) == len(delivered_stale) == len(stale_acks),
                f"{len(stale)} refused ({len(stale_acks)} acks of delivered receipts, "
                f"{len(delivered_stale)} of them seen by the provider), "
                f"{len(completed_stale)} completed anyway")

        # --- counters of the surviving workers against the audit trail
        survivors = [w for w in self.workers if not w.killed]
        mismatches = []
        stale_metric = 0.0
        for w in survivors:
            m, app = w.last_metrics, w.app or ""
            stale_metric += m.get("receipts_stale_acks_total", 0)
            logged = sum(1 for s in stale if s["_worker"] == w.name)
            pairs = {
                "acks_total": (m.get("receipts_acks_total", 0), done_by[app]),
                "failures_total": (metric_sum(m, "receipts_failures_total"), failed_by[app]),
                "retries_total": (metric_sum(m, "receipts_retries_total"), retried_by[app]),
                "jobs_claimed_total": (
                    m.get("receipts_jobs_claimed_total", 0)
                    + (len(cut_rows) if w.proxied else 0), claimed_by[app]),
                "stale_acks_total": (m.get("receipts_stale_acks_total", 0), logged),
            }
            for name, (metric, truth) in pairs.items():
                if int(metric) != truth:
                    mismatches.append(f"{w.name} {name}={int(metric)} vs {truth}")
        r.figures["stale_metric"] = stale_metric
        self.effects["timeouts"] = int(sum(
            w.last_metrics.get('receipts_retries_total{reason="timeout"}', 0)
            for w in self.workers))
        r.check("counters of surviving workers equal the database's audit trail "
                "(acks, retries, failures, claims) and their own logs (stale acks)",
                not mismatches and bool(survivors), "; ".join(mismatches[:8]))
        killed = {w.name for w in self.workers if w.killed}
        bad_exits = {n: code for n, code in exit_codes.items() if code != 0 and n not in killed}
        r.check("every surviving process exited 0 on SIGTERM", not bad_exits, str(bad_exits))
        r.check("every fault kind was injected",
                all(r.faults.get(k, 0) > 0 for k in FAULT_KINDS),
                ", ".join(k for k in FAULT_KINDS if not r.faults.get(k)))
        r.figures["worker_processes"] = len(self.workers)
        r.figures["throughput"] = c.jobs / elapsed if elapsed else 0.0
        r.effects = dict(self.effects)


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
