"""Fleet controls across real worker processes: an operator pauses every worker's deliveries
from the console (real chromium) and resumes them. Two ``receipts worker`` processes, one
reference provider process, PostgreSQL 18; the workers' own metrics say what they did."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from receipts.embedded import free_port
from receipts.supervisor import Child, MetricSamples, Supervisor
from receipts.ui.app import UiOptions
from receipts.worker import PAUSE_RECHECK_SECONDS
from tests.browser.cdp import Page
from tests.browser.console import TOKEN, serve
from tests.conftest import Server, enqueue_many, fetch_rows

#: How long past its recheck interval a worker may take to notice (a claim in flight, a
#: scrape's own delay).
SLACK_SECONDS = 3.0


async def scrape_all(workers: list[Child]) -> list[MetricSamples]:
    return await asyncio.gather(*(asyncio.to_thread(w.scrape) for w in workers))


async def until(what: str, check: Callable[[], object], timeout: float) -> float:
    """Wait for an awaitable-returning or plain *check* to be truthy; seconds it took."""
    start = time.monotonic()
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"timed out after {timeout:g}s: {what}"
        await asyncio.sleep(0.1)


def paused(samples: MetricSamples) -> float:
    """receipts_provider_paused over every reason (1 while this pod honours a pause)."""
    return samples.total("receipts_provider_paused")


@pytest.mark.slow
async def test_a_pause_from_the_page_stops_two_worker_processes_and_a_resume_restarts_them(
        pg18: Server, page: Page, tmp_path: Path) -> None:
    async with serve(pg18, TOKEN, options=UiOptions(refresh_seconds=1.0), seeded=False) as ui:
        enqueue_many(ui.dsn, [f"fleet-{i}" for i in range(5000)])
        with Supervisor(tmp_path) as sup:
            port = free_port()
            provider = sup.start("provider", ["provider", "--port", str(port),
                                              "--latency-ms", "150"], port=port)
            await asyncio.to_thread(provider.wait_healthy)
            workers = []
            for i in range(2):
                metrics_port = free_port()
                workers.append(sup.start(f"worker-{i}", ["worker"], {
                    "RECEIPTS_DATABASE_URL": ui.dsn,
                    "RECEIPTS_PROVIDER_URL": provider.url("/receipts"),
                    "RECEIPTS_METRICS_PORT": str(metrics_port), "RECEIPTS_CONCURRENCY": "4",
                    "RECEIPTS_POLL_INTERVAL_SECONDS": "0.2"}, port=metrics_port))
            for worker in workers:
                await asyncio.to_thread(worker.wait_healthy)

            async def both_claimed() -> bool:
                return all(s.total("receipts_jobs_claimed_total") > 0
                           for s in await scrape_all(workers))

            await until("both workers claim", both_claimed, 30)

            # The console lists both processes and names the holder of each running job.
            await until("both heartbeats", lambda: fetch_rows(
                ui.dsn, "SELECT count(*) FROM receipt_workers WHERE stopped_at IS NULL"
            ) == [(2,)], 30)
            await ui.reread()
            await page.goto(ui.url + "/?state=running")
            rows = await page.eval("[...document.querySelectorAll('table.workers tbody tr')]"
                                   ".map(r => r.innerText)")
            assert sorted(int(r.split("pid ")[1].split()[0]) for r in rows) == sorted(
                w.pid for w in workers)
            assert all("\t4\t" in r.replace("\n", "\t") for r in rows)  # 4 slots each
            holders = await page.eval(
                "[...document.querySelectorAll('table.jobs td[data-label=\"Held by\"]')]"
                ".map(e => e.innerText)")
            assert holders and set(holders) == {socket.gethostname()}

            # Pause from the page.
            await page.goto(ui.url + "/login")
            await page.type("input[name=token]", TOKEN)
            await page.click("form.confirm button")
            await page.goto(ui.url + "/")
            await page.type("#pause-note-input", "provider maintenance")
            await page.click("#pause-fleet")
            took = await until("both workers honour the pause", lambda: _all(
                workers, lambda s: paused(s) == 1), PAUSE_RECHECK_SECONDS + SLACK_SECONDS)
            assert took <= PAUSE_RECHECK_SECONDS + SLACK_SECONDS
            before = await scrape_all(workers)
            claimed = [s.total("receipts_jobs_claimed_total") for s in before]
            claims = [s.total("receipts_claims_total") for s in before]
            # Each re-reads the fleet's state at least twice, and claims nothing.
            await until("two rechecks each", lambda: _all_pairs(
                workers, claims, lambda s, c: s.total("receipts_claims_total") >= c + 2),
                3 * PAUSE_RECHECK_SECONDS + SLACK_SECONDS)
            after = await scrape_all(workers)
            assert [s.total("receipts_jobs_claimed_total") for s in after] == claimed
            assert fetch_rows(ui.dsn, "SELECT count(*) FROM receipt_jobs"
                                      " WHERE state = 'running'") == [(0,)]

            # Resume from the page: both claim again within their recheck interval.
            await ui.reread()
            await page.goto(ui.url + "/")
            await page.click("#resume-fleet")
            assert await page.text("#provider-state") == "Delivering (not paused)"
            took = await until("both workers claim again", lambda: _all_pairs(
                workers, claimed, lambda s, c: s.total("receipts_jobs_claimed_total") > c
                and paused(s) == 0), PAUSE_RECHECK_SECONDS + SLACK_SECONDS)
            assert took <= PAUSE_RECHECK_SECONDS + SLACK_SECONDS
            for worker in workers:
                worker.stop()
            rows = fetch_rows(ui.dsn, "SELECT count(*) FROM receipt_workers"
                                      " WHERE stopped_at IS NOT NULL")
            assert rows == [(2,)]  # their last heartbeat says they stopped


async def _all(workers: list[Child], check: Callable[[MetricSamples], bool]) -> bool:
    return all(check(s) for s in await scrape_all(workers))


async def _all_pairs(workers: list[Child], values: list[float],
                     check: Callable[[MetricSamples, float], bool]) -> bool:
    return all(check(s, v) for s, v in zip(await scrape_all(workers), values, strict=True))
