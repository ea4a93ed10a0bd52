"""The database's bill: server CPU, WAL, statements and dead tuples per delivered job.

``python -m bench.bill`` (also ``bench/run.sh --only bill``). Every run gets a
fresh database holding the same number of ready jobs, right after
``VACUUM (ANALYZE)`` and ``CHECKPOINT`` (so each page's first change logs a
full-page image in every run alike). A drain is metered from 10 % to 90 % of
its jobs (:func:`metered_drain`): a long-running fleet's cost, without the
start (cold caches, statements not yet prepared) or the half-empty tail.
:class:`Meter` reads:

* **database CPU**: the whole server's user + system time (``/proc``), less
  the benchmark's own sessions; split by process (client backends by
  ``application_name``, the WAL writer, autovacuum, the checkpointer…) from a
  sample every 0.25 s;
* **WAL**: ``pg_current_wal_insert_lsn()`` before and after; records and
  full-page images from ``pg_stat_wal``;
* **statements**: ``pg_stat_statements`` of the database (the bench's server
  preloads it), each statement classified by what it is for (claim, ack,
  reschedule, commit probe, queue stats, LISTEN…): calls, rows, execution
  and planning time (wall clock: on shared cores it includes waiting for
  one), WAL bytes; and the WAL by record type (``pg_walinspect``);
* **dead tuples created**: heap update, HOT update and delete records in the
  WAL (each leaves one dead row version); the per-table split from
  ``pg_stat_user_tables``.

Rows:

* ``raw``: pgbench running the project's own claim and batched ack
  (:func:`bench.raw.pgbench_script`, batch 100) with a fixed number of
  transactions, so it does exactly the jobs the drains do;
* ``receipts``: the real worker (no-op deliverer) at 1, 4 and 16 processes
  sharing the same total slots (512), draining the same jobs; with admission
  control off (capacity) and on (the default: its commit probes are billed);
* ``latency``: the same fleets when each delivery takes 200 ms (× U(0.5, 1.5),
  no I/O): slots free one at a time, so claims are as small as they are in
  production;
* ``failures``: 3 % of the attempts answered 503 and retried soon after:
  reschedules and the attempt history;
* ``idle``: the same fleets on an empty queue: CPU, WAL and statements per
  second and per process;
* ``steady``: jobs enqueued one per transaction at a fixed rate through the
  public API while the fleet keeps up (claims of one, wake-ups).

Per-job figures divide by the jobs delivered in the run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import psycopg

from bench import raw
from bench.document import write_json
from bench.pg import Bench, fill_ready, settle
from bench.procs import Children
from bench.scenarios import receipts_argv
from receipts.enqueue import enqueue

TABLES = ("receipt_jobs", "receipt_flow", "receipt_attempts")
METER: dict[str, Any] = {"autocommit": True, "application_name": "bench-meter"}
#: Total slots of every fleet, and the fleets' process counts (brief: same total slots).
SLOTS = 512
PROCESSES = (1, 4, 16)

# What each statement the database saw is for, by its (normalised) text. Order
# matters: the first pattern that matches wins.
_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pattern, re.IGNORECASE | re.DOTALL)) for kind, pattern in (
        ("bench", r"/\* bench \*/|^\s*SELECT count\(\*\) FROM pg_stat_activity"),
        # (pg_stat_statements texts may be cut short: the claim's opening names it too)
        ("claim", r"candidate AS \(.*claimed AS \(|^\s*WITH flow AS (MATERIALIZED )?\("
                  r"\s*SELECT \S*receipts_pause_reason\("),
        ("ack", r"^\s*(WITH done AS \(\s*)?UPDATE \S*receipt_jobs AS j\s+SET state = \S+,"
                r"\s+lease_token = \S+,"
                r"\s+lease_until = \S+,\s+last_token = a\.token"),
        ("reschedule", r"^\s*WITH r AS \("),
        ("resolve_writes", r"WHERE j\.last_token = a\.token"),
        ("recovery", r"expired AS \(|exhausted AS \(|old AS \(|receipts_prune\("),
        ("history", r"INSERT INTO \S*receipt_attempts|receipts_record_attempts\("),
        ("queue_stats", r"WITH ready AS MATERIALIZED"),
        ("probe", r"pg_logical_emit_message|^\s*SET LOCAL synchronous_commit"),
        # A probe's and a checkout's BEGIN and COMMIT alike (the worker's own
        # statements are autocommit and send neither).
        ("transaction", r"^\s*(BEGIN|COMMIT|ROLLBACK)\s*$"),
        ("listen", r"^\s*(LISTEN|SELECT \$1\s*$)"),
        ("flow", r"receipt_flow"),
        ("enqueue", r"INSERT INTO \S*receipt_jobs|receipts_enqueue"),
    ))


def kind_of(query: str) -> str:
    """What a statement is for (``claim``, ``ack``… ``other``), from its text."""
    for kind, pattern in _KINDS:
        if pattern.search(query):
            return kind
    return "other"


def _lsn(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT /* bench */ pg_current_wal_insert_lsn() - '0/0'").fetchone()
    return int(row[0]) if row else 0


def _wal_stats(conn: psycopg.Connection[Any]) -> dict[str, int]:
    row = conn.execute("SELECT /* bench */ wal_records, wal_fpi, wal_bytes FROM pg_stat_wal"
                       ).fetchone()
    return dict(zip(("records", "fpi", "bytes"), (int(v) for v in row), strict=True)) if row \
        else {}


def _wal_records(conn: psycopg.Connection[Any], start: int, end: int) -> dict[str, dict[str, int]]:
    """WAL between two LSNs by record type (pg_walinspect): count, record bytes, FPI bytes.

    Waits (≤ 2 s) for the WAL writer to flush up to *end*; empty when nothing
    was written in between.
    """
    deadline = time.monotonic() + 2.0
    while True:
        row = conn.execute("SELECT /* bench */ pg_current_wal_flush_lsn() - '0/0'").fetchone()
        flushed = int(row[0]) if row else 0
        if flushed >= end or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    end = min(end, flushed)
    if end <= start:
        return {}
    rows = conn.execute(
        "SELECT /* bench */ \"resource_manager/record_type\", count, record_size, fpi_size"
        " FROM pg_get_wal_stats(%s::pg_lsn, %s::pg_lsn, true) WHERE count > 0",
        (_lsn_text(start), _lsn_text(end))).fetchall()
    return {str(r[0]): {"count": int(r[1]), "record_bytes": int(r[2]), "fpi_bytes": int(r[3])}
            for r in rows}


def _lsn_text(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def _tables(conn: psycopg.Connection[Any]) -> dict[str, dict[str, int]]:
    rows = conn.execute(
        "SELECT /* bench */ relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del,"
        " n_dead_tup, autovacuum_count, pg_relation_size(relid),"
        " pg_indexes_size(relid) FROM pg_stat_user_tables WHERE relname = ANY(%s)",
        (list(TABLES),)).fetchall()
    keys = ("ins", "upd", "hot_upd", "del", "dead", "autovacuums", "heap_bytes", "index_bytes")
    return {str(r[0]): dict(zip(keys, (int(v) for v in r[1:]), strict=True)) for r in rows}


def _statements(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    cur = conn.execute(
        "SELECT /* bench */ query, calls, rows, total_exec_time, total_plan_time,"
        " wal_bytes, wal_records, wal_fpi, shared_blks_hit + shared_blks_read"
        " FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database"
        " WHERE datname = current_database())")
    keys = ("query", "calls", "rows", "exec_ms", "plan_ms", "wal_bytes", "wal_records",
            "wal_fpi", "blocks")
    return [dict(zip(keys, r, strict=True)) for r in cur.fetchall()]


class Meter:
    """The database's bill between :meth:`start` and :meth:`stop` (see the module doc).

    Args:
        bench: the benchmark server (its ``/proc`` readings).
        dsn: the measured database.
        interval_seconds: how often the server's processes are sampled.
    """

    def __init__(self, bench: Bench, dsn: str, interval_seconds: float = 0.25) -> None:
        self.bench = bench
        self.dsn = dsn
        self.interval = interval_seconds
        self._conn = psycopg.connect(dsn, **METER)
        self._lock = threading.Lock()
        #: pid → [label, cpu at first sight (0 for a process born after start), last cpu]
        self._procs: dict[int, list[Any]] = {}
        self._apps: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, daemon=True)
        self._start: dict[str, Any] = {}
        self._end: dict[str, Any] = {}

    def close(self) -> None:
        """Stop sampling (if running) and close the meter's connection."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._conn.close()

    def _label(self, pid: int, kind: str) -> str:
        if kind != "backend":
            return kind
        app = self._apps.get(pid, "")
        return "bench" if app.startswith("bench-") or not app else app

    def _sample(self, first: bool = False) -> None:
        with self._lock:
            rows = self._conn.execute(
                "SELECT /* bench */ pid, application_name FROM pg_stat_activity"
                " WHERE backend_type = 'client backend'").fetchall()
            self._apps.update({int(pid): str(app or "") for pid, app in rows})
            for pid, (kind, cpu) in self.bench.server_processes().items():
                seen = self._procs.get(pid)
                if seen is None:
                    self._procs[pid] = [self._label(pid, kind), cpu if first else 0.0, cpu]
                else:
                    if seen[0] in ("bench", "backend") and kind == "backend":
                        seen[0] = self._label(pid, kind)  # its application_name is known now
                    seen[2] = cpu

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> None:
        """Reset the database's statement statistics and take the first readings."""
        c = self._conn
        c.execute("SELECT /* bench */ pg_stat_statements_reset(0, (SELECT oid FROM pg_database"
                  " WHERE datname = current_database()), 0)")
        self._start = {"tables": _tables(c), "wal": _wal_stats(c), "lsn": _lsn(c),
                       "cpu": self.bench.server_cpu_seconds(), "at": time.monotonic()}
        self._sample(first=True)
        self._thread.start()

    def stop(self) -> None:
        """The last readings of CPU and WAL (call when the measured work is done)."""
        self._stop.set()
        self._thread.join(5)
        self._sample()
        self._end = {"lsn": _lsn(self._conn), "cpu": self.bench.server_cpu_seconds(),
                     "at": time.monotonic(), "tables": _tables(self._conn)}

    def bill(self, jobs: int) -> dict[str, Any]:
        """The bill per job (*jobs* delivered; per second when *jobs* is 0).

        Call after :meth:`stop`. Dead tuples created are counted from the WAL
        (heap update, HOT update and delete records: every one leaves a dead
        row version); the per-table split and autovacuum counts come from
        ``pg_stat_user_tables``, read at :meth:`stop` (a session flushes its
        counters about once a second, so they are approximate).
        """
        c = self._conn
        tables = self._end["tables"]
        wal = _wal_stats(c)
        records = _wal_records(c, self._start["lsn"], self._end["lsn"])
        stmts = _statements(c)
        seconds = self._end["at"] - self._start["at"]
        per = float(jobs) if jobs else seconds
        cpu_total = self._end["cpu"] - self._start["cpu"]
        by_process: dict[str, float] = {}
        for label, first, last in self._procs.values():
            by_process[label] = by_process.get(label, 0.0) + max(0.0, last - first)
        bench_cpu = by_process.pop("bench", 0.0)
        # The steady row's enqueuing session (application_name "enqueue"): the
        # checkout's own part of a job, billed apart from the queue's.
        enqueue_cpu = by_process.pop("enqueue", 0.0)
        attributed = sum(by_process.values())
        by_process["ended or unsampled"] = max(
            0.0, cpu_total - bench_cpu - enqueue_cpu - attributed)
        by_kind: dict[str, dict[str, float]] = {}
        for s in stmts:
            k = by_kind.setdefault(kind_of(s["query"]), dict.fromkeys(
                ("calls", "rows", "exec_ms", "plan_ms", "wal_bytes", "wal_records",
                 "wal_fpi", "blocks"), 0.0))
            for key in k:
                k[key] += float(s[key])
        by_kind.pop("bench", None)
        wal_bytes = self._end["lsn"] - self._start["lsn"]
        in_statements = sum(k["wal_bytes"] for k in by_kind.values())
        dead = {t: tables.get(t, {}).get("upd", 0) - self._start["tables"].get(t, {}).get("upd", 0)
                + tables.get(t, {}).get("del", 0) - self._start["tables"].get(t, {}).get("del", 0)
                for t in TABLES}
        hot = {t: tables.get(t, {}).get("hot_upd", 0)
               - self._start["tables"].get(t, {}).get("hot_upd", 0) for t in TABLES}
        out: dict[str, Any] = {
            "jobs": jobs,
            "seconds": round(seconds, 3),
            "per": "job" if jobs else "second",
            "db_cpu_us": round((cpu_total - bench_cpu - enqueue_cpu) / per * 1e6, 2),
            "bench_cpu_us": round(bench_cpu / per * 1e6, 2),
            "enqueue_cpu_us": round(enqueue_cpu / per * 1e6, 2),
            "wal_bytes": round(wal_bytes / per, 1),
            "wal_records": round((wal.get("records", 0) - self._start["wal"].get("records", 0))
                                 / per, 3),
            "wal_fpi": round((wal.get("fpi", 0) - self._start["wal"].get("fpi", 0)) / per, 4),
            "statements": round(sum(k["calls"] for k in by_kind.values()) / per, 4),
            "dead_tuples": round(sum(records.get(k, {}).get("count", 0) for k in (
                "Heap/UPDATE", "Heap/HOT_UPDATE", "Heap/DELETE")) / per, 3),
            "cpu_us_by_process": {k: round(v / per * 1e6, 2) for k, v in
                                  sorted(by_process.items(), key=lambda kv: -kv[1])},
            "by_statement": {k: {
                "calls": round(v["calls"] / per, 5),
                "rows_per_call": round(v["rows"] / v["calls"], 1) if v["calls"] else 0.0,
                "exec_us": round((v["exec_ms"] + v["plan_ms"]) * 1000 / per, 2),
                "plan_us": round(v["plan_ms"] * 1000 / per, 2),
                "wal_bytes": round(v["wal_bytes"] / per, 1),
                "wal_fpi": round(v["wal_fpi"] / per, 4),
                "blocks": round(v["blocks"] / per, 2),
            } for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]["exec_ms"])},
            "wal_bytes_outside_statements": round((wal_bytes - in_statements) / per, 1),
            "wal_by_record": {k: {"count": round(v["count"] / per, 3),
                                  "bytes": round((v["record_bytes"] + v["fpi_bytes"]) / per, 1),
                                  "fpi_bytes": round(v["fpi_bytes"] / per, 1)}
                              for k, v in sorted(records.items(), key=lambda kv:
                                                 -(kv[1]["record_bytes"] + kv[1]["fpi_bytes"]))},
            "dead_tuples_by_table": {t: round(n / per, 3) for t, n in dead.items() if n},
            "hot_updates_by_table": {t: round(n / per, 3) for t, n in hot.items() if n},
            "autovacuums": {t: tables.get(t, {}).get("autovacuums", 0)
                            - self._start["tables"].get(t, {}).get("autovacuums", 0)
                            for t in TABLES},
            "other_statements": sorted(
                s["query"][:120] for s in stmts if kind_of(s["query"]) == "other")[:10],
        }
        return out


@contextmanager
def metered(bench: Bench, dsn: str) -> Iterator[Meter]:
    """A started :class:`Meter` on *dsn*, closed on exit."""
    meter = Meter(bench, dsn)
    try:
        meter.start()
        yield meter
    finally:
        meter.close()


def _nothing_left(conn: psycopg.Connection[Any]) -> bool:
    """No ready and no running job (two index probes; cheap at any table size)."""
    row = conn.execute("SELECT /* bench */ NOT EXISTS (SELECT FROM receipt_jobs WHERE"
                       " state = 'ready') AND NOT EXISTS (SELECT FROM receipt_jobs"
                       " WHERE state = 'running')").fetchone()
    return bool(row and row[0])


def _done(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT /* bench */ count(*) FROM receipt_jobs WHERE state = 'done'"
                       ).fetchone()
    return int(row[0]) if row else 0


def _head(conn: psycopg.Connection[Any]) -> float | None:
    """The ``run_at`` (epoch seconds) of the first ready job, None when none is ready."""
    row = conn.execute("SELECT /* bench */ extract(epoch FROM run_at)::float8 FROM receipt_jobs"
                       " WHERE state = 'ready' ORDER BY run_at, id LIMIT 1").fetchone()
    return float(row[0]) if row else None


#: The share of a drain that is metered: from 10 % of the jobs claimed to 90 %,
#: so that neither the start (cold caches, plans not yet prepared, idle slots)
#: nor the tail (half-empty claims) is billed.
WINDOW = (0.1, 0.9)


def metered_drain(bench: Bench, dsn: str, alive: Callable[[], bool],
                  timeout_seconds: float = 600.0) -> dict[str, Any]:
    """Meter the middle of a drain of the jobs :func:`bench.pg.fill_ready` made.

    ``fill_ready`` gives the n-th job ``run_at`` = start + n µs and claims take
    the oldest first, so the first ready job's ``run_at`` says how far the
    drain has got (one index probe). The meter runs while it is between the
    two fractions of :data:`WINDOW`; the bill is per job that became done in
    between. *alive*: False when the drainers have died (raises RuntimeError).
    """
    meter = Meter(bench, dsn)
    try:
        c = meter._conn
        row = c.execute("SELECT /* bench */ extract(epoch FROM min(run_at))::float8,"
                        " extract(epoch FROM max(run_at))::float8 FROM receipt_jobs"
                        " WHERE state = 'ready'").fetchone()
        first, last = (float(row[0]), float(row[1])) if row and row[0] is not None else (0, 0)
        span = max(last - first, 1e-6)
        deadline = time.monotonic() + timeout_seconds

        def reach(fraction: float) -> None:
            while True:
                head = _head(c)
                if head is None or (head - first) / span >= fraction:
                    return
                if time.monotonic() > deadline or not alive():
                    raise RuntimeError("the drain did not finish")
                time.sleep(0.02)

        reach(WINDOW[0])
        meter.start()
        done0 = _done(c)
        reach(WINDOW[1])
        done1 = _done(c)
        meter.stop()
        return meter.bill(max(1, done1 - done0))
    finally:
        meter.close()


# ------------------------------------------------------------------- rows


def bill_raw(bench: Bench, *, jobs: int, batch: int = 100, clients: int = 1,
             **script: Any) -> dict[str, Any]:
    """pgbench's claim *batch* + batched ack over exactly *jobs* ready jobs."""
    transactions = max(1, jobs // (batch * clients))
    jobs = transactions * batch * clients
    with bench.database("bill") as dsn:
        fill_ready(dsn, jobs)
        settle(dsn, "receipt_jobs")
        with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as fh:
            fh.write(raw.pgbench_script(batch, **script))
            path = fh.name
        try:
            cmd = raw.pgbench_argv(bench, dsn, path, clients=clients, transactions=transactions)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=raw.pgbench_env())
            try:
                out = metered_drain(bench, dsn, lambda: proc.poll() in (None, 0))
            finally:
                _, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"pgbench failed: {err.strip()[-600:]}")
        finally:
            Path(path).unlink(missing_ok=True)
    out.update(row="raw", batch=batch, processes=clients,
               jobs_per_second=round(out["jobs"] / max(out["seconds"], 1e-9)), script=script)
    return out


def _fleet(dsn: str, processes: int, slots: int, batch: int, admission: bool | None,
           **opts: Any) -> list[list[str]]:
    """*processes* workers sharing *slots*; *admission* None: the shipped default."""
    per = max(1, slots // processes)
    switch = None if admission is None else ("on" if admission else "off")
    return [receipts_argv(dsn, concurrency=per, batch=batch, admission=switch,
                          **opts)] * processes


def bill_receipts(bench: Bench, *, jobs: int, processes: int, slots: int = SLOTS,
                  batch: int = 100, admission: bool = False, delay_ms: float = 0.0,
                  fail_percent: float = 0.0, timeout_seconds: float = 600.0) -> dict[str, Any]:
    """*processes* no-op workers sharing *slots* drain *jobs* ready jobs; each
    delivery takes *delay_ms* × U(0.5, 1.5) (no I/O) when given; *fail_percent*
    of the attempts are answered 503 and retried after 0.05 s × backoff (so
    that the retries land within the drain: reschedules and attempt history)."""
    with bench.database("bill") as dsn:
        fill_ready(dsn, jobs)
        settle(dsn, "receipt_jobs")
        children = Children(_fleet(dsn, processes, slots, batch, admission,
                                   delay_ms=delay_ms or None, fail_percent=fail_percent or None,
                                   retry_base_seconds=0.05 if fail_percent else None))
        try:
            children.go()
            out = metered_drain(bench, dsn, children.alive, timeout_seconds)
            with psycopg.connect(dsn, **METER) as c:
                deadline = time.monotonic() + timeout_seconds
                while not _nothing_left(c):
                    if time.monotonic() > deadline or not children.alive():
                        raise RuntimeError("the drain did not finish")
                    time.sleep(0.1)
                left = jobs - _done(c)
            tails = children.stop()
        finally:
            children.stop()
    out["worker_cpu_us"] = round(children.cpu_seconds(tails) / jobs * 1e6, 1)
    out.update(row="receipts", processes=processes, slots=slots, batch=batch,
               admission=admission, delay_ms=delay_ms, fail_percent=fail_percent,
               jobs_per_second=round(out["jobs"] / max(out["seconds"], 1e-9)))
    if left:
        raise RuntimeError(f"{left} jobs not done")
    return out


def bill_maintenance(bench: Bench, *, jobs: int, batch: int = 100) -> dict[str, Any]:
    """What a job costs after its delivery: vacuum, retention's prune, vacuum again.

    *jobs* ready jobs are claimed and acked by pgbench (unmetered); then three
    metered steps, each billed per job: ``VACUUM receipt_jobs`` (the two dead
    versions a job's claim and ack left, and their index entries); the
    ``prune`` statement in batches of 1,000 with a retention of 0 (the
    delete); ``VACUUM receipt_jobs`` again (the deleted rows).
    """
    from receipts.statements import statements

    transactions = max(1, jobs // batch)
    jobs = transactions * batch
    out: dict[str, Any] = {"row": "maintenance", "jobs": jobs, "per": "job"}
    with bench.database("bill") as dsn:
        fill_ready(dsn, jobs)
        settle(dsn, "receipt_jobs")
        with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as fh:
            fh.write(raw.pgbench_script(batch))
            path = fh.name
        try:
            subprocess.run(raw.pgbench_argv(bench, dsn, path, clients=1,
                                            transactions=transactions),
                           check=True, capture_output=True, env=raw.pgbench_env(), timeout=600)
        finally:
            Path(path).unlink(missing_ok=True)
        prune = statements()["prune"].replace("%(retention_seconds)s", "0").replace(
            "%(batch)s", "1000")
        steps = (("vacuum_after_ack", ["VACUUM receipt_jobs"]),
                 ("prune", [prune] * (jobs // 1000 + 1)),
                 ("vacuum_after_prune", ["VACUUM receipt_jobs"]))
        with psycopg.connect(dsn, autocommit=True, application_name="maintenance") as conn:
            for name, sqls in steps:
                with metered(bench, dsn) as meter:
                    for sql in sqls:
                        conn.execute(sql)
                    meter.stop()
                    billed = meter.bill(jobs)
                out[name] = {k: billed[k] for k in ("db_cpu_us", "wal_bytes", "wal_fpi",
                                                    "wal_by_record", "seconds")}
    for key in ("db_cpu_us", "wal_bytes", "wal_fpi"):
        out[key] = round(sum(out[name][key] for name, _ in steps), 2)
    out.update(statements=0.0, dead_tuples=0.0, wal_records=0.0,
               wal_bytes_outside_statements=0.0)
    return out


def bill_idle(bench: Bench, *, processes: int, seconds: float = 30.0, slots: int = SLOTS,
              admission: bool | None = None) -> dict[str, Any]:
    """*processes* workers on an empty queue for *seconds*: the bill per second."""
    with bench.database("bill") as dsn:
        settle(dsn, "receipt_jobs")
        children = Children(_fleet(dsn, processes, slots, 100, admission))
        try:
            children.go()
            time.sleep(3.0)  # past start-up (the first claim, LISTEN, the first stats)
            with metered(bench, dsn) as meter:
                time.sleep(seconds)
                meter.stop()
                children.stop()
                out = meter.bill(0)
        finally:
            children.stop()
    out.update(row="idle", processes=processes, slots=slots, admission=admission)
    return out


def bill_steady(bench: Bench, *, processes: int, rate: float = 200.0, seconds: float = 20.0,
                slots: int = SLOTS, admission: bool | None = None) -> dict[str, Any]:
    """Jobs enqueued one per transaction at *rate*/s (public API) while *processes*
    workers keep up; billed per delivered job. The enqueuing session's CPU is
    ``enqueue_cpu_us``, apart from ``db_cpu_us`` (the queue's); its WAL is in
    ``wal_bytes`` (``by_statement["enqueue"]`` says how much)."""
    with bench.database("bill") as dsn:
        settle(dsn, "receipt_jobs")
        children = Children(_fleet(dsn, processes, slots, 100, admission))
        try:
            children.go()
            time.sleep(3.0)
            with metered(bench, dsn) as meter, \
                    psycopg.connect(dsn, application_name="enqueue") as conn:
                t0 = time.monotonic()
                n = 0
                while time.monotonic() - t0 < seconds:
                    delay = t0 + n / rate - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    with conn.transaction():
                        enqueue(conn, f"s-{n}")
                    n += 1
                deadline = time.monotonic() + 30
                while not _nothing_left(meter._conn) and time.monotonic() < deadline:
                    time.sleep(0.05)
                meter.stop()
                children.stop()
                done = _done(meter._conn)
                out = meter.bill(done)
        finally:
            children.stop()
    out.update(row="steady", processes=processes, slots=slots, admission=admission,
               rate=rate, enqueued=n)
    return out


# ------------------------------------------------------------------ the plan


Row = tuple[str, Callable[[Bench], dict[str, Any]]]


def rows(*, jobs: int, processes: Sequence[int] = PROCESSES, idle_seconds: float = 20.0,
         steady_seconds: float = 15.0, steady_rate: float = 200.0,
         admission_on: bool = True, delay_ms: float = 200.0, delay_jobs: int = 20_000,
         fail_percent: float = 3.0, maintenance: bool = True) -> list[Row]:
    """The bill's rows in run order: (key, run). A 0 / False argument leaves its rows out."""
    out: list[Row] = [(f"raw:{n}", partial(bill_raw, jobs=jobs, clients=n)) for n in processes]
    out += [(f"receipts:{n}", partial(bill_receipts, jobs=jobs, processes=n))
            for n in processes]
    if delay_ms:
        out += [(f"latency:{n}", partial(bill_receipts, jobs=delay_jobs, processes=n,
                                         delay_ms=delay_ms)) for n in processes]
    ends = (processes[0], processes[-1])
    if fail_percent:
        out += [(f"failures:{n}", partial(bill_receipts, jobs=delay_jobs, processes=n,
                                          fail_percent=fail_percent)) for n in ends]
    if admission_on:
        out += [(f"receipts:{n}:admission", partial(bill_receipts, jobs=jobs, processes=n,
                                                    admission=True)) for n in ends]
    if idle_seconds:
        out += [(f"idle:{n}", partial(bill_idle, processes=n, seconds=idle_seconds))
                for n in ends]
    if maintenance:
        out.append(("maintenance", partial(bill_maintenance, jobs=jobs)))
    if steady_seconds:
        out += [(f"steady:{n}", partial(bill_steady, processes=n, rate=steady_rate,
                                        seconds=steady_seconds)) for n in ends]
    return out


def _median_at(runs: list[dict[str, Any]], *path: str) -> float:
    """The median over *runs* of ``run[path[0]][path[1]]…`` (0 where absent), rounded."""
    values = []
    for run in runs:
        value: Any = run
        for key in path:
            value = value.get(key, {}) if isinstance(value, dict) else {}
        values.append(float(value) if isinstance(value, int | float) else 0.0)
    return round(statistics.median(values), 5)


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Median over rounds of each row's headline figures and of its breakdown."""
    out: dict[str, Any] = {}
    for key, rs in runs.items():
        row: dict[str, Any] = {k: _median_at(rs, k) for k in (
            "db_cpu_us", "wal_bytes", "statements", "dead_tuples", "wal_fpi", "wal_records",
            "wal_bytes_outside_statements")}
        if "jobs_per_second" in rs[0]:
            row["jobs_per_second"] = _median_at(rs, "jobs_per_second")
        for extra in ("worker_cpu_us", "enqueue_cpu_us"):
            if extra in rs[0]:
                row[extra] = _median_at(rs, extra)
        for step in ("vacuum_after_ack", "prune", "vacuum_after_prune"):
            if step in rs[0]:
                row[step] = {k: _median_at(rs, step, k) for k in ("db_cpu_us", "wal_bytes")}
        row["per"] = rs[0]["per"]
        procs = sorted({p for r in rs for p in r.get("cpu_us_by_process", {})})
        row["cpu_us_by_process"] = {p: _median_at(rs, "cpu_us_by_process", p) for p in procs}
        kinds = sorted({k for r in rs for k in r.get("by_statement", {})})
        fields = ("calls", "rows_per_call", "exec_us", "plan_us", "wal_bytes", "wal_fpi")
        row["by_statement"] = {k: {f: _median_at(rs, "by_statement", k, f) for f in fields}
                               for k in kinds}
        recs = {k for r in rs for k in r.get("wal_by_record", {})}
        row["wal_by_record"] = dict(sorted(
            ((k, {f: _median_at(rs, "wal_by_record", k, f)
                  for f in ("count", "bytes", "fpi_bytes")}) for k in recs),
            key=lambda kv: -kv[1]["bytes"]))
        row["rounds"] = len(rs)
        out[key] = row
    ref = out.get("raw:1")
    if ref:
        for row in out.values():
            if row["per"] == "job":
                row["cpu_vs_raw1"] = round(row["db_cpu_us"] / max(ref["db_cpu_us"], 1e-9), 2)
                row["wal_vs_raw1"] = round(row["wal_bytes"] / max(ref["wal_bytes"], 1e-9), 2)
    return out


def headline(summary: dict[str, Any]) -> str:
    """One line per row: DB CPU, WAL, statements, dead tuples (per job or per second)."""
    return table(summary, details=False)


def table(summary: dict[str, Any], *, details: bool = True) -> str:
    """The headline table and, per row, where the CPU and the WAL went."""
    lines = [f"{'row':<26}{'unit':>7}{'DB CPU µs':>11}{'×raw1':>7}{'WAL B':>9}{'×raw1':>7}"
             f"{'stmts':>8}{'dead':>7}{'FPI':>7}{'jobs/s':>9}{'wkr CPU µs':>12}"]
    for key, r in summary.items():
        lines.append(
            f"{key:<26}{r['per']:>7}{r['db_cpu_us']:>11.1f}{r.get('cpu_vs_raw1', 0):>7.2f}"
            f"{r['wal_bytes']:>9.1f}{r.get('wal_vs_raw1', 0):>7.2f}{r['statements']:>8.3g}"
            f"{r['dead_tuples']:>7.2f}{r['wal_fpi']:>7.3f}{r.get('jobs_per_second', 0):>9,.0f}"
            + (f"{r['worker_cpu_us']:>12.1f}" if "worker_cpu_us" in r else ""))
    if not details:
        return "\n".join(lines)
    for key, r in summary.items():
        lines.append(f"\n{key} (per {r['per']}):")
        procs = ", ".join(f"{p} {v:.1f}" for p, v in sorted(
            r["cpu_us_by_process"].items(), key=lambda kv: -kv[1]) if v >= 0.05)
        lines.append(f"  CPU µs by process: {procs}")
        for k, s in sorted(r["by_statement"].items(), key=lambda kv: -kv[1]["exec_us"]):
            lines.append(f"  {k:<15} calls {s['calls']:.3g} (rows/call {s['rows_per_call']:.0f})"
                         f"  exec {s['exec_us']:.2f} µs (plan {s.get('plan_us', 0):.2f})"
                         f"  WAL {s['wal_bytes']:.1f} B"
                         f"  FPI {s['wal_fpi']:.4f}")
        lines.append(f"  WAL outside statements (commit records, vacuum, checkpoints):"
                     f" {r['wal_bytes_outside_statements']:.1f} B")
        top = [f"{k} {v['bytes']:.0f} B ({v['count']:.3g}"
               + (f", FPI {v['fpi_bytes']:.0f} B" if v["fpi_bytes"] else "") + ")"
               for k, v in list(r.get("wal_by_record", {}).items())[:8] if v["bytes"] >= 1]
        lines.append("  WAL by record: " + ", ".join(top))
    return "\n".join(lines)


def run(bench: Bench, plan: list[tuple[str, Callable[[Bench], dict[str, Any]]]], rounds: int,
        only: set[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every row once per round, rows interleaved (A B C … A B C …), odd rounds reversed."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for n in range(rounds):
        order = plan if n % 2 == 0 else list(reversed(plan))
        for key, fn in order:
            if only and key.split(":")[0] not in only and key not in only:
                continue
            t = time.monotonic()
            print(f"  round {n + 1}/{rounds} {key} …", end="", flush=True, file=sys.stderr)
            runs.setdefault(key, []).append(fn(bench))
            print(f" {time.monotonic() - t:.1f}s  load {os.getloadavg()[0]:.2f}",
                  flush=True, file=sys.stderr)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bill",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=100_000,
                   help="jobs per drain (default 100,000)")
    p.add_argument("--only", default="",
                   help="row kinds or keys, comma-separated (raw, receipts, idle, steady, "
                        "receipts:16…)")
    p.add_argument("--idle-seconds", type=float, default=20.0)
    p.add_argument("--steady-seconds", type=float, default=15.0)
    p.add_argument("--steady-rate", type=float, default=200.0)
    p.add_argument("--out", type=Path, help="write the runs and the summary as JSON")
    args = p.parse_args(argv)
    bench = Bench()
    load = [os.getloadavg()]
    try:
        runs = run(bench, rows(jobs=args.jobs, idle_seconds=args.idle_seconds,
                               steady_seconds=args.steady_seconds,
                               steady_rate=args.steady_rate),
                   args.rounds, {s for s in args.only.split(",") if s})
    finally:
        bench.cleanup()
    load.append(os.getloadavg())
    summary = summarise(runs)
    print(table(summary))
    print(f"\nload average at start / end: {load[0][0]:.2f} / {load[1][0]:.2f}")
    if args.out:
        write_json({"summary": summary, "runs": runs, "load_average": load}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
