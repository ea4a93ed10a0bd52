"""The chaos proxy's record of claim answers, against a fake server: what the worker took
(answered) and what it never took (cut, given up on at its deadline, broken off)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Callable

import pytest

from receipts.embedded import free_port
from tests.chaos.pgproxy import CANCEL_REQUEST_CODE, PgProxy

CLAIM = b"WITH candidate AS (SELECT 1 FOR UPDATE SKIP LOCKED) ... lease_token = gen_random_uuid()"
TOKEN = "11111111-0000-4000-8000-000000000001"
PID_KEY = struct.pack("!ii", 4242, 99)


def _msg(kind: bytes, body: bytes = b"") -> bytes:
    return kind + struct.pack("!i", len(body) + 4) + body


def _row(*cols: bytes | None) -> bytes:
    body = struct.pack("!h", len(cols))
    for col in cols:
        body += struct.pack("!i", -1) if col is None else struct.pack("!i", len(col)) + col
    return _msg(b"D", body)


READY = _msg(b"Z", b"I")
CLAIM_ROWS = _row(b"j1", b"o1", TOKEN.encode(), b"1") + _msg(b"C", b"UPDATE 1\x00") + READY


class FakeServer:
    """Just enough of PostgreSQL: start-up, a canned answer per Sync, cancels recorded."""

    def __init__(self) -> None:
        self.port = free_port()
        self.answer: Callable[[], bytes] = lambda: CLAIM_ROWS
        self.cancels: list[bytes] = []
        self.close_after_answer = False
        self.delay = 0.0  # seconds before each answer

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readexactly(8)
            length, code = struct.unpack("!ii", head)
            rest = await reader.readexactly(length - 8)
            if code == CANCEL_REQUEST_CODE:
                self.cancels.append(rest)
                return
            writer.write(_msg(b"R", struct.pack("!i", 0)) + _msg(b"K", PID_KEY) + READY)
            while True:
                kind = await reader.readexactly(1)
                (n,) = struct.unpack("!i", await reader.readexactly(4))
                await reader.readexactly(n - 4)
                if kind == b"X":
                    return
                if kind == b"Q":
                    writer.write(_msg(b"C", b"SELECT 1\x00") + READY)
                if kind == b"S":
                    await asyncio.sleep(self.delay)
                    writer.write(self.answer())
                    await writer.drain()
                    if self.close_after_answer:
                        return
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


class Client:
    """A client speaking the extended protocol to the proxy, as libpq does."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.key = b""

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        params = b"user\x00postgres\x00\x00"
        self.writer.write(struct.pack("!ii", 8 + len(params), 196608) + params)
        for kind, body in await self.answer():
            if kind == b"K":
                self.key = body

    async def send_claim(self) -> None:
        bind = b"\x00\x00" + struct.pack("!hhh", 0, 0, 0)
        self.writer.write(_msg(b"P", b"\x00" + CLAIM + b"\x00" + struct.pack("!h", 0))
                          + _msg(b"B", bind) + _msg(b"E", b"\x00" + struct.pack("!i", 0))
                          + _msg(b"S"))
        await self.writer.drain()

    async def send_query(self, sql: bytes) -> None:
        self.writer.write(_msg(b"Q", sql + b"\x00"))
        await self.writer.drain()

    async def answer(self) -> list[tuple[bytes, bytes]]:
        """Messages up to and including the next ReadyForQuery."""
        out = []
        while True:
            kind = await self.reader.readexactly(1)
            (n,) = struct.unpack("!i", await self.reader.readexactly(4))
            out.append((kind, await self.reader.readexactly(n - 4)))
            if kind == b"Z":
                return out

    async def cancel(self) -> None:
        """What a driver does when its deadline fires: a CancelRequest on a new connection."""
        _, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(struct.pack("!ii", 16, CANCEL_REQUEST_CODE) + self.key)
        await writer.drain()
        writer.close()


@pytest.fixture
async def rig() -> AsyncIterator[tuple[FakeServer, PgProxy, Client]]:
    server = FakeServer()
    listener = await asyncio.start_server(server.serve, "127.0.0.1", server.port)
    proxy = PgProxy(server.port, free_port())
    await proxy.start()
    client = Client(proxy.port)
    await client.connect()
    yield server, proxy, client
    client.writer.close()
    await proxy.close()
    listener.close()


async def _until(condition: Callable[[], object], seconds: float = 3.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_claim_answer_the_client_read_is_answered(rig):
    _server, proxy, client = rig
    await client.send_claim()
    assert next(k for k, _ in await client.answer()) == b"D"
    assert list(proxy.answered) == [TOKEN] and not proxy.lost


async def test_a_claim_held_half_open_and_cancelled_by_its_client_is_lost_though_forwarded(rig):
    # The hold outlives the client's deadline: it cancels (the driver keeps its socket
    # open and still reads the answer, which it then throws away), the hold ends, the
    # claim reaches the server and commits.
    server, proxy, client = rig
    proxy.hold(0.5)
    await client.send_claim()
    await client.cancel()
    answer = await client.answer()
    assert answer[0][0] == b"D"  # forwarded after the hold: the client reads it ...
    assert not proxy.answered  # ... but had given up on it
    assert [(c.why, [r.token for r in c.rows]) for c in proxy.lost] == [("cancelled", [TOKEN])]
    await _until(lambda: server.cancels)
    assert server.cancels == [PID_KEY]


async def test_a_claim_answer_forwarded_as_the_deadline_fired_is_lost(rig):
    # The answer was on the wire when the client's deadline fired: the cancel comes
    # before the client sends anything else.
    _server, proxy, client = rig
    await client.send_claim()
    await _until(lambda: proxy.answered)
    await client.cancel()
    await _until(lambda: proxy.lost)
    assert not proxy.answered and proxy.lost[0].why == "cancelled"
    # A cancel after the client went on with another statement is for that one.
    await client.answer()
    await client.send_claim()
    await client.answer()
    await client.send_query(b"SELECT 1")
    await client.cancel()
    await _until(lambda: proxy.cancels == 2)
    assert list(proxy.answered) == [TOKEN] and len(proxy.lost) == 1


async def test_a_claim_answer_held_when_its_client_closes_is_lost(rig):
    server, proxy, client = rig
    server.delay = 0.2
    await client.send_claim()
    await _until(lambda: proxy.claims == 1)  # forwarded; its answer comes in 0.2 s
    proxy.hold(1.0)
    await asyncio.sleep(0.4)
    client.writer.close()
    await _until(lambda: proxy.lost, seconds=2)
    assert proxy.lost[0].why == "client gone" and not proxy.answered


async def test_a_claim_broken_off_in_mid_answer_is_unsure_and_a_failed_one_claimed_nothing(rig):
    server, proxy, client = rig
    server.answer = lambda: _row(b"j1", b"o1", TOKEN.encode(), b"1")
    server.close_after_answer = True
    await client.send_claim()
    await _until(lambda: proxy.unsure)
    assert proxy.unsure[0].why == "broken" and not proxy.answered and not proxy.lost
    # Rows followed by an error: the claim's transaction rolled back.
    server2, proxy2 = server, proxy
    server2.close_after_answer = False
    server2.answer = lambda: (_row(b"j1", b"o1", TOKEN.encode(), b"1")
                              + _msg(b"E", b"SERROR\x00\x00") + READY)
    again = Client(proxy2.port)
    await again.connect()
    await again.send_claim()
    await again.answer()
    assert not proxy2.answered and not proxy2.lost and len(proxy2.unsure) == 1
    again.writer.close()


async def test_an_armed_cut_drops_a_committed_claim_answer(rig):
    _server, proxy, client = rig
    proxy.arm_cut()
    await client.send_claim()
    with pytest.raises(asyncio.IncompleteReadError):
        await client.answer()
    assert [r.token for r in proxy.cuts[0].rows] == [TOKEN]
    assert not proxy.answered and not proxy.lost


async def test_a_claim_on_its_way_when_its_client_closes_is_read_to_its_end_and_lost(rig):
    # Closing both sockets at once would leave the server to commit a claim nobody
    # hears of: the proxy reads its answer first.
    server, proxy, client = rig
    server.delay = 0.3
    await client.send_claim()
    await _until(lambda: proxy.claims == 1)
    client.writer.close()
    await _until(lambda: proxy.lost, seconds=2)
    assert proxy.lost[0].why == "client gone" and not proxy.answered


@pytest.mark.parametrize("tag", [None, "0badcafe"])
@pytest.mark.parametrize("limited", [False, True])
def test_the_proxy_knows_the_worker_claims_and_nothing_else_as_claims(
        tag: str | None, limited: bool) -> None:
    from receipts.statements import claim_query, statements
    from tests.chaos.pgproxy import _kind

    claim = claim_query(100, limited=limited, tag=tag).as_string(None).encode()
    assert _kind(claim) == "claim"
    for name in ("recover_expired", "prune", "fail_exhausted", "enqueue", "ack", "reschedule"):
        assert _kind(statements()[name].encode()) != "claim", name
