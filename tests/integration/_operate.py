"""Helpers for the operate tests: an in-process worker served over real HTTP, scrapes, waits.

:func:`serving_worker` runs a real :class:`~receipts.worker.Worker` (real pool,
real ``httpx`` deliverer, real aiohttp metrics server on a free port) in the
test's event loop, so tests can scrape ``/metrics`` exactly as Prometheus does
and still drive the in-loop reference provider.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from receipts.embedded import free_port
from receipts.settings import Settings
from receipts.supervisor import MetricSamples, parse_metrics


def value(samples: MetricSamples, name: str, **labels: str) -> float:
    """One sample's value; KeyError when the series is absent."""
    return samples.value(name, **labels)


def total(samples: MetricSamples, name: str) -> float:
    """Sum of a metric's samples over every label set (0 when absent)."""
    return samples.total(name)


def by_label(samples: MetricSamples, name: str, label: str) -> dict[str, float]:
    """{label value: sample value} for one metric."""
    return samples.by_label(name, label)


async def wait_for(predicate: Callable[[], Awaitable[bool]], *, timeout_seconds: float,
                   what: str, every_seconds: float = 0.05) -> None:
    """Poll *predicate* until it is true; AssertionError naming *what* after the deadline."""
    deadline = time.monotonic() + timeout_seconds
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_seconds:g}s waiting for {what}")
        await asyncio.sleep(every_seconds)


@dataclass
class ServedWorker:
    """A running in-process worker and its metrics endpoint."""

    worker: object
    port: int
    client: httpx.AsyncClient

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def get(self, path: str) -> httpx.Response:
        return await self.client.get(self.url(path))

    async def scrape(self) -> MetricSamples:
        response = await self.get("/metrics")
        response.raise_for_status()
        return parse_metrics(response.text)


@asynccontextmanager
async def serving_worker(settings: Settings, *, wait_ready: bool = True
                         ) -> AsyncIterator[ServedWorker]:
    """Run a Worker with its metrics server until the block ends, then stop and drain it."""
    from receipts.runtime import worker_runtime

    port = free_port()
    async with worker_runtime(settings, metrics_port=port) as runtime, \
            httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        worker = runtime.worker
        task = asyncio.create_task(worker.run())
        served = ServedWorker(worker, port, client)
        try:
            if wait_ready:
                async def ready() -> bool:
                    return (await served.get("/readyz")).status_code == 200
                await wait_for(ready, timeout_seconds=15, what="/readyz 200")
            yield served
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
