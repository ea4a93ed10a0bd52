"""A small Chrome DevTools Protocol client: headless Debian chromium driven over a websocket.

Why our own: the protocol is JSON over one websocket, and aiohttp (already a
dependency) has a well-kept websocket client, so ~150 lines replace a driver
stack (chromedriver + selenium, or playwright with its own browser build,
which cannot be downloaded here). Only what the tests need: navigate and wait
for the load, evaluate an expression, click an element with real mouse
events, type with real key input, screenshots, cookies.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """Path of a chromium binary, or None."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """A headless chromium process with remote debugging on a free port.

    *host_rules* maps extra host names to 127.0.0.1 (``--host-resolver-rules``)
    so a test can serve a page from another site (another origin and site).
    """

    def __init__(self, binary: str, *, host_rules: tuple[str, ...] = ()) -> None:
        self.profile = tempfile.mkdtemp(prefix="receipts-chromium-")
        rules = ",".join(f"MAP {h} 127.0.0.1" for h in host_rules)
        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--disable-sync",
                "--disable-background-networking", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}", "about:blank"]
        if rules:
            args.insert(1, f"--host-resolver-rules={rules}")
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True, env={**os.environ, "HOME": self.profile})
        self.port = self._read_port()

    def _read_port(self) -> int:
        assert self.process.stderr is not None
        seen = []
        for line in self.process.stderr:
            seen.append(line)
            match = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if match:
                return int(match.group(1))
            if len(seen) > 200:
                break
        self.close()
        raise RuntimeError("chromium did not start:\n" + "".join(seen[-20:]))

    def close(self) -> None:
        """Stop the browser and remove its profile."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.process.stderr is not None:  # the pipe the port was read from
            self.process.stderr.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    @asynccontextmanager
    async def page(self) -> AsyncIterator[Page]:
        """A new tab, closed at the end of the block."""
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{self.port}"
            async with http.put(f"{base}/json/new?about:blank") as resp:
                target = await resp.json()
            ws = await http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
            page = Page(ws)
            reader = asyncio.create_task(page._read())
            try:
                await page.send("Page.enable")
                await page.send("Runtime.enable")
                await page.send("Network.enable")
                yield page
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                await ws.close()
                async with http.get(f"{base}/json/close/{target['id']}"):
                    pass


class ProtocolError(RuntimeError):
    """A DevTools command answered with an error."""


class Page:
    """One tab: commands by id, events to waiters."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: dict[str, list[asyncio.Future[dict[str, Any]]]] = {}
        self.responses: list[dict[str, Any]] = []

    async def _read(self) -> None:
        async for message in self.ws:
            data = json.loads(message.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    if "error" in data:
                        future.set_exception(ProtocolError(str(data["error"])))
                    else:
                        future.set_result(data.get("result", {}))
            else:
                if data.get("method") == "Network.responseReceived":
                    self.responses.append(data["params"]["response"])
                for waiter in self._events.pop(data.get("method", ""), []):
                    if not waiter.done():
                        waiter.set_result(data.get("params", {}))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Run one DevTools command; its result, or :class:`ProtocolError`."""
        command_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[command_id] = future
        await self.ws.send_str(json.dumps({"id": command_id, "method": method,
                                           "params": params}))
        return await asyncio.wait_for(future, 30)

    def expect(self, event: str) -> asyncio.Future[dict[str, Any]]:
        """A future for the next *event* (register before triggering it)."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._events.setdefault(event, []).append(future)
        return future

    async def goto(self, url: str) -> None:
        """Navigate and wait for the load event."""
        loaded = self.expect("Page.loadEventFired")
        await self.send("Page.navigate", url=url)
        await asyncio.wait_for(loaded, 30)

    async def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (DevTools evaluation)."""
        result = await self.send("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise ProtocolError(str(result["exceptionDetails"]))
        return result["result"].get("value")

    async def text(self, selector: str = "body") -> str:
        """The visible text of the first element matching *selector*."""
        return str(await self.eval(f"document.querySelector({json.dumps(selector)}).innerText"))

    async def click(self, selector: str, *, navigates: bool = True) -> None:
        """Click the element's centre with real mouse events; wait for the next load."""
        box = await self.eval(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        loaded = self.expect("Page.loadEventFired") if navigates else None
        for kind in ("mousePressed", "mouseReleased"):
            await self.send("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1],
                            button="left", clickCount=1)
        if loaded is not None:
            await asyncio.wait_for(loaded, 30)

    async def type(self, selector: str, text: str) -> None:
        """Focus the element and type *text* as key input."""
        await self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.send("Input.insertText", text=text)

    async def screenshot(self, path: Path) -> Path:
        """Save a full-page PNG screenshot at *path*."""
        shot = await self.send("Page.captureScreenshot", format="png",
                               captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    async def cookies(self) -> list[dict[str, Any]]:
        """The cookies the browser holds for the current page."""
        return list((await self.send("Network.getCookies"))["cookies"])

    async def viewport(self, width: int, height: int = 900) -> None:
        """Lay the page out as on a screen *width* CSS pixels wide (a phone: 390)."""
        await self.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                        deviceScaleFactor=1, mobile=width < 600)

    async def wait_for(self, expression: str, *, timeout: float = 15.0) -> Any:
        """Poll a JavaScript expression until it is truthy; its value. Raises TimeoutError."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"still false after {timeout:g}s: {expression}")
            await asyncio.sleep(0.1)

    async def overflow(self) -> int:
        """How many CSS pixels the page is wider than its viewport (0: no sideways scroll)."""
        return int(await self.eval(
            "Math.max(document.documentElement.scrollWidth, document.body.scrollWidth)"
            " - window.innerWidth"))

    async def axe(self, source: str) -> list[dict[str, Any]]:
        """Run axe-core (*source*: axe.min.js) on the page; its violations.

        The script is evaluated through the DevTools protocol, which the
        page's CSP does not govern, so the page itself keeps its strict policy.
        """
        await self.eval(source)
        return list(await self.eval(
            "axe.run(document, {resultTypes: ['violations']}).then(r => r.violations.map("
            "v => ({id: v.id, impact: v.impact, help: v.help,"
            " nodes: v.nodes.map(n => n.target.join(' ')).slice(0, 5)})))"))
