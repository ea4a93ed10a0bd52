"""The transports on real sockets, through their one door (``sender``): framing, reuse,
errors, bounds, h11 agreement, and aiohttp's stale-connection resend.

A raw asyncio server answers each request with scripted bytes, so every
framing rule, every broken answer and every way a reused connection can die
is produced exactly. These count the connections the server saw. The tests
of how a failure is raised run on both transports (``door``); the rest are
the aiohttp transport's (the default), whose pool and resend are ours to
configure.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from receipts.delivery import HttpDeliverer
from receipts.embedded import free_port
from receipts.model import Job, Reason, Verdict
from receipts.transport import (
    MAX_HEADER_LINE_BYTES,
    AiohttpTransport,
    AnswerTimeout,
    ConnectionLost,
    HttpxTransport,
    NothingSent,
    Transport,
)
from receipts.transport import Answer as WireAnswer

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[None]]


@dataclass
class RawServer:
    """A TCP server; each request (head + Content-Length body) gets ``answer``."""

    answer: Answer | None = None
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    #: Per request: which request on its connection it was (1 = the first).
    nth: list[int] = field(default_factory=list)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/receipts?x=1"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                served += 1
                self.requests.append(head + body)
                self.nth.append(served)
                assert self.answer is not None
                await self.answer(reader, writer, head + body)
                if writer.is_closing():
                    return
        finally:
            writer.close()


@pytest.fixture
async def raw() -> AsyncIterator[RawServer]:
    server = RawServer(port=free_port())
    listener = await asyncio.start_server(server.handle, "127.0.0.1", server.port)
    try:
        yield server
    finally:
        listener.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(listener.wait_closed(), 2)


def send(data: bytes, *, close: bool = False) -> Answer:
    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
        writer.write(data)
        await writer.drain()
        if close:
            writer.close()
    return answer


async def open_answer(transport: Transport, url: str, *, method: str = "POST",
                      body: bytes = b"{}", headers: list[tuple[str, str]] | None = None,
                      timeouts: dict[str, float | None] | None = None) -> WireAnswer:
    """One request through the transport's door; the answer with its body unread."""
    send = transport.sender(url, timeouts or {"read": 5.0})
    return await send(method, headers or [], body)


async def exchange(transport: Transport, url: str, **kwargs: object
                   ) -> tuple[int, list[tuple[str, str]], bytes]:
    """One whole exchange: status, header pairs, body."""
    answer = await open_answer(transport, url, **kwargs)  # type: ignore[arg-type]
    try:
        data = bytearray()
        await answer.read_into(data, 64 * 1024 * 1024)
    finally:
        await answer.release()
    return answer.status, list(answer.headers.items()), bytes(data)  # type: ignore[attr-defined]


@pytest.fixture
async def transport() -> AsyncIterator[AiohttpTransport]:
    t = AiohttpTransport(max_connections=4)
    yield t
    await t.aclose()


@pytest.fixture(params=["aiohttp", "httpx"])
async def door(request: pytest.FixtureRequest) -> AsyncIterator[Transport]:
    """Each transport behind the one door (RECEIPTS_PROVIDER_TRANSPORT's values)."""
    t: Transport = (AiohttpTransport if request.param == "aiohttp" else HttpxTransport)(
        max_connections=4)
    yield t
    await t.aclose()


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


# ------------------------------------------------------------------ framing

FRAMINGS = [
    ("content-length", b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\n\r\nhello", 201, b"hello",
     True),
    ("chunked with extension and trailer",
     b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nhel\r\n2\r\nlo\r\n"
     b"0\r\nX-Trailer: t\r\n\r\n", 200, b"hello", True),
    ("no body for 204", b"HTTP/1.1 204 No Content\r\n\r\n", 204, b"", True),
    ("until close", b"HTTP/1.1 200 OK\r\n\r\nhello", 200, b"hello", False),
    ("HTTP/1.0", b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", 200, b"ok", False),
    ("Connection: close", b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
     200, b"ok", False),
    ("interim answers skipped",
     b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
     b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", 200, b"ok", True),
    ("bare LF line ends", b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok", 200, b"ok", True),
    ("no reason phrase", b"HTTP/1.1 422\r\nContent-Length: 0\r\n\r\n", 422, b"", True),
]


@pytest.mark.parametrize(("name", "answer", "status", "body", "reused"), FRAMINGS,
                         ids=[f[0] for f in FRAMINGS])
async def test_each_framing_yields_the_body_and_reuses_the_connection_only_when_it_may(
    raw, transport, name, answer, status, body, reused
):
    raw.answer = send(answer, close=not reused and b"Content-Length" not in answer)
    assert (await exchange(transport, raw.url))[::2] == (status, body)
    raw.answer = send(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert (await exchange(transport, raw.url))[0] == 200
    assert raw.connections == (1 if reused else 2)


async def test_folded_header_lines_are_joined(raw, transport):
    raw.answer = send(b"HTTP/1.1 200 OK\r\nX-Long: a\r\n  b\r\nContent-Length: 0\r\n\r\n")
    _, headers, _ = await exchange(transport, raw.url)
    assert [" ".join(v.split()) for k, v in headers if k == "X-Long"] == ["a b"]


BROKEN = [
    ("invalid status line", b"HTTP/2 200 OK\r\n\r\n"),
    ("garbage", b"\x16\x03\x01 not http\r\n\r\n"),
    ("header without colon", b"HTTP/1.1 200 OK\r\nNoColon\r\n\r\n"),
    ("conflicting Content-Length", b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n"
                                   b"Content-Length: 2\r\n\r\nxx"),
    ("non-numeric Content-Length", b"HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n"),
    # RFC 9110 §8.6 lets a recipient reject a list even of equal values; llhttp does.
    ("repeated equal Content-Length", b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok"),
    ("header line too long", b"HTTP/1.1 200 OK\r\n" + b"X: " + b"y" * MAX_HEADER_LINE_BYTES
     + b"\r\n\r\n"),
    ("too many headers", b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 200 + b"\r\n"),
    ("invalid chunk size", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
    ("body shorter than its length", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"),
    ("closed before answering", b""),
]


@pytest.mark.parametrize(("name", "answer"), BROKEN, ids=[b[0] for b in BROKEN])
async def test_a_broken_answer_is_a_lost_connection_and_the_connection_is_dropped(
    raw, transport, name, answer
):
    raw.answer = send(answer, close=True)
    with pytest.raises(ConnectionLost):
        await exchange(transport, raw.url)
    raw.answer = send(OK)
    assert (await exchange(transport, raw.url))[0] == 200
    assert raw.connections == 2  # the broken one was not reused


async def test_a_reset_after_the_request_was_sent_is_a_lost_connection(raw, door):
    async def reset(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
        writer.transport.abort()

    raw.answer = reset
    with pytest.raises(ConnectionLost):
        await exchange(door, raw.url)
    assert raw.requests  # the request did reach the server: the outcome is unknown


# -------------------------------------------------------------- the request


async def test_the_request_bytes_are_exactly_the_request(raw, transport):
    raw.answer = send(OK)
    headers = [("User-Agent", "t/1"), ("Idempotency-Key", "receipt:ørder")]
    await exchange(transport, raw.url, body=b'{"a":1}', headers=headers)
    # Framing headers of the request are the client's own: one Content-Length, no chunking.
    assert raw.requests == [
        b"POST /receipts?x=1 HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nUser-Agent: t/1\r\n"
        b"Idempotency-Key: receipt:\xc3\xb8rder\r\nAccept: */*\r\nContent-Length: 7\r\n"
        b"Content-Type: application/octet-stream\r\n\r\n{\"a\":1}" % raw.port
    ]


@pytest.mark.parametrize("value", ["a\r\nX-Injected: 1", "a\nb", "a\rb", "a\x00b"])
async def test_a_header_value_that_would_inject_a_header_is_refused_and_nothing_is_sent(
    raw, door, value
):
    with pytest.raises(NothingSent):
        await exchange(door, raw.url, headers=[("X-Order", value)])
    assert raw.requests == []


# ------------------------------------------------------------ connections


async def test_sequential_requests_share_one_keep_alive_connection(raw, transport):
    raw.answer = send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    for _ in range(20):
        await exchange(transport, raw.url)
    assert raw.connections == 1


async def test_a_2xx_whose_body_came_with_its_head_is_skipped_and_its_connection_reused(
        raw, transport):
    raw.answer = send(b"HTTP/1.1 201 Created\r\nContent-Length: 11\r\n\r\n{\"ok\":true}")
    deliverer = HttpDeliverer(raw.url, timeout_seconds=5, transport=transport)
    for n in range(5):
        outcome = await deliverer.deliver(Job(uuid.uuid4(), f"o-{n}", uuid.uuid4(), 1))
        assert (outcome.verdict, outcome.status) == (Verdict.DELIVERED, 201)
    assert raw.connections == 1


@pytest.mark.parametrize(("answer", "skipped"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", True),
    (b"HTTP/1.1 204 No Content\r\n\r\n", True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nok", False),  # 3 bytes still to come
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", True),
])
async def test_complete_is_true_only_for_a_body_that_has_wholly_arrived(
        raw, transport, answer, skipped):
    raw.answer = send(answer)
    answer = await open_answer(transport, raw.url)
    # The server wrote the whole answer at once: a short one arrives with its head.
    assert answer.complete() is skipped
    await answer.release()
    raw.answer = send(OK)
    await exchange(transport, raw.url)
    assert raw.connections == (1 if skipped else 2)  # an unfinished body is not reused


async def test_concurrent_requests_never_exceed_max_connections(raw):
    async def slow(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
        await asyncio.sleep(0.05)
        writer.write(OK)

    raw.answer = slow
    transport = AiohttpTransport(max_connections=3)
    try:
        await asyncio.gather(*(exchange(transport, raw.url) for _ in range(12)))
    finally:
        await transport.aclose()
    assert raw.connections == 3


async def test_no_free_connection_within_the_pool_timeout_is_a_timeout_before_sending(raw):
    raw.answer = send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")  # body never comes
    transport = AiohttpTransport(max_connections=1)
    held = await open_answer(transport, raw.url, body=b"")
    try:
        with pytest.raises(NothingSent):
            await exchange(transport, raw.url, timeouts={"pool": 0.1})
    finally:
        await held.release()
        await transport.aclose()
    assert len(raw.requests) == 1


async def test_a_cancelled_wait_for_a_connection_does_not_lose_the_slot(raw):
    raw.answer = send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")  # holds it
    transport = AiohttpTransport(max_connections=1)
    try:
        held = await open_answer(transport, raw.url, body=b"")
        raw.answer = send(OK)
        first = asyncio.create_task(exchange(transport, raw.url))
        second = asyncio.create_task(exchange(transport, raw.url))
        await asyncio.sleep(0.05)
        first.cancel()
        await held.release()  # the connection goes to the next live waiter
        assert (await asyncio.wait_for(second, 5))[0] == 200
        assert first.cancelled()
        assert (await asyncio.wait_for(exchange(transport, raw.url), 5))[0] == 200
    finally:
        await transport.aclose()


async def test_an_idle_connection_the_server_closed_is_not_reused(raw, transport):
    raw.answer = send(OK, close=True)
    await exchange(transport, raw.url)  # keep-alive by its headers, but closed by the server
    await asyncio.sleep(0.05)  # the close reaches the client
    raw.answer = send(OK)
    assert (await exchange(transport, raw.url))[0] == 200
    assert raw.connections == 2 and transport.stale_retries == 0


async def test_an_idle_connection_older_than_the_keepalive_is_not_reused(raw):
    raw.answer = send(OK)
    transport = AiohttpTransport(keepalive_seconds=0.05)
    try:
        await exchange(transport, raw.url)
        await asyncio.sleep(0.1)
        await exchange(transport, raw.url)
    finally:
        await transport.aclose()
    assert raw.connections == 2


async def test_a_response_closed_before_its_body_arrived_closes_its_connection(raw, transport):
    async def late_body(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        with contextlib.suppress(ConnectionError):
            writer.write(b"HTTP/")  # would be read as the next answer's start if reused
            await writer.drain()

    raw.answer = late_body
    answer = await open_answer(transport, raw.url, body=b"")
    await answer.release()
    raw.answer = send(OK)
    await asyncio.sleep(0.15)
    assert (await exchange(transport, raw.url))[0] == 200
    assert raw.connections == 2


# --------------------------------------------- a reused connection that died


def on_nth(first: Answer, later: Answer) -> Answer:
    """*first* for the first request of each connection, *later* for the others."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     request: bytes) -> None:
        raw_server = answer.server  # type: ignore[attr-defined]
        await (first if raw_server.nth[-1] == 1 else later)(reader, writer, request)
    return answer


async def _close(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
    writer.close()


async def _reset(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
    writer.transport.abort()


async def _half_head(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-")
    await writer.drain()
    writer.close()


@pytest.mark.parametrize("dies", [_close, _reset], ids=["closed", "reset"])
async def test_a_reused_connection_that_dies_before_any_answer_byte_is_resent_on_a_fresh_one(
        raw, transport, dies):
    answer = on_nth(send(OK), dies)
    answer.server = raw  # type: ignore[attr-defined]
    raw.answer = answer
    assert (await exchange(transport, raw.url))[0] == 200
    # The second request goes out on the kept connection, which dies; it is sent
    # again on a new connection, where it is that connection's first request.
    assert (await exchange(transport, raw.url))[0] == 200
    assert transport.stale_retries == 1
    assert raw.nth == [1, 2, 1] and raw.connections == 2
    # The same request (the fresh connection is not kept: it says Connection: close).
    assert raw.requests[1] == raw.requests[2].replace(b"Connection: close\r\n", b"")


async def test_a_fresh_connection_that_dies_is_not_resent(raw, transport):
    raw.answer = _close
    with pytest.raises(ConnectionLost):
        await exchange(transport, raw.url)
    assert len(raw.requests) == 1 and transport.stale_retries == 0


async def test_a_reused_connection_that_dies_after_part_of_the_answer_is_not_resent(
        raw, transport):
    answer = on_nth(send(OK), _half_head)
    answer.server = raw  # type: ignore[attr-defined]
    raw.answer = answer
    await exchange(transport, raw.url)
    with pytest.raises(ConnectionLost):
        await exchange(transport, raw.url)
    assert len(raw.requests) == 2 and transport.stale_retries == 0


async def test_a_request_is_resent_at_most_once(raw, transport):
    answer = on_nth(send(OK), _close)
    answer.server = raw  # type: ignore[attr-defined]
    raw.answer = answer
    await exchange(transport, raw.url)
    raw.answer = _close  # the fresh connection dies too
    with pytest.raises(ConnectionLost):
        await exchange(transport, raw.url)
    assert len(raw.requests) == 3 and transport.stale_retries == 1


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize("name", ["aiohttp", "httpx"])
async def test_nothing_listening_is_nothing_sent_and_the_outcome_says_so(name):
    url = f"http://127.0.0.1:{free_port()}/"
    transport = (AiohttpTransport if name == "aiohttp" else HttpxTransport)()
    try:
        with pytest.raises(NothingSent):
            await exchange(transport, url)
    finally:
        await transport.aclose()
    deliverer = HttpDeliverer(url, timeout_seconds=2, transport=name)
    try:
        outcome = await deliverer.deliver(Job(uuid.uuid4(), "o-1", uuid.uuid4(), 1))
    finally:
        await deliverer.aclose()
    assert outcome.reason is Reason.CONNECT_ERROR


@pytest.mark.parametrize("name", ["aiohttp", "httpx"])
async def test_a_close_after_the_request_was_read_is_an_unknown_outcome(raw, name):
    raw.answer = _close
    deliverer = HttpDeliverer(raw.url, timeout_seconds=2, transport=name)
    try:
        outcome = await deliverer.deliver(Job(uuid.uuid4(), "o-1", uuid.uuid4(), 1))
    finally:
        await deliverer.aclose()
    assert outcome.reason is Reason.CONNECTION_LOST
    assert len(raw.requests) == 1  # it did reach the server


async def test_a_connect_that_hangs_is_nothing_sent(door):
    transport = door
    try:
        started = time.monotonic()
        with pytest.raises(NothingSent):
            # A non-routable address (TEST-NET-1): the SYN goes unanswered or is refused.
            await exchange(transport, "http://192.0.2.1:81/", timeouts={"connect": 0.2})
        assert time.monotonic() - started < 2
    finally:
        await transport.aclose()


async def test_no_bytes_within_the_read_timeout_is_an_answer_timeout(raw, door):
    async def silent(*_: object) -> None:
        await asyncio.sleep(5)

    raw.answer = silent
    with pytest.raises(AnswerTimeout):
        await exchange(door, raw.url, timeouts={"read": 0.1})


async def test_an_unsupported_scheme_is_refused_and_nothing_is_sent(door):
    with pytest.raises(NothingSent):
        await exchange(door, "ftp://127.0.0.1/")


# ----------------------------------------------------------------- bounds


async def test_a_large_body_left_unread_is_not_held_in_memory(raw, transport):
    total = 16 * 1024 * 1024

    async def big(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        with contextlib.suppress(ConnectionError):
            for _ in range(total // 65536):
                writer.write(b"x" * 65536)
                await writer.drain()

    raw.answer = big
    tracemalloc.start()
    try:
        answer = await open_answer(transport, raw.url, body=b"")
        await asyncio.sleep(0.3)  # the server keeps writing; the client does not read
        _, peak = tracemalloc.get_traced_memory()
        data = bytearray()
        await answer.read_into(data, total + 1)
        seen = len(data)
        await answer.release()
        del data
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024  # reading paused: the 16 MB waited in the sender
    assert seen == total  # and resumed when read


# ------------------------------------------------------- agreement with h11

_token = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).map(
    lambda s: "x-" + s)
_value = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)


def _h11_answer(status: int, headers: list[tuple[str, str]], body: bytes, chunked: bool,
                cuts: list[int]) -> bytes:
    """What h11 (httpx's default parser) writes as a server for this answer."""
    server = h11.Connection(h11.SERVER)
    server.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    server.next_event()
    server.next_event()
    framing = [("Transfer-Encoding", "chunked")] if chunked else [
        ("Content-Length", str(len(body)))]
    out = server.send(h11.Response(status_code=status, headers=headers + framing))
    assert out is not None
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    for piece in pieces:
        if piece:
            out += server.send(h11.Data(data=piece)) or b""
    return out + (server.send(h11.EndOfMessage()) or b"")


@pytest.mark.slow
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(status=st.integers(200, 599).filter(lambda s: s not in (204, 304)),  # no body allowed
       # Framing headers are h11's to write (a generated Content-Length would make
       # the test's own server refuse its answer).
       headers=st.lists(st.tuples(_token, _value).filter(
           lambda h: h[0].lower() not in {"content-length", "transfer-encoding", "connection"}),
           max_size=6),
       body=st.binary(max_size=3000),
       chunked=st.booleans(),
       cuts=st.lists(st.integers(0, 3000), max_size=4))
async def test_answers_written_by_h11_are_read_as_h11_wrote_them(
    raw, status, headers, body, chunked, cuts
):
    cuts = sorted({min(c, len(body)) for c in cuts})
    raw.answer = send(_h11_answer(status, headers, body, chunked, cuts))
    raw.connections = 0
    transport = AiohttpTransport()
    try:
        got_status, got_headers, got_body = await exchange(transport, raw.url)
        got_status2, _, got_body2 = await exchange(transport, raw.url)
    finally:
        await transport.aclose()
    assert (got_status, got_body) == (status, body) == (got_status2, got_body2)
    sent = {(k.lower(), v) for k, v in headers}
    assert sent <= {(k.lower(), v) for k, v in got_headers}
    assert raw.connections == 1  # read to its end: the connection was reused
