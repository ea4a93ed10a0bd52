"""aiohttp's client as the deliverer's wire, with httpx's exceptions and interface.

:class:`AiohttpTransport` offers two doors onto one exchange. The deliverer's
is :meth:`AiohttpTransport.sender`: method, header pairs and body in, an
:class:`Answer` out, no per-request objects of ours beyond it (the seam is
thin because each layer costs CPU per delivery, bench/README.md). The other
is httpx's: it is an ``httpx.AsyncBaseTransport`` (``httpx.Request`` in,
``httpx.Response`` out), for tests and for anything written against httpx.
Both raise httpx's exceptions. aiohttp (a maintained client with llhttp, a
C parser) does the protocol: framing, keep-alive pooling, TLS (the caller's
``ssl.SSLContext``: private CA, client certificate, SNI and host name
checks), proxies (``CONNECT`` for ``https``), response-head limits and read
flow control. This module only translates, and decides two things aiohttp
leaves open (docs/design.md, "The HTTP path"):

* **What was sent.** Anything raised while getting a connection (aiohttp's
  ``connect()``, observed by :class:`_Connector`) means nothing reached the
  provider; every later failure may follow a request it acted on.
* **When to send again.** A *reused* keep-alive connection that closes,
  resets or cannot be written before any byte of the answer arrives (the
  server dropped it while it sat in the pool) has the request sent once more
  on a fresh connection; :attr:`AiohttpTransport.stale_retries` counts them.

How it fails (each an httpx exception, so callers classify as with httpx):

=====================================================  ==============================
what happened                                          raised
=====================================================  ==============================
refused, DNS, TLS or certificate failure, a proxy      ``httpx.ConnectError``
that failed while tunnelling
a proxy that refused the ``CONNECT`` tunnel            ``httpx.ProxyError``
no connection within the ``connect``/``pool`` timeout  ``httpx.ConnectTimeout``
a header name that is no token, a value with control   ``httpx.LocalProtocolError``
characters (refused before anything is written)
closed or reset after the request was written          ``httpx.RemoteProtocolError``
                                                       / ``httpx.ReadError``
a malformed or oversized head, a body cut short        ``httpx.RemoteProtocolError``
no bytes within the ``read`` timeout                   ``httpx.ReadTimeout``
a scheme other than http/https                         ``httpx.UnsupportedProtocol``
=====================================================  ==============================

Timeouts come from the request's ``timeout`` extension (``connect``,
``read``, ``pool``; seconds, None for none), or the sender's, converted once;
callers that need one deadline for the whole exchange wrap the call and the
body read in a deadline (``asyncio.timeout``, :mod:`receipts.deadlines`):
cancellation at any point closes the connection.
"""

from __future__ import annotations

import contextvars
import functools
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import aiohttp
import httpx
from yarl import URL

_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")

#: Header names already seen to be valid tokens (bounded: callers' names only).
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


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


#: Seconds an idle keep-alive connection is kept for reuse: below the 5 s idle
#: timeout of Node, Apache and uvicorn (docs/design.md, "The HTTP path").
KEEPALIVE_SECONDS = 4.0
#: Most header fields of a response head, and most bytes of one header line
#: (aiohttp's defaults, stated here: a 72 KB head of 18 × 4 KB headers passes).
MAX_RESPONSE_HEADERS = 128
MAX_HEADER_LINE_BYTES = 8190

#: Set by :meth:`_Connector.connect` for the exchange running in this task:
#: True when the connection came from the idle pool (it served an earlier request).
_REUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("receipts_reused",
                                                                default=False)

#: Request headers the client writes itself from the body.
_FRAMING = frozenset({b"Content-Length", b"content-length", b"Transfer-Encoding",
                      b"transfer-encoding", b"CONTENT-LENGTH", b"TRANSFER-ENCODING"})


class _NotConnected(aiohttp.ClientConnectionError):
    """Raised by :meth:`_Connector.connect`: no connection, so nothing was sent.

    Its ``__cause__`` is aiohttp's own error (a refused connect, a TLS
    failure, a proxy that refused the tunnel or hung up during it).
    """


class _Connector(aiohttp.TCPConnector):
    """aiohttp's TCP connector, telling the caller whether its connection was reused.

    aiohttp's public ``connect()`` hands out a pooled or a new connection; this
    override only observes which (a connection it has handed out before, so
    marked, is a reused one: :data:`_REUSED`), and turns every failure to
    connect into :class:`_NotConnected` ("nothing sent"). A mark on the
    protocol object, not a ``WeakSet`` of them: the set cost measurably more
    per request (bench/README.md, "A maintained HTTP client").
    """

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        """aiohttp's ``connect()``; raises :class:`_NotConnected` for any failure but a
        timeout (which aiohttp reports as ``ConnectionTimeoutError``)."""
        try:
            conn = await super().connect(req, traces, timeout)
        except TimeoutError:
            raise  # aiohttp reports it as ConnectionTimeoutError
        except (aiohttp.ClientError, OSError) as exc:
            raise _NotConnected(str(exc)) from exc
        protocol: Any = conn.protocol
        _REUSED.set(getattr(protocol, "_receipts_served", False))
        protocol._receipts_served = True  # the protocol object lives as long as its socket
        return conn


class AiohttpBody(httpx.AsyncByteStream):
    """A response body read from aiohttp's stream; closing it releases the connection."""

    __slots__ = ("_response",)

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _translate(exc) from exc

    def skip_buffered(self) -> bool:
        """True when the whole body has already arrived (nothing to read or wait for).

        aiohttp gives the connection back to its pool by itself once a body is
        complete, so a caller that does not want the body (a 2xx) only closes.
        """
        return self._response.content.is_eof()

    async def aclose(self) -> None:
        """Give the connection back (body complete, reusable) or close it."""
        self._response.release()


#: Request headers for :data:`Send`: (name, value) pairs, in order.
Headers = Sequence[tuple[str, str]]


class HeaderLookup(Protocol):
    """Case-insensitive access to an answer's headers (aiohttp's and httpx's both are)."""

    def get(self, name: str, /) -> str | None:
        """The first value of the header *name*, or None."""
        ...


class Answer(Protocol):
    """A provider's answer as the deliverer reads it: the head has arrived, the body may not.

    Attributes:
        status: the HTTP status code.
        headers: the answer's headers (:class:`HeaderLookup`).
    """

    status: int
    headers: HeaderLookup

    def complete(self) -> bool:
        """True when the whole body has already arrived (nothing to read or wait for)."""
        ...

    async def read_into(self, buffer: bytearray, limit: int) -> None:
        """Append the body to *buffer* until it ends or *buffer* holds *limit* bytes.

        Raises the httpx exceptions of the module doc (a body cut short: a
        ``RemoteProtocolError``); what arrived before stays in *buffer*.
        """
        ...

    async def release(self) -> None:
        """Give the connection back (body complete, reusable) or close it."""
        ...


#: Sends one request (method, headers, body) to a fixed URL; returns its :class:`Answer`.
Send = Callable[[str, Headers, bytes], Awaitable[Answer]]


class AiohttpAnswer:
    """An :class:`Answer` over aiohttp's response (its headers: a case-insensitive multidict)."""

    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status: int = response.status
        self.headers: HeaderLookup = response.headers

    def complete(self) -> bool:
        """True when the whole body has arrived (aiohttp then gives the connection back
        to its pool by itself; :meth:`release` only marks the answer done)."""
        return self._response.content.is_eof()

    async def read_into(self, buffer: bytearray, limit: int) -> None:
        """Append the body to *buffer* until its end or *limit* bytes."""
        content = self._response.content
        try:
            while len(buffer) < limit:
                chunk = await content.readany()
                if not chunk:
                    return
                buffer += chunk
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _translate(exc) from exc

    async def release(self) -> None:
        """Give the connection back (body complete, reusable) or close it."""
        self._response.release()


class HttpxAnswer:
    """An :class:`Answer` over an ``httpx.Response`` from any httpx transport."""

    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status: int = response.status_code
        self.headers: HeaderLookup = response.headers

    def complete(self) -> bool:
        """True when the transport's stream says its body has wholly arrived
        (a stream with a ``skip_buffered()`` method, such as :class:`AiohttpBody`)."""
        skip = getattr(self._response.stream, "skip_buffered", None)
        return bool(skip is not None and skip())

    async def read_into(self, buffer: bytearray, limit: int) -> None:
        """Append the raw body (no decoding) to *buffer* until its end or *limit* bytes."""
        stream = self._response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        async for chunk in stream:
            buffer += chunk
            if len(buffer) >= limit:
                return

    async def release(self) -> None:
        """Close the response (the transport decides whether its connection is kept)."""
        await self._response.aclose()


def httpx_sender(transport: httpx.AsyncBaseTransport, url: str,
                 timeouts: Mapping[str, float | None] | None = None) -> Send:
    """A :data:`Send` for *url* over any httpx transport (httpx's own, for comparisons):
    each call builds an ``httpx.Request`` (``Host`` from *url* first, values as UTF-8
    bytes, ``Content-Length`` from the body) with *timeouts* as its ``timeout``
    extension."""
    target = httpx.URL(url)
    host = (b"Host", target.netloc)
    extensions = {"timeout": dict(timeouts)} if timeouts is not None else {}

    async def send(method: str, headers: Headers, body: bytes) -> Answer:
        raw = [host, *((name.encode("ascii"), value.encode("utf-8", "surrogateescape"))
                       for name, value in headers)]
        raw.append((b"Content-Length", b"%d" % len(body)))
        request = httpx.Request(method, target, headers=raw, stream=httpx.ByteStream(body),
                                extensions=extensions)
        return HttpxAnswer(await transport.handle_async_request(request))
    return send


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx's transport interface over aiohttp's client (module doc: what it raises).

    Args:
        tls: the TLS client context for ``https`` URLs (private CA, client
            certificate; see :func:`receipts.delivery.tls_context`); None: the
            default verifying context.
        max_connections: most connections in use at once (≥ 1).
        keepalive_seconds: an idle connection older than this is closed.
        connect_timeout_seconds: most seconds to connect (TCP, proxy tunnel, TLS).
        proxy: ``http://[user:password@]host:port`` of an HTTP proxy, or None.

    Attributes:
        stale_retries: requests sent again on a fresh connection because the
            reused one they went out on died before any byte of the answer.
    """

    def __init__(self, *, tls: ssl.SSLContext | None = None, max_connections: int = 100,
                 keepalive_seconds: float = KEEPALIVE_SECONDS,
                 connect_timeout_seconds: float | None = 5.0,
                 proxy: str | None = None) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._tls = tls
        self._max_connections = max_connections
        self._keepalive = keepalive_seconds
        self._default_timeout = aiohttp.ClientTimeout(total=None, connect=None,
                                                      sock_connect=connect_timeout_seconds,
                                                      sock_read=None)
        self._timeout = self._default_timeout
        self._proxy = proxy
        self._timeouts_key: object = None
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self._url_key: str = ""
        self._url: URL = URL()
        #: Requests sent again on a fresh connection after a reused one failed.
        self.stale_retries = 0

    def _new_session(self, *, fresh: bool) -> aiohttp.ClientSession:
        connector = _Connector(
            limit=self._max_connections, limit_per_host=0,
            ssl=self._tls if self._tls is not None else True,
            **({"force_close": True} if fresh else {"keepalive_timeout": self._keepalive}))
        return aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(), timeout=self._default_timeout,
            auto_decompress=False, trust_env=False, skip_auto_headers=("Accept-Encoding",),
            proxy=self._proxy, max_line_size=MAX_HEADER_LINE_BYTES,
            max_field_size=MAX_HEADER_LINE_BYTES, max_headers=MAX_RESPONSE_HEADERS)

    def sender(self, url: str, timeouts: Mapping[str, float | None] | None = None) -> Send:
        """A :data:`Send` for *url* (``http``/``https``, percent-encoded as httpx gives it):
        the deliverer's path, without httpx's request and response objects.

        *timeouts* as httpx's ``timeout`` extension (``connect``, ``read``,
        ``pool``; seconds, None for none), converted once. Each call sends one
        request and returns its :class:`Answer` once the head has arrived;
        header names must be valid tokens (the caller's constants: not checked
        per request), values are checked by aiohttp. Raises the httpx
        exceptions of the module doc.
        """
        # A partial, not a closure: no extra coroutine frame per request.
        return functools.partial(self._send, URL(url, encoded=True),
                                 _client_timeout(timeouts, self._default_timeout))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send *request*; return its response once the head has arrived.

        The body streams from ``response.stream`` (an :class:`AiohttpBody`);
        closing the response gives the connection back. Raises the httpx
        exceptions of the module doc (``LocalProtocolError`` for a header name
        that is no token).
        """
        raw_url = str(request.url)
        if raw_url != self._url_key:
            self._url = URL(raw_url, encoded=True)
            self._url_key = raw_url
        headers = []
        for name, value in request.headers.raw:
            if name in _FRAMING:
                continue  # aiohttp frames the body itself (one Content-Length)
            if not _is_token(name):
                raise httpx.LocalProtocolError(f"invalid header name {name!r}")
            headers.append((name.decode("ascii"), value.decode("utf-8", "surrogateescape")))
        body = request.read() if isinstance(request.stream, httpx.ByteStream) else (
            await request.aread())
        timeouts = request.extensions.get("timeout")
        if timeouts is not self._timeouts_key:  # callers pass one dict every time
            self._timeouts_key = timeouts
            self._timeout = _client_timeout(timeouts, self._default_timeout)
        response = (await self._send(self._url, self._timeout, request.method, headers,
                                     body))._response
        return httpx.Response(
            response.status, headers=response.raw_headers, stream=AiohttpBody(response),
            request=request,
            extensions={"http_version": b"HTTP/1.1",
                        "reason_phrase": (response.reason or "").encode("latin-1", "replace")},
        )

    async def _send(self, url: URL, timeout: aiohttp.ClientTimeout, method: str,
                    headers: Headers, body: bytes) -> AiohttpAnswer:
        """One request through aiohttp's session, resent once on a fresh connection when a
        reused one died before its answer (module doc); aiohttp's errors as httpx's."""
        session = self._session
        if session is None:
            session = self._session = self._new_session(fresh=False)
        _REUSED.set(False)
        try:
            try:
                return AiohttpAnswer(await session.request(
                    method, url, data=body, headers=headers, allow_redirects=False,
                    timeout=timeout))
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    aiohttp.ClientConnectionResetError) as exc:
                if not (_REUSED.get() and _stale(exc)):
                    raise
                self.stale_retries += 1
                fresh = self._fresh
                if fresh is None:
                    fresh = self._fresh = self._new_session(fresh=True)
                return AiohttpAnswer(await fresh.request(
                    method, url, data=body, headers=headers, allow_redirects=False,
                    timeout=timeout))
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise _translate(exc) from exc

    async def aclose(self) -> None:
        """Close every connection."""
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None


def _client_timeout(timeouts: Any, default: aiohttp.ClientTimeout) -> aiohttp.ClientTimeout:
    """aiohttp's timeouts for httpx's ``timeout`` extension (seconds, None: no limit):
    ``connect`` → ``sock_connect`` (TCP, tunnel, TLS), ``read`` → ``sock_read``
    (between bytes), ``pool`` → ``connect`` (waiting for a connection slot plus
    connecting, aiohttp's nearest). No extension: *default*."""
    if not isinstance(timeouts, dict):
        return default
    return aiohttp.ClientTimeout(total=None, connect=timeouts.get("pool"),
                                 sock_connect=timeouts.get("connect", default.sock_connect),
                                 sock_read=timeouts.get("read"))


def _stale(exc: BaseException) -> bool:
    """True for a failure of a reused connection before its answer's head: closed by
    the server (EOF without a partial head), reset, or unwritable (aiohttp reports a
    write to a connection already closed as ``ClientOSError`` without an errno)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return isinstance(exc.message, str)  # a partial head comes as a message object
    return isinstance(exc, aiohttp.ClientOSError | aiohttp.ClientConnectionResetError)


def _translate(exc: BaseException) -> httpx.TransportError:
    """The httpx exception for an aiohttp failure (the module doc's table)."""
    if isinstance(exc, _NotConnected):
        cause = exc.__cause__
        if isinstance(cause, aiohttp.ClientHttpProxyError):
            return httpx.ProxyError(f"proxy refused the tunnel: {cause.status} {cause.message}")
        return httpx.ConnectError(_describe(cause or exc))
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout("no connection within the connect timeout")
    if isinstance(exc, TimeoutError):  # aiohttp's read timeouts subclass it
        return httpx.ReadTimeout(_describe(exc))
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        if isinstance(exc.message, str):
            return httpx.RemoteProtocolError("server disconnected without sending a response")
        return httpx.RemoteProtocolError("server disconnected during the response head")
    if isinstance(exc, aiohttp.ClientResponseError):  # a head the parser refused
        return httpx.RemoteProtocolError(f"invalid response: {exc.message}")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(_describe(exc))
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return httpx.UnsupportedProtocol(_describe(exc))
    if isinstance(exc, ValueError):  # a header aiohttp refuses to write (control characters)
        return httpx.LocalProtocolError(_describe(exc))
    if isinstance(exc, OSError | aiohttp.ClientConnectionError):
        return httpx.ReadError(_describe(exc))
    return httpx.RemoteProtocolError(_describe(exc))
