"""Receipt delivery over HTTP: ``deliver(job) → Outcome``; no database access.

The contract (docs/design.md §3): POST a JSON body naming the order to the provider
with ``Idempotency-Key: receipt:<order_id>``, the same on every attempt, and an
identical body on every attempt (providers may reject a reused key whose body
differs). The answer is classified:

=================================  =========  ==================================
provider answer                    verdict    reason label
=================================  =========  ==================================
2xx (incl. a replayed success)     delivered  ``delivered``
409 (same key still in progress)   retry      ``in_progress``
429                                retry      ``rate_limited`` (Retry-After)
5xx                                retry      ``provider_5xx`` (Retry-After)
401, 403, 407 (proxy credentials)  retry      ``auth_rejected`` (opens breaker)
408 (the provider timed us out)    retry      ``timeout``
other 4xx                          permanent  ``rejected`` (a verdict only on
                                              evidence: receipts.flow)
4xx whose body was cut off         retry      ``connection_lost`` / ``timeout``
1xx/3xx (we never follow)          retry      ``unexpected_status``
timeout (incl. hang after headers) retry      ``timeout`` (outcome unknown)
connection lost after sending      retry      ``connection_lost`` (unknown)
connect error, nothing sent        retry      ``connect_error``
=================================  =========  ==================================

The whole exchange, body included, is bounded by one deadline
(``delivery_timeout_seconds``, kept within ``deadlines.RESOLUTION_SECONDS``
by :class:`~receipts.deadlines.Deadlines`), and at most ``MAX_BODY_BYTES`` of
the response are read, so a slow-drip or 50 MB answer cannot hold a slot or
memory.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from collections.abc import Callable
from typing import Protocol

import certifi
import httpx

from receipts import tracing
from receipts.deadlines import Deadlines
from receipts.dsn import redact_dsn
from receipts.model import Job, Outcome, Reason, Verdict
from receipts.proxy import ProxyChoice
from receipts.retry import parse_retry_after
from receipts.transport import (
    DEFAULT_TRANSPORT,
    Answer,
    AnswerTimeout,
    ConnectionLost,
    HeaderLookup,
    NothingSent,
    Send,
    Transport,
    TransportError,
    TransportName,
    make_transport,
)

MAX_BODY_BYTES = 64 * 1024
#: Most time spent connecting (TCP and TLS), seconds (never more than the deadline).
CONNECT_SECONDS = 5.0
#: Most time spent reading a 2xx body, seconds: it is read only so that its
#: connection goes back to the pool (closing an unread response closes it).
SUCCESS_BODY_SECONDS = 0.5
USER_AGENT = "receipts-worker/0.1"
#: OpenTelemetry installed (extra ``otel``): a span per delivery, ``traceparent`` sent.
_TRACING = tracing.otel_available()


class Deliverer(Protocol):
    """Anything the worker can hand a claimed job to (HTTP, or a bench no-op)."""

    async def deliver(self, job: Job) -> Outcome:
        """Attempt *job* once and classify the result; must not raise for I/O errors."""
        ...

    async def aclose(self) -> None:
        """Release connections; called once when the worker stops."""
        ...


def delivered(status: int, headers: HeaderLookup) -> Outcome:
    """The outcome of a 2xx answer: delivered, and whether the provider says it replayed
    a stored answer (``Idempotent-Replayed: true``, case-insensitive)."""
    replayed = (headers.get("idempotent-replayed") or "").strip().lower() == "true"
    return Outcome(Verdict.DELIVERED, Reason.DELIVERED, status, replayed=replayed)


def classify(status: int, headers: HeaderLookup, body: bytes) -> Outcome:
    """Map an HTTP response to an :class:`Outcome` (the table in this module).

    *headers*: case-insensitive ``get`` (aiohttp's or httpx's headers).
    """
    retry_after = parse_retry_after(headers.get("retry-after"), date_header=headers.get("date"))
    retry = Verdict.RETRY
    if 200 <= status < 300:
        return delivered(status, headers)
    if status == 409:
        return Outcome(retry, Reason.IN_PROGRESS, status, retry_after, "409 request in progress")
    if status == 408:
        return Outcome(retry, Reason.TIMEOUT, status, retry_after, "408 request timeout")
    if status == 429:
        return Outcome(retry, Reason.RATE_LIMITED, status, retry_after, "429 rate limited")
    if status >= 500:
        return Outcome(retry, Reason.PROVIDER_5XX, status, retry_after, f"{status} provider error")
    if status in (401, 403, 407):  # 407: the egress proxy refused our proxy credentials
        detail = f"{status} credentials rejected"
        return Outcome(retry, Reason.AUTH_REJECTED, status, retry_after, detail)
    if 400 <= status < 500:
        detail = f"{status} {_reason(body)}"
        return Outcome(Verdict.PERMANENT, Reason.REJECTED, status, None, detail)
    return Outcome(retry, Reason.UNEXPECTED_STATUS, status, retry_after, f"unexpected {status}")


def _reason(body: bytes) -> str:
    """A short, printable reason from a 4xx body (JSON ``error``/``detail`` or text)."""
    text = body[:2048].decode("utf-8", "replace")
    try:
        data = json.loads(text)
        if isinstance(data, dict):
            text = str(data.get("error") or data.get("detail") or data.get("message") or text)
    except ValueError:
        pass
    clean = "".join(ch if ch.isprintable() else " " for ch in text).strip()
    return clean[:200] or "rejected"


def tls_context(ca_file: str | None = None, cert_file: str | None = None,
                key_file: str | None = None) -> ssl.SSLContext:
    """The TLS client context for an ``https`` provider.

    Trusts *ca_file* (PEM bundle of a private CA) when given, else the public
    CAs of ``certifi``; presents the client certificate *cert_file* (PEM,
    with its key in *key_file* or in the same file) for providers that
    require mutual TLS. Certificates and host names are always verified.
    Raises ``OSError`` for unreadable files and :class:`TLSFileError` (which
    names the file's role) for files that hold no usable PEM data.
    """
    try:
        context = ssl.create_default_context(cafile=ca_file or certifi.where())
    except ssl.SSLError as exc:
        raise TLSFileError("ca_file", f"no usable PEM certificate ({exc.reason})") from exc
    if cert_file:
        try:
            context.load_cert_chain(cert_file, key_file)
        except ssl.SSLError as exc:
            raise TLSFileError("client_cert", "no usable PEM certificate and key"
                               f" ({exc.reason})") from exc
    return context


class TLSFileError(ValueError):
    """A TLS file that was read but is not usable; *role* is ``ca_file`` or
    ``client_cert`` (the certificate and key files)."""

    def __init__(self, role: str, message: str) -> None:
        super().__init__(message)
        self.role = role


class HttpDeliverer:
    """Deliver receipts over HTTP through a :class:`~receipts.transport.Transport`.

    Each delivery sends one request through the transport's one door, a
    :data:`~receipts.transport.Send`: method, header pairs and body in, an
    :class:`~receipts.transport.Answer` out, failures as the transport's three
    exceptions, each mapped once to a reason (:data:`FAILURE_REASONS`), and
    answers classified by the table of this module. The transport is aiohttp's
    client by default, or httpx's (``RECEIPTS_PROVIDER_TRANSPORT``; the
    :mod:`receipts.transport` module doc says how each fails).
    ``httpx.AsyncClient`` is not used: its per-request machinery (auth flow,
    redirects, cookies, event hooks) costs CPU and does nothing this contract
    wants (redirects are never followed, cookies never kept; the proxy is
    chosen once, at start).

    The request: ``POST`` to *url* with ``Host``, ``User-Agent``, ``Accept:
    */*``, ``Content-Type: application/json``, ``Authorization`` (``Bearer``
    *token*; without a token, ``Basic`` from the URL's userinfo, as httpx
    did), ``Idempotency-Key`` (UTF-8), ``X-Receipts-Attempt`` and
    ``Content-Length``; no ``Accept-Encoding``, so answers arrive
    uncompressed and a failure's reason is readable.

    Args:
        url: the provider endpoint (POST), ``http`` or ``https``.
        timeout_seconds: deadline for the whole exchange, body included, seconds.
        token: bearer token for ``Authorization``, or None.
        max_connections: most exchanges (and connections) at once (normally the slot count).
        tls: the TLS context for an ``https`` provider (see :func:`tls_context`;
            default: the public CAs).
        transport: the name of the transport to build (``aiohttp``, the default,
            or ``httpx``: :func:`~receipts.transport.make_transport`), or a
            :class:`~receipts.transport.Transport` of the caller's (then *tls*
            and *proxy* are the caller's business).
        proxy: the egress proxy (:func:`receipts.proxy.choose_proxy`, or its URL);
            None: a direct connection.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_seconds: float,
        token: str | None = None,
        max_connections: int = 100,
        tls: ssl.SSLContext | None = None,
        transport: Transport | TransportName = DEFAULT_TRANSPORT,
        proxy: ProxyChoice | str | None = None,
    ) -> None:
        self.url = url
        self.timeout_seconds = timeout_seconds
        self.proxy = proxy if isinstance(proxy, ProxyChoice) else ProxyChoice(proxy, "argument")
        given = httpx.URL(url)
        # Credentials in the URL become the Authorization header below; the URL
        # the client sees carries none (nor a fragment, never sent).
        target = given.copy_with(userinfo=b"", fragment=None)
        connect = min(CONNECT_SECONDS, timeout_seconds)
        if isinstance(transport, str):
            if tls is None and target.scheme == "https":
                tls = tls_context()  # loads the CA bundle (costs CPU): only when needed
            transport = make_transport(transport, tls=tls,
                                       max_connections=max(1, max_connections),
                                       connect_timeout_seconds=connect, proxy=self.proxy.url)
        self._transport = transport
        # The outer deadline bounds every phase; connect and pool keep their own.
        timeouts = {"connect": connect, "read": None, "write": None, "pool": timeout_seconds}
        self._send: Send = transport.sender(str(target), timeouts)
        # Host is the client's to write (from the URL; the origin's behind a proxy).
        headers = [
            ("User-Agent", USER_AGENT),
            ("Accept", "*/*"),
            ("Content-Type", "application/json"),
        ]
        if token:
            headers.append(("Authorization", "Bearer " + token))
        elif given.userinfo:
            userpass = f"{given.username}:{given.password}".encode()
            headers.append(("Authorization", "Basic " + base64.b64encode(userpass).decode()))
        self._headers = headers
        self._secrets = self.proxy.secrets()
        # One timer for every delivery's deadline (asyncio.timeout arms one per call).
        self._deadlines = Deadlines()
        if _TRACING:  # decided once: no extra coroutine per delivery without it
            self.deliver = self._traced_deliver  # type: ignore[method-assign]

    async def aclose(self) -> None:
        """Close the transport's connections."""
        self._deadlines.close()
        await self._transport.aclose()

    def body(self, job: Job) -> bytes:
        """The request body for *job*: compact JSON, byte-identical on every attempt."""
        # The bytes json.dumps({...}, separators=(",", ":")) gives, without its
        # per-call machinery: every string through the same C escaper.
        return b'{"order_id":%s,"job_id":"%s","idempotency_key":%s}' % (
            _quote(job.order_id).encode("ascii"), str(job.id).encode("ascii"),
            _quote(job.idempotency_key).encode("ascii"))

    def headers(self, job: Job) -> list[tuple[str, str]]:
        """The request headers for *job* (the same on every attempt but
        ``X-Receipts-Attempt``; the client adds ``Content-Length``)."""
        headers = [*self._headers, ("Idempotency-Key", job.idempotency_key),
                   ("X-Receipts-Attempt", str(job.attempt))]
        if _TRACING and (traceparent := tracing.current_traceparent()):
            headers.append(("traceparent", traceparent))
        return headers

    async def reach(self) -> int:
        """Send one ``OPTIONS`` request to the provider URL through the delivery transport
        (the TLS settings, proxy and credentials a delivery uses; no body, no
        idempotency key, so no receipt) and return the answer's HTTP status.

        For ``receipts check`` (:mod:`receipts.check`). Raises ``TimeoutError`` when no
        answer comes within the delivery timeout, and the transport's
        :class:`~receipts.transport.TransportError` when none can.
        """
        async with asyncio.timeout(self.timeout_seconds):
            answer = await self._send("OPTIONS", self._headers, b"")
            await answer.release()
        return answer.status

    def _detail(self, exc: BaseException) -> str:
        return _short(exc, self._secrets)

    async def _traced_deliver(self, job: Job) -> Outcome:
        return await tracing.traced_delivery(job, lambda: HttpDeliverer.deliver(self, job))

    async def deliver(self, job: Job) -> Outcome:
        """POST *job*'s receipt and classify the answer; never raises for I/O errors.

        With OpenTelemetry installed, the attempt runs in a ``receipts.deliver``
        span linked to the enqueuing trace, and the provider gets its
        ``traceparent`` (:mod:`receipts.tracing`).
        """
        body = self.body(job)
        headers = self.headers(job)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_seconds
        answer: Answer | None = None
        data = bytearray()
        # A failure's body cut off by a reset or the deadline: a partial reason is
        # no verdict about the order (the outcome is unknown: retry, same key).
        cut: Outcome | None = None
        try:
            # One deadline for the whole exchange; reading a 2xx body gets at most
            # SUCCESS_BODY_SECONDS of it (the answer is known from the status line).
            with self._deadlines.at(deadline) as scope:
                answer = await self._send("POST", headers, body)
                if 200 <= answer.status < 300:
                    if answer.complete():
                        # The usual small 2xx: its body came with the head.
                        return delivered(answer.status, answer.headers)
                    scope.reschedule(min(deadline, loop.time() + SUCCESS_BODY_SECONDS))
                # Read a bounded prefix: a 2xx body only so its connection is
                # reused, a failure's for its reason.
                await answer.read_into(data, MAX_BODY_BYTES)
        except TimeoutError:
            if answer is None:
                return Outcome(Verdict.RETRY, Reason.TIMEOUT, None, None,
                               f"no answer within {self.timeout_seconds:g}s")
            cut = Outcome(Verdict.RETRY, Reason.TIMEOUT, answer.status, None,
                          f"{answer.status} answer cut off: no whole body within "
                          f"{self.timeout_seconds:g}s")
        except TransportError as exc:
            # Before the head: the failure is the outcome. While reading the body:
            # the status decides, unless it would be a verdict on a partial reason
            # (a 4xx cut off by a reset or a stall: an unknown outcome, below).
            reason = FAILURE_REASONS[type(exc)]
            if answer is None:
                return Outcome(Verdict.RETRY, reason, None, None, self._detail(exc))
            cut = Outcome(Verdict.RETRY, reason, answer.status, None,
                          f"{answer.status} answer cut off: {self._detail(exc)}"[:200])
        finally:
            if answer is not None:
                await answer.release()
        assert answer is not None
        if 200 <= answer.status < 300:
            return delivered(answer.status, answer.headers)
        outcome = classify(answer.status, answer.headers, bytes(data))
        if cut is not None and outcome.verdict is Verdict.PERMANENT:
            return cut
        return outcome


#: The reason of each transport failure, mapped here once (the table of this module):
#: nothing sent is a known failure; a lost connection or a read timeout after the
#: request was written is an unknown outcome (retried with the same key).
FAILURE_REASONS: dict[type[TransportError], Reason] = {
    NothingSent: Reason.CONNECT_ERROR,
    ConnectionLost: Reason.CONNECTION_LOST,
    AnswerTimeout: Reason.TIMEOUT,
}

#: JSON string literal of a str, ASCII only (the C function ``json.dumps`` uses).
_quote: Callable[[str], str] = json.encoder.encode_basestring_ascii


def _short(exc: BaseException, secrets: list[str]) -> str:
    """``ExcType: message``, credentials masked (URL passwords and *secrets*), ≤ 200 chars."""
    text = redact_dsn(str(exc).strip()) or type(exc).__name__
    for secret in secrets:
        text = text.replace(secret, "***")
    # One printable line: a client's message may quote the server's bytes over lines.
    text = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    return f"{type(exc).__name__}: {text}"[:200]
