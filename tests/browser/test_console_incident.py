"""The console in an incident (real chromium, real PostgreSQL): the provider panel follows a
pause made on the command line, a signed-out cookie is refused from the first request after a
restart, bulk actions are taken over by a restarted console without a click, a form sent twice
reads as "already done", and the small things an operator reads at a glance stay right."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import httpx
import psycopg
import pytest

from receipts.bulk import BulkPolicy
from receipts.db import make_pool
from receipts.embedded import free_port
from receipts.jobqueue import JobQueue
from receipts.metrics import start_server
from receipts.ui import make_app
from receipts.ui.chart import Sample
from receipts.ui.state import CONSOLE, UiOptions
from tests.browser.cdp import Page
from tests.browser.console import SHOTS, TOKEN, Served, serve
from tests.conftest import Server, claim_jobs, enqueue_many, fetch_rows, make_settings

#: Every test here drives Chromium: the fast lane leaves them out.
pytestmark = pytest.mark.slow

LIVE = UiOptions(refresh_seconds=1.0)
#: Rows of the bulk test: 200 batches of 100, resting 4 × each batch's time between two.
ROWS = 20_000


@pytest.fixture
async def ui(pg18: Server) -> AsyncIterator[Served]:
    async with serve(pg18, TOKEN, options=LIVE) as served:
        yield served


async def sign_in(page: Page, url: str, token: str = TOKEN) -> None:
    await page.goto(url + "/login")
    await page.type("input[name=token]", token)
    await page.click("form.confirm button")


def session_cookie(cookies: list[dict[str, object]]) -> str:
    (value,) = [str(c["value"]) for c in cookies if c["name"] == "receipts_ui_session"]
    return value


def insert_failed(dsn: str, rows: int, *, error: str = "503 provider busy",
                  prefix: str = "bulk") -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("""
            INSERT INTO receipt_jobs (id, order_id, state, attempts, last_error, finished_at)
            SELECT gen_random_uuid(), %(prefix)s || '-' || g, 'failed', 5, %(error)s,
                   statement_timestamp() - make_interval(secs => g::float8 / 1000)
            FROM generate_series(1, %(n)s) AS g""", {"n": rows, "error": error,
                                                       "prefix": prefix})


# ------------------------------------------------------------- the provider panel


async def test_the_provider_panel_follows_a_command_line_pause_for_a_signed_in_admin(
        ui: Served, page: Page) -> None:
    await sign_in(page, ui.url)
    await page.goto(ui.url + "/")
    await page.eval("window.__same_page = true")
    assert await page.text("#provider-state") == "Delivering (not paused)"
    # The admin's panel holds the pause form (a <select> among its controls), untouched.
    assert await page.eval("document.querySelector('#provider select') !== null")
    env = {**os.environ, "RECEIPTS_DATABASE_URL": ui.dsn, "RECEIPTS_LOG_LEVEL": "WARNING"}
    done = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "receipts", "jobs", "pause", "--for", "30m", "--reason",
        "provider maintenance from the CLI"], env=env, capture_output=True, text=True,
        timeout=60)
    assert done.returncode == 0, done.stderr
    await page.wait_for("document.querySelector('#provider-state').innerText"
                        ".startsWith('Deliveries paused')", timeout=10)
    assert await page.text("#pause-note") == "provider maintenance from the CLI"
    assert await page.eval("window.__same_page === true")  # refreshed in place
    assert "editing waits" not in await page.text("#live-status")


# ------------------------------------------------------------------ sign-out


async def test_a_signed_out_cookie_replayed_right_after_a_restart_is_refused(
        ui: Served, page: Page) -> None:
    await sign_in(page, ui.url)
    copied = session_cookie(await page.cookies())
    await page.goto(ui.url + "/")
    csrf = await page.eval("document.querySelector('input[name=csrf]').value")
    await page.click("header .mode button")  # Sign out: recorded in the database
    assert "signed in" not in await page.text(".mode")

    # A new console process on the same database (a restart): its first request is the replay.
    port = free_port()
    restarted = make_app(ui.queue, ui.operations,
                         admin_token=TOKEN, loopback_only=True, options=LIVE)
    runner = await start_server(restarted, port, host="127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(trust_env=False) as client:
            shown = await client.get(url + "/", headers={
                "Cookie": f"receipts_ui_session={copied}"})
            assert shown.status_code == 200
            assert "signed in (admin)" not in shown.text
            posted = await client.post(url + "/recover", data={"csrf": csrf}, headers={
                "Origin": url, "Cookie": f"receipts_ui_session={copied}"})
            assert posted.status_code == 403
        assert restarted[CONSOLE].monitor.readings <= 1  # the list came before any reading
    finally:
        await runner.cleanup()


# ------------------------------------------------------------------ bulk actions


async def test_a_restarted_console_takes_over_bulk_actions_without_a_click(
        pg18: Server, page: Page, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="receipts.bulk")
    slow = UiOptions(refresh_seconds=1.0, bulk_policy=BulkPolicy(
        first_batch=100, min_batch=100, max_batch=100, pace=4.0, stale_seconds=2.0))
    async with serve(pg18, TOKEN, options=slow, seeded=False) as first:
        insert_failed(first.dsn, ROWS)
        await first.reread()
        await sign_in(page, first.url)
        await page.goto(first.url + "/?state=failed")
        await page.click("button[value='retry:filter']")
        # What a replay would send: the confirmation form as it was.
        form = await page.eval("new URLSearchParams(new FormData("
                               "document.querySelector('form.confirm'))).toString()")
        await page.click("#confirm")
        action_id = uuid.UUID((await page.eval("location.pathname")).split("/")[-1])
        await page.wait_for("Number(document.querySelector('#bulk-changed').innerText"
                            ".split(' ')[0].replace(/,/g, '')) > 0", timeout=30)
        # Rate and time left while it runs.
        await page.wait_for("document.querySelector('#bulk-rate') !== null"
                            " && document.querySelector('#bulk-eta') !== null", timeout=10)
        assert "jobs examined a second" in await page.text("#bulk-rate")
        assert (await page.text("#bulk-eta")).startswith("about ")
        await page.viewport(390)
        await page.screenshot(SHOTS / "bulk-progress-390.png")
        await page.viewport(1440)
        await page.screenshot(SHOTS / "bulk-progress-1440.png")

        # 1. The console is killed: its runner and its background vanish, nothing is released.
        console = first.app[CONSOLE]
        (task,) = console.runners
        console.tokens.clear()
        gone = [task, *(t for t in asyncio.all_tasks() if t.get_name() == "ui-bulk-adopt")]
        for t in gone:
            t.cancel()
        await asyncio.gather(*gone, return_exceptions=True)
        (killed_at,) = fetch_rows(first.dsn, "SELECT changed FROM receipt_bulk_actions")

        # A restarted console on the same database takes it over by itself once it is silent.
        port = free_port()
        second = make_app(first.queue, first.operations,
                          admin_token=TOKEN, loopback_only=True, options=slow)
        runner = await start_server(second, port, host="127.0.0.1")
        try:
            await until_logged(caplog, "bulk_action_adopted", 1, timeout=20)
            await until_changed_beyond(first.dsn, killed_at[0])
            # 2. A clean restart: it releases the action, and the next console takes it at once.
            await runner.cleanup()
            (released,) = fetch_rows(first.dsn, "SELECT runner, status FROM receipt_bulk_actions")
            assert released == (uuid.UUID(int=0), "running")
            third = make_app(first.queue, first.operations,
                             admin_token=TOKEN, loopback_only=True, options=slow)
            runner = await start_server(third, port, host="127.0.0.1")
            await until_logged(caplog, "bulk_action_adopted", 2, timeout=5)
            await page.goto(f"http://127.0.0.1:{port}/bulk/{action_id}")
            await page.wait_for("document.querySelector('#bulk-status').innerText === 'done'",
                                timeout=120)
        finally:
            await runner.cleanup()
        adopted = [r.__dict__ for r in caplog.records if r.getMessage() == "bulk_action_adopted"]
        assert {a["action_id"] for a in adopted} == {str(action_id)}
        assert fetch_rows(first.dsn, "SELECT changed, status FROM receipt_bulk_actions") == [
            (ROWS, "done")]

        # The same form sent again: the same action, "already done", not "0 changed of 6,000".
        async with httpx.AsyncClient(trust_env=False) as client:
            cookie = session_cookie(await page.cookies())
            again = await client.post(first.url + "/act", content=form, headers={
                "Origin": first.url, "Cookie": f"receipts_ui_session={cookie}",
                "Content-Type": "application/x-www-form-urlencoded"})
        assert again.status_code == 303
        assert again.headers["Location"] == f"/bulk/{action_id}?again=1"
        await page.goto(first.url + again.headers["Location"])
        assert "already done" in await page.text("#bulk-again")
        assert await page.text("#bulk-changed") == f"{ROWS:,} of {ROWS:,} confirmed"
        assert fetch_rows(first.dsn, "SELECT count(*) FROM receipt_bulk_actions") == [(1,)]


async def until_logged(caplog: pytest.LogCaptureFixture, event: str, count: int, *,
                       timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while sum(1 for r in caplog.records if r.getMessage() == event) < count:
        assert asyncio.get_running_loop().time() < deadline, f"no {event} within {timeout} s"
        await asyncio.sleep(0.1)


async def until_changed_beyond(dsn: str, changed: int, timeout: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while fetch_rows(dsn, "SELECT changed FROM receipt_bulk_actions")[0][0] <= changed:
        assert asyncio.get_running_loop().time() < deadline, "the action made no progress"
        await asyncio.sleep(0.1)


# ------------------------------------------------------------------ small things


async def test_held_by_names_the_pod_and_the_process(ui: Served, page: Page) -> None:
    enqueue_many(ui.dsn, ["held-1"])
    pool = make_pool(make_settings(ui.dsn), "worker", max_size=1)
    await pool.open(wait=True)
    try:
        worker = JobQueue(pool, lease_seconds=60, max_attempts=5, worker_tag="0badcafe")
        await claim_jobs(worker, 10)
    finally:
        await pool.close()
    await ui.queue.heartbeat(tag="0badcafe", pod="receipts-worker-5d8f7-x2k4p", pid=4242,
                                  version="0.3.0", slots=8, inflight=1, claimed_total=1,
                                  uptime_seconds=10, since_claim_seconds=1)
    await ui.reread()
    await page.goto(ui.url + "/?state=running")
    holders = await page.eval("[...document.querySelectorAll('td[data-label=\"Held by\"]')]"
                              ".map(e => e.innerText)")
    assert holders and set(holders) == {"receipts-worker-5d8f7-x2k4p pid 4242 · 0badcafe"}


async def test_a_killed_worker_stops_counting_as_live_within_half_a_minute(
        ui: Served, page: Page) -> None:
    await ui.queue.heartbeat(tag="00000001", pod="alive", pid=1, version="0.3.0", slots=4,
                                  inflight=0, claimed_total=0, uptime_seconds=5,
                                  since_claim_seconds=None)
    await ui.queue.heartbeat(tag="00000002", pod="killed", pid=2, version="0.3.0", slots=4,
                                  inflight=0, claimed_total=0, uptime_seconds=5,
                                  since_claim_seconds=None)
    # Its last heartbeat was 31 s ago: more than the longest gap between two (24 s) allows.
    fetch_rows(ui.dsn, "UPDATE receipt_workers SET seen_at = now() - interval '31 s'"
                       " WHERE tag = '00000002' RETURNING 1")
    await ui.reread()
    await page.goto(ui.url + "/")
    assert await page.text("#count-workers") == "1"
    rows = await page.eval("[...document.querySelectorAll('table.workers tbody tr')]"
                           ".map(r => r.innerText)")
    assert any("killed" in r and "silent" in r for r in rows)


async def test_the_expired_badge_stays_inside_its_column_at_desk_width(
        ui: Served, page: Page) -> None:
    (job,) = await claim_jobs(ui.queue, 1)
    fetch_rows(ui.dsn, "UPDATE receipt_jobs SET lease_until = now() - interval '1 min'"
                       " WHERE id = %s RETURNING 1", (job.id,))
    await ui.reread()
    await page.viewport(1440)
    await page.goto(ui.url + "/?state=running")
    inside = await page.eval("""(() => {
        const badge = document.querySelector('td[data-label="Lease until"] .badge');
        const cell = badge.closest('td').getBoundingClientRect();
        const b = badge.getBoundingClientRect();
        return b.left >= cell.left && b.right <= cell.right; })()""")
    assert inside


async def test_the_chart_axis_shows_a_million_whole(ui: Served, page: Page) -> None:
    monitor = ui.app[CONSOLE].monitor
    await ui.reread()
    monitor.history.appendleft(Sample(monitor.history[0].at - timedelta(minutes=1),
                                      ready=0, running=0, failed=1_000_000))
    await page.viewport(1440)
    await page.goto(ui.url + "/")
    label = await page.eval("""(() => {
        const svg = document.querySelector('svg.depth');
        const text = [...svg.querySelectorAll('text')].find(t => t.textContent === '1,000,000');
        const s = svg.getBoundingClientRect(), t = text.getBoundingClientRect();
        return [t.left - s.left, text.textContent]; })()""")
    assert label[1] == "1,000,000" and label[0] >= 0


async def test_the_chart_keeps_its_hour_across_a_restart(ui: Served, page: Page) -> None:
    fetch_rows(ui.dsn, "INSERT INTO receipt_ui_samples (minute, ready, running, failed)"
                       " SELECT date_trunc('minute', now()) - make_interval(mins => g), 10 + g,"
                       " 1, 5 FROM generate_series(1, 50) AS g RETURNING 1")
    port = free_port()
    restarted = make_app(ui.queue, ui.operations,
                         admin_token=TOKEN, loopback_only=True, options=LIVE)
    runner = await start_server(restarted, port, host="127.0.0.1")
    try:
        await page.goto(f"http://127.0.0.1:{port}/")
        title = await page.eval("document.querySelector('svg.depth title').textContent")
        assert "ready 60 to 1 (highest 60)" in title, title
        assert await page.eval("document.querySelectorAll('svg.depth polyline').length") == 3
        # Its own readings are kept too, one a minute.
        assert fetch_rows(ui.dsn, "SELECT count(*) FROM receipt_ui_samples WHERE minute ="
                                  " date_trunc('minute', now())") == [(1,)]
    finally:
        await runner.cleanup()


async def test_the_done_count_follows_each_delivery(ui: Served, page: Page) -> None:
    await page.goto(ui.url + "/")
    assert await page.text("#count-done") == "0"
    enqueue_many(ui.dsn, ["done-a", "done-b"])
    for job in await claim_jobs(ui.queue, 2):
        await ui.queue.ack([(job.id, job.token)])
    # Well within the minute between two full counts.
    await page.wait_for("document.querySelector('#count-done').innerText === '2'", timeout=8)
