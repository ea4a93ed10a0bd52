"""The deliverer's wire: one door (:class:`Transport`), two clients behind it.

A transport's one door is :meth:`Transport.sender`: it binds a URL and its
timeouts once, and returns a :data:`Send`, a callable taking method, header
pairs and body and returning an :class:`Answer` once the answer's head has
arrived. No per-request objects of ours beyond that (the seam is thin
because each layer costs CPU per delivery, bench/README.md). Two clients
stand behind it, chosen by ``RECEIPTS_PROVIDER_TRANSPORT`` (:func:`make_transport`):

* ``aiohttp`` (:class:`AiohttpTransport`, the default): aiohttp's client, a
  maintained client with llhttp (a C parser), at the lowest CPU per delivery
  the bench measured;
* ``httpx`` (:class:`HttpxTransport`): httpx's own transport (httpcore + h11),
  the client this service was first specified with.

The library does the protocol: framing, keep-alive pooling, TLS (the caller's
``ssl.SSLContext``: private CA, client certificate, SNI and host name
checks), proxies (``CONNECT`` for ``https``), response-head limits and read
flow control. This module only translates, and, for aiohttp, decides two
things aiohttp leaves open (docs/design.md, "The HTTP path"):

* **What was sent.** Anything raised while getting a connection (aiohttp's
  ``connect()``, observed by :class:`_Connector`) means nothing reached the
  provider; every later failure may follow a request it acted on.
* **When to send again.** A *reused* keep-alive connection that closes,
  resets or cannot be written before any byte of the answer arrives (the
  server dropped it while it sat in the pool) has the request sent once more
  on a fresh connection; :attr:`AiohttpTransport.stale_retries` counts them.

How it fails: every transport raises this module's own three exceptions
(subclasses of :class:`TransportError`), whichever client is behind the door;
:mod:`receipts.delivery` maps each once to the outcome's reason.

=====================================================  ===========================
what happened                                          raised
=====================================================  ===========================
refused, DNS, TLS or certificate failure, a proxy      :class:`NothingSent`
that failed or refused the ``CONNECT`` tunnel, no
connection within the ``connect``/``pool`` timeout, a
header name that is no token or a value with control
characters, a scheme other than http/https
closed or reset after the request was written, a       :class:`ConnectionLost`
malformed or oversized head, a body cut short
no bytes within the ``read`` timeout                   :class:`AnswerTimeout`
=====================================================  ===========================

Timeouts are given to :meth:`Transport.sender` as a mapping (``connect``,
``read``, ``pool``; seconds, None for none), converted once; callers that
need one deadline for the whole exchange wrap the call and the body read in
a deadline (``asyncio.timeout``, :mod:`receipts.deadlines`): cancellation at
any point closes the connection.
"""

from __future__ import annotations

import contextvars
import functools
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import aiohttp
import httpx
from yarl import URL

#: ``RECEIPTS_PROVIDER_TRANSPORT``'s choices (:func:`make_transport`).
TransportName = Literal["aiohttp", "httpx"]
DEFAULT_TRANSPORT: TransportName = "aiohttp"


class TransportError(Exception):
    """An exchange that produced no answer; always one of the three subclasses below.

    ``str()`` says what failed, often as the client's exception type and
    message (it may quote a proxy URL: callers mask credentials before
    logging it); ``__cause__`` is the client's own exception.
    """


class NothingSent(TransportError):
    """No byte of the request reached the provider (no connection, a refused
    proxy tunnel, a request refused before writing): safe to send again."""


class ConnectionLost(TransportError):
    """The connection failed after the request was written, or the answer was
    broken: the provider may have acted on the request (outcome unknown)."""


class AnswerTimeout(TransportError):
    """No byte of the answer within the ``read`` timeout after the request was
    written: the provider may have acted on it (outcome unknown)."""


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

        Raises the exceptions of the module doc (a body cut short:
        :class:`ConnectionLost`); what arrived before stays in *buffer*.
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


class Transport(Protocol):
    """The deliverer's one door onto the wire (module doc: what it raises)."""

    def sender(self, url: str, timeouts: Mapping[str, float | None] | None = None) -> Send:
        """A :data:`Send` for *url* (``http``/``https``, percent-encoded) with *timeouts*
        (``connect``, ``read``, ``pool``; seconds, None for none; None: the
        transport's own). Each call sends one request with the given header
        pairs (names: valid tokens) and body, and returns its :class:`Answer`
        once the head has arrived."""
        ...

    async def aclose(self) -> None:
        """Close every connection."""
        ...


class AiohttpTransport:
    """A :class:`Transport` over aiohttp's client (module doc: what it raises).

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
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
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
        """A :data:`Send` for *url* (``http``/``https``, percent-encoded), without
        per-request objects of ours beyond the answer.

        *timeouts*: ``connect``, ``read``, ``pool`` (seconds, None for none),
        converted once to aiohttp's. Each call sends one
        request and returns its :class:`Answer` once the head has arrived;
        header names must be valid tokens (the caller's constants: not checked
        per request), values are checked by aiohttp. Raises the exceptions of
        the module doc.
        """
        # A partial, not a closure: no extra coroutine frame per request.
        return functools.partial(self._send, URL(url, encoded=True),
                                 _client_timeout(timeouts, self._default_timeout))

    async def _send(self, url: URL, timeout: aiohttp.ClientTimeout, method: str,
                    headers: Headers, body: bytes) -> AiohttpAnswer:
        """One request through aiohttp's session, resent once on a fresh connection when a
        reused one died before its answer (module doc); aiohttp's errors as this module's."""
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
    """aiohttp's timeouts for a sender's *timeouts* (seconds, None: no limit):
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


def _translate(exc: BaseException) -> TransportError:
    """This module's exception for an aiohttp failure (the module doc's table)."""
    if isinstance(exc, _NotConnected):
        cause = exc.__cause__
        if isinstance(cause, aiohttp.ClientHttpProxyError):
            return NothingSent(f"proxy refused the tunnel: {cause.status} {cause.message}")
        return NothingSent(_describe(cause or exc))
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return NothingSent("no connection within the connect timeout")
    if isinstance(exc, TimeoutError):  # aiohttp's read timeouts subclass it
        return AnswerTimeout(_describe(exc))
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        if isinstance(exc.message, str):
            return ConnectionLost("server disconnected without sending a response")
        return ConnectionLost("server disconnected during the response head")
    if isinstance(exc, aiohttp.ClientResponseError):  # a head the parser refused
        return ConnectionLost(f"invalid response: {exc.message}")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return ConnectionLost(_describe(exc))
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return NothingSent(_describe(exc))
    if isinstance(exc, ValueError):  # a header aiohttp refuses to write (control characters)
        return NothingSent(_describe(exc))
    return ConnectionLost(_describe(exc))


# ------------------------------------------------------------------ httpx


class HttpxAnswer:
    """An :class:`Answer` over an ``httpx.Response`` from httpx's transport."""

    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status: int = response.status_code
        self.headers: HeaderLookup = response.headers

    def complete(self) -> bool:
        """False: httpcore does not say whether a body has wholly arrived (the
        deliverer then reads it, briefly, so the connection can be reused)."""
        return False

    async def read_into(self, buffer: bytearray, limit: int) -> None:
        """Append the raw body (no decoding) to *buffer* until its end or *limit* bytes."""
        stream = self._response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        try:
            async for chunk in stream:
                buffer += chunk
                if len(buffer) >= limit:
                    return
        except httpx.TransportError as exc:
            raise _translate_httpx(exc) from exc

    async def release(self) -> None:
        """Close the response (httpcore keeps its connection when the body was read)."""
        await self._response.aclose()


class HttpxTransport:
    """A :class:`Transport` over httpx's own transport (httpcore + h11).

    ``RECEIPTS_PROVIDER_TRANSPORT=httpx``. Same arguments as
    :class:`AiohttpTransport`; httpcore keeps idle connections for
    ``keepalive_seconds`` and does not resend a request whose reused
    connection died (such a failure is :class:`ConnectionLost`, retried
    through the backoff with the same idempotency key). Costs more CPU per
    delivery than aiohttp (bench/README.md).
    """

    def __init__(self, *, tls: ssl.SSLContext | None = None, max_connections: int = 100,
                 keepalive_seconds: float = KEEPALIVE_SECONDS,
                 connect_timeout_seconds: float | None = 5.0,
                 proxy: str | None = None) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._connect = connect_timeout_seconds
        self._transport = httpx.AsyncHTTPTransport(
            verify=tls if tls is not None else True, trust_env=False,
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections,
                                keepalive_expiry=keepalive_seconds),
            proxy=httpx.Proxy(proxy) if proxy else None)

    def sender(self, url: str, timeouts: Mapping[str, float | None] | None = None) -> Send:
        """A :data:`Send` for *url* (see :meth:`Transport.sender`): each call builds
        one ``httpx.Request`` (``Host`` from *url*, values as UTF-8 bytes,
        ``Content-Length`` from the body). Raises the exceptions of the module doc."""
        target = httpx.URL(url)
        host = (b"Host", target.netloc)
        chosen = {"connect": self._connect, "read": None, "write": None, "pool": None}
        chosen.update(timeouts or {})
        extensions = {"timeout": chosen}
        transport = self._transport

        async def send(method: str, headers: Headers, body: bytes) -> Answer:
            try:
                raw = [host, *((name.encode("ascii"), value.encode("utf-8", "surrogateescape"))
                               for name, value in headers)]
                raw.append((b"Content-Length", b"%d" % len(body)))
                request = httpx.Request(method, target, headers=raw,
                                        stream=httpx.ByteStream(body), extensions=extensions)
                return HttpxAnswer(await transport.handle_async_request(request))
            except (httpx.TransportError, httpx.InvalidURL, UnicodeEncodeError) as exc:
                raise _translate_httpx(exc) from exc
        return send

    async def aclose(self) -> None:
        """Close every connection."""
        await self._transport.aclose()


#: httpx's failures that happen before any byte of the request reached the provider.
_HTTPX_NOTHING_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout,
                       httpx.ProxyError, httpx.UnsupportedProtocol, httpx.LocalProtocolError,
                       httpx.InvalidURL, UnicodeEncodeError)


def _translate_httpx(exc: Exception) -> TransportError:
    """This module's exception for an httpx failure (the module doc's table)."""
    if isinstance(exc, _HTTPX_NOTHING_SENT):
        return NothingSent(_describe(exc))
    if isinstance(exc, httpx.TimeoutException):  # ReadTimeout, WriteTimeout
        return AnswerTimeout(_describe(exc))
    return ConnectionLost(_describe(exc))


def make_transport(name: TransportName = DEFAULT_TRANSPORT, *,
                   tls: ssl.SSLContext | None = None, max_connections: int = 100,
                   connect_timeout_seconds: float | None = 5.0,
                   proxy: str | None = None) -> Transport:
    """The transport ``RECEIPTS_PROVIDER_TRANSPORT`` names: ``aiohttp`` (the default,
    :class:`AiohttpTransport`) or ``httpx`` (:class:`HttpxTransport`), with the
    given TLS context, connection limit, connect timeout (seconds) and proxy URL.
    Raises ``ValueError`` for another name."""
    kinds: dict[str, type[AiohttpTransport] | type[HttpxTransport]] = {
        "aiohttp": AiohttpTransport, "httpx": HttpxTransport}
    if name not in kinds:
        raise ValueError(f"unknown transport {name!r} (one of: {', '.join(kinds)})")
    return kinds[name](tls=tls, max_connections=max_connections,
                       connect_timeout_seconds=connect_timeout_seconds, proxy=proxy)
