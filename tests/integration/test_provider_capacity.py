"""The reference provider's concurrency capacity, over real HTTP."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from receipts.provider import Faults


async def burst(url: str, n: int, prefix: str) -> list[httpx.Response]:
    """*n* keyed POSTs sent at once; their answers."""
    async with httpx.AsyncClient(trust_env=False, timeout=30,
                                 limits=httpx.Limits(max_connections=n)) as client:
        return await asyncio.gather(*(
            client.post(url, json={"order_id": f"{prefix}-{i}"},
                        headers={"Idempotency-Key": f"receipt:{prefix}-{i}"})
            for i in range(n)))


@pytest.mark.parametrize("answer", ["503", "429"])
async def test_beyond_its_capacity_it_refuses_with_the_status_chosen(provider, answer):
    provider.set_faults(latency_seconds=0.5, capacity=3, capacity_answer=answer)
    answers = await burst(provider.url, 8, "o")
    statuses = sorted(a.status_code for a in answers)
    assert statuses.count(201) == 3 and statuses.count(int(answer)) == 5, statuses
    if answer == "429":
        assert all(a.headers["Retry-After"] == "1" for a in answers if a.status_code == 429)
    stats = provider.provider.snapshot()
    assert (stats["max_concurrent"], stats["over_capacity"], stats["concurrent"]) == (4, 5, 0)
    assert len(provider.provider.loads) == 8
    assert max(load for _, load in provider.provider.loads) == 4


async def test_over_capacity_with_latency_accepts_all_but_slows_them(provider):
    provider.set_faults(latency_seconds=0.2, capacity=2, capacity_answer="latency")
    answers = await burst(provider.url, 6, "o")
    assert all(a.status_code == 201 for a in answers)
    took = sorted(a.elapsed.total_seconds() for a in answers)
    # The first two arrive within capacity (0.2 s); the last found 6 at once: 0.6 s.
    assert took[0] < 0.45 and took[-1] >= 0.55, took
    assert provider.provider.snapshot()["max_concurrent"] == 6


async def test_the_capacity_changes_while_it_runs_and_null_lifts_it(provider):
    provider.set_faults(latency_seconds=0.3, capacity=1)
    first = await burst(provider.url, 4, "a")
    provider.set_faults(capacity=None)
    second = await burst(provider.url, 4, "b")
    assert sorted(a.status_code for a in first) == [201, 503, 503, 503]
    assert [a.status_code for a in second] == [201] * 4


@pytest.mark.parametrize("faults", [
    {"capacity": 0}, {"capacity": 1.5}, {"capacity": "4"}, {"capacity": True},
    {"capacity_answer": "500"}, {"capacity_answer": 500}, {"capacity_answer": True},
    {"capacity": 10**20}, {"body_bytes": 10**10}, {"latency_seconds": 1e308}])
def test_bad_capacity_settings_are_refused(faults):
    with pytest.raises(ValueError):
        Faults.from_mapping(faults)


def test_the_answer_beyond_capacity_may_be_given_as_a_number_as_on_the_command_line():
    assert Faults.from_mapping({"capacity_answer": 429}).capacity_answer == "429"


async def test_put_faults_takes_a_capacity_and_refuses_a_bad_one(provider):
    async with httpx.AsyncClient(trust_env=False) as client:
        base = provider.url.rsplit("/receipts", 1)[0]
        good = await client.put(f"{base}/faults", json={"capacity": 5,
                                                         "capacity_answer": "latency"})
        bad = await client.put(f"{base}/faults", json={"capacity": "5"})
        stats = (await client.get(f"{base}/stats")).json()
    assert good.status_code == 200 and good.json()["capacity"] == 5
    assert bad.status_code == 400 and "capacity" in bad.json()["error"]
    assert stats["faults"]["capacity_answer"] == "latency" and stats["max_concurrent"] == 0
