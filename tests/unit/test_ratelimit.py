"""The pod's share of the fleet-wide rate limit: its token bucket, which bucket a
claim charges, the shares by slots, and the watermark's wake-up payload."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from receipts.ratelimit import (
    JOIN_WAIT_SECONDS,
    SHARE_FRESH_SECONDS,
    TokenBucket,
    choose,
    shares_of,
)
from receipts.waker import decode_mark, encode_mark, tag_number


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_starts_empty_and_fills_at_its_rate_up_to_its_capacity():
    clock = Clock()
    bucket = TokenBucket(10.0, 5.0, clock=clock)
    assert bucket.allowance(3)[0] == 0
    clock.now += 0.2
    assert bucket.allowance(3) == (2, 0.0)
    clock.now += 60
    assert bucket.allowance(100) == (5, 0.0)  # capped at the capacity


def test_an_empty_bucket_says_how_long_until_a_claims_worth():
    clock = Clock()
    bucket = TokenBucket(100.0, 100.0, clock=clock)
    n, wait = bucket.allowance(32)
    assert n == 0
    assert wait == pytest.approx(0.05)  # 5 tokens at 100/s: a few jobs per claim, not one


def test_unused_tokens_come_back_and_a_new_share_keeps_what_fits():
    clock = Clock()
    bucket = TokenBucket(10.0, 10.0, clock=clock)
    clock.now += 1
    assert bucket.allowance(8) == (8, 0.0)
    bucket.refund(5)
    assert bucket.tokens == pytest.approx(7)
    bucket.resize(2.0, 3.0)
    assert bucket.tokens == pytest.approx(3)
    clock.now += 1
    assert bucket.allowance(10) == (3, 0.0)


def test_a_pod_charges_its_own_bucket_once_its_share_is_announced():
    choice = choose(shares={"aaaaaaaa": 0.25, "bbbbbbbb": 0.75}, tag="aaaaaaaa",
                    shares_age=1.0, member_age=30.0)
    assert (choice.mode, choice.share) == ("local", 0.25)


def test_a_new_pod_waits_for_its_share_then_falls_back_to_the_shared_row():
    unannounced = {"bbbbbbbb": 1.0}
    assert choose(shares=unannounced, tag="aaaaaaaa", shares_age=0.5,
                  member_age=JOIN_WAIT_SECONDS / 2).mode == "wait"
    assert choose(shares=None, tag="aaaaaaaa", shares_age=float("inf"),
                  member_age=0.0).mode == "wait"
    assert choose(shares=unannounced, tag="aaaaaaaa", shares_age=0.5,
                  member_age=JOIN_WAIT_SECONDS + 1).mode == "shared"


def test_stale_shares_or_no_listen_session_mean_the_shared_row():
    shares = {"aaaaaaaa": 0.5, "bbbbbbbb": 0.5}
    assert choose(shares=shares, tag="aaaaaaaa", shares_age=SHARE_FRESH_SECONDS + 1,
                  member_age=60.0).mode == "shared"
    assert choose(shares=shares, tag=None, shares_age=0.0, member_age=None).mode == "shared"


def test_shares_follow_the_slots_and_an_unreported_pod_weighs_the_mean():
    assert shares_of({"a": 32, "b": 32, "c": 64}) == {"a": 0.25, "b": 0.25, "c": 0.5}
    shares = shares_of({"a": 10, "b": 30, "c": None})
    assert shares["c"] == pytest.approx(1 / 3, abs=1e-5)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-5)
    assert shares_of({"a": None}) == {"a": 1.0}
    assert shares_of({}) == {}


def test_the_watermark_survives_its_payload_to_the_microsecond():
    mark = (datetime(2026, 12, 5, 13, 0, 0, 123457, tzinfo=UTC), uuid.uuid4())
    assert decode_mark(encode_mark(*mark)) == mark
    assert decode_mark("") is None
    assert decode_mark("not a mark") is None


def test_a_tag_is_a_signed_32_bit_lock_key():
    assert tag_number("00000001") == 1
    assert tag_number("7fffffff") == 2**31 - 1
    assert tag_number("ffffffff") == -1


@pytest.mark.parametrize("want", [0, 1, 3, 7, 50])
@pytest.mark.parametrize("seconds", [0.0, 0.05, 0.25, 0.9, 10.0])
def test_what_a_bucket_has_available_is_what_a_claim_would_be_granted_and_stays(want, seconds):
    clock = Clock()
    bucket = TokenBucket(10.0, 8.0, clock=clock)
    clock.now += seconds
    offered = bucket.available(want)
    assert bucket.available(want) == offered  # looking takes nothing
    assert offered == bucket.allowance(want)[0]


def test_a_leading_share_goes_to_its_pod_and_the_others_split_the_rest_by_slots():
    members = {"a": 32, "b": 32, "c": 64, "d": None}
    shares = shares_of(members, ("a", 0.5))
    assert shares["a"] == 0.5
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-5)
    # The rest by slots: b 32, c 64, d the mean (128 / 3).
    assert shares["c"] == pytest.approx(2 * shares["b"], abs=1e-5)
    assert shares["d"] == pytest.approx(shares["b"] * (128 / 3) / 32, abs=1e-5)


@pytest.mark.parametrize("lead", [("a", 0.1), ("zz", 0.9), ("a", -1.0)])
def test_a_lead_below_the_pods_own_share_or_for_no_member_changes_nothing(lead):
    members = {"a": 32, "b": 32, "c": 64}
    assert shares_of(members, lead) == shares_of(members)


def test_a_lone_pod_has_the_whole_limit_whatever_its_lead_and_a_lead_never_takes_it_all():
    assert shares_of({"a": 8}, ("a", 0.5)) == {"a": 1.0}
    shares = shares_of({"a": 8, "b": 8}, ("a", 1.5))
    assert shares["a"] < 1.0 and shares["b"] > 0.0
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-5)
