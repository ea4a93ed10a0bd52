"""Admission control's AIMD limit on a fake clock."""

from __future__ import annotations

import itertools

import pytest

from receipts.admission import AdmissionController, AdmissionPolicy

POLICY = AdmissionPolicy(min_rate=50, max_rate=5000, tolerance=3.0, decrease=0.7,
                         increase_per_second=200)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_latency_above_the_baseline_cuts_the_limit_multiplicatively_down_to_the_floor():
    clock = Clock()
    ac = AdmissionController(POLICY, clock)
    ac.observe(0.001, 1)  # idle baseline: 1 ms
    trace = []
    for _ in range(40):
        clock.now += 0.25
        ac.observe(0.060, 1)  # the database is 60x slower: congestion
        trace.append(ac.limit)
    cuts = [b / a for a, b in itertools.pairwise(trace) if b < a]
    assert cuts and all(c == pytest.approx(0.7) for c in cuts[:-1])  # multiplicative
    assert trace[-1] == 50  # bounded below: a backlog always drains


def test_commit_jitter_and_event_loop_lag_are_not_congestion():
    """What a drain on an idle server looks like: 0.6 ms at best, 2 ms typical, spikes."""
    clock = Clock()
    ac = AdmissionController(POLICY, clock)
    ac.observe(0.0006, 1)
    for i in range(2000):
        clock.now += 0.005
        ac.observe(0.012 if i % 10 == 0 else 0.002, 10)  # p90 spikes of 12 ms
    assert ac.decreases == 0 and ac.limit == 5000


def test_decreases_are_spaced_so_one_round_of_slow_statements_counts_once():
    clock = Clock()
    ac = AdmissionController(POLICY, clock)
    ac.observe(0.001, 1)
    for _ in range(10):
        clock.now += 0.001
        ac.observe(0.050, 1)
    assert ac.decreases == 1


def test_the_limit_grows_back_additively_when_latency_returns_to_the_baseline():
    clock = Clock()
    ac = AdmissionController(POLICY, clock)
    ac.observe(0.001, 1)
    for _ in range(20):
        clock.now += 0.25
        ac.observe(0.050, 1)
    low = ac.limit
    for _ in range(40):  # the moving average settles back below the threshold
        clock.now += 0.1
        ac.observe(0.0011, 1)
    settled = ac.limit
    assert settled > low
    for _ in range(10):
        clock.now += 0.1
        ac.observe(0.0011, 1)
    assert ac.limit == pytest.approx(settled + 200 * 1.0)


def test_bigger_statements_are_not_mistaken_for_congestion():
    clock = Clock()
    ac = AdmissionController(POLICY, clock)
    ac.observe(0.0003, 1)  # a claim of one on an idle server
    clock.now += 0.5
    ac.observe(0.0036, 100)  # a claim of 100 on the same idle server
    assert ac.decreases == 0


def test_the_allowance_spends_tokens_at_the_limit_and_says_how_long_to_wait():
    clock = Clock()
    ac = AdmissionController(AdmissionPolicy(min_rate=10, max_rate=100), clock)
    assert ac.allowance(10) == (10, 0.0)  # starts full (at least one batch)
    n, wait = ac.allowance(10)
    assert n == 0 and 0 < wait <= 0.01 + 1e-9
    clock.now += 0.05  # 5 tokens at 100/s
    assert ac.allowance(10)[0] == 5
    ac.refund(3)
    assert ac.allowance(10)[0] == 3
