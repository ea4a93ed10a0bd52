"""``receipts demo``: the whole service, its faults and its guarantees, in one command.

What it does (docs/design.md §8):

1. starts an embedded PostgreSQL 18 (or uses ``--dsn``) and migrates it;
2. starts the reference provider with latency and faults (503, 429 with
   Retry-After, which pauses the whole fleet, 422 for a few orders, and receipts recorded but never
   answered: timeouts and reset connections);
3. starts several ``receipts worker`` processes and a ``receipts recover
   --loop`` process, then places orders, each with its receipt job in one
   order transaction;
4. SIGKILLs a worker in the middle of its deliveries (and starts a
   replacement), and SIGSTOPs another in the middle of its deliveries for
   longer than the lease so that its late outcomes are refused as stale;
   then takes the provider down for a few
   seconds: the fleet pauses, probes and resumes by itself;
5. waits until the queue is drained, stops everything with SIGTERM and
   prints a summary checked against the database and the provider.

Exit status 0 when nothing was lost (every order's job is done, failed, or a
rejection held for evidence that waits in the queue for the next orders to
judge it; every done job has a receipt at the provider), 1 otherwise.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from receipts.db import translate
from receipts.dsn import redact_dsn
from receipts.embedded import EmbeddedPostgres, free_port
from receipts.enqueue import enqueue
from receipts.flow import HELD_PREFIX
from receipts.migrate import apply_migrations
from receipts.model import PauseReason
from receipts.supervisor import Child, MetricSamples, Supervisor

LEASE_SECONDS = 6.0
OUTAGE_SECONDS = 4.0  # the provider outage the demo stages after the orders are placed
DRAIN_TIMEOUT_SECONDS = 240.0
@dataclass(slots=True)
class DemoOptions:
    """Demo knobs: *orders* placed, *workers* processes × *concurrency* slots."""

    dsn: str | None = None
    orders: int = 3000
    workers: int = 3
    concurrency: int = 32
    seed: int = 7


@dataclass(slots=True)
class _Run:
    opts: DemoOptions
    dsn: str
    sup: Supervisor
    run_id: str
    provider: Child | None = None
    max_lag_seconds: float = 0.0
    outage: bool = False  # the provider outage step ran


def _say(text: str) -> None:
    print(f"  · {text}", flush=True)


def _worker_env(run: _Run, port: int) -> dict[str, str]:
    assert run.provider is not None
    return {
        "RECEIPTS_DATABASE_URL": run.dsn,
        "RECEIPTS_PROVIDER_URL": run.provider.url("/receipts"),
        "RECEIPTS_CONCURRENCY": str(run.opts.concurrency),
        "RECEIPTS_LEASE_SECONDS": str(LEASE_SECONDS),
        "RECEIPTS_LEASE_MARGIN_SECONDS": "2",
        "RECEIPTS_DELIVERY_TIMEOUT_SECONDS": "2",
        "RECEIPTS_POLL_INTERVAL_SECONDS": "0.5",
        "RECEIPTS_RETRY_BASE_SECONDS": "0.5",
        "RECEIPTS_RETRY_CAP_SECONDS": "4",
        "RECEIPTS_RETRY_AFTER_MAX_SECONDS": "5",
        "RECEIPTS_MAX_ATTEMPTS": "8",
        "RECEIPTS_SHUTDOWN_GRACE_SECONDS": "5",
        "RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS": "1",
        "RECEIPTS_RECOVERY_DELAY_SECONDS": "0.5",
        "RECEIPTS_METRICS_PORT": str(port),
        "RECEIPTS_LOG_LEVEL": "INFO",
        # Flow control at demo scale: a provider outage pauses the fleet for about
        # a second, probes, and doubles up to 4 s (the defaults: 5 s up to 5 min).
        "RECEIPTS_OUTAGE_PAUSE_SECONDS": "1",
        "RECEIPTS_PAUSE_MAX_SECONDS": "4",
    }


def _start_worker(run: _Run, index: int) -> Child:
    port = free_port()
    child = run.sup.start(f"worker-{index}", ["worker"], _worker_env(run, port), port=port)
    return child.wait_healthy(timeout_seconds=15)


def _place_orders(run: _Run, start: int, count: int, errors: list[BaseException]) -> None:
    """Each order and its receipt job in one transaction, as the orders API does."""
    try:
        with psycopg.connect(run.dsn) as conn:
            for n in range(start, start + count):
                order_id = f"{run.run_id}-{n:06d}"
                with conn.transaction():
                    conn.execute("INSERT INTO demo_orders (id) VALUES (%s)", (order_id,))
                    enqueue(conn, order_id)
    except BaseException as exc:  # reported by the caller
        errors.append(exc)


def _counts(run: _Run) -> dict[str, int]:
    with psycopg.connect(run.dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT state, count(*) FROM receipt_jobs WHERE order_id LIKE %s GROUP BY state"
            " UNION ALL SELECT 'held', count(*) FROM receipt_jobs WHERE order_id LIKE %s"
            " AND state IN ('ready', 'running') AND starts_with(last_error, %s)",
            (run.run_id + "-%", run.run_id + "-%", HELD_PREFIX),
        ).fetchall()
        lag = conn.execute(
            "SELECT coalesce(extract(epoch FROM statement_timestamp() - min(run_at)), 0)"
            " FROM receipt_jobs WHERE state = 'ready' AND run_at <= statement_timestamp()"
        ).fetchone()
    run.max_lag_seconds = max(run.max_lag_seconds, float(lag[0]) if lag else 0.0)
    return {state: int(n) for state, n in rows}


def _wait_for_deliveries(victim: Child) -> None:
    """Return once *victim*'s metrics show deliveries in flight (or after 20 s)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if victim.scrape().total("receipts_inflight_deliveries") > 0:
                return
        time.sleep(0.02)


def _kill_mid_delivery(victim: Child) -> None:
    """SIGKILL *victim* once its metrics show deliveries in flight (or after 20 s)."""
    _wait_for_deliveries(victim)
    victim.kill()
    _say(f"SIGKILLed {victim.name} (pid {victim.pid}) in the middle of its deliveries")


def _pause_past_lease(victim: Child, run: _Run) -> None:
    """SIGSTOP *victim* with deliveries in flight (or after 20 s) for longer than its
    leases, then SIGCONT: what it then tries to write is refused as stale. The
    provider outage is staged while it is stopped, so that it meets queued work
    (a fast machine drains the rest of the orders within the stop)."""
    _wait_for_deliveries(victim)
    victim.pause()
    stopped = time.monotonic()
    _say(f"SIGSTOPped {victim.name} for {LEASE_SECONDS + 3:g}s (longer than its "
         f"{LEASE_SECONDS:g}s leases)")
    _provider_outage(run)
    # The fault itself: paused past every lease it holds.
    time.sleep(max(0.0, stopped + LEASE_SECONDS + 3 - time.monotonic()))
    victim.resume()
    _say(f"SIGCONTed {victim.name}: its late outcomes must be refused as stale")


def run_demo(opts: DemoOptions) -> int:
    """Run the demo; returns the exit status (0: nothing lost).

    With ``opts.dsn`` everything happens in a scratch schema of that database
    (``receipts_demo_<run>``, dropped at the end), so jobs of anyone else
    using the database are never touched. Every child process is stopped
    whatever happens, and its logs are kept (and named) when the run failed.
    """
    workdir = Path(tempfile.mkdtemp(prefix="receipts-demo-"))
    run_id = f"demo{int(time.time()) % 100000:05d}"
    pg: EmbeddedPostgres | None = None
    schema: str | None = None
    ok = False
    try:
        if opts.dsn:
            schema = f"receipts_demo_{run_id}"
            dsn = _scratch_schema(opts.dsn, schema)
            print(f"receipts demo: using {redact_dsn(opts.dsn)}, scratch schema {schema}")
        else:
            print("receipts demo: starting an embedded PostgreSQL 18 …", flush=True)
            pg = EmbeddedPostgres().start()
            dsn = pg.create_database("receipts_demo")
        with Supervisor(workdir, stop_timeout_seconds=30) as sup:
            ok = _demo(_Run(opts, dsn, sup, run_id=run_id))
    finally:
        if schema is not None and opts.dsn:
            with contextlib.suppress(psycopg.Error), psycopg.connect(
                opts.dsn, autocommit=True, connect_timeout=5
            ) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        if pg is not None:
            pg.cleanup()
        if ok or not any(workdir.iterdir()):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"receipts demo: logs kept in {workdir}", file=sys.stderr)
    return 0 if ok else 1


def _scratch_schema(dsn: str, schema: str) -> str:
    """Create *schema* in *dsn*'s database; return a DSN whose search_path is it.

    Raises :class:`~receipts.errors.QueueError` (redacted) when the database
    refuses or cannot be reached.
    """
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
    except psycopg.Error as exc:
        raise translate(exc) from exc
    theirs = conninfo_to_dict(dsn).get("options")
    ours = f"-c search_path={schema}"
    return make_conninfo(dsn, options=f"{theirs} {ours}" if theirs else ours)


def _demo(run: _Run) -> bool:
    opts = run.opts
    # With --dsn the demo's queue lives in its own scratch schema, beside any
    # queue the database already has: a second queue is intended here.
    applied = apply_migrations(run.dsn, beside_existing=True)
    _say(f"migrated ({len(applied)} migration(s) applied)")
    with psycopg.connect(run.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS demo_orders ("
                     " id TEXT PRIMARY KEY, placed_at TIMESTAMPTZ NOT NULL DEFAULT now())")

    port = free_port()
    run.provider = run.sup.start("provider", [
        "provider", "--port", str(port), "--latency-ms", "15", "--jitter-ms", "35",
        "--error-rate", "0.04", "--rate-limit-rate", "0.002", "--retry-after", "1",
        "--reject-rate", "0.005", "--timeout-rate", "0.01", "--reset-rate", "0.01",
        "--hang-seconds", "4", "--seed", str(opts.seed),
    ], port=port, health_path="/stats").wait_healthy(timeout_seconds=15)
    _say(f"reference provider on :{port} (latency 15–50 ms, 4% 503, 0.2% 429 (each pauses "
         "the whole fleet for its Retry-After), "
         "0.5% of orders rejected 422, 1% hang and 1% reset after recording)")

    workers = [_start_worker(run, i) for i in range(opts.workers)]
    run.sup.start("recover", ["recover", "--loop", "1"], _worker_env(run, 0))
    _say(f"{opts.workers} workers × {opts.concurrency} slots, recovery sweeping every 1s")

    started = time.monotonic()
    errors: list[BaseException] = []
    per_thread = -(-opts.orders // 4)
    placers = [threading.Thread(target=_place_orders,
                                args=(run, i * per_thread,
                                      max(0, min(per_thread, opts.orders - i * per_thread)),
                                      errors))
               for i in range(4)]
    for t in placers:
        t.start()

    # Faults: kill one worker mid-delivery once work flows; pause another past its lease.
    while sum(_counts(run).values()) < max(1, opts.orders // 5) and not errors:
        time.sleep(0.05)
    _kill_mid_delivery(workers[0])
    workers.append(_start_worker(run, opts.workers))
    _say(f"started replacement worker-{opts.workers}")
    if len(workers) > 2:
        _pause_past_lease(workers[1], run)
    else:
        _provider_outage(run)
    for t in placers:
        t.join()
    if errors:
        raise errors[0]
    _say(f"placed {opts.orders} orders, each with its receipt job in one transaction")

    deadline = time.monotonic() + DRAIN_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        counts = _counts(run)
        # A rejection held for evidence (no other order accepted around it) waits for
        # the next orders to judge it: the demo's have all been delivered by then.
        if counts.get("ready", 0) + counts.get("running", 0) - counts.get("held", 0) <= 0:
            break
        time.sleep(0.25)
    elapsed = time.monotonic() - started

    live = [w for w in workers if w.running]
    scraped = _scrape_settled(run, live)
    metrics_port = live[-1].port if live else None
    excerpt = _metrics_excerpt(live, scraped)
    provider_stats = run.provider.get_json("/stats")
    provider_receipts = run.provider.get_json("/receipts", timeout_seconds=10)
    codes = run.sup.stop_all(timeout_seconds=30)
    return _summary(run, elapsed, scraped, codes, provider_stats, provider_receipts,
                    metrics_port, excerpt)


def _provider_outage(run: _Run) -> None:
    """Take the provider down (503 to everything) for a few seconds, then bring it back.

    While it is down the workers pause the whole fleet instead of spending the
    queued jobs' attempts, probe it with one job at a time, and resume on
    their own once a probe is delivered.
    """
    assert run.provider is not None
    if sum(_counts(run).get(s, 0) for s in ("ready", "running")) == 0:
        _say("queue nearly drained: no provider outage this run")
        return
    run.provider.request("PUT", "/faults", json={"status": 503}).raise_for_status()
    _say(f"provider outage: every request answered 503 for {OUTAGE_SECONDS:g}s")
    time.sleep(OUTAGE_SECONDS)  # the outage itself
    run.provider.request("PUT", "/faults", json={"status": None}).raise_for_status()
    run.outage = True
    _say("provider back; the fleet resumes after its next probe")


#: Per-worker counters in the excerpt: (column, metric); label sets are summed.
EXCERPT_COUNTERS = (
    ("claims", "receipts_claims_total"), ("claimed", "receipts_jobs_claimed_total"),
    ("acks", "receipts_acks_total"), ("retries", "receipts_retries_total"),
    ("failures", "receipts_failures_total"), ("stale_acks", "receipts_stale_acks_total"),
    ("leases_lost", "receipts_leases_lost_total"),
    ("pauses", "receipts_provider_pauses_total"), ("probes", "receipts_provider_probes_total"),
)


def _scrape_settled(run: _Run, workers: list[Child]) -> list[MetricSamples]:
    """Scrape *workers* once their queue gauges have caught up with the drain's end.

    The workers read the queue gauges once per ``RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS``
    (1 s here), so a scrape at the very end can show the queue as it was a moment
    before (a new user read "5 ready" above "nothing lost", and later an oldest
    undelivered job 9 s old with nothing left). Waits (at most 3 s) until the last
    worker's gauges agree with the table: ``receipts_ready_jobs`` is its count of due
    ready jobs, and ``receipts_oldest_undelivered_age_seconds`` is 0 exactly when no
    job is ready or running; then returns every worker's samples.
    """
    deadline = time.monotonic() + 3.0
    with psycopg.connect(run.dsn, autocommit=True) as conn:
        while workers and time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE state = 'ready'"
                " AND run_at <= statement_timestamp()), count(*)"
                " FROM receipt_jobs WHERE state IN ('ready', 'running')").fetchone()
            m = workers[-1].scrape()
            if (row is not None and m.total("receipts_ready_jobs") == row[0]
                    and (m.total("receipts_oldest_undelivered_age_seconds") == 0)
                    == (row[1] == 0)):
                break
            time.sleep(0.25)
    return [w.scrape() for w in workers]


def _metrics_excerpt(workers: list[Child], scraped: list[MetricSamples]) -> str:
    """One line of counters per live worker (labelled), then the queue gauges once.

    The counters are each process's own, so each line is labelled with its
    worker and a total line sums them; the queue gauges are read from the
    database by every worker alike, so they are shown once.
    """
    lines = []
    rows = [(w.name, m) for w, m in zip(workers, scraped, strict=True)]
    for name, m in rows:
        lines.append(f"    {name:<10}" + "  ".join(
            f"{col}={int(m.total(metric))}" for col, metric in EXCERPT_COUNTERS))
    lines.append("    " + "all".ljust(10) + "  ".join(
        f"{col}={int(sum(m.total(metric) for _, m in rows))}" for col, metric in EXCERPT_COUNTERS))
    if rows:
        last = rows[-1][1]
        lines.append("    queue     " + "  ".join(
            f"{name}={last.total(name):g}" for name in (
                "receipts_ready_jobs", "receipts_queue_lag_seconds",
                "receipts_expired_leases", "receipts_oldest_undelivered_age_seconds")))
    return "\n".join(lines)


def _summary(run: _Run, elapsed: float, scraped: list[MetricSamples],
             codes: dict[str, int], provider_stats: dict[str, Any],
             provider_receipts: dict[str, Any], metrics_port: int | None,
             excerpt: str) -> bool:
    prefix = run.run_id + "-%"
    with psycopg.connect(run.dsn, autocommit=True) as conn:
        orders = conn.execute("SELECT count(*) FROM demo_orders WHERE id LIKE %s",
                              (prefix,)).fetchone()[0]  # type: ignore[index]
        rows = conn.execute(
            "SELECT j.order_id, j.state, j.attempts, j.state IN ('ready', 'running')"
            " AND starts_with(j.last_error, %s) FROM demo_orders o"
            " LEFT JOIN receipt_jobs j ON j.order_id = o.id WHERE o.id LIKE %s",
            (HELD_PREFIX, prefix),
        ).fetchall()
    states: dict[str | None, int] = {}
    for _, state, _, _ in rows:
        states[state] = states.get(state, 0) + 1
    done_orders = {order for order, state, _, _ in rows if state == "done"}
    keys = {v["order_id"] for k, v in provider_receipts.items() if k.startswith("receipt:")}
    ours = {k for k in keys if k.startswith(run.run_id + "-")}
    done_without_receipt = len(done_orders - ours)
    held = sum(1 for *_, is_held in rows if is_held)  # the drain loop's rule, per row
    lost = sum(n for state, n in states.items() if state not in ("done", "failed")) - held
    redeliveries = sum(max(0, attempts - 1) for _, _, attempts, _ in rows if attempts)

    def total(name: str) -> int:
        return int(sum(m.total(name) for m in scraped))

    duplicates = int(provider_stats.get("duplicates_suppressed", 0))
    # A refused write counts in both; receipts_leases_lost_total also counts the outcomes
    # a worker gave up after a failed write, once their lease had certainly ended.
    stale, leases_lost = total("receipts_stale_acks_total"), total("receipts_leases_lost_total")
    pauses = total("receipts_provider_pauses_total")
    # The outage counts as ridden out only if a delivery met it: the fleet paused for it.
    outage_pauses = int(sum(m.by_label("receipts_provider_pauses_total", "reason").get(
        str(PauseReason.OUTAGE), 0.0) for m in scraped))
    worker_codes = {k: v for k, v in codes.items() if k.startswith("worker")}
    bad_exits = {k: v for k, v in worker_codes.items() if v not in (0, -9)}
    ok = lost == 0 and done_without_receipt == 0 and not bad_exits and orders == run.opts.orders
    delivered = states.get("done", 0)
    lines = [
        "",
        "receipts demo — summary",
        f"  orders placed                  {orders}",
        f"  receipts delivered (done)      {delivered}",
        f"  failed                         {states.get('failed', 0)}"
        "  (provider answered 4xx, or attempts ran out)",
        f"  held, awaiting evidence        {held}  (a 4xx with no other order accepted"
        " around it: `receipts jobs list --held`)",
        f"  lost (not done, failed, held)  {lost}",
        f"  done without a receipt         {done_without_receipt}",
        f"  receipts at provider (unique)  {len(ours)}",
        f"  duplicates suppressed          {duplicates}  (same Idempotency-Key sent again)",
        f"  redeliveries (attempts > 1)    {redeliveries}",
        f"  late outcomes not written      {leases_lost}  ({stale} refused as stale"
        f" by the database, {leases_lost - stale} given up after a failed write;"
        " workers that ran to the end)",
        f"  retries by surviving workers   {total('receipts_retries_total')}",
        "  provider outage ridden out     "
        + (f"yes: {outage_pauses} outage pause(s) and {pauses - outage_pauses} other"
           f" (Retry-After's), {total('receipts_provider_probes_total')} probe(s)"
           " (surviving workers)"
           if run.outage and outage_pauses
           else "not met: the fleet never paused for it (the queue drained before"
           f" enough deliveries met it; {pauses} Retry-After pause(s))" if run.outage
           else f"no outage this run ({pauses} Retry-After pause(s))"),
        f"  throughput                     {delivered / elapsed:.0f} receipts/s over "
        f"{elapsed:.1f}s",
        f"  worst queue lag seen           {run.max_lag_seconds:.2f}s",
        "  worker exit codes              "
        + ", ".join(f"{k}={'SIGKILL' if v == -9 else v}" for k, v in worker_codes.items()),
        f"  metrics endpoint served        http://127.0.0.1:{metrics_port}/metrics"
        " (one per worker; excerpt below, each line labelled with its worker)",
        "",
        excerpt,
        "",
        "result: " + ("OK — nothing lost" if ok else "FAILED — see above"),
    ]
    print("\n".join(lines), flush=True)
    return ok
