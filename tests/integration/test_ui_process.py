"""``receipts ui`` as a process: binds to localhost, read-only without a token, stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from receipts.embedded import free_port
from tests.conftest import enqueue_many


def _wait_healthy(url: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        try:
            if httpx.get(url + "/healthz", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("receipts ui did not answer /healthz within 30 s")


@pytest.mark.slow
def test_receipts_ui_serves_read_only_on_localhost_and_stops_cleanly(dsn: str) -> None:
    enqueue_many(dsn, ["ui-process-1"])
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")}
    env |= {"RECEIPTS_DATABASE_URL": dsn, "RECEIPTS_UI_PORT": str(port)}
    process = subprocess.Popen([sys.executable, "-m", "receipts", "ui"], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)
        page = httpx.get(url + "/?state=ready", trust_env=False)
        assert page.status_code == 200 and "ui-process-1" in page.text
        assert "read-only" in page.text
        assert httpx.post(url + "/act", data={"action": "discard:filter", "state": "ready",
                                              "expected": "1"}, trust_env=False
                          ).status_code == 403
        # Bound to 127.0.0.1 only: the machine's other addresses do not answer.
        listening = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True,
                                   text=True, check=False).stdout
        local = {line.split()[3] for line in listening.splitlines() if line.strip()}
        if local:  # `ss` is there
            assert local == {f"127.0.0.1:{port}"}
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    assert '"event": "ui_started"' in output and '"mode": "read-only"' in output


@pytest.mark.slow
def test_receipts_ui_beyond_localhost_refuses_to_start_without_a_viewer_token(dsn: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")}
    env |= {"RECEIPTS_DATABASE_URL": dsn, "RECEIPTS_UI_HOST": "0.0.0.0",
            "RECEIPTS_UI_PORT": str(free_port())}
    result = subprocess.run([sys.executable, "-m", "receipts", "ui"], env=env, text=True,
                            capture_output=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "receipts: error: RECEIPTS_UI_VIEWER_TOKEN: is required when the review page binds to "
        "0.0.0.0 (beyond this machine); set it (readers sign in with it), or set "
        "RECEIPTS_UI_ANONYMOUS_READ=true only behind a proxy that authenticates"]
    same = env | {"RECEIPTS_UI_VIEWER_TOKEN": "x" * 20, "RECEIPTS_UI_ADMIN_TOKEN": "x" * 20}
    result = subprocess.run([sys.executable, "-m", "receipts", "ui"], env=same, text=True,
                            capture_output=True, timeout=60)
    assert result.returncode == 2 and "must differ" in result.stderr
