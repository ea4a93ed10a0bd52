"""Every row of the provider-outcome table (docs/design.md §3), against a real HTTP server."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiohttp import web

from receipts.delivery import HttpDeliverer
from receipts.embedded import free_port
from receipts.model import Job, Outcome, Verdict


def a_job(order_id: str = "order-1", attempt: int = 1) -> Job:
    return Job(id=uuid.uuid4(), order_id=order_id, token=uuid.uuid4(), attempt=attempt)


async def deliver_once(url: str, timeout: float = 2.0, job: Job | None = None) -> Outcome:
    """One delivery through a fresh HttpDeliverer (closed afterwards)."""
    deliverer = HttpDeliverer(url, timeout_seconds=timeout)
    try:
        return await deliverer.deliver(job or a_job())
    finally:
        await deliverer.aclose()


def status(code: int, headers: dict[str, str] | None = None, body: str = "{}"):
    async def fn(_: web.Request) -> web.Response:
        return web.Response(status=code, text=body, headers=headers,
                            content_type="application/json")
    return fn


@pytest.mark.parametrize(
    ("code", "verdict", "reason"),
    [
        (200, Verdict.DELIVERED, "delivered"),
        (201, Verdict.DELIVERED, "delivered"),
        (409, Verdict.RETRY, "in_progress"),
        (429, Verdict.RETRY, "rate_limited"),
        (500, Verdict.RETRY, "provider_5xx"),
        (503, Verdict.RETRY, "provider_5xx"),
        (401, Verdict.RETRY, "auth_rejected"),
        (403, Verdict.RETRY, "auth_rejected"),
        (400, Verdict.PERMANENT, "rejected"),
        (404, Verdict.PERMANENT, "rejected"),
        (410, Verdict.PERMANENT, "rejected"),
        (422, Verdict.PERMANENT, "rejected"),
        (302, Verdict.RETRY, "unexpected_status"),
    ],
)
async def test_each_status_is_classified_as_the_contract_says(stub, code, verdict, reason):
    stub.answer(status(code, {"Location": "/elsewhere"} if code == 302 else None,
                       '{"error": "order unknown"}'))
    outcome = await deliver_once(stub.url, 2)
    assert (outcome.verdict, outcome.reason, outcome.status) == (verdict, reason, code)
    if verdict is Verdict.PERMANENT:
        assert outcome.detail == f"{code} order unknown"


async def test_the_idempotency_key_and_body_are_identical_on_every_attempt(stub):
    stub.answer(status(503))
    deliverer = HttpDeliverer(stub.url, timeout_seconds=2)
    job = a_job("order-42")
    try:
        for attempt in (1, 2, 3):
            await deliverer.deliver(Job(job.id, job.order_id, uuid.uuid4(), attempt))
    finally:
        await deliverer.aclose()
    assert {r["key"] for r in stub.requests} == {"receipt:order-42"}
    assert len({r["body"] for r in stub.requests}) == 1


async def test_retry_after_is_parsed_from_the_answer(stub):
    stub.answer(status(429, {"Retry-After": "7"}))
    outcome = await deliver_once(stub.url, 2)
    assert outcome.retry_after_seconds == 7.0


async def test_a_provider_that_never_answers_times_out_as_an_unknown_outcome(stub):
    async def hang(_: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response()

    stub.answer(hang)
    start = time.monotonic()
    outcome = await deliver_once(stub.url, 0.5)
    assert time.monotonic() - start < 2
    assert (outcome.verdict, outcome.reason) == (Verdict.RETRY, "timeout")


async def test_a_provider_that_hangs_after_sending_headers_frees_the_slot_in_time(stub):
    async def headers_then_hang(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=503)
        await response.prepare(request)
        await response.write(b"partial")
        await asyncio.sleep(30)
        return response

    stub.answer(headers_then_hang)
    start = time.monotonic()
    outcome = await deliver_once(stub.url, 0.5)
    assert time.monotonic() - start < 2
    assert (outcome.verdict, outcome.reason) == (Verdict.RETRY, "provider_5xx")


async def test_a_connection_reset_after_sending_is_an_unknown_outcome(stub):
    async def reset(request: web.Request) -> web.Response:
        await request.read()
        assert request.transport is not None
        request.transport.abort()
        await asyncio.sleep(1)
        return web.Response()

    stub.answer(reset)
    outcome = await deliver_once(stub.url, 2)
    assert (outcome.verdict, outcome.reason) == (Verdict.RETRY, "connection_lost")


async def test_a_connect_error_before_sending_is_a_known_failure():
    outcome = await deliver_once(f"http://127.0.0.1:{free_port()}/receipts", 2)
    assert (outcome.verdict, outcome.reason) == (Verdict.RETRY, "connect_error")


async def test_a_huge_failure_body_is_read_only_up_to_a_bound(stub):
    stub.answer(status(422, body='{"error": "' + "x" * 5_000_000 + '"}'))
    outcome = await deliver_once(stub.url, 5)
    assert outcome.verdict is Verdict.PERMANENT and len(outcome.detail) <= 210
