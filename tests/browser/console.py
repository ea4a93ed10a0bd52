"""The review console served in-process for browser tests: a real aiohttp server on a free
port, a real PostgreSQL 18 database, seeded with failed, ready and running jobs."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from receipts.db import make_pool
from receipts.embedded import free_port
from receipts.jobqueue import JobQueue
from receipts.metrics import start_server
from receipts.model import AttemptRecord, Job, Reason
from receipts.operations import Operations
from receipts.ui import make_app
from receipts.ui.app import CONSOLE, UiOptions
from tests.conftest import (
    Server,
    claim_jobs,
    enqueue_many,
    fetch_rows,
    make_settings,
    reschedule_one,
)

TOKEN = "test-admin-token-0123456789"
VIEWER_TOKEN = "test-viewer-token-9876543210"
ROOT = Path(__file__).resolve().parents[2]
#: Screenshots go here (ignored by git, never committed).
SHOTS = ROOT / ".tmp" / "screenshots"
AXE = ROOT / ".tools" / "axe" / "axe.min.js"
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
LONG_LINE = "E" * 50_000
#: An order id a browser would lay out right to left, with an RLO override inside.
BIDI_ORDER = "הזמנה-\u202eevil-\u2067" + "٣" * 40
LONG_ORDER = "order-" + "x" * 190


@dataclass
class Served:
    """The review page on a free port over a fresh database."""

    dsn: str
    queue: JobQueue
    port: int
    jobs: dict[str, Job]
    app: web.Application
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def operations(self) -> Operations:
        return self.app[CONSOLE].operations

    async def reread(self) -> None:
        """Take the shared reading now (instead of waiting for the next interval)."""
        await self.app[CONSOLE].monitor.refresh()
        self.app[CONSOLE].lists.clear()

    def state(self, order_id: str) -> str:
        return str(fetch_rows(self.dsn, "SELECT state FROM receipt_jobs WHERE order_id = %s",
                              (order_id,))[0][0])


async def seed(dsn: str, queue: JobQueue) -> dict[str, Job]:
    """Failed jobs: three 422s (one hostile, one very long), two 503s out of attempts; one ready."""
    plan = {
        "order-422-a": (Reason.REJECTED, 422, "422 order unknown"),
        "order-422-b": (Reason.REJECTED, 422, "422 " + HOSTILE),
        "order-422-long": (Reason.REJECTED, 422, "422 " + LONG_LINE),
        "order-503-a": (Reason.MAX_ATTEMPTS, 503, "503 provider busy"),
        "order-503-b": (Reason.MAX_ATTEMPTS, 503, "503 provider busy"),
    }
    enqueue_many(dsn, list(plan))
    jobs = {j.order_id: j for j in await claim_jobs(queue, len(plan))}
    for order_id, (_, _, error) in plan.items():
        await reschedule_one(queue, jobs[order_id], delay_seconds=0, error=error, permanent=True)
    history = [AttemptRecord(jobs[o].id, 1, reason, status, error, 0.125, "receipts-worker-7f9c")
               for o, (reason, status, error) in plan.items()]
    history.insert(0, AttemptRecord(jobs["order-503-a"].id, 1, Reason.TIMEOUT, None,
                                    "timed out after 10 s", 10.0, "receipts-worker-1a2b"))
    await queue.record_attempts(history)
    enqueue_many(dsn, ["order-ready"])
    return jobs


@asynccontextmanager
async def serve(pg18: Server, admin_token: str | None, *, viewer_token: str | None = None,
                options: UiOptions | None = None, loopback_only: bool = True,
                seeded: bool = True, pool_size: int = 4,
                settings: dict[str, object] | None = None) -> AsyncIterator[Served]:
    """The console over a fresh database (seeded with :func:`seed` unless told not to);
    *settings* override the test settings of its pool (say, the statement timeout)."""
    dsn = pg18.new_database()
    pool = make_pool(make_settings(dsn, **(settings or {})), "ui", max_size=pool_size)
    await pool.open(wait=True)
    queue = JobQueue(pool, lease_seconds=30, max_attempts=5)
    jobs = await seed(dsn, queue) if seeded else {}
    port = free_port()
    app = make_app(queue, Operations(pool), admin_token=admin_token,
                   viewer_token=viewer_token, loopback_only=loopback_only, options=options)
    runner = await start_server(app, port, host="127.0.0.1")
    try:
        yield Served(dsn, queue, port, jobs, app)
    finally:
        await runner.cleanup()
        await pool.close()
        pg18.drop_database(dsn)


def new_id() -> uuid.UUID:
    return uuid.uuid4()
