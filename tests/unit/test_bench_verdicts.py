"""The benchmark's judges: the soak's verdict and the bill's statement classes."""

from __future__ import annotations

import pytest

from bench.bill import kind_of
from bench.soak import hold_effect, latency_steady, slope, steady, verdict
from receipts.statements import statements


def samples(values, key="size", every=10.0):
    return [{"t": i * every, key: v} for i, v in enumerate(values)]


def test_a_size_that_stopped_growing_is_steady():
    rows = samples([100 + min(i, 30) for i in range(120)])  # grows, then flat
    check = steady(rows, "size", period=600, end=1200, tolerance=0.1)
    assert check["ok"] is True and check["ratio"] == 1.0


def test_a_size_that_keeps_growing_is_not_steady():
    rows = samples([100 + 2 * i for i in range(120)])
    check = steady(rows, "size", period=600, end=1200, tolerance=0.1)
    assert check["ok"] is False and check["slope_per_hour"] == pytest.approx(720, rel=0.01)


def test_a_step_that_stays_below_the_previous_peak_is_steady():
    # Bloat from a held snapshot in each period: the second peak no higher than the first.
    values = [100] * 20 + [150] * 40 + [150] * 20 + [148] * 40
    check = steady(samples(values), "size", period=600, end=1200, tolerance=0.1)
    assert check["ok"] is True


def test_latency_trend_leaves_out_held_snapshots_and_their_recovery():
    values = [1.0] * 60 + [1.0] * 20 + [50.0] * 10 + [1.1] * 30
    rows = samples(values, key="p99")
    holds = [(800.0, 900.0)]
    assert latency_steady(rows, "p99", period=600, end=1200, holds=holds, tolerance=0.25,
                          after_hold=0)["ok"] is True
    worse = samples([1.0] * 60 + [2.0] * 60, key="p99")
    assert latency_steady(worse, "p99", period=600, end=1200, holds=[], tolerance=0.25)[
        "ok"] is False


def test_hold_effect_compares_claim_p99_during_a_held_snapshot_with_before_it():
    claims = [(t / 10, 1.0) for t in range(0, 1000)] + [(t / 10, 5.0) for t in range(1000, 2000)]
    check = hold_effect(claims, (100.0, 200.0))
    assert check["ratio"] == pytest.approx(5.0) and check["ok"] is False
    assert hold_effect(claims, (50.0, 100.0))["ok"] is True


def test_the_verdict_fails_when_an_order_is_lost():
    rows = [{"t": i * 10.0, "receipt_jobs_heap_bytes": 1, "claim_p99_ms": 1.0,
             "checkout_p99_ms": 1.0, "expired": 0} for i in range(120)]
    doc = {"plan": {"hours": 1200 / 3600, "hold_every_seconds": 600}, "samples": rows,
           "holds": [], "end": {"lost": 1, "left": 0}}
    v = verdict(doc)
    assert v["nothing_lost"]["ok"] is False and v["ok"] is False
    doc["end"]["lost"] = 0
    assert verdict(doc)["nothing_lost"]["ok"] is True


def test_slope_needs_three_points():
    assert slope(samples([1, 2]), "size") is None


@pytest.mark.parametrize(("name", "kind"), [
    ("claim", "claim"), ("claim_limited", "claim"), ("ack", "ack"),
    ("reschedule", "reschedule"), ("resolve_writes", "resolve_writes"),
    ("record_attempts", "history"), ("queue_stats", "queue_stats"),
    ("commit_probe", "probe"), ("extend_pause", "flow"), ("begin_probe", "flow"),
    ("recover_expired", "recovery"), ("prune", "recovery"), ("enqueue", "enqueue"),
])
def test_the_bill_names_what_each_queue_statement_is_for(name, kind):
    assert kind_of(statements()[name]) == kind


@pytest.mark.parametrize("name", ["claim", "claim_limited"])
def test_the_bill_names_a_claim_from_its_first_200_characters(name):
    """pg_stat_statements' text as a report reads it may be cut short (the soak keeps
    200 characters): the claim's opening still names it."""
    assert kind_of(statements()[name].replace("{limit}", "3")[:200]) == "claim"
