"""The chaos run in CI: 2,000 jobs, every fault kind once, every invariant checked.

The same code runs bigger by hand: ``python -m tests.chaos.run --jobs 50000 --seed 1``
(see docs/chaos.md). ``RECEIPTS_CHAOS_JOBS`` / ``RECEIPTS_CHAOS_SEED`` change the
CI run without editing it.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.run import ChaosConfig, run_chaos

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]


async def test_no_job_is_lost_and_no_stale_ack_lands_under_every_fault(tmp_path):
    config = ChaosConfig(
        jobs=int(os.environ.get("RECEIPTS_CHAOS_JOBS", "2000")),
        seed=int(os.environ.get("RECEIPTS_CHAOS_SEED", "1")),
        workdir=tmp_path,
        quiet=True,
    )
    report = await run_chaos(config)
    print(report.table())
    assert report.ok, "\n".join(report.failures) + f"\nlogs: {tmp_path}"
