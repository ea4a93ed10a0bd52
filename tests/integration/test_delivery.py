"""Every row of the provider-outcome table (docs/design.md §3), against a real HTTP server.

The classification must not depend on the transport behind the deliverer's one
door: the outcome rows run on both values of ``RECEIPTS_PROVIDER_TRANSPORT``,
aiohttp's client (the default) and httpx's own transport (httpcore).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
from aiohttp import web

from receipts.delivery import SUCCESS_BODY_SECONDS, HttpDeliverer
from receipts.embedded import free_port
from receipts.model import Job, Outcome, Verdict

TRANSPORTS = ["aiohttp", "httpx"]


def a_job(order_id: str = "order-1", attempt: int = 1) -> Job:
    return Job(id=uuid.uuid4(), order_id=order_id, token=uuid.uuid4(), attempt=attempt)


def make(url: str, timeout: float, transport: str = "aiohttp", **kwargs) -> HttpDeliverer:
    return HttpDeliverer(url, timeout_seconds=timeout, transport=transport, **kwargs)


async def deliver_once(url: str, timeout: float = 2.0, job: Job | None = None,
                       transport: str = "aiohttp") -> Outcome:
    """One delivery through a fresh HttpDeliverer (closed afterwards)."""
    deliverer = make(url, timeout, transport)
    try:
        return await deliverer.deliver(job or a_job())
    finally:
        await deliverer.aclose()


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


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
async def test_each_status_is_classified_as_the_contract_says(
    stub, transport, code, verdict, reason
):
    stub.answer(status(code, {"Location": "/elsewhere"} if code == 302 else None,
                       '{"error": "order unknown"}'))
    outcome = await deliver_once(stub.url, 2, transport=transport)
    assert (outcome.verdict, outcome.reason, outcome.status) == (verdict, reason, code)
    if verdict is Verdict.PERMANENT:
        assert outcome.detail == f"{code} order unknown"


async def test_the_idempotency_key_and_body_are_identical_on_every_attempt(stub, transport):
    stub.answer(status(503))
    deliverer = HttpDeliverer(stub.url, timeout_seconds=2, transport=transport)
    job = a_job("order-42")
    try:
        for attempt in (1, 2, 3):
            await deliverer.deliver(Job(job.id, job.order_id, uuid.uuid4(), attempt))
    finally:
        await deliverer.aclose()
    assert {r["key"] for r in stub.requests} == {"receipt:order-42"}
    assert len({r["body"] for r in stub.requests}) == 1


@pytest.mark.parametrize(("headers", "replayed"), [
    ({"Idempotent-Replayed": "true"}, True), ({"idempotent-replayed": " TRUE "}, True),
    ({"Idempotent-Replayed": "false"}, False), ({}, False), ({"Idempotent-Replayed": ""}, False),
])
async def test_a_replayed_success_is_marked_so_its_round_trip_is_no_latency_sample(
        stub, transport, headers, replayed):
    stub.answer(status(200, headers))
    outcome = await deliver_once(stub.url, 2, transport=transport)
    assert (outcome.verdict, outcome.replayed) == (Verdict.DELIVERED, replayed)


async def test_retry_after_is_parsed_from_the_answer(stub, transport):
    stub.answer(status(429, {"Retry-After": "7"}))
    outcome = await deliver_once(stub.url, 2, transport=transport)
    assert outcome.retry_after_seconds == 7.0


async def test_a_provider_that_never_answers_times_out_as_an_unknown_outcome(stub, transport):
    async def hang(_: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response()

    stub.answer(hang)
    start = time.monotonic()
    outcome = await deliver_once(stub.url, 0.5, transport=transport)
    assert time.monotonic() - start < 2
    assert (outcome.verdict, outcome.reason) == (Verdict.RETRY, "timeout")


async def test_a_provider_that_hangs_after_sending_headers_frees_the_slot_in_time(stub, transport):
    async def headers_then_hang(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=503)
        await response.prepare(request)
        await response.write(b"partial")
        await asyncio.sleep(30)
        return response

    stub.answer(headers_then_hang)
    start = time.monotonic()
    outcome = await deliver_once(stub.url, 0.5, transport=transport)
    assert time.monotonic() - start < 2
    assert (outcome.verdict, outcome.reason) == (Verdict.RETRY, "provider_5xx")


async def test_a_connection_reset_after_sending_is_an_unknown_outcome(stub, transport):
    async def reset(request: web.Request) -> web.Response:
        await request.read()
        assert request.transport is not None
        request.transport.abort()
        await asyncio.sleep(1)
        return web.Response()

    stub.answer(reset)
    outcome = await deliver_once(stub.url, 2, transport=transport)
    assert (outcome.verdict, outcome.reason) == (Verdict.RETRY, "connection_lost")


async def test_a_rejection_cut_off_by_a_reset_is_a_connection_failure_not_a_verdict(
        stub, transport):
    """A 422 whose body the connection reset cut short: its partial reason judges nothing."""
    async def cut(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(status=422, headers={"Content-Length": "4000"})
        response.content_type = "application/json"
        await response.prepare(request)
        await response.write(b'{"error": "order cann')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        await asyncio.sleep(1)
        return response

    stub.answer(cut)
    outcome = await deliver_once(stub.url, 2, transport=transport)
    assert (outcome.verdict, outcome.reason) == (Verdict.RETRY, "connection_lost")
    assert outcome.status == 422 and "cut off" in outcome.detail


async def test_a_rejection_whose_body_never_ends_is_a_timeout_not_a_verdict(stub, transport):
    async def drip(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=422, headers={"Content-Length": "4000"})
        await response.prepare(request)
        await response.write(b'{"error": ')
        await asyncio.sleep(30)
        return response

    stub.answer(drip)
    outcome = await deliver_once(stub.url, 0.5, transport=transport)
    assert (outcome.verdict, outcome.reason) == (Verdict.RETRY, "timeout")


async def test_a_408_is_a_timeout_not_a_verdict(stub, transport):
    stub.answer(status(408, body='{"error": "request timeout"}'))
    outcome = await deliver_once(stub.url, 2, transport=transport)
    assert (outcome.verdict, outcome.reason, outcome.status) == (Verdict.RETRY, "timeout", 408)


async def test_a_connect_error_before_sending_is_a_known_failure(transport):
    outcome = await deliver_once(f"http://127.0.0.1:{free_port()}/receipts", 2,
                                 transport=transport)
    assert (outcome.verdict, outcome.reason) == (Verdict.RETRY, "connect_error")


async def test_a_huge_failure_body_is_read_only_up_to_a_bound(stub, transport):
    stub.answer(status(422, body='{"error": "' + "x" * 5_000_000 + '"}'))
    outcome = await deliver_once(stub.url, 5, transport=transport)
    assert outcome.verdict is Verdict.PERMANENT and len(outcome.detail) <= 210


# ------------------------------------------------------------- the request


def capture(seen: list[web.Request], bodies: list[bytes], answer: web.Response | None = None):
    async def fn(request: web.Request) -> web.Response:
        seen.append(request)
        bodies.append(await request.read())
        return answer or web.json_response({"receipt_id": "r"}, status=201)
    return fn


async def test_the_request_carries_exactly_the_contract_headers_and_body(stub, transport):
    seen: list[web.Request] = []
    bodies: list[bytes] = []
    stub.answer(capture(seen, bodies))
    deliverer = HttpDeliverer(stub.url, timeout_seconds=2, token="tok-1", transport=transport)
    job = a_job("ørder-日本-1", attempt=3)
    try:
        assert (await deliverer.deliver(job)).verdict is Verdict.DELIVERED
    finally:
        await deliverer.aclose()
    (request,), (body,) = seen, bodies
    assert request.method == "POST" and request.path_qs == "/receipts"
    headers = {k.lower(): v for k, v in request.raw_headers}
    assert headers[b"idempotency-key"] == "receipt:ørder-日本-1".encode()
    assert headers[b"x-receipts-attempt"] == b"3"
    assert headers[b"authorization"] == b"Bearer tok-1"
    assert headers[b"user-agent"] == b"receipts-worker/0.1"
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"content-length"] == str(len(body)).encode()
    assert b"accept-encoding" not in headers and b"cookie" not in headers
    # Byte-identical to what every earlier release sent for this job (compact, ASCII-escaped).
    assert body == json.dumps({"order_id": job.order_id, "job_id": str(job.id),
                               "idempotency_key": job.idempotency_key},
                              separators=(",", ":")).encode()


async def test_the_url_userinfo_becomes_basic_auth_when_no_token_is_set(stub, transport):
    seen: list[web.Request] = []
    stub.answer(capture(seen, []))
    url = stub.url.replace("http://", "http://us%40er:p%3Ass@")
    deliverer = HttpDeliverer(url, timeout_seconds=2, transport=transport)
    try:
        await deliverer.deliver(a_job())
    finally:
        await deliverer.aclose()
    assert seen[0].headers["Authorization"] == httpx.BasicAuth("us@er", "p:ss")._auth_header


async def test_a_2xx_is_acted_on_without_waiting_for_a_slow_body(stub, transport):
    async def status_then_stall(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Length": "100"})
        await response.prepare(request)
        await response.write(b"{")
        await asyncio.sleep(30)
        return response

    stub.answer(status_then_stall)
    start = time.monotonic()
    outcome = await deliver_once(stub.url, 5, transport=transport)
    assert (outcome.verdict, outcome.status) == (Verdict.DELIVERED, 200)
    assert time.monotonic() - start < SUCCESS_BODY_SECONDS + 1


async def test_a_redirect_is_not_followed(stub, transport):
    stub.answer(status(307, {"Location": "/receipts-elsewhere"}))
    outcome = await deliver_once(stub.url, 2, transport=transport)
    assert outcome.reason == "unexpected_status"
    assert len(stub.requests) == 1


@pytest.mark.slow
async def test_cookies_set_by_the_provider_are_never_sent_back(stub, transport):
    seen: list[web.Request] = []
    answer = web.json_response({}, headers={"Set-Cookie": "session=abc; Path=/"})
    stub.answer(capture(seen, [], answer))
    deliverer = HttpDeliverer(stub.url, timeout_seconds=2, transport=transport)
    try:
        for _ in range(2):
            await deliverer.deliver(a_job())
    finally:
        await deliverer.aclose()
    assert [r.headers.get("Cookie") for r in seen] == [None, None]


async def test_deliveries_reuse_keep_alive_connections_up_to_the_connection_limit(stub, transport):
    peers: set[object] = set()

    async def ok(request: web.Request) -> web.Response:
        peers.add(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        await asyncio.sleep(0.01)
        return web.json_response({}, status=201)

    stub.answer(ok)
    deliverer = HttpDeliverer(stub.url, timeout_seconds=5, max_connections=8,
                              transport=transport)
    try:
        for _ in range(20):
            assert (await deliverer.deliver(a_job())).verdict is Verdict.DELIVERED
        assert len(peers) == 1
        outcomes = await asyncio.gather(*(deliverer.deliver(a_job()) for _ in range(100)))
    finally:
        await deliverer.aclose()
    assert {o.verdict for o in outcomes} == {Verdict.DELIVERED}
    assert len(peers) <= 8
