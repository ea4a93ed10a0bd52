"""The metrics registry: build info, no `_created` series, the new signals' shapes."""

from __future__ import annotations

from importlib.metadata import version

from prometheus_client.parser import text_string_to_metric_families

from receipts.jobqueue import QueueStats
from receipts.metrics import Metrics
from receipts.model import PauseReason
from receipts.settings import package_version


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def test_a_scrape_has_no_created_series() -> None:
    metrics = Metrics()
    metrics.acks.inc()
    metrics.observe_time_to_receipt(1.5)
    text = metrics.render().decode()
    assert "_created" not in text
    assert "receipts_acks_total 1.0" in text


def test_build_info_carries_the_installed_version() -> None:
    assert package_version() == version("receipts-queue")  # the distribution's metadata agrees
    samples = _samples(Metrics())
    assert samples[("receipts_build_info", (("version", version("receipts-queue")),))] == 1


def test_time_to_receipt_buckets_reach_hours_and_clamp_clock_skew() -> None:
    metrics = Metrics()
    metrics.observe_time_to_receipt(2 * 3600)
    metrics.observe_time_to_receipt(-0.5)  # a database clock ahead of ours: counts as 0
    samples = _samples(metrics)
    bucket = "receipts_time_to_receipt_seconds_bucket"
    assert samples[(bucket, (("le", "0.1"),))] == 1
    assert samples[(bucket, (("le", "3600.0"),))] == 1
    assert samples[(bucket, (("le", "7200.0"),))] == 2
    assert samples[("receipts_time_to_receipt_seconds_sum", ())] == 7200


def test_pause_and_flow_control_series_exist_before_anything_happens() -> None:
    samples = _samples(Metrics())
    for reason in tuple(PauseReason):
        assert samples[("receipts_provider_paused", (("reason", reason),))] == 0
    assert ("receipts_provider_tokens", ()) in samples
    assert ("receipts_claim_rate_limit", ()) in samples


def test_queue_snapshot_sets_the_age_of_the_oldest_undelivered_job() -> None:
    metrics = Metrics()
    metrics.observe_queue(QueueStats(
        ready_due=0, ready=3, running=1, expired=0, failed=0, lag_seconds=0.0,
        done_estimate=10, dead_tuples=5, oldest_transaction_age_seconds=2.5,
        oldest_undelivered_age_seconds=1800.0))
    samples = _samples(metrics)
    assert samples[("receipts_oldest_undelivered_age_seconds", ())] == 1800
    assert samples[("receipts_queue_lag_seconds", ())] == 0
    assert samples[("receipts_oldest_transaction_age_seconds", ())] == 2.5
    assert samples[("receipts_queue_stats_timestamp_seconds", ())] > 0


def _stats() -> QueueStats:
    return QueueStats(
        ready_due=7, ready=9, running=3, expired=1, failed=2, lag_seconds=1.5,
        done_estimate=100, dead_tuples=40, oldest_transaction_age_seconds=0.3,
        oldest_undelivered_age_seconds=12.0)


QUEUE_GAUGES = ("receipts_ready_jobs", "receipts_queue_lag_seconds", "receipts_expired_leases",
                "receipts_jobs", "receipts_oldest_undelivered_age_seconds",
                "receipts_oldest_transaction_age_seconds", "receipts_table_dead_tuples",
                "receipts_xmin_horizon_age_transactions")


def test_queue_gauges_leave_the_scrape_once_their_last_read_is_three_intervals_old() -> None:
    now = [100.0]
    metrics = Metrics(queue_stats_interval_seconds=10, clock=lambda: now[0])
    names = lambda: {name for name, _ in _samples(metrics)}  # noqa: E731
    assert not names() & set(QUEUE_GAUGES)  # nothing read yet: nothing to show
    metrics.observe_queue(_stats())
    assert set(QUEUE_GAUGES) <= names()
    stamp = _samples(metrics)[("receipts_queue_stats_timestamp_seconds", ())]
    now[0] += 30  # three intervals: still the rule's last fresh moment
    assert ("receipts_ready_jobs", ()) in _samples(metrics)
    now[0] += 0.5  # the database stopped answering the stats reads
    samples = _samples(metrics)
    assert not {name for name, _ in samples} & set(QUEUE_GAUGES)
    assert samples[("receipts_queue_stats_timestamp_seconds", ())] == stamp  # kept
    metrics.observe_queue(_stats())  # the next successful read brings them back
    assert _samples(metrics)[("receipts_ready_jobs", ())] == 7


def test_every_pause_reason_has_its_series_rejecting_and_manual_included() -> None:
    samples = _samples(Metrics())
    for reason in ("auth", "outage", "retry_after", "rejecting", "manual"):
        assert samples[("receipts_provider_paused", (("reason", reason),))] == 0
        assert samples[("receipts_provider_pauses_total", (("reason", reason),))] == 0
