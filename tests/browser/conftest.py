"""Fixtures of the browser tests: one headless chromium per test session, a fresh tab per test."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.browser.cdp import Browser, Page, find_chromium


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    binary = find_chromium()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing; scripts/install-tools.sh installs Debian's chromium")
        pytest.skip("chromium is not installed and could not be (scripts/install-tools.sh "
                    "installs Debian's chromium package)")
    b = Browser(binary, host_rules=("evil.test", "review.test"))
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    async with browser.page() as tab:
        await tab.send("Network.clearBrowserCookies")
        yield tab
