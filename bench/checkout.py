"""Bench scenario "checkout": what enqueueing a receipt costs the order's own transaction.

``python -m bench.checkout`` (from the bench virtualenv for the peers' rows:
``.tmp/bench-venv/bin/python -m bench.checkout``; ``--smoke`` for the CI size).

A checkout is one transaction: one order row (a primary key and three indexed
columns), three order-line rows (a foreign key to the order), then the
receipt's job, then COMMIT. Each disk gets its own durable embedded
PostgreSQL 18 (``bench.pg.Bench``):

* ``local``: this machine's disk;
* ``slow``: the same with 1 ms added to every ``fdatasync``/``fsync`` of the
  server (``bench/slowsync.c``, built with ``cc`` into a temporary folder at
  run time and loaded with ``LD_PRELOAD``; a cloud volume's flush).

Every run gets a fresh database cloned from a template (the migrated queue,
the order tables, the peers' schemas). The parts:

1. **throughput**: pgbench ``-M prepared`` at 1, 8, 32 and 64 clients for
   ``--seconds`` each, every row once per round, rounds interleaved with the
   row order reversed every other round (A B C … C B A …); per run the
   checkouts/s, p50/p99 per transaction (pgbench's per-transaction log), the
   server's CPU and WAL bytes per checkout. Rows: the order alone; + a plain
   job-row insert (``INSERT INTO receipt_jobs (id, order_id) VALUES
   (gen_random_uuid(), …)``); + ``SELECT receipts_enqueue(…)``; + the statement
   ``receipts.enqueue()`` sends (``enqueue_one`` of enqueue.sql, its client-made
   UUIDv7 id written as a server-side expression of the same shape); + 0.2.0's
   default (its one-statement enqueue plus ``pg_notify`` in the transaction);
   + PgQueuer's and Procrastinate's enqueue (their own statement text, taken
   from the installed libraries, with their NOTIFY triggers: their defaults).
2. **rates**: fixed arrival rates (pgbench ``-R``; 16, 16 and 32 clients for
   200, 500 and 900 checkouts/s); p50/p99 per transaction counted from its
   scheduled start, so a queue that cannot keep up shows as growing latency;
   the achieved rate.
3. **python**: the real API in threads of one process, as a new user tries it
   (``receipts.enqueue(conn, order)`` at its defaults against the same
   checkout inserting the job row itself through psycopg, and 0.2.0's
   default), at the same client counts.
4. **rowcost**: local disk, 32 clients: the server's CPU and WAL per checkout
   with ``receipts.enqueue()``'s statement, and with one thing removed each
   (ON CONFLICT, the ready index, the unique order_id index, the four partial
   indexes an insert never enters, the CHECK constraints), beside the order
   alone.

Prints the tables and writes every run to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from bench import peers
from bench.document import write_json
from bench.pg import NINE_CHECKS, Bench
from bench.run import machine
from bench.scenarios import percentile
from receipts.enqueue import NOTIFY_CHANNEL, enqueue
from receipts.statements import statements

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "enqueue-checkout.json"
TEMPLATE = "checkout_template"

ORDER_TABLES = """
CREATE TABLE checkout_orders (
  id text PRIMARY KEY,
  customer_id bigint NOT NULL,
  email text NOT NULL,
  status text NOT NULL DEFAULT 'placed',
  total_cents integer NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ON checkout_orders (customer_id);
CREATE INDEX ON checkout_orders (email);
CREATE INDEX ON checkout_orders (created_at);
CREATE TABLE checkout_order_lines (
  order_id text NOT NULL REFERENCES checkout_orders (id),
  line smallint NOT NULL,
  sku text NOT NULL,
  qty integer NOT NULL,
  price_cents integer NOT NULL,
  PRIMARY KEY (order_id, line)
);
CREATE TABLE checkout_minimal_orders (id text PRIMARY KEY);
"""

#: The checkout before its receipt: the order and its three lines (pgbench script).
HEAD = (
    "\\set n random(1, 4611686018427387903)\n"
    "\\set c random(1, 100000)\n"
    "BEGIN;\n"
    "INSERT INTO checkout_orders (id, customer_id, email, total_cents)"
    " VALUES ('o' || :n, :c, 'c' || :c || '@example.com', 4999);\n"
    "INSERT INTO checkout_order_lines (order_id, line, sku, qty, price_cents)"
    " VALUES ('o' || :n, 1, 'sku-1', 1, 999), ('o' || :n, 2, 'sku-2', 2, 1500),"
    " ('o' || :n, 3, 'sku-3', 1, 2500);\n"
)
#: The minimal checkout (``--order minimal``): one order row of a primary key alone, so
#: the receipt's part of the transaction weighs the most it can.
HEAD_MINIMAL = (
    "\\set n random(1, 4611686018427387903)\n"
    "BEGIN;\n"
    "INSERT INTO checkout_minimal_orders (id) VALUES ('o' || :n);\n"
)
#: ``--order``: the checkout before its receipt.
HEADS = {"realistic": HEAD, "minimal": HEAD_MINIMAL}
#: A time-ordered UUIDv7-shaped id made by the server (what the API makes in the
#: client): this millisecond, then bits from :n. Costs the server a few µs the
#: real client-side id does not.
V7_EXPR = ("(lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::int8), 12, '0')"
           " || '7000' || '8' || lpad(to_hex(:n % 1152921504606846976), 15, '0'))::uuid")

ROW_NAMES = {
    "order": "order alone (no queue)",
    "plain": "+ plain job-row insert",
    "function": "+ SELECT receipts_enqueue()",
    "receipts": "+ receipts.enqueue() (its statement)",
    "v020": "+ 0.2.0 default (pg_notify in the txn)",
    "pgqueuer": "+ PgQueuer enqueue (default)",
    "procrastinate": "+ Procrastinate defer (default)",
}


def receipts_statement() -> str:
    """``enqueue_one`` as ``receipts.enqueue()`` sends it (unqualified tables, no trace)."""
    text = statements(None)["enqueue_one"]
    return (text.replace("%(id)s", V7_EXPR).replace("%(order_id)s", "'o' || :n")
            .replace("%(run_at)s::timestamptz", "NULL::timestamptz"))


def v020_statement() -> str:
    """0.2.0's default: its one-statement enqueue of one order, then ``pg_notify``."""
    text = statements(None)["enqueue"]
    text = (text.replace("%(order_ids)s::text", "('o' || :n)::text")
            .replace("%(count)s::int8", "1::int8").replace("%(count)s", "1")
            .replace("%(run_at)s::timestamptz", "NULL::timestamptz"))
    return f"{text};\nSELECT pg_notify('{NOTIFY_CHANNEL}', '')"


def pgqueuer_statement() -> str:
    """PgQueuer's enqueue of one job (``Queries.enqueue("noop", payload)``), its defaults."""
    from pgqueuer.adapters.persistence.qb import QueryQueueBuilder

    text = QueryQueueBuilder().build_enqueue_query()
    for placeholder, value in (
            ("$1::int[]", "ARRAY[0]::int[]"), ("$2::text[]", "ARRAY['noop']::text[]"),
            ("$3::bytea[]", "ARRAY[convert_to('o' || :n, 'UTF8')]::bytea[]"),
            ("$4::interval[]", "ARRAY['0 seconds'::interval]"),
            ("$5::text[]", "ARRAY[NULL]::text[]"), ("$6::jsonb[]", "ARRAY['null'::jsonb]")):
        if placeholder not in text:
            raise RuntimeError(f"PgQueuer's enqueue has no {placeholder} any more")
        text = text.replace(placeholder, value)
    return "\n".join(line for line in text.splitlines() if not line.strip().startswith("--"))


def procrastinate_statement() -> str:
    """Procrastinate's ``defer`` of one job (``defer_jobs`` of its queries.sql), its defaults."""
    from procrastinate import sql as procrastinate_sql

    text = procrastinate_sql.queries["defer_jobs"]
    job = ("ARRAY[ROW('default', 'noop', 0, NULL, NULL, jsonb_build_object('order', 'o' || :n),"
           " NULL)::procrastinate_job_to_defer_v1]")
    if "%(jobs)s::procrastinate_job_to_defer_v1[]" not in text:
        raise RuntimeError("Procrastinate's defer_jobs changed shape")
    return str(text).replace("%(jobs)s::procrastinate_job_to_defer_v1[]", job).strip().rstrip(";")


def job_parts(available: dict[str, str | None]) -> dict[str, str]:
    """Row name → the SQL after the order (empty for the order alone)."""
    parts = {
        "order": "",
        "plain": "INSERT INTO receipt_jobs (id, order_id) VALUES (gen_random_uuid(), 'o' || :n)",
        "function": "SELECT receipts_enqueue('o' || :n)",
        "receipts": receipts_statement(),
        "v020": v020_statement(),
    }
    if available.get("pgqueuer"):
        parts["pgqueuer"] = pgqueuer_statement()
    if available.get("procrastinate"):
        parts["procrastinate"] = procrastinate_statement()
    return parts


def script(part: str, order: str = "realistic") -> str:
    """The whole pgbench script of one checkout (*order*: a key of :data:`HEADS`) with
    *part* as its receipt."""
    return HEADS[order] + (f"{part};\n" if part else "") + "COMMIT;\n"


# ----------------------------------------------------------------- servers


def build_shim() -> Path:
    """Compile ``bench/slowsync.c`` into a fresh temporary folder; the ``.so``'s path.

    Raises ``RuntimeError`` when no C compiler is there (``scripts/install-tools.sh``
    installs one).
    """
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) to build the slow-flush shim")
    folder = Path(tempfile.mkdtemp(prefix="receipts-slowsync-"))
    folder.chmod(0o755)  # the server runs as another user
    out = folder / "slowsync.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(HERE / "slowsync.c"),
                    "-ldl"], check=True, capture_output=True, text=True)
    out.chmod(0o755)
    return out


def start_server(disk: str, flush_delay_ms: float) -> tuple[Bench, Path | None]:
    """A durable server for *disk* (``local`` or ``slow``) and the shim it loaded."""
    if disk == "local":
        return Bench(), None
    shim = build_shim()
    bench = Bench(env={"LD_PRELOAD": str(shim), "SLOWSYNC_US": str(round(flush_delay_ms * 1000))})
    pid = (bench.server.data / "postmaster.pid").read_text().split()[0]
    if str(shim) not in Path(f"/proc/{pid}/maps").read_text():
        bench.cleanup()
        raise RuntimeError("the server did not load the slow-flush shim")
    return bench, shim


def make_template(bench: Bench, available: dict[str, str | None]) -> None:
    """The checkout template: the migrated queue, the order tables, the peers' schemas."""
    bench._ensure_template()
    with psycopg.connect(bench.server.dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE}"')
        conn.execute(f'CREATE DATABASE "{TEMPLATE}" TEMPLATE bench_template')
    dsn = bench.server.dsn_for(TEMPLATE)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ORDER_TABLES)
    for peer in peers.PEERS:
        if available.get(peer):
            peers.install(peer, dsn)


# ----------------------------------------------------------------- pgbench


def _sessions_left(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()").fetchone()
    return int(row[0]) if row else 0


def _wal_lsn(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    return int(row[0]) if row else 0


def pgbench(bench: Bench, dsn: str, text: str, *, clients: int, seconds: float,
            rate: float | None = None) -> dict[str, Any]:
    """One pgbench run of *text*; checkouts/s, latency percentiles (ms), CPU and WAL per txn.

    Latency is per transaction from pgbench's log; with *rate* (``-R``) it counts
    from the transaction's scheduled start (pgbench's definition), so a server
    that falls behind shows a growing latency.
    """
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkout.sql"
        path.write_text(text)
        cmd = [str(Path(bench.bin_dir) / "pgbench"), "-n", "-M", "prepared",
               "-h", "127.0.0.1", "-p", str(bench.port), "-U", "postgres",
               "-c", str(clients), "-j", str(min(clients, 2)), "-T", str(max(1, round(seconds))),
               "-l", "--log-prefix", str(Path(tmp) / "log"), "-f", str(path), str(name)]
        if rate is not None:
            cmd[cmd.index("-T"):cmd.index("-T")] = ["-R", str(rate)]
        wal = _wal_lsn(dsn)
        cpu = bench.server_cpu_seconds()
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
        deadline = time.monotonic() + 10
        while _sessions_left(dsn) and time.monotonic() < deadline:
            time.sleep(0.01)  # a backend's CPU is counted once it has ended
        cpu = bench.server_cpu_seconds() - cpu
        wal = _wal_lsn(dsn) - wal
        if result.returncode != 0:
            raise RuntimeError(f"pgbench failed: {result.stderr.strip()[-800:]}")
        latencies: list[float] = []
        for log in Path(tmp).glob("log*"):
            for line in log.read_text().splitlines():
                fields = line.split()
                if len(fields) >= 6 and fields[2] != "skipped":
                    latencies.append(int(fields[2]) / 1000.0)
    done = len(latencies)
    match = re.search(r"number of failed transactions: (\d+)", result.stdout)
    return {
        "clients": clients, "seconds": seconds, "rate": rate,
        "checkouts": done,
        "per_second": done / seconds,
        "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
        "db_cpu_us": round(cpu / done * 1e6, 1) if done else None,
        "wal_bytes": round(wal / done, 1) if done else None,
        "failed": int(match.group(1)) if match else 0,
    }


@dataclass
class Plan:
    """Sizes of one run (``--smoke``: CI sizes, figures meaningless)."""

    rounds: int = 3
    seconds: float = 5.0
    clients: tuple[int, ...] = (1, 8, 32, 64)
    rates: tuple[tuple[float, int], ...] = ((200.0, 16), (500.0, 16), (900.0, 32))
    rate_seconds: float = 10.0
    rate_rounds: int = 2
    rate_rows: tuple[str, ...] = ("order", "plain", "function", "receipts", "v020")
    python_clients: tuple[int, ...] = (1, 8, 32, 64)
    python_rounds: int = 2
    rowcost_clients: int = 32
    #: throughput rows to run (None: all of :func:`job_parts`).
    rows: tuple[str, ...] | None = None
    #: rowcost rows to run (None: all of :func:`rowcost_rows`).
    rowcost_only: tuple[str, ...] | None = None
    #: A fresh database per run (False: one per disk and part, for the smoke's speed).
    fresh: bool = True
    disks: tuple[str, ...] = ("local", "slow")
    flush_delay_ms: float = 1.0
    #: The checkout before the receipt (a key of :data:`HEADS`; pgbench parts only).
    order: str = "realistic"
    commit_seconds: float = 2.0
    parts: tuple[str, ...] = ("throughput", "rates", "python", "rowcost")
    #: The parts also run on the slow disk (rowcost: local only; CPU, not flushes).
    slow_parts: tuple[str, ...] = ("throughput", "rates", "python")
    peers: dict[str, str | None] = field(default_factory=peers.available)

    @classmethod
    def smoke(cls) -> Plan:
        return cls(rounds=1, seconds=1.0, clients=(4,), rates=((50.0, 2),), rate_seconds=1.0,
                   rate_rounds=1, rate_rows=("order", "receipts"), python_clients=(2,),
                   python_rounds=1, rowcost_clients=2, commit_seconds=1.0,
                   slow_parts=("throughput",), rowcost_only=("receipts", "without ON CONFLICT"),
                   fresh=False, peers={name: None for name in peers.PEERS})


@contextmanager
def checkout_database(bench: Bench, plan: Plan) -> Iterator[Callable[[], Any]]:
    """A factory of databases for one part's runs: a fresh clone of the template per
    run, or (``plan.fresh`` False) the same clone for all of them."""
    if plan.fresh:
        yield lambda: bench.database("chk", template=TEMPLATE)
        return
    with bench.database("chk", template=TEMPLATE) as dsn:
        yield lambda: nullcontext(dsn)


def interleaved(names: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, name) in A B C, C B A, A B C … order."""
    out = []
    for r in range(rounds):
        order = list(names) if r % 2 == 0 else list(reversed(names))
        out += [(r, name) for name in order]
    return out


def throughput(bench: Bench, plan: Plan, parts: dict[str, str]) -> list[dict[str, Any]]:
    runs = []
    with checkout_database(bench, plan) as database:
        for clients in plan.clients:
            for r, row in interleaved(list(parts), plan.rounds):
                with database() as dsn:
                    run = pgbench(bench, dsn, script(parts[row], plan.order),
                                  clients=clients,
                                  seconds=plan.seconds)
                runs.append({"part": "throughput", "row": row, "round": r, **run})
                _progress(runs[-1])
    return runs


def rates(bench: Bench, plan: Plan, parts: dict[str, str]) -> list[dict[str, Any]]:
    runs = []
    rows = [row for row in plan.rate_rows if row in parts]
    with checkout_database(bench, plan) as database:
        for rate, clients in plan.rates:
            for r, row in interleaved(rows, plan.rate_rounds):
                with database() as dsn:
                    run = pgbench(bench, dsn, script(parts[row], plan.order),
                                  clients=clients,
                                  seconds=plan.rate_seconds, rate=rate)
                runs.append({"part": "rates", "row": row, "round": r, **run})
                _progress(runs[-1])
    return runs


#: rowcost rows: (DDL run on the clone first, the receipt's SQL).
def rowcost_rows() -> dict[str, tuple[str, str]]:
    receipts = receipts_statement()
    no_conflict = receipts.replace("\nON CONFLICT DO NOTHING", "")
    if no_conflict == receipts:
        raise RuntimeError("enqueue_one has no ON CONFLICT clause any more")
    not_exists = receipts.replace("\nON CONFLICT DO NOTHING", "").replace(
        "VALUES (", "SELECT ").replace(
        "now()))\nRETURNING", "now())\nWHERE NOT EXISTS (SELECT 1 FROM receipt_jobs"
        " WHERE order_id = 'o' || :n)\nRETURNING")
    if "WHERE NOT EXISTS" not in not_exists:
        raise RuntimeError("enqueue_one changed shape")
    v020 = v020_statement().rpartition(";\n")[0]  # without its pg_notify
    function = "SELECT receipts_enqueue('o' || :n)"
    signature = "receipts_enqueue(text, timestamptz, text)"
    return {
        "order": ("", ""),
        "plain": ("", job_parts({})["plain"]),
        "receipts": ("", receipts),
        "receipts_enqueue() (migration 0009: the caller's rights)": ("", function),
        "receipts_enqueue() as 0006 made it (SECURITY DEFINER, pinned search_path)": (
            f"ALTER FUNCTION {signature} SECURITY DEFINER SET search_path = public, pg_temp",
            function),
        "0.2.0's one-statement enqueue, no pg_notify": ("", v020),
        "without ON CONFLICT": ("", no_conflict),
        "NOT EXISTS pre-check instead of ON CONFLICT": ("", not_exists),
        "without receipt_jobs_ready": ("DROP INDEX receipt_jobs_ready", receipts),
        "without the unique order_id index": (
            "ALTER TABLE receipt_jobs DROP CONSTRAINT receipt_jobs_order_id_key", no_conflict),
        "without the 4 partial indexes an insert never enters": (
            "DROP INDEX receipt_jobs_expired, receipt_jobs_finished, receipt_jobs_failed,"
            " receipt_jobs_discarded", receipts),
        "without the CHECK rules (migration 0012's receipt_jobs_rules)": (
            "ALTER TABLE receipt_jobs DROP CONSTRAINT receipt_jobs_rules", receipts),
        "with the nine CHECK constraints of 0011 instead of 0012's one": (NINE_CHECKS, receipts),
    }


def rowcost(bench: Bench, plan: Plan) -> list[dict[str, Any]]:
    runs = []
    rows = {k: v for k, v in rowcost_rows().items()
            if plan.rowcost_only is None or k in plan.rowcost_only}
    for r, row in interleaved(list(rows), plan.rounds):
        ddl, part = rows[row]
        with bench.database("chk", template=TEMPLATE) as dsn:
            if ddl:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute(ddl)
            run = pgbench(bench, dsn, script(part, plan.order), clients=plan.rowcost_clients,
                          seconds=plan.seconds)
        runs.append({"part": "rowcost", "row": row, "round": r, **run})
        _progress(runs[-1])
    return runs


# ------------------------------------------------------------- Python clients


def _python_job(row: str) -> Callable[[psycopg.Connection[Any], str], None]:
    def plain(conn: psycopg.Connection[Any], order: str) -> None:
        conn.execute("INSERT INTO receipt_jobs (id, order_id) VALUES (gen_random_uuid(), %s)",
                     (order,))

    def receipts(conn: psycopg.Connection[Any], order: str) -> None:
        enqueue(conn, order)

    def v020(conn: psycopg.Connection[Any], order: str) -> None:
        enqueue(conn, order)
        conn.execute("SELECT pg_notify(%s, '')", (NOTIFY_CHANNEL,))

    def nothing(conn: psycopg.Connection[Any], order: str) -> None:
        return None

    return {"order": nothing, "plain": plain, "receipts": receipts, "v020": v020}[row]


def python_clients(dsn: str, row: str, clients: int, seconds: float) -> dict[str, Any]:
    """*clients* threads of this process, each a connection running checkouts for *seconds*."""
    job = _python_job(row)
    barrier = threading.Barrier(clients + 1)
    latencies: list[list[float]] = [[] for _ in range(clients)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with psycopg.connect(dsn) as conn:
                barrier.wait(30)
                mine = latencies[i]
                while not stop.is_set():
                    order = uuid.uuid4().hex
                    t = time.perf_counter()
                    with conn.transaction():
                        conn.execute("INSERT INTO checkout_orders (id, customer_id, email,"
                                     " total_cents) VALUES (%s, %s, %s, 4999)",
                                     (order, 7, "c7@example.com"))
                        conn.execute("INSERT INTO checkout_order_lines (order_id, line, sku, qty,"
                                     " price_cents) VALUES (%s, 1, 'sku-1', 1, 999),"
                                     " (%s, 2, 'sku-2', 2, 1500), (%s, 3, 'sku-3', 1, 2500)",
                                     (order, order, order))
                        job(conn, order)
                    mine.append((time.perf_counter() - t) * 1000)
        except BaseException as exc:  # reported below
            errors.append(exc)
            barrier.abort()  # release the others

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait(60)
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(60)
    if errors:
        raise RuntimeError(f"a checkout client failed: {errors[0]!r}")
    flat = [x for per in latencies for x in per]
    return {"clients": clients, "seconds": seconds, "checkouts": len(flat),
            "per_second": len(flat) / seconds, "p50_ms": percentile(flat, 50),
            "p99_ms": percentile(flat, 99)}


def python(bench: Bench, plan: Plan) -> list[dict[str, Any]]:
    runs = []
    with checkout_database(bench, plan) as database:
        for clients in plan.python_clients:
            for r, row in interleaved(["order", "plain", "receipts", "v020"],
                                      plan.python_rounds):
                with database() as dsn:
                    run = python_clients(dsn, row, clients, plan.seconds)
                runs.append({"part": "python", "row": row, "round": r, **run})
                _progress(runs[-1])
    return runs


def _progress(run: dict[str, Any]) -> None:
    print(f"    {run['part']} {run['row']} c={run['clients']} r={run.get('rate')}: "
          f"{run['per_second']:,.0f}/s p99 {run['p99_ms']:.1f} ms", file=sys.stderr, flush=True)


def commit_latency(bench: Bench, seconds: float) -> dict[str, Any]:
    """One client's small durable commits for *seconds*: what the disk's flush costs here."""
    with bench.database("chk", template=TEMPLATE) as dsn:
        run = pgbench(bench, dsn, "SELECT pg_logical_emit_message(true, 'bench', '');\n",
                      clients=1, seconds=seconds)
    return {"p50_ms": run["p50_ms"], "p99_ms": run["p99_ms"], "per_second": run["per_second"]}


# ------------------------------------------------------------------ report


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per disk, part, row and clients (or rate): medians over the rounds."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for run in runs:
        key = (run["disk"], run["part"], run["row"],
               str(run["rate"] if run.get("rate") else run["clients"]))
        groups.setdefault(key, []).append(run)
    out: dict[str, Any] = {}
    for (disk, part, row, point), group in groups.items():
        cell: dict[str, Any] = {k: _median([g[k] for g in group if g.get(k) is not None])
                for k in ("per_second", "p50_ms", "p99_ms", "db_cpu_us", "wal_bytes")
                if any(g.get(k) is not None for g in group)}
        cell["runs"] = len(group)
        cell["per_second_runs"] = [round(g["per_second"]) for g in group]
        out.setdefault(disk, {}).setdefault(part, {}).setdefault(row, {})[point] = cell
    return out


def round_ratios(runs: Sequence[dict[str, Any]], disk: str, row: str, base: str,
                 clients: int = 32) -> list[float]:
    """Per interleaved round of the pgbench throughput part: *row*'s checkouts/s over
    *base*'s, at *clients* (rounds where either is missing are left out)."""
    rates: dict[tuple[str, int], float] = {}
    for run in runs:
        if run["part"] == "throughput" and run["disk"] == disk and run["clients"] == clients:
            rates[(run["row"], run["round"])] = run["per_second"]
    return [rates[(row, r)] / rates[(base, r)] for (name, r) in sorted(rates)
            if name == row and (base, r) in rates and rates[(base, r)] > 0]


def targets(summary: dict[str, Any], plan: Plan,
            runs: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    out = []
    for disk, parts in summary.items():
        thr = parts.get("throughput", {})
        if {"receipts", "plain", "order"} <= set(thr) and "32" in thr.get("plain", {}):
            mine = thr["receipts"]["32"]["per_second"]
            plain = thr["plain"]["32"]["per_second"]
            order = thr["order"]["32"]["per_second"]
            out.append({"disk": disk, "target": "receipts.enqueue() / plain job-row insert, "
                        "32 clients", "value": mine / plain, "goal": ">= 0.9",
                        "met": mine / plain >= 0.9})
            out.append({"disk": disk, "target": "checkout with receipts.enqueue() / no queue, "
                        "32 clients", "value": mine / order, "goal": ">= 0.8",
                        "met": mine / order >= 0.8})
            if "function" in thr:
                fn = thr["function"]["32"]["per_second"]
                out.append({"disk": disk, "target": "receipts_enqueue() / plain job-row insert, "
                            "32 clients", "value": fn / plain, "goal": ">= 0.9",
                            "met": fn / plain >= 0.9})
                per_round = round_ratios(runs, disk, "function", "plain")
                if per_round:
                    median = statistics.median(per_round)
                    out.append({"disk": disk, "target": "receipts_enqueue() / plain job-row "
                                "insert, 32 clients, median of the rounds' ratios "
                                f"({', '.join(f'{x:.2f}' for x in per_round)})",
                                "value": median, "goal": ">= 0.85", "met": median >= 0.85})
            per_round = round_ratios(runs, disk, "receipts", "plain")
            if per_round:
                median = statistics.median(per_round)
                out.append({"disk": disk, "target": "receipts.enqueue() / plain job-row insert, "
                            "32 clients, median of the rounds' ratios "
                            f"({', '.join(f'{x:.2f}' for x in per_round)})",
                            "value": median, "goal": ">= 0.9", "met": median >= 0.9})
        py = parts.get("python", {})
        if {"receipts", "plain"} <= set(py) and "32" in py["plain"]:
            ratio = py["receipts"]["32"]["per_second"] / py["plain"]["32"]["per_second"]
            out.append({"disk": disk, "target": "receipts.enqueue() / plain insert, Python "
                        "threads, 32 clients", "value": ratio, "goal": ">= 0.9",
                        "met": ratio >= 0.9})
        rt = parts.get("rates", {})
        for rate, _ in plan.rates:
            point = str(rate)
            order = rt.get("order", {}).get(point)
            if not order or order["per_second"] < 0.97 * rate:
                continue  # the database does not sustain this rate without the queue
            for row in ("receipts", "function"):
                mine, plain = rt.get(row, {}).get(point), rt.get("plain", {}).get(point)
                if mine and plain:
                    ratio = mine["p99_ms"] / max(plain["p99_ms"], 1e-9)
                    out.append({"disk": disk, "target": f"p99 at {rate:g}/s, {ROW_NAMES[row]} / "
                                "plain job-row insert", "value": ratio, "goal": "<= 1.2",
                                "met": ratio <= 1.2})
    return out


def table(doc: dict[str, Any]) -> str:
    lines = []
    summary = doc["summary"]
    for disk, parts in summary.items():
        flush = doc["commit_latency"].get(disk, {})
        lines.append(f"\n== {disk} disk (one small durable commit: p50 "
                     f"{flush.get('p50_ms', 0):.2f} ms) ==")
        for part, label in (("throughput", "pgbench: checkouts/s (p99 ms)"),
                            ("python", "Python threads, the real API: checkouts/s (p99 ms)")):
            rows = parts.get(part)
            if not rows:
                continue
            points = sorted({p for r in rows.values() for p in r}, key=float)
            lines.append(f"\n{label}")
            lines.append(f"{'':42}" + "".join(f"{p + ' clients':>20}" for p in points))
            for row, cells in rows.items():
                lines.append(f"{ROW_NAMES.get(row, row):42}" + "".join(
                    f"{cells[p]['per_second']:>11,.0f} ({cells[p]['p99_ms']:5.1f})"
                    if p in cells else f"{'':>20}" for p in points))
        rows = parts.get("rates")
        if rows:
            points = sorted({p for r in rows.values() for p in r}, key=float)
            lines.append("\nfixed arrival rate: p50 / p99 ms (achieved /s)")
            lines.append(f"{'':42}" + "".join(f"{p + '/s':>26}" for p in points))
            for row, cells in rows.items():
                lines.append(f"{ROW_NAMES.get(row, row):42}" + "".join(
                    f"{cells[p]['p50_ms']:>8.1f} / {cells[p]['p99_ms']:7.1f} "
                    f"({cells[p]['per_second']:4,.0f})" if p in cells else f"{'':>26}"
                    for p in points))
        rows = parts.get("rowcost")
        if rows:
            lines.append("\nrow cost, 32 clients: server CPU µs and WAL bytes per checkout, "
                         "checkouts/s")
            for row, cells in rows.items():
                (cell,) = cells.values()
                lines.append(f"{row:56}{cell.get('db_cpu_us', 0):>8.0f} µs "
                             f"{cell.get('wal_bytes', 0):>7.0f} B {cell['per_second']:>9,.0f}/s")
    lines.append("\ntarget                                                       disk    value "
                 " goal     met")
    for t in doc["targets"]:
        lines.append(f"{t['target']:60} {t['disk']:6} {t['value']:6.2f}  {t['goal']:8} "
                     f"{'yes' if t['met'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkout",
                                description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CI); figures meaningless")
    p.add_argument("--rounds", type=int)
    p.add_argument("--seconds", type=float)
    p.add_argument("--disks", help="comma-separated: local,slow")
    p.add_argument("--parts", help="comma-separated: throughput,rates,python,rowcost")
    p.add_argument("--flush-delay-ms", type=float, help="added to every flush on 'slow' (1)")
    p.add_argument("--clients", help="comma-separated client counts (1,8,32,64)")
    p.add_argument("--rows", help="comma-separated throughput rows (default: all)")
    p.add_argument("--rate-rounds", type=int)
    p.add_argument("--rowcost-rows", help="semicolon-separated rowcost rows (default: all)")
    p.add_argument("--order", choices=sorted(HEADS),
                   help="the checkout before the receipt: realistic (an order and three "
                        "lines, the default) or minimal (one key-only order row)")
    p.add_argument("--out", type=Path, help=f"JSON output (default {DEFAULT_OUT}; --smoke: none)")
    args = p.parse_args(argv)
    plan = Plan.smoke() if args.smoke else Plan()
    if args.rounds:
        plan.rounds = args.rounds
    if args.seconds:
        plan.seconds = args.seconds
    if args.disks:
        plan.disks = tuple(args.disks.split(","))
    if args.parts:
        plan.parts = tuple(args.parts.split(","))
    if args.flush_delay_ms is not None:
        plan.flush_delay_ms = args.flush_delay_ms
    if args.clients:
        plan.clients = plan.python_clients = tuple(int(c) for c in args.clients.split(","))
    if args.rows:
        plan.rows = tuple(args.rows.split(","))
    if args.rate_rounds:
        plan.rate_rounds = args.rate_rounds
    if args.order:
        plan.order = args.order
    if args.rowcost_rows:
        plan.rowcost_only = tuple(args.rowcost_rows.split(";"))
        unknown = set(plan.rowcost_only) - set(rowcost_rows())
        if unknown:
            p.error(f"unknown rowcost rows: {sorted(unknown)}")
    out = args.out if args.out is not None else (None if args.smoke else DEFAULT_OUT)
    started = datetime.now(UTC)
    info = machine()
    runs: list[dict[str, Any]] = []
    flush: dict[str, Any] = {}
    servers: dict[str, Any] = {}
    for disk in plan.disks:
        print(f"{disk} disk", file=sys.stderr, flush=True)
        bench, shim = start_server(disk, plan.flush_delay_ms)
        try:
            servers[disk] = {**bench.durability(), "shim": str(shim) if shim else None,
                             "flush_delay_ms": plan.flush_delay_ms if shim else 0.0}
            make_template(bench, plan.peers)
            parts = {k: v for k, v in job_parts(plan.peers).items()
                     if plan.rows is None or k in plan.rows}
            flush[disk] = commit_latency(bench, plan.commit_seconds)
            part_runs: list[dict[str, Any]] = []
            wanted = set(plan.parts) & (set(plan.slow_parts) if disk == "slow" else set(plan.parts))
            if "throughput" in wanted:
                part_runs += throughput(bench, plan, parts)
            if "rates" in wanted:
                part_runs += rates(bench, plan, parts)
            if "python" in wanted:
                part_runs += python(bench, plan)
            if "rowcost" in wanted:
                part_runs += rowcost(bench, plan)
            runs += [{"disk": disk, **run} for run in part_runs]
        finally:
            bench.cleanup()
            if shim is not None:
                shutil.rmtree(shim.parent, ignore_errors=True)
    info["load_average_at_end"] = os.getloadavg()
    summary = summarise(runs)
    doc = {"started": started.isoformat(timespec="seconds"),
           "finished": datetime.now(UTC).isoformat(timespec="seconds"),
           "machine": info, "servers": servers, "plan": {
               k: v for k, v in plan.__dict__.items()}, "commit_latency": flush,
           "statements": job_parts(plan.peers), "summary": summary, "runs": runs}
    doc["targets"] = targets(summary, plan, runs)
    print(table(doc))
    if out:
        write_json(doc, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
