"""Every page of the console laid out at 390 px (a phone) and 1,440 px (a desk), read-only and
signed in as admin, with long and bidi order ids (real chromium). Each page is photographed
(.tmp/screenshots/, never committed), must not scroll sideways, must keep its table rows
short, must not carry raw bidi controls in its title, and axe-core must find no serious or
critical accessibility issue in it."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator

import pytest

from tests.browser.cdp import Page
from tests.browser.console import AXE, BIDI_ORDER, LONG_ORDER, SHOTS, TOKEN, Served, serve
from tests.conftest import Server, claim_jobs, enqueue_many, fetch_rows, reschedule_one

WIDTHS = (390, 1440)
#: The tallest a table row (or its card, at 390 px) may be: a few lines, not a column of
#: characters.
MAX_ROW_PX = 320
BIDI_CONTROLS = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"


@pytest.fixture(scope="module")
def axe_source() -> str:
    if not AXE.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{AXE} is missing; scripts/install-tools.sh installs axe-core")
        pytest.skip("axe-core is not installed (make tools)")
    return AXE.read_text()


@pytest.fixture(params=["read-only", "admin"])
async def ui(request: pytest.FixtureRequest, pg18: Server) -> AsyncIterator[Served]:
    async with serve(pg18, TOKEN if request.param == "admin" else None) as served:
        enqueue_many(served.dsn, [LONG_ORDER, BIDI_ORDER, "running-1"])
        fetch_rows(served.dsn, "UPDATE receipt_jobs SET run_at = now() + interval '1 hour'"
                               " WHERE order_id = 'order-ready' RETURNING 1")
        claimed = {j.order_id: j for j in await claim_jobs(served.queue, 3)}
        for order in (LONG_ORDER, BIDI_ORDER):
            await reschedule_one(served.queue, claimed[order], delay_seconds=0,
                                 error="422 " + order, permanent=True)
        await served.queue.record_attempts([])
        await served.queue.heartbeat(
            tag="0badcafe", pod="receipts-worker-6c9d8f7b5-" + "q" * 40, pid=1, version="0.3.0",
            slots=32, inflight=1, claimed_total=3, uptime_seconds=60, since_claim_seconds=1)
        await served.operations.pause_fleet(900, note="provider maintenance " + "n" * 150,
                                            paused_by="ui:abcdefabcdef")
        await served.reread()
        served.mode = request.param  # type: ignore[attr-defined]
        yield served


async def check_page(page: Page, name: str, mode: str, width: int, axe_source: str) -> None:
    """Photograph the page and check its layout, title and accessibility."""
    await page.screenshot(SHOTS / f"{name}-{mode}-{width}.png")
    assert await page.overflow() == 0, f"{name} ({mode}, {width} px) scrolls sideways"
    tallest = await page.eval("Math.max(0, ...[...document.querySelectorAll('tbody tr')]"
                              ".map(r => r.getBoundingClientRect().height))")
    assert tallest <= MAX_ROW_PX, f"{name} ({mode}, {width} px): a row is {tallest} px tall"
    title = await page.eval("document.title")
    assert not set(title) & set(BIDI_CONTROLS), f"{name}: raw bidi controls in {title!r}"
    violations = [v for v in await page.axe(axe_source)
                  if v["impact"] in ("serious", "critical")]
    assert not violations, f"{name} ({mode}, {width} px): " + json.dumps(violations, indent=1)


@pytest.mark.slow
async def test_every_page_is_readable_at_both_widths(
        ui: Served, page: Page, axe_source: str) -> None:
    mode = ui.mode  # type: ignore[attr-defined]
    if mode == "admin":
        await page.goto(ui.url + "/login")
        await page.type("input[name=token]", TOKEN)
        await page.click("form.confirm button")
    long_id = ui_job_id(ui, LONG_ORDER)
    pages = {
        "console-failed": "/?state=failed",
        "console-running": "/?state=running",
        "job-long-order": f"/jobs/{long_id}",
        "job-bidi-order": f"/jobs/{ui_job_id(ui, BIDI_ORDER)}",
        "job-404": "/jobs/" + "z" * 150,
    }
    if mode == "admin":
        pages["login"] = "/login"
    for width in WIDTHS:
        await page.viewport(width)
        for name, path in pages.items():
            await page.goto(ui.url + path)
            await check_page(page, name, mode, width, axe_source)
        if mode == "admin":
            await page.goto(ui.url + "/?state=failed")
            await page.click("button[value='discard:filter']")
            await check_page(page, "confirm", mode, width, axe_source)
            if width == WIDTHS[0]:
                await page.click("#confirm")
                await page.wait_for("document.querySelector('#bulk-status')?.innerText"
                                    " === 'done'")
                bulk_url = await page.eval("location.pathname")
            await page.goto(ui.url + bulk_url)
            await check_page(page, "bulk", mode, width, axe_source)
            fetch_rows(ui.dsn, "UPDATE receipt_jobs SET state = 'failed', finished_at = now()"
                               " WHERE state = 'discarded' RETURNING 1")
            await ui.reread()


@pytest.mark.slow
async def test_read_only_tables_give_the_order_id_its_room(ui: Served, page: Page) -> None:
    await page.viewport(1440)
    await page.goto(ui.url + "/?state=failed")
    width = await page.eval("document.querySelector('table.jobs thead th.w-order')"
                            ".getBoundingClientRect().width")
    assert width >= 200  # not squeezed to two characters by the checkbox column's rule
    cell = await page.eval("document.querySelector('table.jobs tbody td.order')"
                           ".getBoundingClientRect().width")
    assert cell >= 200


@pytest.mark.slow
async def test_the_title_and_headings_keep_bidi_text_in_its_place(
        ui: Served, page: Page) -> None:
    await page.goto(f"{ui.url}/jobs/{ui_job_id(ui, BIDI_ORDER)}")
    title = await page.eval("document.title")
    assert "\ufffd" in title and not set(title) & set(BIDI_CONTROLS)
    # The order id is isolated: the words after it stay in reading order.
    assert await page.eval("getComputedStyle(document.querySelector('h1 bdi'))"
                           ".unicodeBidi") == "isolate"


@pytest.mark.slow
async def test_done_is_exact_when_the_table_statistics_lag(ui: Served, page: Page) -> None:
    with_done = "INSERT INTO receipt_jobs (id, order_id, state, attempts, finished_at) SELECT" \
                " gen_random_uuid(), 'done-' || g, 'done', 1, now() FROM generate_series(1," \
                " 10150) AS g RETURNING 1"
    fetch_rows(ui.dsn, with_done)
    fetch_rows(ui.dsn, "DELETE FROM receipt_jobs WHERE order_id LIKE 'done-%%' AND"
                       " substr(order_id, 6)::int > 150 RETURNING 1")
    await ui.reread()
    await page.goto(ui.url + "/")
    assert await page.text("#count-done") == "150"


def ui_job_id(ui: Served, order_id: str) -> str:
    return str(fetch_rows(ui.dsn, "SELECT id FROM receipt_jobs WHERE order_id = %s",
                          (order_id,))[0][0])




@pytest.mark.slow
async def test_the_accessibility_check_finds_a_known_problem(
        page: Page, axe_source: str) -> None:
    """The harness itself: axe-core, injected the same way, reports an image without alt."""
    await page.goto("data:text/html,<!doctype html><html lang=en><title>t</title>"
                    "<main><img src='data:,x'></main></html>")
    found = {v["id"]: v["impact"] for v in await page.axe(axe_source)}
    assert found.get("image-alt") == "critical"
