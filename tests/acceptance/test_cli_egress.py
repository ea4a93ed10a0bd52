"""`receipts worker` and its egress settings, as real processes: a malformed provider
URL or proxy is one line and exit 2 before any connection; the proxy that applies is
logged at start, its password masked."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.acceptance.test_cli_usage import SECRET, Listener, down, receipts  # noqa: F401

PROXY_SECRET = "pr0xy-pa55-9031"


@pytest.mark.slow
@pytest.mark.parametrize(("url", "message"), [
    ("http://provider.example:bad/receipts", "invalid port"),
    ("http://provider.example:99999/receipts", "invalid port"),
    ("https://provider.example:0/receipts", "invalid port"),
    ("ftp://provider.example/receipts", "http:// or https://"),
    ("provider.example/receipts", "http:// or https://"),
    ("http:///receipts", "with a host"),
    (f"http://user:{PROXY_SECRET}@[::1/receipts", "invalid port"),
])
def test_a_malformed_provider_url_is_one_line_and_exit_2_before_any_connection(
        down: Listener, url: str, message: str) -> None:  # noqa: F811
    result = receipts("worker", env={"RECEIPTS_DATABASE_URL": down.dsn,
                                     "RECEIPTS_PROVIDER_URL": url})
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("receipts: error: RECEIPTS_PROVIDER_URL: ") and message in line
    assert PROXY_SECRET not in line and "Traceback" not in result.stderr
    assert down.accepted == 0


@pytest.mark.slow
@pytest.mark.parametrize(("variable", "value", "message"), [
    ("RECEIPTS_PROVIDER_PROXY", f"http://u:{PROXY_SECRET}@proxy.example:bad", "invalid port"),
    ("RECEIPTS_PROVIDER_PROXY", f"socks5://u:{PROXY_SECRET}@proxy.example:1080",
     "'socks5' is not supported"),
    ("HTTPS_PROXY", f"http://u:{PROXY_SECRET}@proxy.example:99999", "invalid port"),
    ("https_proxy", f"https://u:{PROXY_SECRET}@proxy.example:3128", "'https' is not supported"),
])
def test_a_malformed_proxy_that_applies_is_one_line_and_exit_2(
        down: Listener, variable: str, value: str, message: str) -> None:  # noqa: F811
    result = receipts("worker", env={"RECEIPTS_DATABASE_URL": down.dsn,
                                     "RECEIPTS_PROVIDER_URL": "https://provider.example/r",
                                     variable: value})
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"receipts: error: {variable}: ") and message in line
    assert PROXY_SECRET not in result.stderr and down.accepted == 0


@pytest.mark.slow
def test_help_lists_the_proxy_setting_and_never_its_value() -> None:
    result = receipts("worker", "--help", env={
        "RECEIPTS_PROVIDER_PROXY": f"http://u:{PROXY_SECRET}@proxy.example:3128",
        "HTTPS_PROXY": f"http://u:{PROXY_SECRET}@proxy.example:3128"})
    assert result.returncode == 0
    assert "RECEIPTS_PROVIDER_PROXY" in result.stdout
    assert PROXY_SECRET not in result.stdout + result.stderr


@pytest.mark.slow
def test_the_worker_logs_which_proxy_applies_at_start_with_its_password_masked(
        down: Listener) -> None:  # noqa: F811
    env = {"RECEIPTS_DATABASE_URL": down.dsn, "RECEIPTS_METRICS_PORT": "0",
           "RECEIPTS_PROVIDER_URL": "https://provider.example/receipts",
           "HTTPS_PROXY": f"http://egress:{PROXY_SECRET}@proxy.example:3128",
           "NO_PROXY": "localhost,.internal"}
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")} | env
    proc = subprocess.Popen([sys.executable, "-m", "receipts", "worker"], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 30
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if '"worker_started"' in line:
                started = json.loads(line)
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    text = "".join(lines) + out
    assert started is not None, text
    assert started["proxy"] == "http://egress:***@proxy.example:3128 (HTTPS_PROXY)"
    assert PROXY_SECRET not in text
