"""Admission control's AIMD limit, steered by commit-probe latency, on a fake clock."""

from __future__ import annotations

import itertools

import pytest

from receipts import admission
from receipts.admission import AdmissionController, AdmissionPolicy

POLICY = AdmissionPolicy(min_rate=50, max_rate=5000, tolerance=1.5, decrease=0.75,
                         increase_per_second=500)
QUIET = admission.QUIET_RATE_FACTOR * POLICY.min_rate  # 200 jobs/s


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def window(ac: AdmissionController, clock: Clock, *, claim_rate: float, probe_seconds: float,
           seconds: float = 1.0) -> None:
    """One window: claims at *claim_rate* jobs/s (as far as the limit lets), then its probes."""
    steps = admission.WINDOW_SAMPLES
    for _ in range(steps):
        clock.now += seconds / steps
        want = max(1, round(claim_rate * seconds / steps))
        ac.allowance(want)
        ac.refund(0)
        ac.observe(probe_seconds)


def with_baseline(clock: Clock, probe_seconds: float = 0.001) -> AdmissionController:
    ac = AdmissionController(POLICY, clock)
    window(ac, clock, claim_rate=10, probe_seconds=probe_seconds)  # a trickle: a quiet window
    assert ac.baseline == pytest.approx(probe_seconds)
    return ac


def test_a_quiet_window_measures_the_baseline_and_the_limit_starts_at_the_ceiling():
    clock = Clock()
    ac = with_baseline(clock, 0.002)
    assert ac.limit == 5000 and ac.decreases == 0


def test_commits_slowed_by_the_drain_cut_the_limit_below_the_rate_it_used():
    clock = Clock()
    ac = with_baseline(clock)
    window(ac, clock, claim_rate=2000, probe_seconds=0.003)  # 3x the baseline: congestion
    assert ac.decreases == 1
    assert ac.limit == pytest.approx(0.75 * 2000, rel=0.05)  # binds at once, not at 0.75 x 5000


def test_sustained_congestion_falls_multiplicatively_to_the_quiet_rate_never_below_the_floor():
    clock = Clock()
    ac = with_baseline(clock)
    limits = []
    for _ in range(12):
        window(ac, clock, claim_rate=5000, probe_seconds=0.010)
        limits.append(ac.limit)
    falling = [b / a for a, b in itertools.pairwise(limits) if b < a]
    assert len(falling) >= 5 and all(r == pytest.approx(0.75, abs=0.06) for r in falling)
    assert min(limits) >= 50  # bounded below: a backlog always drains
    assert min(limits) <= QUIET  # cut until the worker is as quiet as a quiet window


def test_commits_that_stay_slow_once_the_worker_is_quiet_are_not_its_doing():
    """Throttled to the quiet rate, slow commits become the baseline: the worker does not
    starve itself for someone else's load, and climbs back while it adds little."""
    clock = Clock()
    ac = with_baseline(clock)
    for _ in range(20):
        window(ac, clock, claim_rate=5000, probe_seconds=0.010)
    assert ac.baseline == pytest.approx(0.010)
    low = ac.limit
    for _ in range(5):
        window(ac, clock, claim_rate=5000, probe_seconds=0.011)
    assert ac.limit > low


def test_commit_latency_within_the_tolerance_is_not_congestion():
    clock = Clock()
    ac = with_baseline(clock, 0.002)
    for _ in range(20):
        window(ac, clock, claim_rate=3000, probe_seconds=0.0029)  # 1.45x
    assert ac.decreases == 0


def test_the_limit_grows_back_additively_but_never_past_twice_the_rate_used():
    clock = Clock()
    ac = with_baseline(clock)
    window(ac, clock, claim_rate=2000, probe_seconds=0.004)
    low = ac.limit
    window(ac, clock, claim_rate=5000, probe_seconds=0.001)  # healthy again, bound by the limit
    grown = ac.limit
    assert grown == pytest.approx(low + 500, rel=0.05)  # + 500 jobs/s per second
    for _ in range(40):
        window(ac, clock, claim_rate=600, probe_seconds=0.001)  # slot-bound at ~600 jobs/s
    assert ac.limit == grown  # does not bank a limit it never tried


def test_a_busy_worker_without_a_baseline_makes_a_quiet_window_first():
    clock = Clock()
    ac = AdmissionController(POLICY, clock)
    window(ac, clock, claim_rate=4000, probe_seconds=0.005)  # busy from the start
    assert ac.baseline is None and ac.limit == 50 and ac.quiet_windows_forced == 1
    window(ac, clock, claim_rate=4000, probe_seconds=0.001)  # the quiet window, at the floor
    assert ac.baseline == pytest.approx(0.001) and ac.limit == 5000
    window(ac, clock, claim_rate=4000, probe_seconds=0.005)
    assert ac.decreases == 1


def test_a_long_drain_remeasures_the_baseline_every_quiet_interval():
    clock = Clock()
    ac = with_baseline(clock)
    forced_at = []
    for _ in range(95):
        before = ac.quiet_windows_forced
        window(ac, clock, claim_rate=1000, probe_seconds=0.0012)
        if ac.quiet_windows_forced > before:
            forced_at.append(clock.now)
    assert len(forced_at) == 3  # ~ every QUIET_EVERY_SECONDS (30 s) of draining
    assert all(b - a >= admission.QUIET_EVERY_SECONDS for a, b in itertools.pairwise(forced_at))


def test_a_trickle_below_the_quiet_rate_never_pays_for_a_quiet_window():
    clock = Clock()
    ac = with_baseline(clock)
    for _ in range(100):
        window(ac, clock, claim_rate=QUIET * 0.9, probe_seconds=0.001)
    assert ac.quiet_windows_forced == 0 and ac.limit == 5000


def test_probes_are_frequent_while_claiming_and_rare_when_idle():
    clock = Clock()
    ac = AdmissionController(POLICY, clock)
    assert ac.probe_interval() == admission.IDLE_PROBE_INTERVAL_SECONDS
    n, _ = ac.allowance(10)
    ac.refund(n)  # the claim found nothing: still idle
    assert ac.probe_interval() == admission.IDLE_PROBE_INTERVAL_SECONDS
    n, _ = ac.allowance(10)
    ac.refund(n - 3)  # it claimed three
    assert ac.probe_interval() == admission.PROBE_INTERVAL_SECONDS
    clock.now += 1.5
    assert ac.probe_interval() == admission.IDLE_PROBE_INTERVAL_SECONDS


def test_the_allowance_spends_tokens_at_the_limit_in_whole_batches():
    clock = Clock()
    ac = AdmissionController(AdmissionPolicy(min_rate=10, max_rate=100), clock)
    clock.now += 1.0
    assert ac.allowance(10) == (10, 0.0)  # a full bucket: one batch (0.1 s of 100/s)
    n, wait = ac.allowance(10)
    assert n == 0 and wait == pytest.approx(0.1)  # waits for a whole batch, not one token
    clock.now += 0.05
    n, wait = ac.allowance(10)
    assert n == 0 and wait == pytest.approx(0.05)
    clock.now += 0.05
    assert ac.allowance(10)[0] == 10
    ac.refund(4)
    assert ac.allowance(4)[0] == 4  # refunded tokens are spent again


@pytest.mark.parametrize("want", [0, 1, 5, 40, 500])
@pytest.mark.parametrize("seconds", [0.0, 0.01, 0.05, 0.3, 5.0])
def test_what_admission_has_available_is_what_a_claim_would_be_granted_and_stays(
        want, seconds):
    clock = Clock()
    ac = with_baseline(clock)
    ac.allowance(10_000)  # spend what the baseline's window left
    clock.now += seconds
    offered = ac.available(want)
    assert ac.available(want) == offered  # looking takes nothing
    assert offered == ac.allowance(want)[0]
