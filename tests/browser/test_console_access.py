"""Who may read and act on the console (real chromium): sign-out revokes the session on every
replica, wrong tokens are throttled per client, a viewer token guards reading, a Secure cookie
that cannot stick over plain HTTP is explained, and every action is audited with its session."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from receipts.embedded import free_port
from receipts.metrics import start_server
from receipts.ui import make_app
from tests.browser.cdp import Page
from tests.browser.console import TOKEN, VIEWER_TOKEN, Served, serve
from tests.conftest import Server


@pytest.fixture
async def ui(pg18: Server) -> AsyncIterator[Served]:
    async with serve(pg18, TOKEN) as served:
        yield served


async def sign_in(page: Page, url: str, token: str) -> None:
    await page.goto(url + "/login")
    await page.type("input[name=token]", token)
    await page.click("form.confirm button")


def session_cookie(cookies: list[dict[str, object]]) -> str:
    (value,) = [str(c["value"]) for c in cookies if c["name"] == "receipts_ui_session"]
    return value


@pytest.mark.slow
async def test_signing_out_revokes_the_session_on_every_replica(
        ui: Served, page: Page) -> None:
    from receipts.ui.app import CONSOLE

    await sign_in(page, ui.url, TOKEN)
    # What someone copying the operator's session would hold: the cookie and a form's CSRF.
    copied = session_cookie(await page.cookies())
    assert copied.split(".")[2] == "admin"
    await page.goto(ui.url + "/")
    csrf = await page.eval("document.querySelector('input[name=csrf]').value")
    other_port = free_port()
    other = make_app(ui.queue, ui.operations, admin_token=TOKEN, loopback_only=True)
    runner = await start_server(other, other_port, host="127.0.0.1")
    replicas = (ui.url, f"http://127.0.0.1:{other_port}")
    try:
        for url in replicas:  # before sign-out the copy acts on either replica
            assert (await recover_with(url, copied, csrf)).status_code == 200

        await page.click("header .mode button")  # Sign out
        assert "signed in" not in await page.text(".mode")
        assert session_cookie(await page.cookies()) != copied
        await other[CONSOLE].monitor.refresh()  # the other replica's next shared reading

        for url in replicas:  # after it, the copy is refused everywhere
            response = await recover_with(url, copied, csrf)
            assert response.status_code == 403, url
            async with httpx.AsyncClient(trust_env=False) as client:
                shown = await client.get(url + "/", headers={
                    "Cookie": f"receipts_ui_session={copied}"})
                assert "signed in (admin)" not in shown.text
    finally:
        await runner.cleanup()


async def recover_with(url: str, cookie: str, csrf: str) -> httpx.Response:
    async with httpx.AsyncClient(trust_env=False) as client:
        return await client.post(url + "/recover", data={"csrf": csrf}, headers={
            "Origin": url, "Cookie": f"receipts_ui_session={cookie}"})


@pytest.mark.slow
async def test_wrong_tokens_are_throttled_per_client(ui: Served, page: Page) -> None:
    for _ in range(5):
        await sign_in(page, ui.url, "not-the-token-at-all")
        assert await page.text("#message") == "Wrong token"
    # The sixth try is refused without looking at the token, even the right one.
    await sign_in(page, ui.url, TOKEN)
    assert await page.text("#message") == "Too many attempts"
    assert [r["status"] for r in page.responses if r["url"].endswith("/login")][-1] == 429
    assert "admin" not in session_cookie(await page.cookies())
    # Another client (another address: 127.0.0.2) is not held back by the first one's.
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    async with httpx.AsyncClient(trust_env=False, transport=transport) as other:
        form = await other.get(ui.url + "/login")
        guest = form.cookies["receipts_ui_session"]
        marker = 'name="csrf" value="'
        start = form.text.index(marker) + len(marker)
        csrf = form.text[start:form.text.index('"', start)]
        response = await other.post(ui.url + "/login", data={"csrf": csrf, "token": TOKEN},
                                    headers={"Origin": ui.url,
                                             "Cookie": f"receipts_ui_session={guest}"})
        assert response.status_code == 303
        assert response.cookies["receipts_ui_session"].split(".")[2] == "admin"


@pytest.mark.slow
async def test_with_a_viewer_token_reading_needs_a_sign_in_too(pg18: Server, page: Page) -> None:
    async with serve(pg18, TOKEN, viewer_token=VIEWER_TOKEN) as ui:
        await page.goto(ui.url + "/?state=failed")
        assert await page.eval("location.pathname") == "/login"
        assert "viewer token" in await page.text("main")
        assert await page.eval("document.querySelector('table.jobs') === null")
        async with httpx.AsyncClient(trust_env=False) as client:
            live = await client.get(ui.url + "/", headers={"X-Receipts-Live": "1"})
            assert live.status_code == 401
            assert "order-422-a" not in (await client.get(ui.url + "/jobs/order-422-a")).text

        await page.type("input[name=token]", VIEWER_TOKEN)
        await page.click("form.confirm button")
        assert await page.eval("location.search") == "?state=failed"  # back where it was
        assert "signed in (read)" in await page.text(".mode")
        assert "order-422-a" in await page.text("#jobs")
        # A reader gets no fleet control; an action asks for the admin token; a forged one
        # is refused.
        assert await page.eval("document.querySelector('#pause-fleet, #resume-fleet')") is None
        await page.click("button[value='retry:filter']")
        assert await page.eval("document.querySelector('input[name=token]') !== null")
        await page.goto(ui.url + "/")
        csrf = await page.eval("document.querySelector('input[name=csrf]').value")
        status = await page.eval(
            f"fetch('/recover', {{method: 'POST', body: new URLSearchParams({{csrf: "
            f"{json.dumps(csrf)}}})}}).then(r => r.status)")
        assert status == 403


@pytest.mark.slow
async def test_over_plain_http_on_a_real_name_signing_in_explains_the_secure_cookie(
        pg18: Server, page: Page) -> None:
    async with serve(pg18, TOKEN, loopback_only=False) as ui:
        url = f"http://review.test:{ui.port}"
        await page.goto(url + "/login")
        assert "served over plain HTTP at review.test" in await page.text("#insecure")
        await page.type("input[name=token]", TOKEN)
        await page.click("form.confirm button")
        # Not "the form expired": the browser dropped the Secure cookie, and the page says so.
        assert await page.text("#message") == "Sign-in needs HTTPS here"
        assert "kubectl port-forward" in await page.text("#message-text")
        # Behind a TLS-terminating proxy (X-Forwarded-Proto: https) the warning goes away.
        async with httpx.AsyncClient(trust_env=False) as client:
            behind = await client.get(url.replace("review.test", "127.0.0.1") + "/login",
                                      headers={"Host": f"review.test:{ui.port}",
                                               "X-Forwarded-Proto": "https"})
            assert 'id="insecure"' not in behind.text


@pytest.mark.slow
async def test_every_action_is_audited_with_its_session_and_its_jobs(
        ui: Served, page: Page, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="receipts.ui")
    await sign_in(page, ui.url, TOKEN)
    session = session_cookie(await page.cookies()).split(".")[0][:12]
    await page.goto(ui.url + "/?status=422")
    target = ui.jobs["order-422-a"].id
    await page.click(f"input[value='{target}']", navigates=False)
    await page.click("button[value='retry:selected']")
    await page.click("#confirm")
    await page.goto(ui.url + "/?status=503")
    await page.click("button[value='discard:filter']")
    await page.click("#confirm")
    await page.wait_for("document.querySelector('#bulk-status')?.innerText === 'done'")
    actions = [r.__dict__ for r in caplog.records if r.getMessage() == "ui_action"]
    selected, by_filter = actions
    assert selected["action"] == "retry" and selected["ids"] == [str(target)]
    assert selected["session"] == session and selected["changed"] == 1
    assert by_filter["action"] == "discard" and by_filter["expected"] == 2
    assert "status=503" in by_filter["filter"] and by_filter["session"] == session
    signed_in = [r.__dict__ for r in caplog.records if r.getMessage() == "ui_signed_in"]
    assert signed_in[-1]["session"] == session and signed_in[-1]["role"] == "admin"
