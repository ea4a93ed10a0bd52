"""Shared fixtures: real PostgreSQL servers, fresh databases, the reference provider.

Servers: ``pg18`` is an embedded PostgreSQL 18 started once per session;
``pg15`` is the machine's PostgreSQL 15 on 127.0.0.1:5432 (or the DSN in
``RECEIPTS_TEST_PG15_DSN``), used when it answers. ``--pg`` picks which run
(default: all that are available; ``RECEIPTS_TEST_REQUIRE_PG15=1`` turns a
missing PostgreSQL 15 into an error instead of a skip).

Each test gets its own database cloned from a migrated template database, so
tests never see each other's rows and cloning costs tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from aiohttp import web

from receipts.embedded import EmbeddedPostgres, free_port
from receipts.enqueue import enqueue_many as enqueue_rows
from receipts.migrate import apply_migrations
from receipts.model import Job, JobState
from receipts.provider import Faults, ReferenceProvider, serve
from receipts.settings import Settings, load_settings
from tests.servers import nginx, pki  # noqa: F401  (real nginx and a private CA, for any test)

# One template per test process: a shared server (the machine's PostgreSQL 15) may
# serve several test runs at once, each with its own migrations.
TEMPLATE = f"receipts_template_{os.getpid()}"
PG15_DSN = os.environ.get("RECEIPTS_TEST_PG15_DSN", "postgresql://postgres@127.0.0.1:5432/test")
_counter = itertools.count()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--pg", default="all", choices=["all", "pg18", "pg15"],
                     help="which PostgreSQL servers the integration tests run on")


@dataclass
class Server:
    """A PostgreSQL server the tests may create databases on."""

    name: str
    admin_dsn: str
    embedded: EmbeddedPostgres | None = None
    _template_ready: bool = field(default=False)

    def dsn_for(self, database: str) -> str:
        info = psycopg.conninfo.conninfo_to_dict(self.admin_dsn)
        info["dbname"] = database
        return psycopg.conninfo.make_conninfo(**info)  # type: ignore[arg-type]

    def _ensure_template(self) -> None:
        if self._template_ready:
            return
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{TEMPLATE}"')
        apply_migrations(self.dsn_for(TEMPLATE))
        self._template_ready = True

    def new_database(self, migrated: bool = True) -> str:
        """Create a fresh database (a clone of the migrated template); return its DSN."""
        self._ensure_template()
        name = f"receipts_t{os.getpid()}_{next(_counter)}"
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            if migrated:
                conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{TEMPLATE}"')
            else:
                conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn_for(name)

    def drop_database(self, dsn: str) -> None:
        name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
        with contextlib.suppress(psycopg.Error), psycopg.connect(
            self.admin_dsn, autocommit=True
        ) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _pg15_available() -> bool:
    info = psycopg.conninfo.conninfo_to_dict(PG15_DSN)
    try:
        with socket.create_connection((str(info.get("host", "127.0.0.1")),
                                       int(info.get("port", 5432))), timeout=1):
            pass
        with psycopg.connect(PG15_DSN, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        return True
    except (OSError, psycopg.Error):
        return False


@pytest.fixture(scope="session")
def pg18() -> Iterator[Server]:
    server = EmbeddedPostgres(fast=True)
    server.start()
    try:
        yield Server("pg18", server.dsn, embedded=server)
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def pg15() -> Iterator[Server]:
    if not _pg15_available():
        if os.environ.get("RECEIPTS_TEST_REQUIRE_PG15") == "1":
            pytest.fail(f"PostgreSQL 15 is required but does not answer at {PG15_DSN}")
        pytest.skip("no PostgreSQL 15 on 127.0.0.1:5432")
    server = Server("pg15", PG15_DSN)
    yield server
    with contextlib.suppress(psycopg.Error), psycopg.connect(PG15_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')


#: Folders whose every test is ``solo`` (pyproject.toml's marker): they measure time or
#: throughput, or run fleets of processes, so `make test` runs them alone.
SOLO_FOLDERS = frozenset({"acceptance", "bench", "chaos"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        if len(parts) > 1 and parts[0] == "tests" and parts[1] in SOLO_FOLDERS:
            item.add_marker(pytest.mark.solo)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "server" in metafunc.fixturenames:
        choice = metafunc.config.getoption("--pg")
        names = ["pg18", "pg15"] if choice == "all" else [choice]
        metafunc.parametrize("server", names, indirect=True)


@pytest.fixture(scope="session")
def server(request: pytest.FixtureRequest) -> Server:
    """The PostgreSQL server under test (parametrised: pg18, pg15)."""
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


@pytest.fixture
def dsn(server: Server) -> Iterator[str]:
    """A fresh, migrated database on the server under test."""
    url = server.new_database()
    try:
        yield url
    finally:
        server.drop_database(url)


def make_settings(dsn: str, **overrides: object) -> Settings:
    """Test settings: short lease, no metrics port, fast backoff, unless overridden."""
    values: dict[str, object] = {
        "database_url": dsn,
        "provider_url": "http://127.0.0.1:9/receipts",
        "lease_seconds": 30.0,
        "lease_margin_seconds": 5.0,
        "delivery_timeout_seconds": 5.0,
        "poll_interval_seconds": 0.1,
        "retry_base_seconds": 0.05,
        "retry_cap_seconds": 0.2,
        "metrics_port": 0,
        "shutdown_grace_seconds": 5.0,
        "queue_stats_interval_seconds": 1.0,
    }
    values.update(overrides)
    return load_settings(**values)


@pytest.fixture
def settings(dsn: str) -> Settings:
    return make_settings(dsn)


@pytest.fixture
async def queue(settings: Settings) -> AsyncIterator[object]:
    """An open :class:`JobQueue` on the test database."""
    from receipts.db import make_pool
    from receipts.jobqueue import JobQueue

    pool = make_pool(settings, "test", max_size=4)
    await pool.open(wait=True, timeout=10)
    try:
        yield JobQueue(pool, lease_seconds=settings.lease_seconds,
                       max_attempts=settings.max_attempts)
    finally:
        await pool.close()


@pytest.fixture
async def operations(settings: Settings) -> AsyncIterator[object]:
    """An open :class:`~receipts.operations.Operations` (the operator's statements) on
    the test database, on its own pool, as the composition code builds it."""
    from receipts.db import make_pool
    from receipts.runtime import make_operations

    pool = make_pool(settings, "test", max_size=4)
    await pool.open(wait=True, timeout=10)
    try:
        yield make_operations(settings, pool)
    finally:
        await pool.close()


@dataclass
class RunningProvider:
    """A reference provider served in the test's event loop."""

    provider: ReferenceProvider
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/receipts"

    def set_faults(self, **changes: object) -> None:
        self.provider.faults = Faults.from_mapping(changes, self.provider.faults)


@pytest.fixture
async def provider() -> AsyncIterator[RunningProvider]:
    """The reference provider on a free port, no faults (change them per test)."""
    ref = ReferenceProvider(seed=1)
    port = free_port()
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve(ref, "127.0.0.1", port, stop, ready))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield RunningProvider(ref, port)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def enqueue_many(dsn: str, order_ids: list[str]) -> None:
    """Enqueue *order_ids* in one transaction (test helper)."""
    from receipts.enqueue import enqueue_many as enqueue_all

    with psycopg.connect(dsn) as conn:
        enqueue_all(conn, order_ids)


def fetch_rows(dsn: str, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Run a read query on *dsn* and return all rows (test helper)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]


def check_invariants(dsn: str, max_attempts: int) -> None:
    """Assert docs/design.md §2's invariants on every row of *dsn*'s queue."""
    bad_ready = fetch_rows(dsn, "SELECT id FROM receipt_jobs WHERE state = 'ready'"
                                " AND attempts >= %s", (max_attempts,))
    assert not bad_ready, f"ready jobs with attempts >= max: {bad_ready}"
    bad_running = fetch_rows(dsn, "SELECT id FROM receipt_jobs WHERE state = 'running'"
                                  " AND (lease_token IS NULL OR lease_until IS NULL)")
    assert not bad_running, f"running jobs without token or deadline: {bad_running}"
    odd = fetch_rows(dsn, "SELECT id FROM receipt_jobs WHERE state NOT IN"
                          " ('ready', 'running', 'done', 'failed', 'discarded')")
    assert not odd


__all__ = ["RunningProvider", "Server", "check_invariants", "enqueue_many", "fetch_rows",
           "free_port", "make_settings"]


async def claim_jobs(queue: Any, limit: int) -> list[Job]:
    """Claim up to *limit* jobs through :meth:`JobQueue.claim`; the jobs only."""
    result = await queue.claim(limit)
    return [a.job for a in result.attempts]


async def reschedule_one(queue: Any, job: Job, *, delay_seconds: float, error: str,
                         permanent: bool = False, refund: bool = False) -> JobState | None:
    """Write one failed attempt back; its new state, or None when stale."""
    from receipts.model import Attempt, Outcome, Reason, Reschedule, Verdict

    outcome = Outcome(Verdict.PERMANENT if permanent else Verdict.RETRY,
                      Reason.REJECTED if permanent else Reason.PROVIDER_5XX, detail=error)
    states = await queue.reschedule([Reschedule(Attempt(job, time.monotonic()), outcome,
                                                delay_seconds, refund)])
    return states.get(job.id)  # type: ignore[no-any-return]


@pytest.fixture
async def stub():
    """A real HTTP server whose single handler each test sets."""
    handler: dict[str, object] = {}
    seen: list[dict[str, str]] = []

    async def dispatch(request: web.Request) -> web.StreamResponse:
        seen.append({"key": request.headers.get("Idempotency-Key", ""),
                     "body": await request.text()})
        return await handler["fn"](request)  # type: ignore[operator]

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", dispatch)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()

    class Stub:
        url = f"http://127.0.0.1:{port}/receipts"
        requests = seen

        def answer(self, fn) -> None:
            handler["fn"] = fn

    yield Stub()
    await runner.cleanup()


class Trickle:
    """The shop's ordinary traffic: valid orders enqueued at *per_second* until stopped."""

    def __init__(self, dsn: str, per_second: float, prefix: str = "ok-t") -> None:
        self.dsn, self.per_second, self.prefix = dsn, per_second, prefix
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                with conn.transaction():  # as an orders service does: with its order
                    enqueue_rows(conn, [f"{self.prefix}{self.sent}"])
                self.sent += 1
                self._stop.wait(max(0.0, start + self.sent / self.per_second - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
