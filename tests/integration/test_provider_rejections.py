"""The reference provider's rejections that no rule can fit to one shape, over real HTTP."""

from __future__ import annotations

import asyncio
import time
from dataclasses import fields

import httpx
import pytest

from receipts.cli import build_parser
from receipts.provider import Faults


async def post(client: httpx.AsyncClient, url: str, order_id: str) -> httpx.Response:
    return await client.post(url, json={"order_id": order_id},
                             headers={"Idempotency-Key": f"receipt:{order_id}"})


async def test_rejecting_everything_rotates_statuses_and_never_repeats_a_body(provider):
    provider.set_faults(reject_statuses=[400, 404, 422], reject_body="json_ids")
    async with httpx.AsyncClient(trust_env=False) as client:
        answers = [await post(client, provider.url, f"o-{i}") for i in range(6)]
    assert [a.status_code for a in answers] == [400, 404, 422, 400, 404, 422]
    bodies = [a.json() for a in answers]
    assert len({b["error"] for b in bodies}) == 6  # a request id and a timestamp in each
    assert all(b["request_id"].startswith("req_") and b["timestamp"].endswith("Z")
               for b in bodies)
    assert provider.provider.receipts == {}  # nothing recorded


async def test_rejections_can_be_html_pages_or_text(provider):
    async with httpx.AsyncClient(trust_env=False) as client:
        provider.set_faults(reject_statuses=[400], reject_body="html")
        page = await post(client, provider.url, "o-1")
        provider.set_faults(reject_body="text")
        text = await post(client, provider.url, "o-2")
    assert page.status_code == 400 and page.headers["content-type"].startswith("text/html")
    assert page.text.startswith("<html>") and "Reference #req_" in page.text
    assert text.status_code == 400 and text.text.startswith("400 request rejected [req_")


async def test_a_flapping_provider_alternates_rejecting_and_accepting_phases(provider):
    ref = provider.provider
    ref.faults = Faults.from_mapping({"reject_statuses": [422], "flap_seconds": 0.3})
    ref.faults_at = time.monotonic()
    async with httpx.AsyncClient(trust_env=False) as client:
        first = await post(client, provider.url, "o-1")
        await asyncio.sleep(0.35 - (time.monotonic() - ref.faults_at))
        second = await post(client, provider.url, "o-2")
        await asyncio.sleep(0.65 - (time.monotonic() - ref.faults_at))
        third = await post(client, provider.url, "o-3")
    assert (first.status_code, second.status_code, third.status_code) == (422, 201, 422)


async def test_orders_matching_the_pattern_are_invalid_every_time(provider):
    provider.set_faults(invalid_pattern="^bad-")
    async with httpx.AsyncClient(trust_env=False) as client:
        bad = [await post(client, provider.url, "bad-1") for _ in range(2)]
        good = await post(client, provider.url, "ok-1")
    assert [b.status_code for b in bad] == [422, 422]
    assert bad[0].json()["error"] == "order bad-1 cannot receive a receipt"
    assert good.status_code == 201 and list(provider.provider.receipts) == ["receipt:ok-1"]


@pytest.mark.parametrize("faults", [
    {"reject_statuses": [500]}, {"reject_statuses": []}, {"reject_body": "xml"},
    {"invalid_pattern": "("}, {"flap_seconds": -1},
    # a value of the wrong type is refused when set, not when the next request fails on it
    {"status": "abc"}, {"status": 999}, {"status": True}, {"latency_seconds": "0.1"},
    {"error_rate": float("nan")}, {"reject_statuses": ["422"]}, {"reject_body": 1},
    {"body_bytes": 1.5}])
def test_bad_rejection_settings_are_refused(faults):
    with pytest.raises(ValueError):
        Faults.from_mapping(faults)


def test_good_settings_of_every_type_are_taken():
    faults = Faults.from_mapping({"status": 401, "latency_seconds": 1, "body_bytes": 10,
                                  "reject_statuses": [400, 422], "retry_after_raw": "soon",
                                  "invalid_pattern": None})
    assert (faults.status, faults.latency_seconds, faults.reject_statuses) == (401, 1, (400, 422))


def test_the_providers_help_names_every_fault_setting():
    text = " ".join(build_parser()._subparsers._group_actions[0].choices[  # type: ignore[union-attr]
        "provider"].format_help().split())
    assert all(f.name in text for f in fields(Faults)), text
