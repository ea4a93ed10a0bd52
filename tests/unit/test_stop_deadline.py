"""The stop deadline ends a process whose stop hangs, with the status its drain earned.

Each case runs in a child process whose main thread is stuck (a blocking sleep, as
a library call that ignores cancellation would be); only the watchdog thread can
end it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from receipts.runtime import STOP_DEADLINE_MARGIN_SECONDS, stop_deadline_seconds
from receipts.settings import Settings

CHILD = textwrap.dedent("""
    import sys, time
    from receipts.logs import configure_logging
    from receipts.runtime import StopDeadline
    configure_logging("INFO")
    deadline = StopDeadline(0.3, lambda: sys.argv[1] == "drained")
    deadline.arm()
    deadline.arm()  # a second signal does not restart the countdown
    time.sleep(60)  # the stuck exit
""")


@pytest.mark.parametrize(("drained", "status"), [("drained", 0), ("not-drained", 1)])
def test_a_hung_stop_ends_at_its_deadline(drained: str, status: int) -> None:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD, drained], capture_output=True,
                          text=True, timeout=30)
    took = time.monotonic() - started
    assert proc.returncode == status, proc.stderr
    assert took < 30
    events = [json.loads(line) for line in proc.stdout.splitlines() + proc.stderr.splitlines()
              if line.startswith("{")]
    exceeded = [e for e in events if e.get("event") == "stop_deadline_exceeded"]
    assert exceeded == [exceeded[0]] and exceeded[0]["deadline_seconds"] == 0.3
    assert exceeded[0]["drained"] is (drained == "drained")


def test_the_deadline_covers_every_phase_of_a_stop() -> None:
    s = Settings(database_url="postgresql://x@127.0.0.1/x", provider_url="http://x/",
                 shutdown_grace_seconds=20, delivery_timeout_seconds=10)
    # deliveries min(20, 10) + ack flush max(5, min(20, 30)) + pool close 5, then the
    # claim (1 s), the last heartbeat (1 s) and the margin.
    assert stop_deadline_seconds(s) == 10 + 20 + 5 + 1 + 1 + STOP_DEADLINE_MARGIN_SECONDS
    assert stop_deadline_seconds(s) == s.stop_budget_seconds + 2 + STOP_DEADLINE_MARGIN_SECONDS
