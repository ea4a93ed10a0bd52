"""The soak: hours of steady churn against one PostgreSQL, sampled, plotted and judged.

``python -m bench.soak --hours H`` (also ``bench/run.sh --only soak --hours H``
and ``make soak SOAK_ARGS="--hours H"``); ``--smoke`` is the 1-minute version
the test suite runs. One durable embedded PostgreSQL 18 with the server's
defaults (checkpoints every 5 min, autovacuum at its defaults; the tables carry
the shipped migrations' own settings), and for the whole run:

* **orders**: a Poisson stream at ``--rate`` per second, each one checkout
  transaction (insert the order, ``receipts.enqueue.enqueue`` its receipt,
  commit) through the public API; its latency is the checkout figure;
* **workers**: ``--workers`` worker processes (``run_worker``: the default
  settings, and a fleet-wide rate limit of 10 × the order rate, which never
  binds; each pod charges its own bucket at its announced share, and a pod
  without one would charge ``receipt_flow``'s row, so the row's versions
  show which; ``--rate-limit 0`` for none) delivering over HTTP to the reference
  provider (``--provider-latency-ms`` × U(0.5, 1.5)), which answers a few
  percent 503 (``--error-rate``) and drops a few connections after recording
  (``--reset-rate``): retries, attempt history, unknown outcomes;
* **recovery**: ``receipts recover`` once a minute, as the chart's CronJob runs
  it, with retention shortened to ``--retention-seconds`` (30 days ship; 30 min
  here, so that a 2-hour run prunes as much as it enqueues for its last
  90 minutes);
* **a reporting query** holding a REPEATABLE READ snapshot for 10 minutes once
  an hour, the first at 40 minutes (once retention prunes as fast as orders
  arrive, so every hold meets the same churn).

``--hold-first-seconds`` and ``--hold-seconds`` shorten the holds for a
short run (e.g. 5 minutes with a 2-minute hold from the second minute).

**The baseline** (``--baseline-seconds``, 5 minutes; 0: none) comes first, on
the same server and database, at the same rate, before the workers are
released and before recovery or any hold starts: the same checkout
transaction on the same kind of connection, minus the enqueue (BEGIN, the
order's insert, COMMIT). It runs first rather than after the drain so that
nothing of the queue is left to bill to it (the drain's autovacuum debt,
idle workers' probes, retention's deletes); its ``bench_orders`` is the
smaller, so its insert is if anything the cheaper and the ratio errs high.
The database's whole CPU per order (``/proc``, every PostgreSQL process) of
the queue phase (release of the workers → end of the drain, per order
enqueued) over the baseline's is judged against :data:`CPU_VS_BASELINE_LIMIT`.

**The CPU breakdown** (:mod:`bench.dbcpu`, ``/proc`` read every 0.1 s) splits
each phase's database CPU per order by process: the checkout's backend, each
worker's pool backends (``worker N``) and its LISTEN session, where the
fleet's elected waker runs (``worker N listen/waker``), ``receipts recover``'s
backends, the reporting query's, the soak's own sampling, autovacuum
workers, the checkpointer, the WAL writer, the background writer and the
other background processes; next to the ``pg_stat_statements`` execution
time of the same classes' statements, so the gap (parse, plan, protocol,
commit, waiting for a core) shows.

Every ``--sample-seconds`` (10 s) it records claim p50/p99 (every claim of
every worker, timed in the worker process), checkout p50/p99, table and index
sizes, dead tuples, ``receipt_flow``'s row versions (``pageinspect``), the
oldest snapshot's xmin age, WAL and database CPU rates, and the queue's depth.
At the end it stops the orders, waits until nothing is ready or running, and
checks that every order was delivered (the provider's distinct receipts plus
the jobs that failed for good equal the orders), then judges
(:func:`verdict`), plots (matplotlib, the ``bench`` extra) and writes
``soak.json``, ``claims.json`` (every claim's time and latency) and three PNGs
into ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from bench import dbcpu
from bench.bill import kind_of
from bench.pg import Bench
from bench.procs import ROOT, Children, Provider
from bench.scenarios import percentile, receipts_argv
from receipts.embedded import free_port
from receipts.enqueue import enqueue
from receipts.migrate import apply_migrations

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "soak"
#: The soak's server: the defaults (checkpoint_timeout 5 min, max_wal_size 1 GB,
#: autovacuum on), plus pg_stat_statements for the statement totals.
SERVER_SETTINGS = {"shared_preload_libraries": "'pg_stat_statements'",
                   # Planning time per statement too (``plan_ms``, ``plans``): a
                   # statement planned afresh on every call pays it outside its exec time.
                   "pg_stat_statements.track_planning": "on"}
TABLES = ("receipt_jobs", "receipt_attempts", "receipt_flow")
#: The target: the queue phase's database CPU per order ≤ this × the baseline's.
CPU_VS_BASELINE_LIMIT = 3.0
#: Classes of the CPU breakdown that are the soak's clients (see :func:`client_class`).
CHECKOUT, RECOVERY, REPORT, SAMPLING = ("checkout", "recovery", "reporting query",
                                        "soak sampling")


@dataclass
class SoakPlan:
    """One soak's shape (seconds, per second, shares)."""

    hours: float = 2.0
    rate: float = 50.0
    workers: int = 2
    slots: int = 32
    provider_latency_ms: float = 50.0
    error_rate: float = 0.03
    reset_rate: float = 0.005
    retention_seconds: float = 1800.0
    recover_every_seconds: float = 60.0
    #: The first held snapshot once retention prunes as much as is enqueued (after
    #: retention_seconds), so that every hold meets the same churn and the hours'
    #: peaks compare like with like.
    hold_first_seconds: float = 2400.0
    hold_every_seconds: float = 3600.0
    hold_seconds: float = 600.0
    sample_seconds: float = 10.0
    #: Samples this long after a held snapshot ends are still the hold's (vacuum
    #: catches up): the latency comparison leaves them out.
    hold_recovery_seconds: float = 120.0
    retry_base_seconds: float | None = None  # None: the worker's default (10 s)
    #: The fleet-wide provider rate limit, jobs/s (None: 10 × the order rate, which
    #: never binds; 0: none).
    rate_limit: float | None = None
    drain_timeout_seconds: float = 900.0
    #: The checkout stream without the queue, before the workers start (0: none).
    baseline_seconds: float = 300.0
    seed: int = 1

    @property
    def seconds(self) -> float:
        """The orders' duration, seconds."""
        return self.hours * 3600.0

    @classmethod
    def smoke(cls) -> SoakPlan:
        """One minute at 30 orders/s, every phase shrunk (the test suite's run): a
        10 s baseline, a hold of 10 s at 20 s and 40 s, retention 15 s, recovery every
        5 s, samples every 2 s, retries from 1 s."""
        return cls(hours=1 / 60, rate=30.0, retention_seconds=15.0, recover_every_seconds=5.0,
                   hold_first_seconds=20.0, hold_every_seconds=20.0, hold_seconds=10.0,
                   sample_seconds=2.0, hold_recovery_seconds=3.0, retry_base_seconds=1.0,
                   drain_timeout_seconds=240.0, baseline_seconds=10.0)

    def holds(self) -> list[tuple[float, float]]:
        """(start, end) of each held snapshot, seconds from the start."""
        out = []
        t = self.hold_first_seconds
        while t + self.hold_seconds <= self.seconds:
            out.append((t, t + self.hold_seconds))
            t += self.hold_every_seconds
        return out


# ----------------------------------------------------------------- load parts


@dataclass
class Orders:
    """The Poisson stream of checkout transactions (a thread).

    *enqueue* False: the baseline's checkout, the same transaction without the
    receipt's job (BEGIN, the order's insert, COMMIT); *prefix*: the order ids'.
    """

    dsn: str
    rate: float
    seconds: float
    seed: int
    stop: threading.Event
    enqueue: bool = True
    prefix: str = "soak"
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (unix time, ms)
    enqueued: int = 0
    errors: int = 0
    max_behind_seconds: float = 0.0

    def run(self) -> None:
        rng = random.Random(self.seed)
        with psycopg.connect(self.dsn, application_name="bench-checkout") as conn:
            t0 = time.monotonic()
            at = 0.0
            while not self.stop.is_set():
                at += rng.expovariate(self.rate)
                if at >= self.seconds:
                    return
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    self.stop.wait(delay)
                else:
                    self.max_behind_seconds = max(self.max_behind_seconds, -delay)
                order = f"{self.prefix}-{self.enqueued}"
                start = time.perf_counter()
                try:
                    with conn.transaction():
                        conn.execute("INSERT INTO bench_orders (id, total_cents) VALUES (%s, %s)",
                                     (order, 1999))
                        if self.enqueue:
                            enqueue(conn, order)
                except psycopg.Error:
                    self.errors += 1
                    continue
                self.latencies.append((time.time(), (time.perf_counter() - start) * 1000))
                self.enqueued += 1


@dataclass
class Recovery:
    """``receipts recover --json`` every *every* seconds (the chart's CronJob), a thread."""

    dsn: str
    retention_seconds: float
    every: float
    stop: threading.Event
    sweeps: list[dict[str, Any]] = field(default_factory=list)
    failures: int = 0

    def run(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RECEIPTS_DATABASE_URL": self.dsn,
               "RECEIPTS_APPLICATION_NAME": RECOVERY_APP,
               "RECEIPTS_RETENTION_DAYS": repr(self.retention_seconds / 86_400.0),
               "RECEIPTS_LOG_LEVEL": "WARNING"}
        while not self.stop.wait(self.every):
            result = subprocess.run([sys.executable, "-m", "receipts", "recover", "--json"],
                                    capture_output=True, text=True, env=env, timeout=300)
            if result.returncode != 0:
                self.failures += 1
                continue
            lines = result.stdout.strip().splitlines()
            if lines:
                self.sweeps.append({"at": time.time(), **json.loads(lines[-1])})


@dataclass
class Holds:
    """The reporting query: a REPEATABLE READ snapshot held for each (start, end)."""

    dsn: str
    windows: list[tuple[float, float]]
    t0: float  # time.monotonic() of the start
    stop: threading.Event
    held: list[tuple[float, float]] = field(default_factory=list)  # unix times

    def run(self) -> None:
        for start, end in self.windows:
            if self.stop.wait(max(0.0, self.t0 + start - time.monotonic())):
                return
            with psycopg.connect(self.dsn, application_name="bench-report") as conn:
                conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                conn.execute("SELECT /* soak report */ count(*), max(created_at)"
                             " FROM receipt_jobs")
                began = time.time()
                self.stop.wait(max(0.0, self.t0 + end - time.monotonic()))
                conn.execute("COMMIT")
                self.held.append((began, time.time()))


class ClaimLogs:
    """Reads the workers' claim logs (``bench.child --claim-log``) as they grow."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = list(paths)
        self._offsets = [0] * len(self.paths)
        #: Every claim so far: (unix time, ms, jobs, acks it carried; 0 for a log
        #: without that column).
        self.claims: list[tuple[float, float, int, int]] = []

    def read(self) -> list[tuple[float, float, int, int]]:
        """The claims logged since the last call (also kept in :attr:`claims`)."""
        new: list[tuple[float, float, int, int]] = []
        for i, path in enumerate(self.paths):
            try:
                with open(path) as fh:
                    fh.seek(self._offsets[i])
                    data = fh.read()
            except OSError:
                continue
            complete, _, _ = data.rpartition("\n")
            if not complete:
                continue
            self._offsets[i] += len(complete) + 1
            for line in complete.splitlines():
                t, ms, n, *acks = line.split()
                new.append((float(t), float(ms), int(n), int(acks[0]) if acks else 0))
        self.claims += new
        return new


# ------------------------------------------------------------------- samples


def _one(conn: psycopg.Connection[Any], sql: str) -> tuple[Any, ...]:
    row = conn.execute(sql).fetchone()
    return tuple(row) if row else ()


def sample_database(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """One reading of the database: sizes, dead tuples, flow row versions, xmin, WAL, queue."""
    out: dict[str, Any] = {}
    for name, heap, idx, live, dead, vacuums in conn.execute(
            "SELECT /* bench */ c.relname, pg_relation_size(c.oid), pg_indexes_size(c.oid),"
            " s.n_live_tup, s.n_dead_tup, s.autovacuum_count FROM pg_class AS c"
            " JOIN pg_stat_user_tables AS s ON s.relid = c.oid WHERE c.relname = ANY(%s)",
            (list(TABLES),)).fetchall():
        out[f"{name}_heap_bytes"] = int(heap)
        out[f"{name}_index_bytes"] = int(idx)
        out[f"{name}_live"] = int(live)
        out[f"{name}_dead"] = int(dead)
        out[f"{name}_autovacuums"] = int(vacuums)
    for name, size in conn.execute(
            "SELECT /* bench */ indexrelid::regclass::text, pg_relation_size(indexrelid)"
            " FROM pg_index WHERE indrelid = 'receipt_jobs'::regclass").fetchall():
        out[f"index:{name}"] = int(size)
    versions, dead_versions = _one(conn, (
        "SELECT /* bench */ count(*) FILTER (WHERE lp_flags = 1),"
        " count(*) FILTER (WHERE lp_flags = 1 AND t_xmax <> '0'::xid)"
        " FROM generate_series(0, (pg_relation_size('receipt_flow') / 8192)::int - 1) AS b,"
        " heap_page_items(get_raw_page('receipt_flow', b))"))
    out["flow_row_versions"] = int(versions)
    out["flow_row_versions_updated"] = int(dead_versions)
    xmin_age, xact_age = _one(conn, (
        "SELECT /* bench */ coalesce(max(age(backend_xmin)), 0),"
        " coalesce(max(extract(epoch FROM now() - xact_start)), 0)::float8"
        " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"))
    out["xmin_age"] = int(xmin_age)
    out["oldest_xact_seconds"] = float(xact_age)
    out["wal_lsn"] = int(_one(conn, "SELECT /* bench */ pg_current_wal_lsn() - '0/0'")[0])
    due, ready, lag = _one(conn, (
        "SELECT /* bench */ count(*) FILTER (WHERE run_at <= now()), count(*),"
        " coalesce(extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at <= now())), 0)"
        "::float8 FROM receipt_jobs WHERE state = 'ready'"))
    running, expired = _one(conn, (
        "SELECT /* bench */ count(*), count(*) FILTER (WHERE lease_until <= now())"
        " FROM receipt_jobs WHERE state = 'running'"))
    failed = _one(conn, "SELECT /* bench */ count(*) FROM receipt_jobs WHERE state = 'failed'")[0]
    out.update(ready_due=int(due), ready=int(ready), lag_seconds=float(lag),
               running=int(running), expired=int(expired), failed=int(failed))
    return out


#: The ``application_name`` prefix of worker *i*'s sessions (``soak-w0-worker``, ``-listen``…).
WORKER_APP = "soak-w{}"
#: ``receipts recover``'s (``soak-recovery-recover``).
RECOVERY_APP = "soak-recovery"


def client_class(app: str) -> str:
    """The CPU breakdown's class of a client backend, from its ``application_name``.

    ``soak-wN-listen`` → ``worker N listen/waker`` (the LISTEN session, where
    the elected waker probes and sweeps); ``soak-wN-…`` (the pool, the start-up
    check) → ``worker N``; ``soak-recovery…`` → :data:`RECOVERY`;
    ``bench-checkout`` → :data:`CHECKOUT`; ``bench-report`` → :data:`REPORT`;
    any other ``bench-…`` (the sampler, the breakdown's own lookups) →
    :data:`SAMPLING`; anything else ``other client``.
    """
    if app.startswith("soak-w"):
        worker, _, role = app[len("soak-w"):].partition("-")
        return f"worker {worker} listen/waker" if role == "listen" else f"worker {worker}"
    if app.startswith(RECOVERY_APP):
        return RECOVERY
    if app == "bench-checkout":
        return CHECKOUT
    if app == "bench-report":
        return REPORT
    if app.startswith("bench-"):
        return SAMPLING
    return "other client"


def statement_class(query: str) -> str:
    """Which client class a ``pg_stat_statements`` entry belongs to (:func:`client_class`'s
    names; ``workers`` for all workers together).

    The soak's own statements carry ``/* bench */``, the reporting query's
    ``/* soak report */``; the order's insert, the enqueue and BEGIN/COMMIT are
    the checkout's; recovery's are found by :func:`bench.bill.kind_of`; every
    other statement is the workers'.
    """
    if "/* soak report */" in query:
        return REPORT
    kind = kind_of(query)
    if kind == "bench":
        return SAMPLING
    if "bench_orders" in query or kind in ("enqueue", "transaction"):
        return CHECKOUT
    if kind == "recovery":
        return RECOVERY
    return "workers"


_LITERALS = re.compile(r"%\(\w+\)s|\$\d+|'[^']*'|\b\d+\b")


def _shape(text: str) -> str:
    return " ".join(_LITERALS.sub("?", text).split())


@functools.cache
def _known_statements() -> tuple[tuple[str, str], ...]:
    from receipts.statements import statements

    return tuple((name, _shape(text)) for name, text in statements().items())


def statement_name(query: str) -> str:
    """The receipts statement (:func:`receipts.statements.statements`' name) a
    ``pg_stat_statements`` text (maybe cut short) is, else :func:`bench.bill.kind_of`'s
    kind; constants and parameters are ignored."""
    shape = _shape(query)
    if len(shape) >= 20:
        for name, known in _known_statements():
            if known.startswith(shape) or shape.startswith(known):
                return name
    return kind_of(query)


def group_of(cpu_class: str) -> str:
    """A breakdown class's statement class (``worker N…`` → ``workers``)."""
    return "workers" if cpu_class.startswith("worker ") else cpu_class


def statement_totals(conn: psycopg.Connection[Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Every ``pg_stat_statements`` entry of the database so far, by (userid, queryid, toplevel)."""
    rows = conn.execute(
        "SELECT /* bench */ userid, queryid, toplevel, calls, total_exec_time, rows, wal_bytes,"
        " plans, total_plan_time, left(query, 200), right(query, 80) FROM pg_stat_statements"
        " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchall()
    # The tail tells a claim that carries acks (it begins as the ack does) from an ack.
    return {(u, q, t): {"calls": int(c), "exec_ms": float(e), "rows": int(r), "wal_bytes": int(w),
                        "plans": int(pl), "plan_ms": float(pt), "query": str(text),
                        "tail": str(tail)}
            for u, q, t, c, e, r, w, pl, pt, text, tail in rows}


def statements_between(before: dict[tuple[Any, ...], dict[str, Any]],
                       after: dict[tuple[Any, ...], dict[str, Any]]) -> list[dict[str, Any]]:
    """Each statement's calls, exec ms, rows, WAL bytes, plans and plan ms between two
    :func:`statement_totals`, most exec time first (statements not called left out)."""
    out = []
    for key, a in after.items():
        b = before.get(key, {})
        row = {k: a.get(k, 0) - b.get(k, 0)
               for k in ("calls", "exec_ms", "rows", "wal_bytes", "plans", "plan_ms")}
        if row["calls"] > 0:
            out.append({**row, "exec_ms": round(row["exec_ms"], 3),
                        "plan_ms": round(row["plan_ms"], 3), "query": a["query"],
                        "tail": a.get("tail", "")})
    return sorted(out, key=lambda r: -r["exec_ms"])


def phase_cost(cpu: dict[str, float], whole_seconds: float, statements: Sequence[dict[str, Any]],
               orders: int, wal_bytes: int) -> dict[str, Any]:
    """One phase's database bill per order: the whole server's CPU (µs), the
    breakdown by class (µs, :mod:`bench.dbcpu`), WAL (bytes), and per
    statement class its ``pg_stat_statements`` exec time beside its backends' CPU
    (µs per order; ``gap_us`` = CPU − exec: parse, plan, protocol, commit…)."""
    n = max(orders, 1)
    by_group: dict[str, dict[str, float]] = {}
    for cls, seconds in cpu.items():
        g = by_group.setdefault(group_of(cls), {"cpu_us": 0.0, "exec_us": 0.0, "calls": 0.0})
        g["cpu_us"] += seconds / n * 1e6
    for st in statements:
        g = by_group.setdefault(statement_class(st["query"]),
                                {"cpu_us": 0.0, "exec_us": 0.0, "calls": 0.0})
        g["exec_us"] += st["exec_ms"] * 1000 / n
        g["calls"] += st["calls"] / n
    clients = {k: {"cpu_us": round(v["cpu_us"], 1), "exec_us": round(v["exec_us"], 1),
                   "gap_us": round(v["cpu_us"] - v["exec_us"], 1),
                   "calls_per_order": round(v["calls"], 3)}
               for k, v in by_group.items() if v["calls"] or k in (
                   CHECKOUT, "workers", RECOVERY, SAMPLING, REPORT)}
    return {"orders": orders, "db_cpu_us_per_order": round(whole_seconds / n * 1e6, 1),
            "breakdown_us_per_order": dbcpu.per_order_us(cpu, orders),
            "breakdown_total_us": round(sum(cpu.values()) / n * 1e6, 1),
            "wal_bytes_per_order": round(wal_bytes / n, 1),
            "statements_vs_cpu": dict(sorted(clients.items(), key=lambda kv: -kv[1]["cpu_us"]))}


def cpu_vs_baseline(doc: dict[str, Any], limit: float = CPU_VS_BASELINE_LIMIT) -> dict[str, Any]:
    """The target: the queue phase's whole database CPU per order ≤ *limit* × the
    baseline's (``ok`` None when the run had no baseline)."""
    cost = doc.get("cost", {})
    queue = cost.get("queue", {}).get("db_cpu_us_per_order")
    base = cost.get("baseline", {}).get("db_cpu_us_per_order")
    ratio = dbcpu.cpu_ratio(queue, base)
    if ratio is None:
        return {"ok": None, "reason": "no baseline (--baseline-seconds 0)", "limit": limit}
    return {"ok": ratio <= limit, "ratio": ratio, "limit": limit, "queue_us": queue,
            "baseline_us": base}


def _p(values: Sequence[float], q: float) -> float | None:
    return round(percentile(values, q), 3) if values else None


# -------------------------------------------------------------------- verdict


def _in(samples: Sequence[dict[str, Any]], start: float, end: float) -> list[dict[str, Any]]:
    return [s for s in samples if start <= s["t"] < end]


def _near_hold(t: float, holds: Sequence[tuple[float, float]], after: float) -> bool:
    return any(a <= t < b + after for a, b in holds)


def steady(samples: Sequence[dict[str, Any]], key: str, *, period: float, end: float,
           tolerance: float, slack: float = 0.0) -> dict[str, Any]:
    """Whether *key* stopped growing: its peak over the last *period* (seconds
    before *end*) against its peak over the period before that.

    The peaks, not a fitted line: a held snapshot bloats a table in steps that
    vacuum cannot undo (the space is reused, not returned), so the question is
    whether the last period went above the one before, by more than
    *tolerance* (a share) plus *slack* (the key's unit). Also returns the
    least-squares slope over the last period (unit per hour), for the record.
    """
    last = [s[key] for s in _in(samples, end - period, end) if s.get(key) is not None]
    prev = [s[key] for s in _in(samples, end - 2 * period, end - period) if s.get(key) is not None]
    if not last or not prev:
        return {"key": key, "ok": None, "reason": "not enough samples"}
    last_peak, prev_peak = max(last), max(prev)
    ok = last_peak <= prev_peak * (1 + tolerance) + slack
    return {"key": key, "ok": ok, "previous_peak": prev_peak, "last_peak": last_peak,
            "ratio": round(last_peak / prev_peak, 3) if prev_peak else None,
            "slope_per_hour": slope(_in(samples, end - period, end), key)}


def slope(samples: Sequence[dict[str, Any]], key: str) -> float | None:
    """Least-squares slope of *key* over *samples*' ``t``, per hour (None: < 3 points)."""
    pts = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
    if len(pts) < 3:
        return None
    mt = statistics.fmean(t for t, _ in pts)
    mv = statistics.fmean(v for _, v in pts)
    den = sum((t - mt) ** 2 for t, _ in pts)
    return round(sum((t - mt) * (v - mv) for t, v in pts) / den * 3600, 3) if den else 0.0


def latency_steady(samples: Sequence[dict[str, Any]], key: str, *, period: float, end: float,
                   holds: Sequence[tuple[float, float]], tolerance: float,
                   after_hold: float = 0.0) -> dict[str, Any]:
    """Whether a latency (*key*, per sample) trends up: the median of its samples over
    the last *period* against the period before, both outside held snapshots (and
    *after_hold* seconds after each)."""
    def values(a: float, b: float) -> list[float]:
        return [s[key] for s in _in(samples, a, b)
                if s.get(key) is not None and not _near_hold(s["t"], holds, after_hold)]

    last, prev = values(end - period, end), values(end - 2 * period, end - period)
    if not last or not prev:
        return {"key": key, "ok": None, "reason": "not enough samples"}
    a, b = statistics.median(prev), statistics.median(last)
    return {"key": key, "ok": b <= a * (1 + tolerance), "previous_median": a,
            "last_median": b, "ratio": round(b / a, 3) if a else None}


def hold_effect(claims: Sequence[tuple[float, float]], hold: tuple[float, float],
                limit: float = 3.0) -> dict[str, Any]:
    """Claim p99 while a snapshot was held against the same length of time before it.

    *claims*: (seconds from the start, ms); *hold*: (start, end), seconds.
    """
    start, end = hold
    during = [ms for t, ms in claims if start <= t < end]
    before = [ms for t, ms in claims if start - (end - start) <= t < start]
    if not during or not before:
        return {"hold": hold, "ok": None, "reason": "no claims"}
    p_during, p_before = percentile(during, 99), percentile(before, 99)
    ratio = p_during / p_before if p_before else math.inf
    return {"hold": hold, "ok": ratio <= limit, "p99_before_ms": round(p_before, 3),
            "p99_during_ms": round(p_during, 3), "ratio": round(ratio, 2),
            "claims_before": len(before), "claims_during": len(during)}


def verdict(doc: dict[str, Any]) -> dict[str, Any]:
    """The soak's targets, each ``ok`` True/False (None: could not be judged).

    * sizes reach a steady state: each table's and the indexes' peak over the
      last period (``hold_every_seconds``, an hour) ≤ 1.1 × the period before;
    * claim p99 does not trend up: the last period's median (outside held
      snapshots) ≤ 1.25 × the period before's;
    * claim p99 during each held snapshot ≤ 3 × before it;
    * nothing lost or stuck: orders = distinct receipts delivered + jobs failed
      for good, nothing ready or running at the end, and no lease left expired
      for two samples in a row;
    * the database's whole CPU per order ≤ 3 × the baseline's
      (:func:`cpu_vs_baseline`; not judged when the run had none).
    """
    plan = doc["plan"]
    samples = doc["samples"]
    end = plan["hours"] * 3600.0
    period = plan["hold_every_seconds"]
    holds = [tuple(h) for h in doc.get("holds", [])]
    out: dict[str, Any] = {"sizes": [], "latency": [], "holds": []}
    for key, slack in (("receipt_jobs_heap_bytes", 256 * 1024),
                       ("receipt_jobs_index_bytes", 256 * 1024),
                       ("receipt_attempts_heap_bytes", 256 * 1024),
                       ("receipt_attempts_index_bytes", 256 * 1024),
                       ("receipt_flow_heap_bytes", 64 * 1024)):
        out["sizes"].append(steady(samples, key, period=period, end=end, tolerance=0.10,
                                   slack=slack))
    after = plan.get("hold_recovery_seconds", 0.0)
    for key in ("claim_p99_ms", "checkout_p99_ms"):
        out["latency"].append(latency_steady(samples, key, period=period, end=end, holds=holds,
                                             tolerance=0.25, after_hold=after))
    claims = [(t, ms) for t, ms in doc.get("claim_latencies", [])]
    out["holds"] = [hold_effect(claims, h) for h in holds]
    end_state = doc.get("end", {})
    stuck_expired = any(a.get("expired", 0) and b.get("expired", 0)
                        for a, b in itertools.pairwise(samples))
    lost = end_state.get("lost")
    out["nothing_lost"] = {"ok": lost == 0 and not end_state.get("left") and not stuck_expired,
                           "lost": lost, "left_at_end": end_state.get("left"),
                           "expired_leases_seen_twice": stuck_expired}
    out["cpu_vs_baseline"] = cpu_vs_baseline(doc)
    judged = [c["ok"] for group in ("sizes", "latency", "holds") for c in out[group]]
    judged.append(out["nothing_lost"]["ok"])
    if out["cpu_vs_baseline"]["ok"] is not None:  # not judged without a baseline
        judged.append(out["cpu_vs_baseline"]["ok"])
    out["ok"] = all(v is True for v in judged)
    return out


# --------------------------------------------------------------------- plots


def plot(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """Three small PNGs of the samples (latency, storage, health); held snapshots shaded.

    matplotlib comes with the ``bench`` extra (and ``dev``, for the smoke test);
    returns the files written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = doc["samples"]
    if not samples:
        return []
    minutes = [s["t"] / 60 for s in samples]

    def series(key: str, scale: float = 1.0) -> list[float]:
        return [float("nan") if s.get(key) is None else s[key] * scale for s in samples]

    def shade(ax: Any) -> None:
        for a, b in doc.get("holds", []):
            ax.axvspan(a / 60, b / 60, color="0.85", zorder=0)

    mb = 1 / (1024 * 1024)
    figures = {
        "latency": [
            ("claim (ms, every claim of every worker)", [("p50", "claim_p50_ms", 1.0),
                                                          ("p99", "claim_p99_ms", 1.0)], True),
            ("checkout txn: insert order + enqueue (ms)", [("p50", "checkout_p50_ms", 1.0),
                                                           ("p99", "checkout_p99_ms", 1.0)], True),
        ],
        "storage": [
            ("receipt_jobs (MB)", [("heap", "receipt_jobs_heap_bytes", mb),
                                   ("indexes", "receipt_jobs_index_bytes", mb)], False),
            ("receipt_attempts (MB)", [("heap", "receipt_attempts_heap_bytes", mb),
                                       ("indexes", "receipt_attempts_index_bytes", mb)], False),
            ("dead tuples", [("receipt_jobs", "receipt_jobs_dead", 1.0),
                             ("receipt_attempts", "receipt_attempts_dead", 1.0)], False),
            ("receipt_flow row versions", [("on its pages", "flow_row_versions", 1.0)], False),
        ],
        "health": [
            ("oldest snapshot's xmin age (xids)", [("xmin age", "xmin_age", 1.0)], False),
            ("WAL (MB/s) and DB CPU (cores)", [("WAL MB/s", "wal_mb_per_second", 1.0),
                                               ("DB CPU", "db_cpu_cores", 1.0)], False),
            ("queue", [("ready", "ready", 1.0), ("running", "running", 1.0)], False),
            ("jobs/s delivered vs orders/s", [("delivered", "delivered_per_second", 1.0),
                                              ("orders", "orders_per_second", 1.0)], False),
        ],
    }
    written = []
    for name, panels in figures.items():
        fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.9 * len(panels) + 0.6),
                                 sharex=True, dpi=72)
        for ax, (title, lines, log) in zip(axes, panels, strict=True):
            shade(ax)
            for label, key, scale in lines:
                ax.plot(minutes, series(key, scale), label=label, linewidth=0.9)
            if log:
                ax.set_yscale("log")
            ax.set_title(title, fontsize=9, loc="left")
            ax.tick_params(labelsize=8)
            ax.legend(fontsize=7, loc="upper left")
            ax.grid(alpha=0.3)
        axes[-1].set_xlabel("minutes (grey: reporting query holding a snapshot)", fontsize=8)
        fig.tight_layout()
        path = out_dir / f"soak-{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


# ----------------------------------------------------------------------- run


def _scrape_total(children: Children, name: str) -> float:
    total = 0.0
    for proc in children.procs:
        try:
            total += proc.scrape().total(name)
        except Exception:  # a worker's metrics unreachable: counted as 0, noted in the JSON
            return math.nan
    return total


def _count(total: float) -> float | int:
    """A scraped counter as a count: an int, or NaN when a worker's metrics were unreachable."""
    return total if math.isnan(total) else int(total)


def claim_counts(claims: Sequence[tuple[float, float, int, int]],
                 delivered: int) -> dict[str, Any]:
    """Claims per delivered job and the share of claims that came back empty; also
    the claims that carried no acks, and the empty ones among them: a claim carrying
    acks is their ack statement too, so one that claims nothing still did a
    statement's work. *claims*: (unix time, ms, jobs, acks) as ClaimLogs reads them."""
    empty = sum(1 for _, _, n, _ in claims if n == 0)
    bare = [n for _, _, n, acks in claims if acks == 0]
    bare_empty = bare.count(0)
    return {"claims": len(claims), "empty_claims": empty,
            "claims_per_job": round(len(claims) / max(delivered, 1), 3),
            "empty_claim_share": round(empty / max(len(claims), 1), 3),
            "claims_without_acks_per_job": round(len(bare) / max(delivered, 1), 3),
            "empty_without_acks": bare_empty,
            "empty_without_acks_share": round(bare_empty / max(len(claims), 1), 3)}


def baseline_phase(dsn: str, plan: SoakPlan,
                   conn: psycopg.Connection[Any]) -> tuple[Orders, list[dict[str, Any]]]:
    """The checkout stream without the queue for ``plan.baseline_seconds`` (see the
    module doc), sampled as the queue phase is (:func:`sample_database` on *conn*
    every ``sample_seconds``); returns the stream and its samples (checkout p50/p99)."""
    orders = Orders(dsn, plan.rate, plan.baseline_seconds, plan.seed + 1000, threading.Event(),
                    enqueue=False, prefix="base")
    thread = threading.Thread(target=orders.run, daemon=True)
    t0 = time.monotonic()
    thread.start()
    samples: list[dict[str, Any]] = []
    seen = 0
    next_at = t0
    while thread.is_alive():
        next_at += plan.sample_seconds
        thread.join(max(0.0, next_at - time.monotonic()))
        sample_database(conn)
        chk = [lat for _, lat in orders.latencies[seen:]]
        seen = len(orders.latencies)
        samples.append({"t": round(time.monotonic() - t0, 1), "orders": len(chk),
                        "checkout_p50_ms": _p(chk, 50), "checkout_p99_ms": _p(chk, 99)})
    return orders, samples


def _mark(bench: Bench, breakdown: dbcpu.CpuBreakdown | None,
          conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """The readings a phase's bill is the difference of."""
    return {"cpu": bench.server_cpu_seconds(), "by_class": breakdown.mark() if breakdown else {},
            "wal": int(_one(conn, "SELECT /* bench */ pg_current_wal_lsn() - '0/0'")[0]),
            "statements": statement_totals(conn)}


def _phase(a: dict[str, Any], b: dict[str, Any], orders: Orders) -> dict[str, Any]:
    cost = phase_cost(dbcpu.between(a["by_class"], b["by_class"]), b["cpu"] - a["cpu"],
                      statements_between(a["statements"], b["statements"]), orders.enqueued,
                      b["wal"] - a["wal"])
    lat = [ms for _, ms in orders.latencies]
    return {**cost, "checkout_p50_ms": _p(lat, 50), "checkout_p99_ms": _p(lat, 99)}


def run(plan: SoakPlan, out_dir: Path, *, log: Any = print) -> dict[str, Any]:
    """One soak (see the module doc); returns the document also written as ``soak.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(settings=SERVER_SETTINGS)
    stop = threading.Event()
    started = datetime.now(UTC)
    provider = None
    children = None
    breakdown = None
    threads: list[threading.Thread] = []
    try:
        dsn = bench.server.create_database("soak")
        apply_migrations(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("CREATE TABLE bench_orders (id text PRIMARY KEY, total_cents integer"
                         " NOT NULL, created_at timestamptz NOT NULL DEFAULT now())")
        provider = Provider(plan.provider_latency_ms)
        provider.set_faults(error_rate=plan.error_rate, reset_rate=plan.reset_rate,
                            latency_jitter_seconds=plan.provider_latency_ms / 1000.0)
        logs = [out_dir / f"claims-{i}.log" for i in range(plan.workers)]
        for path in logs:
            path.unlink(missing_ok=True)
        ports = [free_port() for _ in range(plan.workers)]
        limit = 10 * plan.rate if plan.rate_limit is None else plan.rate_limit
        argvs = [receipts_argv(dsn, concurrency=plan.slots, batch=100, provider_url=provider.url,
                               claim_log=str(path), metrics_port=port,
                               retry_base_seconds=plan.retry_base_seconds,
                               rate_limit=limit or None, app_name=WORKER_APP.format(i))
                 for i, (path, port) in enumerate(zip(logs, ports, strict=True))]
        children = Children(argvs, ports=ports)  # started, not yet connected: they wait for go
        claim_logs = ClaimLogs(logs)
        server_pid = bench.server_pid()
        if server_pid is not None:
            breakdown = dbcpu.CpuBreakdown(server_pid, dsn, client_class).start()
        samples: list[dict[str, Any]] = []
        with psycopg.connect(dsn, autocommit=True, application_name="bench-sampler") as conn:
            base_orders = None
            if plan.baseline_seconds > 0:
                log(f"soak: baseline, {plan.baseline_seconds:g} s of checkouts without the queue")
                base_start = _mark(bench, breakdown, conn)
                base_orders, base_samples = baseline_phase(dsn, plan, conn)
            queue_start = _mark(bench, breakdown, conn)
            children.go()
            t0 = time.monotonic()
            wall0 = time.time()
            orders = Orders(dsn, plan.rate, plan.seconds, plan.seed, stop)
            recovery = Recovery(dsn, plan.retention_seconds, plan.recover_every_seconds, stop)
            holds = Holds(dsn, plan.holds(), t0, stop)
            for target in (orders.run, recovery.run, holds.run):
                threads.append(threading.Thread(target=target, daemon=True))
                threads[-1].start()
            prev: dict[str, Any] | None = None
            seen_orders = 0
            next_at = t0
            draining = False
            while True:
                next_at += plan.sample_seconds
                stop.wait(max(0.0, next_at - time.monotonic()))
                now = time.monotonic()
                row = sample_database(conn)
                row["t"] = round(now - t0, 1)
                row["cpu_seconds"] = bench.server_cpu_seconds()
                row["delivered"] = int(provider.stats()["receipts"])
                new_claims = claim_logs.read()
                ms = [c[1] for c in new_claims]
                row.update(claims=len(ms), claim_p50_ms=_p(ms, 50), claim_p99_ms=_p(ms, 99),
                           claim_jobs=sum(c[2] for c in new_claims))
                chk = [lat for _, lat in orders.latencies[seen_orders:]]
                seen_orders = len(orders.latencies)
                row.update(orders=len(chk), checkout_p50_ms=_p(chk, 50),
                           checkout_p99_ms=_p(chk, 99))
                if prev is not None:
                    dt = max(row["t"] - prev["t"], 1e-6)
                    row["wal_mb_per_second"] = round(
                        (row["wal_lsn"] - prev["wal_lsn"]) / dt / 1e6, 4)
                    row["db_cpu_cores"] = round((row["cpu_seconds"] - prev["cpu_seconds"]) / dt, 4)
                    row["delivered_per_second"] = round(
                        (row["delivered"] - prev["delivered"]) / dt, 2)
                    row["orders_per_second"] = round(len(chk) / dt, 2)
                samples.append(row)
                prev = row
                if not draining and row["t"] >= plan.seconds:
                    draining = True
                    drain_started = now
                    threads[0].join(30)  # the orders stop by themselves at plan.seconds
                if draining and (row["ready"] + row["running"] == 0
                                 or now - drain_started > plan.drain_timeout_seconds):
                    break
                if int(row["t"]) % 300 < plan.sample_seconds:
                    log(f"soak t={row['t']:.0f}s delivered={row['delivered']} "
                        f"ready={row['ready']} running={row['running']} "
                        f"claim p99={row['claim_p99_ms']} ms load={os.getloadavg()[0]:.2f}")
            left = samples[-1]["ready"] + samples[-1]["running"]
            queue_end = _mark(bench, breakdown, conn)
        cost: dict[str, Any] = {"queue": _phase(queue_start, queue_end, orders)}
        baseline: dict[str, Any] = {"seconds": plan.baseline_seconds}
        if base_orders is not None:
            cost["baseline"] = _phase(base_start, queue_start, base_orders)
            baseline.update(orders=base_orders.enqueued, errors=base_orders.errors,
                            max_behind_seconds=round(base_orders.max_behind_seconds, 3),
                            samples=base_samples)
        cost["ratio"] = dbcpu.cpu_ratio(cost["queue"]["db_cpu_us_per_order"],
                                        cost.get("baseline", {}).get("db_cpu_us_per_order"))
        cost["breakdown"] = {"interval_seconds": breakdown.interval if breakdown else None,
                             "samples": breakdown.samples if breakdown else 0}
        failures = _scrape_total(children, "receipts_failures_total")
        stale = _scrape_total(children, "receipts_stale_acks_total")
        stats = provider.stats()
        delivered = int(stats["receipts"])
        lost = orders.enqueued - delivered - (0 if math.isnan(failures) else int(failures))
        cpu = samples[-1]["cpu_seconds"] - samples[0]["cpu_seconds"] if samples else 0.0
        wal = samples[-1]["wal_lsn"] - samples[0]["wal_lsn"] if samples else 0
        doc: dict[str, Any] = {
            "started": started.isoformat(timespec="seconds"),
            "finished": datetime.now(UTC).isoformat(timespec="seconds"),
            "plan": asdict(plan),
            "machine": {"cpus": os.cpu_count(), "load_average_at_end": os.getloadavg(),
                        "postgres": bench.durability()},
            "holds": [[round(a - wall0, 1), round(b - wall0, 1)] for a, b in holds.held],
            "samples": samples,
            "claim_latencies": [[round(t - wall0, 3), ms] for t, ms, _, _ in claim_logs.claims],
            "end": {
                "orders": orders.enqueued, "order_errors": orders.errors,
                "orders_max_behind_seconds": round(orders.max_behind_seconds, 3),
                "delivered": delivered, "provider": stats, "failed_for_good": _count(failures),
                "stale_acks": _count(stale), "lost": lost, "left": left,
                "recovery_sweeps": len(recovery.sweeps),
                "recovery_failures": recovery.failures,
                "pruned": sum(int(s.get("pruned", 0)) for s in recovery.sweeps),
                "db_cpu_us_per_job": round(cpu / max(delivered, 1) * 1e6, 1),
                **claim_counts(claim_logs.claims, delivered),
                "wal_bytes_per_job": round(wal / max(delivered, 1), 1),
            },
            # The queue phase's (workers released → drain over), most exec time first.
            "statements": statements_between(queue_start["statements"],
                                             queue_end["statements"])[:25],
            "baseline": baseline,
            "cost": cost,
        }
    finally:
        stop.set()
        if breakdown is not None:
            breakdown.close()
        for thread in threads:
            thread.join(10)
        if children is not None:
            children.stop()
        if provider is not None:
            provider.stop()
        bench.cleanup()
    doc["verdict"] = verdict(doc)
    claims_file = out_dir / "claims.json"
    claims_file.write_text(json.dumps(doc.pop("claim_latencies")))
    (out_dir / "soak.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    doc["plots"] = [str(p) for p in plot(doc, out_dir)]
    for path in logs:
        path.unlink(missing_ok=True)
    return doc


def summary(doc: dict[str, Any]) -> str:
    """The verdict as a few lines of text."""
    v = doc["verdict"]
    e = doc["end"]
    lines = [f"soak {doc['plan']['hours']:g} h at {doc['plan']['rate']:g} orders/s: "
             f"{'PASS' if v['ok'] else 'FAIL'}",
             f"  orders {e['orders']:,}, delivered {e['delivered']:,}, failed for good "
             f"{e['failed_for_good']}, lost {e['lost']}, left at end {e['left']}, pruned "
             f"{e['pruned']:,}; DB CPU {e['db_cpu_us_per_job']} µs and WAL "
             f"{e['wal_bytes_per_job']} B per job"]
    lines.append(f"  claims {e.get('claims')}: {e.get('claims_per_job')} per job delivered, "
                 f"{e.get('empty_claim_share')} of them empty")
    if e.get("claims_without_acks_per_job") is not None:
        lines.append(f"  claims carrying no acks: {e['claims_without_acks_per_job']} per job "
                     f"delivered; empty and carrying no acks: "
                     f"{e['empty_without_acks_share']} of all claims")
    for c in v["sizes"]:
        lines.append(f"  size {c['key']}: peak {c.get('previous_peak')} -> "
                     f"{c.get('last_peak')} ({c.get('ratio')}) ok={c['ok']}")
    for c in v["latency"]:
        lines.append(f"  {c['key']} median outside holds: {c.get('previous_median')} -> "
                     f"{c.get('last_median')} ({c.get('ratio')}) ok={c['ok']}")
    for c in v["holds"]:
        lines.append(f"  held snapshot {c['hold']}: claim p99 {c.get('p99_before_ms')} -> "
                     f"{c.get('p99_during_ms')} ms ({c.get('ratio')}×) ok={c['ok']}")
    lines.append(f"  nothing lost or stuck: {v['nothing_lost']}")
    lines += cost_lines(doc)
    return "\n".join(lines)


def cost_lines(doc: dict[str, Any]) -> list[str]:
    """The baseline against the queue phase: CPU per order, its breakdown, statements."""
    cost = doc.get("cost")
    if not cost:
        return []
    q, b = cost["queue"], cost.get("baseline", {})
    check = doc.get("verdict", {}).get("cpu_vs_baseline", {})
    lines = [f"  database CPU per order: baseline (no queue, {b.get('orders', 0):,} orders) "
             f"{b.get('db_cpu_us_per_order')} µs, queue phase ({q['orders']:,} orders) "
             f"{q['db_cpu_us_per_order']} µs: {cost.get('ratio')}× (≤ {CPU_VS_BASELINE_LIMIT:g}) "
             f"ok={check.get('ok')}",
             f"  WAL per order: baseline {b.get('wal_bytes_per_order')} B, queue "
             f"{q['wal_bytes_per_order']} B; checkout p50/p99: baseline "
             f"{b.get('checkout_p50_ms')}/{b.get('checkout_p99_ms')} ms, queue "
             f"{q['checkout_p50_ms']}/{q['checkout_p99_ms']} ms",
             f"  CPU µs per order by process{'':22}{'baseline':>10}{'queue':>10}"]
    qb, bb = q["breakdown_us_per_order"], b.get("breakdown_us_per_order", {})
    for cls in sorted(set(qb) | set(bb), key=lambda c: -qb.get(c, 0.0)):
        lines.append(f"    {cls:<52}{bb.get(cls, 0.0):>10.1f}{qb.get(cls, 0.0):>10.1f}")
    lines.append(f"    {'(sum of the classes)':<52}{b.get('breakdown_total_us', 0.0):>10.1f}"
                 f"{q['breakdown_total_us']:>10.1f}")
    lines.append("  queue phase per order: backends' CPU vs their statements' exec time "
                 "(pg_stat_statements), µs")
    for cls, row in q["statements_vs_cpu"].items():
        lines.append(f"    {cls:<20} CPU {row['cpu_us']:>8.1f}  exec {row['exec_us']:>8.1f}  "
                     f"gap {row['gap_us']:>8.1f}  ({row['calls_per_order']} statements)")
    n = max(q["orders"], 1)
    lines.append("  queue phase statements (pg_stat_statements): calls and exec µs per order")
    for st in doc.get("statements", [])[:12]:
        text = " ".join(st["query"].split())[:48]
        lines.append(f"    {st['calls'] / n:>7.3f} {st['exec_ms'] * 1000 / n:>8.1f} µs  "
                     f"{statement_class(st['query']):<9} {statement_name(st['query']):<16} "
                     f"{text}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--hours", type=float, help="how long orders arrive (default 2)")
    p.add_argument("--smoke", action="store_true", help="the 1-minute version (CI)")
    p.add_argument("--rate", type=float, help="orders per second (default 50)")
    p.add_argument("--workers", type=int, help="worker processes (default 2)")
    p.add_argument("--retention-seconds", type=float, help="retention (default 1800)")
    p.add_argument("--rate-limit", type=float,
                   help="fleet-wide rate limit, jobs/s (default 10 × --rate; 0: none)")
    p.add_argument("--hold-first-seconds", type=float,
                   help="when the first held snapshot starts, seconds (default 2400)")
    p.add_argument("--hold-seconds", type=float,
                   help="how long each snapshot is held (default 600)")
    p.add_argument("--baseline-seconds", type=float,
                   help="checkouts without the queue before the workers start, seconds "
                        "(default 300; --smoke: 10; 0: none)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"folder for soak.json and the PNGs (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    plan = SoakPlan.smoke() if args.smoke else SoakPlan()
    for name in ("hours", "rate", "workers", "retention_seconds", "rate_limit",
                 "hold_first_seconds", "hold_seconds", "baseline_seconds"):
        value = getattr(args, name)
        if value is not None:
            setattr(plan, name, value)
    if plan.hours <= 0 or plan.rate <= 0 or plan.workers < 1 or plan.baseline_seconds < 0:
        print("python -m bench.soak: --hours, --rate and --workers must be positive, "
              "--baseline-seconds not negative", file=sys.stderr)
        return 2
    doc = run(plan, args.out, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(summary(doc))
    print(f"wrote {args.out / 'soak.json'}, claims.json and {len(doc['plots'])} PNGs",
          file=sys.stderr)
    return 0 if doc["verdict"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
