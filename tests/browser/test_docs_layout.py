"""The documentation site at a laptop's width (1,280 px), in a real chromium: the settings
reference keeps every variable name on one line, and a runbook page's PromQL stays inside
its column (it wraps instead of running under the next column or off the page)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.cdp import Page

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WIDTH = 1280


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--site-dir", str(out)], cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stderr
    yield out


async def test_setting_names_are_never_broken_inside(page: Page, site: Path) -> None:
    await page.viewport(WIDTH)
    await page.goto((site / "reference" / "settings" / "index.html").as_uri())
    broken = await page.eval(
        "[...document.querySelectorAll('td code')]"
        ".filter(c => /^RECEIPTS_[A-Z0-9_]+$/.test(c.textContent))"
        ".filter(c => c.getClientRects().length > 1)"
        ".map(c => c.textContent)")
    names = await page.eval("document.querySelectorAll('td code').length")
    assert names > 20
    assert broken == [], f"broken across lines at {WIDTH} px: {broken}"


@pytest.mark.parametrize("alert", ["receiptsqueuelaghigh", "receiptsxminhorizonheld",
                                   "receiptsreadyjobsgrowingatmaxreplicas"])
async def test_runbook_promql_stays_in_its_column(page: Page, site: Path, alert: str) -> None:
    await page.viewport(WIDTH)
    await page.goto((site / "runbook" / alert / "index.html").as_uri())
    assert await page.eval("document.querySelectorAll('pre code').length") >= 1
    hidden = await page.eval(
        "[...document.querySelectorAll('pre code')]"
        ".filter(c => c.scrollWidth > c.clientWidth + 1).map(c => c.textContent.slice(0, 60))")
    assert hidden == [], f"PromQL wider than its column at {WIDTH} px: {hidden}"
    assert await page.overflow() <= 0  # negative: the vertical scrollbar
