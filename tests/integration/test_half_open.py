"""A half-open database connection: no RST, no error, nothing moves (a wire-protocol proxy).

The worker process reaches PostgreSQL through :class:`~tests.chaos.pgproxy.PgProxy`,
which can hold every connection, new ones included, without closing anything.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest

from receipts.embedded import free_port
from receipts.runtime import stop_deadline_seconds
from receipts.settings import Settings
from receipts.supervisor import Child, Supervisor
from receipts.worker import WAKER_POLL_FACTOR
from tests.chaos.pgproxy import PgProxy
from tests.chaos.run import read_events
from tests.conftest import Server, enqueue_many, fetch_rows

# Its deadlines are the keepalive and statement timeouts themselves: run alone (solo),
# a busy neighbour test delays the detection past them.
pytestmark = pytest.mark.solo

STATEMENT_TIMEOUT = 1.0  # so the client-side deadline is 1 + 5 = 6 s
DEADLINE = STATEMENT_TIMEOUT + 5.0
POLL_SECONDS = 0.2
#: The settings that size a stop (Settings field names).
STOP_SETTINGS = {"database_url": "postgresql://x@127.0.0.1/x", "provider_url": "http://x/",
                 "shutdown_grace_seconds": 3.0, "delivery_timeout_seconds": 4.0}
#: The claim that meets the hold starts within one poll: ×1.25 of jitter, and the
#: poll is WAKER_POLL_FACTOR times longer while the worker hears a waker (itself).
FIRST_CLAIM_SECONDS = POLL_SECONDS * WAKER_POLL_FACTOR * 1.25


@pytest.fixture
async def proxied(pg18: Server) -> AsyncIterator[tuple[str, str, PgProxy]]:
    """(direct DSN, DSN through the proxy, the proxy) for a fresh database."""
    assert pg18.embedded is not None
    direct = pg18.new_database()
    name = psycopg.conninfo.conninfo_to_dict(direct)["dbname"]
    proxy = PgProxy(pg18.embedded.port, free_port())
    await proxy.start()
    try:
        yield direct, (f"postgresql://postgres@127.0.0.1:{proxy.port}/{name}"
                       "?sslmode=disable&gssencmode=disable"), proxy
    finally:
        await proxy.close()
        pg18.drop_database(direct)


def _start(sup: Supervisor, dsn: str, provider_url: str) -> Child:
    port = free_port()
    # The claims are the pool's only users while the worker idles (no queue gauges
    # for a minute, no admission control's commit probes): so the claim, not one of
    # those, is the statement caught on the half-open pooled connection. An idle
    # worker holds one pooled connection; a second borrower would wait for a new
    # connection (through the held proxy) and fail on the pool's timeout instead.
    return sup.start("worker", ["worker"], {
        "RECEIPTS_DATABASE_URL": dsn, "RECEIPTS_PROVIDER_URL": provider_url,
        "RECEIPTS_METRICS_PORT": str(port), "RECEIPTS_POLL_INTERVAL_SECONDS": str(POLL_SECONDS),
        "RECEIPTS_STATEMENT_TIMEOUT_SECONDS": str(STATEMENT_TIMEOUT),
        "RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS": "60", "RECEIPTS_SHUTDOWN_GRACE_SECONDS": "3",
        "RECEIPTS_ADMISSION_CONTROL": "false",
        "RECEIPTS_LEASE_SECONDS": "8", "RECEIPTS_DELIVERY_TIMEOUT_SECONDS": "4",
    }, port=port)


async def _until(predicate, what: str, timeout_seconds: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_seconds
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, f"timed out after {timeout_seconds:g}s: {what}"
        await asyncio.sleep(0.1)


def _done(dsn: str) -> int:
    return int(fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs WHERE state = 'done'")[0][0])


@pytest.mark.slow
async def test_a_half_open_connection_is_discarded_and_the_worker_recovers_by_itself(
        proxied, provider, tmp_path: Path):
    direct, via_proxy, proxy = proxied
    with Supervisor(tmp_path) as sup:
        worker = _start(sup, via_proxy, provider.url)
        await asyncio.to_thread(worker.wait_healthy)
        enqueue_many(direct, ["before-1", "before-2"])
        await _until(lambda: _done(direct) == 2, "the first jobs delivered", 20)

        proxy.hold(3 * DEADLINE)
        held_at = time.monotonic()
        enqueue_many(direct, [f"during-{i}" for i in range(5)])
        # The claim times out at the client-side deadline: readiness drops, no wedge.
        await _until(lambda: worker.request("GET", "/readyz").status_code == 503,
                     "/readyz 503 while the connection is half-open", 4 * DEADLINE)
        assert time.monotonic() - held_at < FIRST_CLAIM_SECONDS + 2 * DEADLINE + 5
        assert worker.request("GET", "/healthz").status_code == 200  # bounded waits: alive
        assert _done(direct) == 2

        # The path heals; nothing is restarted by hand. A claim the worker gave up on
        # may still reach the server when the path heals and commit: its jobs wait
        # for their lease to expire and come back through recovery (at-least-once).
        sup.start("recover", ["recover", "--loop", "1"], {"RECEIPTS_DATABASE_URL": direct,
                                                         "RECEIPTS_RECOVERY_DELAY_SECONDS": "0"})
        await _until(lambda: _done(direct) == 7, "delivery resumed after the hold", 60)
        await _until(lambda: worker.request("GET", "/readyz").status_code == 200,
                     "/readyz 200 again", 20)
        failures = read_events(worker.log_path, {"claim_failed"})
        assert any("no answer within" in f["error"] for f in failures), failures


@pytest.mark.slow
async def test_sigterm_stops_a_worker_whose_connections_hang(proxied, provider, tmp_path: Path):
    direct, via_proxy, proxy = proxied
    with Supervisor(tmp_path) as sup:
        worker = _start(sup, via_proxy, provider.url)
        await asyncio.to_thread(worker.wait_healthy)
        enqueue_many(direct, ["first"])
        await _until(lambda: _done(direct) == 1, "the first job delivered", 20)
        proxy.hold(120)
        enqueue_many(direct, ["stuck"])
        await asyncio.sleep(1.0)  # let the next claim go out into the hold
        started = time.monotonic()
        worker.terminate()
        code = await asyncio.to_thread(worker.wait, timeout_seconds=60)
        took = time.monotonic() - started
    assert code == 0
    # The stop budget of these settings: min(3, 4) + max(5, 3) + 5 = 13 s, + 1 s for the
    # claim and 1 s for the last heartbeat; past that and a margin of 1 s the process ends
    # itself (runtime.StopDeadline), drained, so with status 0. 0.5 s for exiting.
    assert took < stop_deadline_seconds(Settings(**STOP_SETTINGS)) + 0.5, took
