"""The Python peers' schemas, fills and queue probes (PgQueuer, Procrastinate).

Both are optional: :func:`available` says which are importable (``bench/run.sh``
installs them into a bench-only virtualenv; they are never runtime
dependencies of receipts).
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import psycopg

PEERS = ("pgqueuer", "procrastinate")


def available() -> dict[str, str | None]:
    """Peer name → installed version, or None when it cannot be imported."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in PEERS:
        try:
            out[name] = version(name) if importlib.util.find_spec(name) else None
        except PackageNotFoundError:
            out[name] = None
    if out["pgqueuer"] and not (importlib.util.find_spec("asyncpg")
                                and importlib.util.find_spec("uvloop")):
        out["pgqueuer"] = None
    return out


def install(peer: str, dsn: str) -> None:
    """Create *peer*'s schema in the database at *dsn*."""
    if peer == "pgqueuer":
        asyncio.run(_pgqueuer_install(dsn))
    else:
        import procrastinate

        app = procrastinate.App(connector=procrastinate.SyncPsycopgConnector(conninfo=dsn))
        with app.open():
            app.schema_manager.apply_schema()


async def _pgqueuer_install(dsn: str) -> None:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(dsn=dsn)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    finally:
        await conn.close()


def fill(peer: str, dsn: str, count: int) -> None:
    """Enqueue *count* no-op jobs with the peer's own bulk-enqueue API."""
    if peer == "pgqueuer":
        asyncio.run(_pgqueuer_fill(dsn, count))
    else:
        asyncio.run(_procrastinate_fill(dsn, count))


async def _pgqueuer_fill(dsn: str, count: int) -> None:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(dsn=dsn)
    try:
        q = Queries(AsyncpgDriver(conn))
        step = 50_000
        for start in range(0, count, step):
            n = min(step, count - start)
            await q.enqueue(["noop"] * n, [str(start + i).encode() for i in range(n)], [0] * n)
    finally:
        await conn.close()


async def _procrastinate_fill(dsn: str, count: int) -> None:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="noop")  # type: ignore[untyped-decorator]
    async def noop(order: str = "") -> None:
        return None

    async with app.open_async():
        step = 5_000
        for start in range(0, count, step):
            n = min(step, count - start)
            batch: list[dict[str, Any]] = [{"order": str(start + i)} for i in range(n)]
            await noop.batch_defer_async(*batch)


def tables(peer: str) -> tuple[str, ...]:
    """The tables to VACUUM (ANALYZE) after a fill."""
    return ("pgqueuer",) if peer == "pgqueuer" else ("procrastinate_jobs",)


def remaining(peer: str, conn: psycopg.Connection[Any]) -> int:
    """Jobs not yet finished."""
    if peer == "pgqueuer":
        sql = "SELECT count(*) FROM pgqueuer WHERE status IN ('queued', 'picked')"
    else:
        sql = "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
    row = conn.execute(sql).fetchone()
    return int(row[0]) if row else 0


async def enqueue_one(peer: str, handle: Any, order: str) -> None:
    """Enqueue one job on an open handle from :func:`open_enqueuer`."""
    if peer == "pgqueuer":
        await handle.enqueue("noop", order.encode(), 0)
    else:
        await handle.defer_async(order=order)


async def open_enqueuer(peer: str, dsn: str) -> tuple[Any, Any]:
    """(handle, closer) for one-at-a-time enqueues (pickup latency)."""
    if peer == "pgqueuer":
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries

        conn = await asyncpg.connect(dsn=dsn)
        return Queries(AsyncpgDriver(conn)), conn.close
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="noop")  # type: ignore[untyped-decorator]
    async def noop(order: str = "") -> None:
        return None

    await app.open_async()
    return noop, app.close_async
