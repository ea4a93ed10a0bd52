"""Retry timing (pure): Retry-After parsing, full-jitter backoff, clamps."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from receipts.retry import BackoffPolicy, parse_retry_after


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("120", 120.0),
        ("0", 0.0),
        ("-5", None),
        ("soon", None),
        ("", None),
        ("31536000", 31536000.0),  # a year: parsed, then clamped by the policy
        ("\u00b2", None),  # a superscript two: isdigit() but not a number
        ("１２", None),  # full-width digits
    ],
)
def test_retry_after_values_are_parsed_or_ignored(header, expected):
    assert parse_retry_after(header) == expected


def test_retry_after_as_a_date_is_measured_against_the_providers_clock():
    provider_now = datetime(2030, 1, 1, tzinfo=UTC)
    later = format_datetime(provider_now + timedelta(seconds=90), usegmt=True)
    assert parse_retry_after(later, date_header=format_datetime(provider_now, usegmt=True)) == 90
    past = format_datetime(provider_now - timedelta(seconds=90), usegmt=True)
    assert parse_retry_after(past, date_header=format_datetime(provider_now, usegmt=True)) is None


def test_backoff_is_full_jitter_under_a_cap_and_honours_a_clamped_retry_after():

    policy = BackoffPolicy(base_seconds=1, cap_seconds=30, retry_after_max_seconds=600)
    rng = random.Random(3)
    draws = [policy.delay(3, rng=rng) for _ in range(2000)]
    assert 0 <= min(draws) < 0.1 and 3.9 < max(draws) <= 4.0  # U(0, 1 * 2**2)
    assert max(policy.delay(50, rng=rng) for _ in range(200)) <= 30
    assert policy.delay(1, retry_after_seconds=45, rng=rng) >= 45
    assert policy.delay(1, retry_after_seconds=31536000, rng=rng) == 600
    assert policy.delay(1, retry_after_seconds=-1, rng=rng) <= 1
