"""The former hand-written HTTP/1.1 transport, kept in bench/ only to compare against.

It was receipts' delivery transport until the aiohttp adapter replaced it
(bench/README.md, "A maintained HTTP client"); `python -m bench.cycle
--transports hand-written,aiohttp` and `python -m bench.client` still run it. Its
text below is as it was in `src/receipts/transport.py` (commit 718b02c).

An HTTP/1.1 transport for httpx over plain asyncio: small requests, bounded answers.

:class:`Http11Transport` is an ``httpx.AsyncBaseTransport``: the delivery code
builds ``httpx.Request`` objects, gets ``httpx.Response`` objects back and
catches httpx's exceptions, exactly as with httpx's default transport; only the
bytes on the wire are handled here. It exists because of CPU (bench/README.md):
POSTs to the reference provider on the benchmark machine, interleaved runs, CPU
of the client process per request — the previous deliverer (``httpx.AsyncClient``
pools over httpcore + h11) 900–1,220 µs; ``httpx.AsyncClient`` over the
``httpx-aiohttp`` transport 490–820 µs; plain aiohttp 160–230 µs; this transport
under :class:`receipts.delivery.HttpDeliverer` 100–190 µs, most of it the
kernel's send and receive and the event loop. h11's parser alone took ~110 µs
per request/response cycle, ``AsyncClient.send`` ~130 µs before any I/O.

Why not ``httpx-aiohttp`` (PyPI, 0.2.0): besides its cost through
``AsyncClient``, it maps ``aiohttp.ClientConnectionError`` — the base class of
both "could not connect" and "the server disconnected after the request" —
to ``httpx.ConnectTimeout``, so a reset after sending reads as "nothing
sent", the one distinction the outcome table rests on (tried: the delivery
test of a reset after sending classifies it ``connect_error`` through it,
``connection_lost`` through this); it is a young 0.x package with one
maintainer. aiohttp's
own client would add a second HTTP API beside httpx. What this module needs
of HTTP/1.1 is small (one request with a known body, a bounded answer) and
every rule of it is tested against real sockets, against h11's output and
against hostile answers (tests/integration/test_transport.py,
tests/integration/test_hostile.py).

What it does:

* ``http`` and ``https`` (TLS with the caller's ``ssl.SSLContext``, so a
  private CA and mutual TLS apply; SNI and host name checks as the context
  says), HTTP/1.1 only, no proxies, no compression (nothing is decoded: the
  caller reads raw bytes and should not send ``Accept-Encoding``).
* A pool per origin: idle keep-alive connections are reused last-in,
  first-out and closed after ``keepalive_seconds`` idle, or when the server
  closed them, or when anything arrived on them while idle. At most
  ``max_connections`` exchanges run at once (a new connection is opened only
  when no idle one is left, so that also bounds open connections).
* Response framing as RFC 9112 §6.3 says: no body for a 1xx, 204, 304 or a
  ``HEAD``; ``Transfer-Encoding: chunked``; ``Content-Length``; else until the
  server closes. Interim 1xx answers (``100 Continue``, ``103 Early Hints``)
  are skipped; ``101`` is returned as final and its connection closed. Bare
  ``LF`` line ends and obsolete line folding are tolerated (RFC 9112 §2.2,
  §5.2). A connection goes back to the pool only when its response was read
  to its end, the server did not ask to close it, and nothing extra arrived.
* Bounded memory: a response head may be at most ``MAX_HEAD_BYTES``; reading
  pauses while more than ``HIGH_WATER_BYTES`` wait unread, so a 50 MB answer
  is never held; the caller decides how much of a body to read.

How it fails (each is an httpx exception, so callers classify as with httpx):

=====================================================  ==============================
what happened                                          raised
=====================================================  ==============================
DNS, refused, TLS handshake or certificate failure      ``httpx.ConnectError``
connecting took longer than the ``connect`` timeout    ``httpx.ConnectTimeout``
no exchange slot within the ``pool`` timeout           ``httpx.PoolTimeout``
a header that would break the request (CR, LF, NUL)    ``httpx.LocalProtocolError``
closed or reset after the request was written          ``httpx.RemoteProtocolError``
                                                       / ``httpx.ReadError``
a malformed or oversized answer, a body cut short      ``httpx.RemoteProtocolError``
no bytes within the ``read`` timeout                   ``httpx.ReadTimeout``
=====================================================  ==============================

Connect errors mean that nothing was sent; every later failure may follow a
request the server acted on. Timeouts come from the request's ``timeout``
extension (``connect``, ``read``, ``pool``; seconds, None for none); callers
that need one deadline for the whole exchange wrap the call and the body read
in ``asyncio.timeout`` (cancellation at any point closes the connection).
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import cast

import httpx

#: Most bytes of a response head (status line and headers).
MAX_HEAD_BYTES = 64 * 1024
#: Most interim (1xx) answers skipped before a final one.
MAX_INTERIM = 16
#: Reading pauses while more than this many received bytes wait unread...
HIGH_WATER_BYTES = 256 * 1024
#: ...and resumes when fewer than this many are left.
LOW_WATER_BYTES = 64 * 1024
#: Most bytes of one chunk-size line or trailer line of a chunked body.
MAX_LINE_BYTES = 4 * 1024

_HEAD_END = re.compile(rb"\r?\n\r?\n")
_LINE_END = re.compile(rb"\r?\n")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: ([^\r\n]*))?")
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DIGITS = re.compile(rb"[0-9]{1,18}")

#: Header names already seen to be valid tokens (bounded: names come from providers too).
_VALID_NAMES: set[bytes] = set()
_VALID_NAMES_MAX = 512


def _is_token(name: bytes) -> bool:
    """True for a valid header name (an RFC 9110 token); remembers valid ones."""
    if name in _VALID_NAMES:
        return True
    if not _TOKEN.fullmatch(name):
        return False
    if len(_VALID_NAMES) < _VALID_NAMES_MAX:
        _VALID_NAMES.add(name)
    return True


# Body framings.
_NONE, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(4)


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: a receive buffer and a wake-up for its reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False  # the server closed its side, or the connection is gone
        self.error: BaseException | None = None
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (not always an asyncio.Transport subclass: uvloop's are not).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > HIGH_WATER_BYTES and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        self.eof = True
        self._wake()
        return None  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self.transport = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # for the reader
    @property
    def usable(self) -> bool:
        """Open, not closed by the server, and nothing unread on it."""
        return not self.eof and not self.buffer and self.transport is not None

    async def receive(self, timeout_seconds: float | None) -> None:
        """Wait until more bytes arrive or the connection ends.

        Raises ``httpx.ReadTimeout`` after *timeout_seconds* (None: no limit).
        """
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        waiter = self.loop.create_future()
        self._waiter = waiter
        timer = None
        if timeout_seconds is not None:
            timer = self.loop.call_later(timeout_seconds, _expire, waiter)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()

    def take(self, n: int) -> bytes:
        """Remove and return up to *n* buffered bytes."""
        buf = self.buffer
        if n >= len(buf):
            data = bytes(buf)
            buf.clear()
        else:
            data = bytes(buf[:n])
            del buf[:n]
        if self._paused and len(buf) < LOW_WATER_BYTES and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def ended(self) -> httpx.TransportError:
        """The error for a connection that ended while more was expected."""
        if self.error is not None:
            return httpx.ReadError(_describe(self.error))
        return httpx.RemoteProtocolError("server closed the connection")

    def close(self) -> None:
        """Close at once (anything unsent is dropped)."""
        self.eof = True
        if self.transport is not None:
            self.transport.abort()
            self.transport = None


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout("no data within the read timeout"))


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class ResponseBody(httpx.AsyncByteStream):
    """A response body read from its connection per its framing; releases it on close."""

    def __init__(self, pool: Http11Transport, key: tuple[bytes, bytes, int], conn: _Connection,
                 framing: int, length: int, keep_alive: bool,
                 read_timeout: float | None) -> None:
        self._pool = pool
        self._key = key
        self._conn = conn
        self._framing = framing
        self._left = length  # _LENGTH: bytes left; _CHUNKED: bytes left of this chunk
        self._keep_alive = keep_alive
        self._read_timeout = read_timeout
        self._complete = framing == _NONE
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._complete:
            return
        conn = self._conn
        if self._framing == _LENGTH:
            while self._left > 0:
                if not conn.buffer:
                    if conn.eof:
                        raise httpx.RemoteProtocolError(
                            f"body ended {self._left} bytes before its Content-Length")
                    await conn.receive(self._read_timeout)
                    continue
                chunk = conn.take(self._left)
                self._left -= len(chunk)
                yield chunk
            self._complete = True
        elif self._framing == _UNTIL_CLOSE:
            while True:
                if conn.buffer:
                    yield conn.take(len(conn.buffer))
                elif conn.eof:
                    break
                else:
                    await conn.receive(self._read_timeout)
            self._complete = True
        else:
            async for chunk in self._chunks():
                yield chunk
            self._complete = True

    async def _line(self) -> bytes:
        """One CRLF- (or LF-) terminated line of a chunked body, without its end."""
        conn = self._conn
        while True:
            end = conn.buffer.find(b"\n")
            if end >= 0:
                line = conn.take(end + 1)
                return line[:-2] if line.endswith(b"\r\n") else line[:-1]
            if len(conn.buffer) > MAX_LINE_BYTES:
                raise httpx.RemoteProtocolError("chunked body: line too long")
            if conn.eof:
                raise httpx.RemoteProtocolError("chunked body ended early")
            await conn.receive(self._read_timeout)

    async def _chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            size_line = (await self._line()).split(b";", 1)[0].strip(b" \t")
            if not _HEX.fullmatch(size_line):
                raise httpx.RemoteProtocolError("chunked body: invalid chunk size")
            self._left = int(size_line, 16)
            if self._left == 0:
                while await self._line():  # trailers, up to the empty line
                    pass
                return
            while self._left > 0:
                if not conn.buffer:
                    if conn.eof:
                        raise httpx.RemoteProtocolError("chunked body ended early")
                    await conn.receive(self._read_timeout)
                    continue
                chunk = conn.take(self._left)
                self._left -= len(chunk)
                yield chunk
            if await self._line():
                raise httpx.RemoteProtocolError("chunked body: data longer than its size")

    def skip_buffered(self) -> bool:
        """Consume the body if all of it has already arrived; True when it has.

        Never waits: a body still on its way (or chunked) is left to be read
        or closed as usual. A caller that does not want the body (a 2xx) calls
        this before :meth:`aclose`, so the connection is reused without the
        cost of iterating, or of a timer for a read that cannot block.
        """
        if self._complete:
            return True
        buffered = len(self._conn.buffer)
        if self._framing == _LENGTH and buffered >= self._left and not self._released:
            self._conn.take(self._left)
            self._left = 0
            self._complete = True
        return self._complete

    async def aclose(self) -> None:
        """Give the connection back (read to its end, reusable) or close it."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        reuse = self._complete and self._keep_alive and conn.usable
        self._pool._release(self._key, conn, reuse)


class Http11Transport(httpx.AsyncBaseTransport):
    """HTTP/1.1 for httpx over asyncio (see the module doc for what it does and raises).

    Args:
        tls: the TLS client context for ``https`` URLs (see
            :func:`receipts.delivery.tls_context`); None refuses ``https``.
        max_connections: most exchanges at once (≥ 1), and so most open connections.
        keepalive_seconds: an idle connection older than this is closed, not reused
            (below the 5 s idle timeout common in servers such as Node's, so a
            connection is not reused just as the server closes it).
        connect_timeout_seconds: used when a request carries no ``connect`` timeout.
    """

    def __init__(self, *, tls: ssl.SSLContext | None = None, max_connections: int = 100,
                 keepalive_seconds: float = 4.0,
                 connect_timeout_seconds: float | None = 5.0) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._tls = tls
        # Free exchange slots, and the exchanges waiting for one (first come, first
        # served). Not asyncio.Semaphore: its locked() builds a generator per call.
        self._free = max_connections
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._max_idle = max_connections
        self._keepalive = keepalive_seconds
        self._connect_timeout = connect_timeout_seconds
        self._idle: dict[tuple[bytes, bytes, int], deque[_Connection]] = {}
        self._closed = False

    @property
    def idle_connections(self) -> int:
        """Idle keep-alive connections held now (all origins)."""
        return sum(len(d) for d in self._idle.values())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send *request* and return its response once the head has arrived.

        The body streams from ``response.stream``; closing the response gives
        the connection back. Raises the httpx exceptions of the module doc.
        """
        if self._closed:
            raise RuntimeError("the transport is closed")
        url = request.url
        scheme = url.raw_scheme
        if scheme == b"https":
            default_port = 443
        elif scheme == b"http":
            default_port = 80
        else:
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {url.scheme!r}")
        key = (scheme, url.raw_host, url.port or default_port)
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        body = request.read() if isinstance(request.stream, httpx.ByteStream) else (
            await request.aread())
        head = _request_head(request, body)
        await self._acquire(timeouts.get("pool"))
        conn: _Connection | None = None
        try:
            conn = self._reuse(key)
            if conn is None:
                conn = await self._connect(key, timeouts.get("connect", self._connect_timeout))
            assert conn.transport is not None
            conn.transport.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.transport.write(body)
            response = await self._read_response(request, key, conn, timeouts.get("read"))
        except BaseException:
            if conn is not None:
                conn.close()
            self._release_slot()
            raise
        return response

    async def _acquire(self, timeout_seconds: float | None) -> None:
        """Take an exchange slot, waiting at most *timeout_seconds* (``httpx.PoolTimeout``)."""
        if self._free > 0:
            self._free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_seconds):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._release_slot()  # handed over just as we gave up: pass it on
            else:
                waiter.cancel()
            if isinstance(exc, TimeoutError):
                raise httpx.PoolTimeout("no connection slot within the pool timeout") from None
            raise

    def _release_slot(self) -> None:
        """Hand a slot to the first live waiter, or put it back."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1

    def _reuse(self, key: tuple[bytes, bytes, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable and now - conn.idle_since <= self._keepalive:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[bytes, bytes, int],
                       timeout_seconds: float | None) -> _Connection:
        scheme, raw_host, port = key
        host = raw_host.decode("ascii")
        tls = None
        if scheme == b"https":
            if self._tls is None:
                raise httpx.ConnectError("https needs a TLS context")
            tls = self._tls
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_seconds):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), host, port, ssl=tls,
                    server_hostname=host if tls is not None else None)
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"no connection within {timeout_seconds:g}s") from None
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise httpx.ConnectError(_describe(exc)) from exc
        return conn

    async def _read_response(self, request: httpx.Request, key: tuple[bytes, bytes, int],
                             conn: _Connection, read_timeout: float | None) -> httpx.Response:
        for _ in range(MAX_INTERIM + 1):
            status, version, reason, headers = await _read_head(conn, read_timeout)
            if 100 <= status < 200 and status != 101:
                continue  # interim answer: the final one follows
            break
        else:
            raise httpx.RemoteProtocolError("too many interim (1xx) answers")
        keep_alive = version == 1
        framing, length = _NONE, 0
        content_length: bytes | None = None
        chunked = False
        transfer_encoding = False
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                if content_length is not None and value != content_length:
                    raise httpx.RemoteProtocolError("conflicting Content-Length headers")
                content_length = value
            elif lower == b"transfer-encoding":
                transfer_encoding = True
                chunked = value.rsplit(b",", 1)[-1].strip(b" \t").lower() == b"chunked"
            elif lower == b"connection":
                tokens = {t.strip(b" \t").lower() for t in value.split(b",")}
                if b"close" in tokens:
                    keep_alive = False
                elif b"keep-alive" in tokens and version == 0:
                    keep_alive = True
        if status == 101:
            keep_alive = False
        elif request.method == "HEAD" or status in (204, 304):
            pass
        elif transfer_encoding:
            if chunked:
                framing = _CHUNKED
            else:
                framing, keep_alive = _UNTIL_CLOSE, False
            if content_length is not None:
                keep_alive = False  # RFC 9112 §6.3: never reuse after such an answer
        elif content_length is not None:
            if b"," in content_length:
                values = {v.strip(b" \t") for v in content_length.split(b",")}
                if len(values) != 1:
                    raise httpx.RemoteProtocolError("conflicting Content-Length values")
                content_length = values.pop()
            if not _DIGITS.fullmatch(content_length):
                raise httpx.RemoteProtocolError("invalid Content-Length")
            length = int(content_length)
            framing = _LENGTH if length else _NONE
        else:
            framing, keep_alive = _UNTIL_CLOSE, False
        stream = ResponseBody(self, key, conn, framing, length, keep_alive, read_timeout)
        return httpx.Response(
            status, headers=headers, stream=stream, request=request,
            extensions={"http_version": b"HTTP/1.1" if version else b"HTTP/1.0",
                        "reason_phrase": reason},
        )

    def _release(self, key: tuple[bytes, bytes, int], conn: _Connection, reuse: bool) -> None:
        self._release_slot()
        if reuse and not self._closed:
            idle = self._idle.setdefault(key, deque())
            if len(idle) < self._max_idle:
                conn.idle_since = time.monotonic()
                idle.append(conn)
                return
        conn.close()

    async def aclose(self) -> None:
        """Close every idle connection; connections in use close when their response does."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()


def _request_head(request: httpx.Request, body: bytes) -> bytes:
    """The request line and headers, validated (no CR, LF or NUL; names are tokens).

    The body is always sent whole with its own ``Content-Length`` (a
    ``Transfer-Encoding`` or ``Content-Length`` of the request is replaced).
    """
    url = request.url
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), url.raw_path)]
    has_host = False
    for name, value in request.headers.raw:
        if not _is_token(name):
            raise httpx.LocalProtocolError(f"invalid header name {name!r}")
        lower = name.lower()
        if lower == b"content-length" or lower == b"transfer-encoding":
            continue
        if lower == b"host":
            has_host = True
        lines.append(b"%s: %s" % (name, value))
    if not has_host:
        lines.insert(1, b"Host: " + url.netloc)
    if body or request.method not in ("GET", "HEAD", "OPTIONS", "DELETE"):
        lines.append(b"Content-Length: %d" % len(body))
    lines.append(b"\r\n")
    head = b"\r\n".join(lines)
    # Every CR and LF must be ours: a value carrying one would inject a header.
    if head.count(b"\n") != len(lines) or head.count(b"\r") != len(lines) or b"\0" in head:
        raise httpx.LocalProtocolError("a header contains CR, LF or NUL")
    return head


async def _read_head(conn: _Connection, read_timeout: float | None
                     ) -> tuple[int, int, bytes, list[tuple[bytes, bytes]]]:
    """Read one response head: (status, minor version, reason, raw headers)."""
    start = 0
    while True:
        match = _HEAD_END.search(conn.buffer, start)
        if match is not None:
            break
        if len(conn.buffer) > MAX_HEAD_BYTES:
            raise httpx.RemoteProtocolError("response head too large")
        if conn.eof:
            if conn.buffer:
                raise httpx.RemoteProtocolError("incomplete response head")
            if conn.error is not None:
                raise httpx.ReadError(_describe(conn.error))
            raise httpx.RemoteProtocolError("server disconnected without sending a response")
        start = max(0, len(conn.buffer) - 4)
        await conn.receive(read_timeout)
    if match.start() > MAX_HEAD_BYTES:
        raise httpx.RemoteProtocolError("response head too large")
    head = conn.take(match.end())[: match.start()]
    lines = _LINE_END.split(head)
    status_line = _STATUS_LINE.fullmatch(lines[0])
    if status_line is None:
        raise httpx.RemoteProtocolError(f"invalid status line {lines[0][:80]!r}")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):  # obsolete line folding: part of the previous value
            if not headers:
                raise httpx.RemoteProtocolError("response head starts with a folded line")
            name, value = headers[-1]
            headers[-1] = (name, value + b" " + line.strip(b" \t"))
            continue
        name, sep, value = line.partition(b":")
        if not sep or not _is_token(name):
            raise httpx.RemoteProtocolError(f"invalid header line {line[:80]!r}")
        headers.append((name, value.strip(b" \t")))
    return (int(status_line[2]), int(status_line[1]), status_line[3] or b"", headers)

