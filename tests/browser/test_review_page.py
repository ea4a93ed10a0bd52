"""The review page in a real headless chromium, used as an operator would.

The page is served in-process (``make_app`` on a real aiohttp server and a real
PostgreSQL 18); the browser is Debian's chromium driven through the DevTools
protocol (``tests/browser/cdp.py``): real navigation, real mouse clicks and key
input, real cookies and the browser's own origin and SameSite rules.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from receipts.embedded import free_port
from receipts.metrics import start_server
from receipts.model import AttemptRecord, Reason
from tests.browser.cdp import Page
from tests.browser.console import HOSTILE, LONG_LINE, SHOTS, TOKEN, Served, serve
from tests.conftest import Server, claim_jobs, fetch_rows, reschedule_one

SCREENSHOT = SHOTS / "review-page.png"
JOB_SCREENSHOT = SHOTS / "review-job.png"


@pytest.fixture
async def ui(pg18: Server) -> AsyncIterator[Served]:
    """The review page with actions (admin token set)."""
    async with serve(pg18, TOKEN) as served:
        yield served


@pytest.fixture
async def readonly_ui(pg18: Server) -> AsyncIterator[Served]:
    """The review page without an admin token."""
    async with serve(pg18, None) as served:
        yield served


async def _rows(page: Page) -> list[str]:
    return list(await page.eval(
        "[...document.querySelectorAll('table.jobs tbody td.order a')].map(e => e.innerText)"))


# ------------------------------------------------------------------ reading


@pytest.mark.slow
async def test_list_filter_and_open_a_job_with_its_attempt_history(
    ui: Served, page: Page, capsys: pytest.CaptureFixture[str]
) -> None:
    await page.goto(ui.url + "/")
    assert await page.text("#count-failed") == "5"
    assert await page.text("#match-count") == "5"
    assert sorted(await _rows(page)) == ["order-422-a", "order-422-b", "order-422-long",
                                         "order-503-a", "order-503-b"]
    assert "not paused" in await page.text("#provider")
    await page.screenshot(SCREENSHOT)
    with capsys.disabled():
        print(f"\nreview page screenshot: {SCREENSHOT}")
    assert SCREENSHOT.stat().st_size > 10_000

    # Filter by HTTP status (typed into the form, submitted with a click).
    await page.type("input[name=status]", "503")
    await page.click("form.filters button")
    assert "status=503" in await page.eval("location.search")
    assert sorted(await _rows(page)) == ["order-503-a", "order-503-b"]
    # Order-id search and reason filter combine.
    await page.goto(ui.url + "/?state=failed&reason=rejected&q=long")
    assert await _rows(page) == ["order-422-long"]

    # Open a job: its attempt history, newest first, with the worker and status.
    await page.goto(ui.url + "/?status=503&q=503-a")
    await page.click("td.order a")
    assert await page.text("#job-state") == "failed"
    history = await page.eval(
        "[...document.querySelectorAll('table.attempts tbody tr')]"
        ".map(r => [...r.cells].map(c => c.innerText))")
    assert [(h[3], h[4], h[6]) for h in history] == [
        ("max_attempts", "503", "receipts-worker-7f9c"),
        ("timeout", "", "receipts-worker-1a2b")]
    assert history[1][5] == "10.0 s"
    await page.screenshot(JOB_SCREENSHOT)
    with capsys.disabled():
        print(f"job page screenshot: {JOB_SCREENSHOT}")
    # No secret on the page: no DSN, no admin token.
    html = await page.eval("document.documentElement.outerHTML")
    assert "postgresql://" not in html and "dbname" not in html and TOKEN not in html


@pytest.mark.slow
async def test_pages_read_without_javascript(ui: Served, page: Page) -> None:
    await page.send("Emulation.setScriptExecutionDisabled", value=True)
    await page.goto(ui.url + "/?status=422")
    # Read through the DOM domain (no page script runs).
    doc = await page.send("DOM.getDocument", depth=-1)
    html = (await page.send("DOM.getOuterHTML", nodeId=doc["root"]["nodeId"]))["outerHTML"]
    assert "order-422-a" in html and "order-503-a" not in html
    assert "Refresh</a>" in html  # without live updates, a plain link reloads
    # The one script is the same-origin file; nothing inline.
    scripts = html.replace("&lt;script", "").split("<script")[1:]
    assert len(scripts) == 1 and scripts[0].startswith(' src="/static/live.js"')


@pytest.mark.slow
async def test_hostile_provider_errors_render_escaped_and_clipped(ui: Served, page: Page) -> None:
    await page.goto(ui.url + "/")
    assert await page.eval("window.__pwned === undefined")
    assert await page.eval("document.querySelectorAll('main script, main img').length") == 0
    cells = await page.eval("[...document.querySelectorAll('td.error')].map(e => e.innerText)")
    assert any("<script>window.__pwned = 1</script>" in c for c in cells)
    long_cell = next(c for c in cells if c.startswith("422 EEE"))
    assert len(long_cell) < 300 and "characters)" in long_cell
    # The very long line wraps: the page never scrolls sideways.
    assert await page.eval("document.documentElement.scrollWidth <= window.innerWidth")

    await page.goto(f"{ui.url}/jobs/{ui.jobs['order-422-b'].id}")
    assert await page.eval("window.__pwned === undefined")
    assert await page.eval("document.querySelectorAll('main script, main img').length") == 0
    assert HOSTILE in await page.text("#last-error")
    await page.goto(f"{ui.url}/jobs/order-422-long")
    text = await page.text("#last-error")
    assert text == ("422 " + LONG_LINE)[:500]  # the stored error is cut to 500 characters
    assert await page.eval("document.documentElement.scrollWidth <= window.innerWidth")


# ------------------------------------------------------------------ actions


@pytest.mark.slow
async def test_retry_needs_the_admin_token_and_then_happens(ui: Served, page: Page) -> None:
    await page.goto(ui.url + "/?status=422")
    target = ui.jobs["order-422-a"].id
    await page.click(f"input[value='{target}']", navigates=False)
    await page.click("button[value='retry:selected']")
    assert "Retry 1 job?" in await page.text("h1")

    # A wrong token: refused, nothing changes.
    await page.type("input[name=token]", "not-the-token-at-all")
    await page.click("#confirm")
    assert await page.text("#message") == "Wrong token"
    assert ui.state("order-422-a") == "failed"
    assert [r["status"] for r in page.responses if r["url"].endswith("/act")][-1] == 403

    # The right token: retried, and the session is now signed in (cookie, flags).
    await page.goto(ui.url + "/?status=422")
    await page.click(f"input[value='{target}']", navigates=False)
    await page.click("button[value='retry:selected']")
    await page.type("input[name=token]", TOKEN)
    await page.click("#confirm")
    assert await page.text("#done") == "Retried 1 job"
    assert ui.state("order-422-a") == "ready"
    (cookie,) = [c for c in await page.cookies() if c["name"] == "receipts_ui_session"]
    assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
    assert TOKEN not in cookie["value"] and cookie["value"].split(".")[2] == "admin"

    # Signed in: a filter action shows its count, then needs no token.
    await page.goto(ui.url + "/?status=503")
    await page.click("button[value='discard:filter']")
    assert "Discard 2 jobs?" in await page.text("h1")
    assert await page.eval("document.querySelector('input[name=token]') === null")
    await page.click("#confirm")
    # A filter runs as a bulk action; its page follows it to the end.
    assert "/bulk/" in await page.eval("location.pathname")
    await page.wait_for("document.querySelector('#bulk-status')?.innerText === 'done'")
    assert "2 of 2 confirmed" in await page.text("#bulk-changed")
    assert {ui.state("order-503-a"), ui.state("order-503-b")} == {"discarded"}


@pytest.mark.slow
async def test_all_matching_is_bounded_by_the_moment_of_confirmation(
        ui: Served, page: Page) -> None:
    await page.goto(ui.url + "/login")
    await page.type("input[name=token]", TOKEN)
    await page.click("form.confirm button")
    await page.goto(ui.url + "/?status=422")
    await page.click("button[value='retry:filter']")
    assert "Retry 3 jobs?" in await page.text("h1")
    # Meanwhile another operator retries one of them, and a new 422 failure arrives.
    await ui.operations.retry_jobs([ui.jobs["order-422-a"].id], expected=1)
    (late,) = await claim_jobs(ui.queue, 1)
    await reschedule_one(ui.queue, late, delay_seconds=0, error="422 late", permanent=True)
    await ui.queue.record_attempts([AttemptRecord(late.id, 1, Reason.REJECTED, 422,
                                                  "422 late", 0.1, "receipts-worker-7f9c")])
    await page.click("#confirm")
    # Not "nothing changed": the two jobs that still qualify were retried; the late one not.
    assert await page.wait_for("document.querySelector('#bulk-status')?.innerText === 'done'")
    assert "2 of 3 confirmed" in await page.text("#bulk-changed")
    assert {ui.state("order-422-b"), ui.state("order-422-long")} == {"ready"}
    assert fetch_rows(ui.dsn, "SELECT state FROM receipt_jobs WHERE id = %s", (late.id,)) == [
        ("failed",)]


@pytest.mark.slow
async def test_a_selection_with_a_job_that_does_not_qualify_changes_nothing(
    ui: Served, page: Page
) -> None:
    await page.goto(ui.url + "/?state=ready")
    ready = await page.eval("document.querySelector('input[name=id]').value")
    # Retry is not offered for ready jobs; discard is.
    assert await page.eval("document.querySelector(\"button[value='retry:selected']\")") is None
    fetch_rows(ui.dsn, "UPDATE receipt_jobs SET state = 'running', lease_token ="
                       " gen_random_uuid(), lease_until = now() + interval '1 min'"
                       " WHERE id = %s RETURNING 1", (uuid.UUID(ready),))
    await page.click("input[name=id]", navigates=False)
    await page.click("button[value='discard:selected']")
    assert await page.text("#refused")
    assert f"{ready} is running" in await page.text("main")
    assert await page.eval("document.querySelector('#confirm') === null")
    assert ui.state("order-ready") == "running"


@pytest.mark.slow
async def test_a_forged_cross_site_post_is_refused(ui: Served, page: Page) -> None:
    """A page on another site auto-submits a retry form to the signed-in operator's page."""
    await page.goto(ui.url + "/login")
    await page.type("input[name=token]", TOKEN)
    await page.click("form.confirm button")
    await page.goto(ui.url + "/")
    csrf = await page.eval("document.querySelector('input[name=csrf]').value")

    evil_port = free_port()
    forged = f"""<!doctype html><title>win a prize</title>
<form method="post" action="{ui.url}/act">
<input name="action" value="retry:filter"><input name="state" value="failed">
<input name="expected" value="5"><input name="csrf" value="{csrf}">
</form><script>document.forms[0].submit()</script>"""

    async def evil(_: web.Request) -> web.Response:
        return web.Response(text=forged, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", evil)
    runner = await start_server(app, evil_port, host="127.0.0.1")
    try:
        landed = page.expect("Page.loadEventFired")
        await page.goto(f"http://evil.test:{evil_port}/")
        await asyncio.wait_for(landed, 30)
        for _ in range(100):  # the auto-submit navigates once more
            if (await page.eval("location.href")).startswith(ui.url):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert await page.eval("location.href") == f"{ui.url}/act"
        assert await page.text("#message") == "Refused"
        assert "came from another site" in await page.text("main")
    finally:
        await runner.cleanup()
    assert {ui.state(o) for o in ui.jobs} == {"failed"}


@pytest.mark.slow
async def test_the_read_only_page_offers_no_actions_and_refuses_every_post(
    readonly_ui: Served, page: Page
) -> None:
    await page.goto(readonly_ui.url + "/")
    assert await page.text(".mode") == "read-only"
    assert await page.eval("document.querySelector('#pause-fleet, #resume-fleet, "
                           "#recover-now') === null")
    assert await page.eval("document.querySelectorAll('input[name=id], button[name=action]')"
                           ".length") == 0
    async with httpx.AsyncClient(trust_env=False) as client:
        for path in ("/act", "/confirm", "/login"):
            response = await client.post(readonly_ui.url + path, data={
                "action": "retry:filter", "state": "failed", "expected": "5", "token": TOKEN})
            assert response.status_code == 403, path
            assert "read-only" in response.text
        # A name that rebinds to 127.0.0.1 is not served.
        response = await client.get(readonly_ui.url + "/", headers={"Host": "evil.test"})
        assert response.status_code == 421
    assert {readonly_ui.state(o) for o in readonly_ui.jobs} == {"failed"}


@pytest.mark.slow
async def test_a_running_job_shows_only_its_lease_token_prefix(ui: Served, page: Page) -> None:
    (job,) = await claim_jobs(ui.queue, 1)
    await page.goto(f"{ui.url}/jobs/{job.id}")
    assert await page.text("#job-state") == "running"
    html = await page.eval("document.documentElement.outerHTML")
    assert f"{job.token.hex[:8]}…" in html
    assert str(job.token) not in html and job.token.hex not in html
    # No action is offered on a running job.
    assert await page.eval("document.querySelectorAll('button[name=action]').length") == 0
