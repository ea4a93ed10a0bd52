"""The console as an on-call operator watches it (real chromium, real PostgreSQL): it refreshes
itself, lists every state, names who holds a lease, recovers expired leases, and shows and
changes the provider's flow state."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from receipts.db import make_pool
from receipts.jobqueue import JobQueue
from receipts.model import PauseReason
from receipts.ui.app import CONSOLE, UiOptions
from receipts.ui.chart import Sample
from tests.browser.cdp import Page
from tests.browser.console import TOKEN, Served, serve
from tests.conftest import Server, claim_jobs, enqueue_many, fetch_rows, make_settings

LIVE = UiOptions(refresh_seconds=1.0)


@pytest.fixture
async def ui(pg18: Server) -> AsyncIterator[Served]:
    """The console with actions, refreshing every second."""
    async with serve(pg18, TOKEN, options=LIVE) as served:
        yield served


async def sign_in(page: Page, ui: Served) -> None:
    await page.goto(ui.url + "/login")
    await page.type("input[name=token]", TOKEN)
    await page.click("form.confirm button")


async def text_is(page: Page, selector: str, expected: str) -> None:
    await page.wait_for(f"document.querySelector({selector!r})?.innerText === {expected!r}")


def page_loads(page: Page, url: str) -> int:
    return sum(1 for r in page.responses if r["url"] == url)


# --------------------------------------------------------------- live refresh


@pytest.mark.slow
async def test_the_summary_and_list_refresh_by_themselves_until_paused(
        ui: Served, page: Page) -> None:
    url = ui.url + "/?state=ready"
    await page.goto(url)
    await page.eval("window.__same_page = true")
    assert await page.text("#count-ready") == "1"
    first_as_of = await page.eval("document.querySelector('#as-of time').dateTime")
    assert await page.eval("!document.querySelector('#live-toggle').hidden")

    enqueue_many(ui.dsn, ["live-1", "live-2", "live-3"])
    await text_is(page, "#count-ready", "4")
    await page.wait_for("document.querySelectorAll('table.jobs tbody td.order').length === 4")
    assert await page.eval("window.__same_page === true")  # updated in place, not reloaded
    assert await page.eval("document.querySelector('#as-of time').dateTime") != first_as_of
    assert "Updated" in await page.text("#live-status")

    # Paused: the server keeps reading (one shared reading), the page asks for nothing.
    await page.click("#live-toggle", navigates=False)
    assert await page.eval("document.querySelector('#live-toggle').getAttribute("
                           "'aria-pressed')") == "true"
    loads = page_loads(page, url)
    enqueue_many(ui.dsn, ["live-4"])
    monitor = ui.app[CONSOLE].monitor
    readings = monitor.readings
    deadline = time.monotonic() + 15
    while monitor.readings < readings + 3:  # three intervals pass without a page refresh
        assert time.monotonic() < deadline
        await page.eval("new Promise(r => setTimeout(r, 200))")
    assert page_loads(page, url) == loads
    assert await page.text("#count-ready") == "4"
    # Played again (the choice survives a reload within the tab): it catches up.
    await page.click("#live-toggle", navigates=False)
    await text_is(page, "#count-ready", "5")


@pytest.mark.slow
async def test_a_refresh_leaves_a_selection_in_progress_alone(ui: Served, page: Page) -> None:
    await sign_in(page, ui)
    await page.goto(ui.url + "/?state=failed")
    target = ui.jobs["order-503-a"].id
    await page.click(f"input[value='{target}']", navigates=False)
    fetch_rows(ui.dsn, "UPDATE receipt_jobs SET state = 'discarded' WHERE order_id ="
                       " 'order-422-a' RETURNING 1")
    await text_is(page, "#count-failed", "4")  # the summary moved on
    await page.wait_for("document.querySelector('#live-status').innerText.includes("
                        "'part you are editing waits')")
    assert await page.eval(f"document.querySelector(\"input[value='{target}']\").checked")
    assert "order-422-a" in await page.text("#jobs")  # the list waits for the operator
    await page.click(f"input[value='{target}']", navigates=False)  # untick: it catches up
    await page.wait_for("!document.querySelector('#jobs').innerText.includes('order-422-a')")


# ------------------------------------------------------------------ every state


@pytest.mark.slow
async def test_every_state_has_a_list_and_a_running_job_names_its_holder(
        ui: Served, page: Page, pg18: Server) -> None:
    fetch_rows(ui.dsn, "UPDATE receipt_jobs SET run_at = now() + interval '1 hour'"
                       " WHERE order_id = 'order-ready' RETURNING 1")
    enqueue_many(ui.dsn, ["run-live", "run-expired", "done-1"])
    pool = make_pool(make_settings(ui.dsn), "worker", max_size=1)
    await pool.open(wait=True)
    try:
        worker_queue = JobQueue(pool, lease_seconds=60, max_attempts=5, worker_tag="0badcafe")
        jobs = {j.order_id: j for j in await claim_jobs(worker_queue, 10)}
        await worker_queue.ack([(jobs["done-1"].id, jobs["done-1"].token)])
    finally:
        await pool.close()
    await ui.queue.heartbeat(tag="0badcafe", pod="receipts-worker-5d8f7-x2k4p", pid=7,
                             version="0.3.0", slots=32, inflight=2, claimed_total=4,
                             uptime_seconds=300, since_claim_seconds=2)
    fetch_rows(ui.dsn, "UPDATE receipt_jobs SET lease_until = now() - interval '3 min'"
                       " WHERE order_id = 'run-expired' RETURNING 1")
    await ui.reread()
    await page.goto(ui.url + "/")
    assert await page.text("#count-running") == "2"
    assert await page.text("#expired-link") == "1 expired lease"
    assert await page.text("#count-done") == "1"

    await page.click("#expired-link")
    assert "expired=1" in await page.eval("location.search")
    rows = await page.eval("[...document.querySelectorAll('table.jobs tbody tr')]"
                           ".map(r => r.innerText)")
    assert len(rows) == 1 and "run-expired" in rows[0] and "expired" in rows[0]
    assert "receipts-worker-5d8f7-x2k4p" in rows[0]

    lists = {}
    for state in ("ready", "running", "done", "failed", "discarded"):
        await page.click(f"header nav a[href='/?state={state}']")
        assert await page.eval("document.querySelector('header nav a[aria-current]')"
                               ".innerText") == state.capitalize()
        lists[state] = sorted(await page.eval(
            "[...document.querySelectorAll('table.jobs tbody td.order a')]"
            ".map(e => e.innerText)"))
    assert lists == {"ready": ["order-ready"], "running": ["run-expired", "run-live"],
                     "done": ["done-1"], "discarded": [],
                     "failed": ["order-422-a", "order-422-b", "order-422-long",
                                "order-503-a", "order-503-b"]}
    await page.goto(ui.url + "/jobs/run-live")
    assert "receipts-worker-5d8f7-x2k4p" in await page.text("#holder")
    assert "pid 7, 0.3.0" in await page.text("#holder")


@pytest.mark.slow
async def test_the_workers_seen_lately_are_listed(ui: Served, page: Page) -> None:
    for tag, pod, stopped in (("00000001", "receipts-worker-a", False),
                              ("00000002", "receipts-worker-b", True)):
        await ui.queue.heartbeat(tag=tag, pod=pod, pid=11, version="0.3.0", slots=64,
                                 inflight=3, claimed_total=1234, uptime_seconds=60,
                                 since_claim_seconds=1, stopped=stopped)
    fetch_rows(ui.dsn, "INSERT INTO receipt_workers (tag, pod, slots, seen_at) VALUES"
                       " ('00000003', 'long-gone', 8, now() - interval '1 hour') RETURNING 1")
    await ui.reread()
    await page.goto(ui.url + "/")
    rows = await page.eval("[...document.querySelectorAll('table.workers tbody tr')]"
                           ".map(r => r.innerText)")
    assert len(rows) == 2 and "long-gone" not in " ".join(rows)
    assert "receipts-worker-a" in rows[0] and "64" in rows[0] and "1,234" in rows[0]
    assert "receipts-worker-b" in rows[1] and "stopped" in rows[1]
    assert await page.text("#count-workers") == "1"


@pytest.mark.slow
async def test_recover_now_returns_expired_leases(ui: Served, page: Page) -> None:
    (job,) = await claim_jobs(ui.queue, 1)
    fetch_rows(ui.dsn, "UPDATE receipt_jobs SET lease_until = now() - interval '1 min'"
                       " WHERE id = %s RETURNING 1", (job.id,))
    await ui.reread()
    await sign_in(page, ui)
    await page.goto(ui.url + "/")
    await page.click("#recover-now")
    assert await page.text("#message") == "Recovered expired leases"
    assert "1 expired lease(s) went back to ready" in await page.text("#message-text")
    assert fetch_rows(ui.dsn, "SELECT state, last_error FROM receipt_jobs WHERE id = %s",
                      (job.id,)) == [("ready", "lease expired")]


# ------------------------------------------------------------------ the provider


@pytest.mark.slow
async def test_the_provider_panel_shows_the_pause_its_reason_and_the_last_probe(
        ui: Served, page: Page) -> None:
    await ui.queue.extend_pause(PauseReason.OUTAGE, 120)
    fetch_rows(ui.dsn, "UPDATE receipt_flow SET last_probe_at = now() - interval '30 s',"
                       " last_probe_outcome = 'provider_5xx' RETURNING 1")
    await ui.reread()
    await page.goto(ui.url + "/")
    assert "the provider is failing" in await page.text("#provider-state")
    panel = await page.text("#provider")
    assert "Last probe\n" in panel and "provider_5xx" in panel and "Rate limit\nnone" in panel
    left = await page.text("#provider .countdown")
    await page.wait_for(f"document.querySelector('#provider .countdown').innerText !== {left!r}")


@pytest.mark.slow
async def test_an_operator_pauses_and_resumes_the_fleet_from_the_page(
        ui: Served, page: Page) -> None:
    await sign_in(page, ui)
    await page.goto(ui.url + "/")
    await page.eval("document.querySelector('#pause-duration').value = '30m'")
    await page.type("#pause-note-input", "provider maintenance window")
    await page.click("#pause-fleet")
    assert "manual" in await page.text("#pause-reason")
    assert await page.text("#pause-note") == "provider maintenance window"
    (row,) = fetch_rows(ui.dsn, "SELECT pause_reason, pause_cause, pause_note, paused_by,"
                                " paused_until - paused_at FROM receipt_flow")
    assert row[:3] == ("retry_after", "manual", "provider maintenance window")
    assert str(row[3]).startswith("ui:") and row[4] == timedelta(minutes=30)

    await page.click("#resume-fleet")
    assert await page.text("#provider-state") == "Delivering (not paused)"
    assert fetch_rows(ui.dsn, "SELECT pause_reason, pause_note FROM receipt_flow") == [
        (None, None)]

    # A longer automatic pause is not cut short unless the operator ticks the box.
    await ui.queue.extend_pause(PauseReason.AUTH, 3600)
    await ui.reread()
    await page.goto(ui.url + "/")
    await page.click("#provider details.pause summary", navigates=False)
    await page.type("#pause-note-input", "short")
    await page.click("#pause-fleet")
    assert await page.text("#message") == "Not paused"
    assert "automatic auth pause" in await page.text("#message-text")
    await page.goto(ui.url + "/")
    await page.click("#provider details.pause summary", navigates=False)
    await page.type("#pause-note-input", "override")
    await page.click("#provider input[name=replace]", navigates=False)
    await page.click("#pause-fleet")
    assert "manual" in await page.text("#pause-reason")


@pytest.mark.slow
async def test_the_chart_draws_the_sampled_hour_on_the_server(ui: Served, page: Page) -> None:
    monitor = ui.app[CONSOLE].monitor
    now = (await ui.operations.fleet_flow()).now
    monitor.history.clear()
    for minutes in range(60, -1, -1):
        monitor.history.append(Sample(now - timedelta(minutes=minutes), ready=60 - minutes,
                                      running=minutes % 7, failed=5))
    await monitor.refresh()
    await page.send("Emulation.setScriptExecutionDisabled", value=True)
    await page.goto(ui.url + "/")
    lines = await page.send("Runtime.evaluate", expression="1")  # scripts are off: nothing
    assert "exceptionDetails" not in lines
    doc = await page.send("DOM.getDocument", depth=-1)
    html = (await page.send("DOM.getOuterHTML", nodeId=doc["root"]["nodeId"]))["outerHTML"]
    svg = html[html.index("<svg class=\"depth\""):html.index("</svg>")]
    assert svg.count("<polyline") == 3
    assert "over the last 60 minutes: ready 1 to 1 (highest 60)" in svg
