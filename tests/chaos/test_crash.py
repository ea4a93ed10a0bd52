"""PostgreSQL killed with SIGKILL mid-drain, in CI: nothing lost, the counters still true.

The same code runs bigger by hand, both settings interleaved:
``python -m tests.chaos.crash --jobs 3000 --rounds 3`` (``make chaos``; docs/chaos.md).
``RECEIPTS_CRASH_JOBS`` changes the CI size without editing it.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.crash import CrashConfig, run_crash

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize("synchronous_commit", ["off", "on"])
async def test_a_database_crash_mid_drain_loses_nothing_and_leaves_the_counters_true(
        tmp_path, synchronous_commit):
    report = await run_crash(CrashConfig(
        jobs=int(os.environ.get("RECEIPTS_CRASH_JOBS", "1500")),
        synchronous_commit=synchronous_commit, workdir=tmp_path, quiet=True))
    print(report.summary())
    assert report.ok, "\n".join(report.failures) + f"\nlogs: {tmp_path}"
    assert report.figures["lost"] == 0 and report.figures["ack_drift"] == 0
