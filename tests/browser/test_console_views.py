"""The console's incident views (real chromium, real PostgreSQL): failures grouped by cause
with their group actions, throughput and attempt time that survive a restart, the person a
trusted proxy names behind every action, and every new view in light and dark at 390 and
1,440 px (photographed under .tmp/screenshots/, checked by axe-core)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import time
from collections.abc import AsyncIterator

import httpx
import psycopg
import pytest

from receipts.embedded import free_port
from receipts.metrics import start_server
from receipts.proxy import parse_networks
from receipts.ui import make_app
from receipts.ui.handlers import GROUPS_FAILED_CAP
from receipts.ui.session import UserHeader
from receipts.ui.state import CONSOLE, UiOptions
from tests.browser.cdp import Page
from tests.browser.console import AXE, SHOTS, TOKEN, Served, serve
from tests.conftest import Server, fetch_rows

#: Every test here drives Chromium: the fast lane leaves them out.
pytestmark = pytest.mark.slow

LIVE = UiOptions(refresh_seconds=1.0)
WIDTHS = (390, 1440)
SCHEMES = ("light", "dark")
#: Rows of the grouped table's timing; RECEIPTS_TEST_GROUP_ROWS lowers it for a quick run.
GROUP_ROWS = int(os.environ.get("RECEIPTS_TEST_GROUP_ROWS", "1000000"))
CAUSES = 20
#: The grouped table's budget (seconds) on the 2-connection pool.
GROUPS_BUDGET_SECONDS = 2.0


@pytest.fixture(scope="module")
def axe_source() -> str:
    if not AXE.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{AXE} is missing; scripts/install-tools.sh installs axe-core")
        pytest.skip("axe-core is not installed (make tools)")
    return AXE.read_text()


@pytest.fixture
async def ui(pg18: Server) -> AsyncIterator[Served]:
    async with serve(pg18, TOKEN, options=LIVE) as served:
        yield served


async def sign_in(page: Page, url: str) -> None:
    await page.goto(url + "/login")
    await page.type("input[name=token]", TOKEN)
    await page.click("form.confirm button")


async def scheme(page: Page, name: str) -> None:
    """Emulate the system's colour scheme (prefers-color-scheme)."""
    await page.send("Emulation.setEmulatedMedia", features=[
        {"name": "prefers-color-scheme", "value": name}])


async def photograph(page: Page, name: str, axe_source: str) -> None:
    """Screenshots of the current page at both widths in both schemes; each must not
    scroll sideways and axe-core must find no serious or critical issue in it."""
    for colours in SCHEMES:
        await scheme(page, colours)
        for width in WIDTHS:
            await page.viewport(width)
            await page.screenshot(SHOTS / f"{name}-{colours}-{width}.png")
            assert await page.overflow() <= 0, f"{name} ({colours}, {width} px) scrolls sideways"
            violations = [v for v in await page.axe(axe_source)
                          if v["impact"] in ("serious", "critical")]
            assert not violations, f"{name} ({colours}, {width} px): " + json.dumps(
                violations, indent=1)
    await scheme(page, "light")


def attempt_history(dsn: str) -> None:
    """An hour of attempts: a minute holds 27 deliveries of 0.1 or 0.3 s and 3 timeouts
    of 10 s."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("""
            INSERT INTO receipt_attempts (job_id, slot, seq, attempt, at, reason, status,
                                          duration_seconds, worker)
            SELECT gen_random_uuid(), 0, 1, 1,
                   statement_timestamp() - make_interval(mins => m, secs => s),
                   CASE WHEN s < 54 THEN 'delivered' ELSE 'timeout' END,
                   CASE WHEN s < 54 THEN 200 END,
                   CASE WHEN s < 54 THEN 0.1 + (s % 4) * 0.1 ELSE 10.0 END, 'w'
            FROM generate_series(1, 58) AS m, generate_series(0, 59, 2) AS s""")


# ---------------------------------------------------------------- failures by cause


async def test_failures_are_grouped_by_cause_and_a_group_is_retried_in_one_action(
        ui: Served, page: Page, axe_source: str) -> None:
    # A held rejection, as a ready job carrying its mark (waiting to be decided).
    fetch_rows(ui.dsn, "UPDATE receipt_jobs SET last_error = 'held: 422 rejected while the"
                       " provider accepted nothing' WHERE order_id = 'order-ready' RETURNING 1")
    await sign_in(page, ui.url)
    await page.click("#nav-failures")
    rows = await page.eval("[...document.querySelectorAll('table.groups tbody tr')]"
                           ".map(r => [...r.cells].map(c => c.innerText.trim()))")
    by_error = {r[3]: r for r in rows}
    busy = by_error["503 provider busy"]
    assert busy[:3] == ["failed", "max_attempts", "503"] and busy[4] == "2"
    assert by_error["422 order unknown"][4] == "1"
    held = next(r for e, r in by_error.items() if e.startswith("held: 422"))
    assert held[0] == "ready" and held[4] == "1"
    assert len(rows) == 5  # 503 busy, 422 unknown, 422 hostile, 422 long, the held one
    assert await page.eval("window.__pwned === undefined")  # the hostile error stays text
    await photograph(page, "failures-by-cause", axe_source)

    # Filterable: by text and by state.
    await page.type("input[name=q]", "busy")
    await page.click("form.filters button")
    assert await page.text("#group-count") == "1"
    await page.goto(ui.url + "/failures?state=ready")
    assert await page.eval("document.querySelectorAll('table.groups tbody tr').length") == 1
    # A ready group can be discarded, not retried (it is waiting already).
    assert await page.eval("document.querySelector('table.groups button[value=\"retry:filter\"]')"
                           " === null")

    # Retry the 503 group: one bulk action over exactly its jobs.
    await page.goto(ui.url + "/failures?q=busy")
    await page.click("table.groups button[value='retry:filter']")
    assert await page.text("h1") == "Retry 2 jobs?"
    await page.click("#confirm")
    await page.wait_for("document.querySelector('#bulk-status')?.innerText === 'done'")
    assert "error_prefix=503 provider busy" in await page.text("main")
    states = dict(fetch_rows(ui.dsn, "SELECT order_id, state FROM receipt_jobs"))
    assert states["order-503-a"] == states["order-503-b"] == "ready"
    assert states["order-422-a"] == "failed"
    await ui.reread()
    await page.goto(ui.url + "/failures?state=failed")
    errors = await page.eval("[...document.querySelectorAll('table.groups td.error')]"
                             ".map(e => e.innerText)")
    assert "503 provider busy" not in errors and len(errors) == 3


@pytest.mark.slow
async def test_the_grouped_table_of_a_million_failed_rows_renders_within_two_seconds(
        pg18: Server, capsys: pytest.CaptureFixture[str]) -> None:
    async with serve(pg18, TOKEN, seeded=False, pool_size=2) as ui:
        with psycopg.connect(ui.dsn, autocommit=True) as conn:
            conn.execute("""
                INSERT INTO receipt_jobs (id, order_id, state, attempts, last_error, finished_at)
                SELECT gen_random_uuid(), 'g-' || g, 'failed', 5,
                       (400 + g %% %(causes)s) || ' cause number ' || g %% %(causes)s
                         || ': the provider refused this receipt; beyond sixty characters'
                         || ' the text varies: ' || g,
                       statement_timestamp() - make_interval(secs => g::float8 / 100)
                FROM generate_series(1, %(n)s) AS g""", {"n": GROUP_ROWS, "causes": CAUSES})
            conn.execute("VACUUM (ANALYZE) receipt_jobs")
        console = ui.app[CONSOLE]
        timings = []
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            for _ in range(3):
                console.lists.clear()
                began = time.perf_counter()
                response = await client.get(ui.url + "/failures")
                timings.append(time.perf_counter() - began)
                assert response.status_code == 200
        assert response.text.count('class="num group-jobs"') == CAUSES
        # Bounded work: the most recent 100,000 failures are grouped, and the page says so.
        grouped = min(GROUP_ROWS, GROUPS_FAILED_CAP)
        assert f">{grouped // CAUSES:,}</td>" in response.text
        assert (GROUP_ROWS > GROUPS_FAILED_CAP) == ('id="groups-capped"' in response.text)
        median = statistics.median(timings)
        with capsys.disabled():
            print(f"\n[bench] /failures over {GROUP_ROWS:,} failed rows in {CAUSES} causes, "
                  f"2-connection pool: median {median:.2f} s of 3 "
                  f"({', '.join(f'{t:.2f}' for t in timings)})")
        assert median < GROUPS_BUDGET_SECONDS


# ---------------------------------------------------------- throughput and latency


async def test_throughput_and_attempt_time_survive_a_restart_and_read_at_390_px(
        pg18: Server, page: Page, axe_source: str) -> None:
    async with serve(pg18, TOKEN, options=LIVE, seeded=False) as ui:
        await throughput_and_attempt_time(ui, page, axe_source)


async def minute_with_room(seconds: float = 15.0) -> None:
    """Wait, if need be, until the wall clock has *seconds* left in its minute: the rate of
    the last five minutes and the bars move on at minute boundaries, so two readings
    compared for equality must fall in one minute."""
    left = 60.0 - (time.time() % 60.0)
    if left < seconds:
        await asyncio.sleep(left + 0.5)


async def throughput_and_attempt_time(ui: Served, page: Page, axe_source: str) -> None:
    # Written before the console's first reading of them (later it reads only the newest
    # minutes again: attempts are recorded as they happen).
    await minute_with_room()
    attempt_history(ui.dsn)
    await ui.reread()
    await page.goto(ui.url + "/")
    before = {k: await page.text(k) for k in ("#per-minute", "#attempt-p50", "#attempt-p95")}
    # 27 a minute, but none in the last minute: about 3.5 of the last 5 minutes hold some.
    assert 10 <= float(before["#per-minute"].removesuffix("/min")) <= 30
    assert before["#attempt-p50"] == "300 ms"
    assert "95th percentile 10.0 s" in before["#attempt-p95"]
    bars = await page.eval("document.querySelectorAll('svg.throughput rect').length")
    assert bars >= 57

    # A new console process on the same database draws the same hour at once (read in the
    # same minute as the first: see minute_with_room; the photographs come after).
    port = free_port()
    restarted = make_app(ui.queue, ui.operations,
                         admin_token=TOKEN, loopback_only=True, options=LIVE)
    runner = await start_server(restarted, port, host="127.0.0.1")
    try:
        await page.viewport(390)
        await page.goto(f"http://127.0.0.1:{port}/")
        after = {k: await page.text(k) for k in before}
        assert after == before
        assert await page.eval(
            "document.querySelectorAll('svg.throughput rect').length") == bars
        # Readable on a phone: the charts' text is at least 10 px high as drawn.
        smallest = await page.eval("Math.min(...[...document.querySelectorAll("
                                   "'svg.rate text')].map(t => t.getBoundingClientRect()"
                                   ".height))")
        assert smallest >= 10, smallest
        await page.screenshot(SHOTS / "summary-after-restart-390.png")
    finally:
        await runner.cleanup()
    await page.goto(ui.url + "/")
    await photograph(page, "summary-throughput", axe_source)


# ------------------------------------------------------------------ identity


async def test_a_trusted_proxy_names_the_person_behind_each_action(
        pg18: Server, page: Page, caplog: pytest.LogCaptureFixture, axe_source: str) -> None:
    caplog.set_level(logging.INFO, logger="receipts.ui")
    proxy = UserHeader("X-Auth-Request-User", parse_networks("127.0.0.1"))
    async with serve(pg18, TOKEN, options=LIVE, user_header=proxy) as ui:
        await page.send("Network.setExtraHTTPHeaders",
                        headers={"X-Auth-Request-User": "alice@example.com"})
        await sign_in(page, ui.url)
        await page.goto(ui.url + "/")
        assert await page.text("#user") == "as alice@example.com"
        await page.type("#pause-note-input", "provider maintenance")
        await page.click("#pause-fleet")
        assert fetch_rows(ui.dsn, "SELECT paused_by FROM receipt_flow") == [
            ("ui:alice@example.com",)]
        assert "ui:alice@example.com" in await page.text("#provider")
        await page.goto(ui.url + "/?status=503")
        await page.click("button[value='discard:filter']")
        await page.click("#confirm")
        await page.wait_for("document.querySelector('#bulk-status')?.innerText === 'done'")
        assert "by ui:alice@example.com" in await page.text("main")
        await photograph(page, "bulk-by-user", axe_source)
        assert fetch_rows(ui.dsn, "SELECT created_by FROM receipt_bulk_actions") == [
            ("ui:alice@example.com",)]
        audit = [r.__dict__ for r in caplog.records if r.getMessage() == "ui_action"]
        assert [(a["action"], a["user"]) for a in audit] == [
            ("pause", "alice@example.com"), ("discard", "alice@example.com")]
        print("audit:", json.dumps({k: audit[-1][k] for k in (
            "action", "user", "session", "peer", "filter", "expected")}))

        # From anywhere but the proxy the header names nobody: the session does.
        transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with httpx.AsyncClient(trust_env=False, transport=transport) as other:
            shown = await other.get(ui.url + "/", headers={"X-Auth-Request-User": "mallory"})
            assert "mallory" not in shown.text and 'id="user"' not in shown.text
