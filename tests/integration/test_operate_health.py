"""/healthz and /readyz across a database outage (an embedded server of the test's own)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from receipts.embedded import EmbeddedPostgres
from receipts.migrate import apply_migrations
from tests.conftest import make_settings
from tests.integration._operate import serving_worker, value, wait_for


@pytest.fixture
def own_postgres() -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL 18 this test may stop and start."""
    server = EmbeddedPostgres(fast=True)
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.mark.slow
async def test_readyz_follows_the_database_while_healthz_stays_up(
    own_postgres: EmbeddedPostgres,
) -> None:
    dsn = own_postgres.create_database("receipts_outage")
    apply_migrations(dsn)
    settings = make_settings(dsn, poll_interval_seconds=0.1)
    async with serving_worker(settings) as served:
        async def status(path: str) -> int:
            return (await served.get(path)).status_code

        assert await status("/readyz") == 200
        assert await status("/healthz") == 200

        await asyncio.to_thread(own_postgres.stop, "fast")

        async def not_ready() -> bool:
            return await status("/readyz") == 503

        await wait_for(not_ready, timeout_seconds=15, what="/readyz 503 with the database down")
        assert await status("/healthz") == 200
        body = (await served.get("/readyz")).json()
        assert body["status"] != "ready"
        assert value(await served.scrape(), "receipts_database_ready") == 0

        await asyncio.to_thread(own_postgres.start)

        async def ready_again() -> bool:
            assert await status("/healthz") == 200
            return await status("/readyz") == 200

        await wait_for(ready_again, timeout_seconds=45,
                       what="/readyz 200 after the database returned")
        samples = await served.scrape()
        assert value(samples, "receipts_database_ready") == 1
        assert value(samples, "receipts_db_errors_total", statement="claim") >= 1
