"""What the attempt history costs on the hot path: ``record_attempts`` for a batch of 100.

    python -m bench.experiments.attempts [--runs 60] [--history 100000]

One durable embedded PostgreSQL 18 (``bench.pg.SERVER_SETTINGS``: fsync,
synchronous_commit and full_page_writes on). The table holds *history* done
jobs, each with one attempt record, after ``VACUUM (ANALYZE)`` and a
``CHECKPOINT``. Each run enqueues 100 jobs and claims them (untimed), then
times, through ``JobQueue`` on a 1-connection pool (as the worker calls it):

* ``ack``: the batched ack of the 100 jobs (before: the hot path without
  history);
* ``record``: ``record_attempts`` of their 100 ``delivered`` records, its own
  autocommit statement right after the ack (after = ack + record);
* ``ack+record, one transaction``: both statements in one transaction (one
  commit, so one WAL flush), for comparison;
* ``record, full ring``: 100 records for jobs that already hold 20 (the
  ring overwrites its oldest slot: an update instead of an insert).

Prints the median and the 10th-90th percentiles of each, in milliseconds per
batch of 100, and the per-job cost of the record.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable

import psycopg

from bench.pg import SERVER_SETTINGS
from receipts.db import make_pool
from receipts.embedded import EmbeddedPostgres
from receipts.jobqueue import JobQueue, ack_params
from receipts.migrate import apply_migrations
from receipts.model import AttemptRecord, Job, Reason
from receipts.settings import load_settings
from receipts.statements import query

BATCH = 100


def _fill(dsn: str, history: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO receipt_jobs (id, order_id, state, attempts, finished_at)"
            " SELECT gen_random_uuid(), 'old-' || g, 'done', 1, now()"
            " FROM generate_series(1, %s) AS g", (history,))
        conn.execute(
            "INSERT INTO receipt_attempts (job_id, slot, seq, attempt, reason, status,"
            " duration_seconds, worker)"
            " SELECT id, 0, 1, 1, 'delivered', 200, 0.05, 'receipts-worker-5d8f7c9b4-x2x9q'"
            " FROM receipt_jobs")
        conn.execute("VACUUM (ANALYZE)")
        conn.execute("CHECKPOINT")


def _records(jobs: list[Job]) -> list[AttemptRecord]:
    return [AttemptRecord(j.id, j.attempt, Reason.DELIVERED, 200, "", 0.05,
                          "receipts-worker-5d8f7c9b4-x2x9q") for j in jobs]


async def _timed(body: Awaitable[object]) -> float:
    start = time.perf_counter()  # a coroutine starts running only when awaited
    await body
    return (time.perf_counter() - start) * 1000


async def measure(dsn: str, runs: int) -> dict[str, list[float]]:
    """Run the four measurements *runs* times each, interleaved; milliseconds per batch."""
    settings = load_settings(database_url=dsn)
    pool = make_pool(settings, "bench", max_size=1)
    await pool.open(wait=True)
    queue = JobQueue(pool, lease_seconds=60, max_attempts=5)
    out: dict[str, list[float]] = {"ack": [], "record": [], "ack+record, one transaction": [],
                                   "record, full ring": []}
    ring = [uuid.uuid4() for _ in range(BATCH)]
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO receipt_jobs (id, order_id) SELECT unnest(%s::uuid[]),"
            " 'ring-' || generate_series(1, %s)", (ring, BATCH))
    full = [AttemptRecord(i, 1, Reason.PROVIDER_5XX, 503, "503 busy", 0.05, "w") for i in ring]
    for _ in range(20):
        await queue.record_attempts(full)
    try:
        for n in range(runs + 5):  # the first 5 rounds warm up (prepared statements)
            rows: dict[str, float] = {}
            for kind in ("separate", "together"):
                async with pool.connection() as conn:
                    await conn.execute(
                        "INSERT INTO receipt_jobs (id, order_id) SELECT gen_random_uuid(),"
                        " %s || g FROM generate_series(1, %s) AS g", (f"r{n}{kind}-", BATCH))
                jobs = [a.job for a in (await queue.claim(BATCH)).attempts]
                assert len(jobs) == BATCH
                pairs = [(j.id, j.token) for j in jobs]
                records = _records(jobs)
                if kind == "separate":
                    rows["ack"] = await _timed(queue.ack(pairs))
                    rows["record"] = await _timed(queue.record_attempts(records))
                else:
                    rows["ack+record, one transaction"] = await _timed(
                        _together(pool, pairs, records))
            rows["record, full ring"] = await _timed(queue.record_attempts(full))
            if n >= 5:
                for key, value in rows.items():
                    out[key].append(value)
    finally:
        await pool.close()
    return out


async def _together(pool: object, pairs: list[tuple[uuid.UUID, uuid.UUID]],
                    recs: list[AttemptRecord]) -> None:
    async with pool.connection() as conn, conn.transaction():  # type: ignore[attr-defined]
        await conn.execute(query("ack"), ack_params(pairs))
        await conn.execute(query("record_attempts"), {
            "job_ids": [r.job_id for r in recs], "attempts": [r.attempt for r in recs],
            "reasons": [str(r.reason) for r in recs], "statuses": [r.status for r in recs],
            "errors": [None] * len(recs), "durations": [r.duration_seconds for r in recs],
            "workers": [r.worker for r in recs]})


def main() -> None:
    """Start a durable PostgreSQL 18, fill it, measure, print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.attempts")
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--history", type=int, default=100_000)
    args = parser.parse_args()
    server = EmbeddedPostgres(fast=False, settings=SERVER_SETTINGS)
    server.start()
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench_attempts")
            version = conn.execute("SHOW server_version").fetchone()
        dsn = server.dsn.rsplit("/", 1)[0] + "/bench_attempts"
        apply_migrations(dsn)
        _fill(dsn, args.history)
        out = asyncio.run(measure(dsn, args.runs))
    finally:
        server.cleanup()
    print(f"PostgreSQL {version[0] if version else '?'}, durable; {args.history:,} done jobs "
          f"with history; {args.runs} runs; ms per batch of {BATCH} (median, p10-p90)")
    for key, values in out.items():
        deciles = statistics.quantiles(values, n=10)
        print(f"  {key:<30} {statistics.median(values):6.2f}   "
              f"({deciles[0]:.2f}-{deciles[-1]:.2f})")
    ack, rec = statistics.median(out["ack"]), statistics.median(out["record"])
    both = statistics.median(out["ack+record, one transaction"])
    print(f"  record per job: {rec / BATCH * 1000:.0f} µs as its own statement; "
          f"{(both - ack) / BATCH * 1000:.0f} µs inside the ack's transaction")


if __name__ == "__main__":
    main()
