"""The documentation site builds with every warning an error (what `make docs` runs).

A broken link or anchor, a page missing from the nav, or a docstring mkdocstrings cannot
render fails the build; the output names the page.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_site_builds_strict_and_has_a_page_per_alert(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (site / "index.html").exists()
    assert (site / "runbook" / "receiptsqueuelaghigh" / "index.html").exists()
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "enqueue_many" in api and "InvalidOrderId" in api  # rendered from the docstrings
