"""Receipt delivery over HTTP (httpx): ``deliver(job) → Outcome``; no database access.

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
401, 403                           retry      ``auth_rejected`` (opens breaker)
other 4xx                          permanent  ``rejected``
1xx/3xx (we never follow)          retry      ``unexpected_status``
timeout (incl. hang after headers) retry      ``timeout`` (outcome unknown)
connection lost after sending      retry      ``connection_lost`` (unknown)
connect error, nothing sent        retry      ``connect_error``
=================================  =========  ==================================

The whole exchange, body included, is bounded by one deadline
(``delivery_timeout_seconds``), and at most ``MAX_BODY_BYTES`` of the response
are read, so a slow-drip or 50 MB answer cannot hold a slot or memory.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import ssl
from typing import Protocol

import certifi
import httpx

from receipts import tracing
from receipts.model import Job, Outcome, Reason, Verdict
from receipts.retry import parse_retry_after

MAX_BODY_BYTES = 64 * 1024
#: Connections per httpx client. httpcore walks every connection of its pool on
#: each request, so one pool of 400 keep-alive connections cost ~9 ms of CPU per
#: delivery; pools of 4 cost ~0.6 ms (bench/). The deliverer keeps
#: ``ceil(max_connections / 4)`` clients and hands each delivery a free one.
CONNECTIONS_PER_CLIENT = 4
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


def classify(status: int, headers: httpx.Headers, body: bytes) -> Outcome:
    """Map an HTTP response to an :class:`Outcome` (the table in this module)."""
    retry_after = parse_retry_after(headers.get("retry-after"), date_header=headers.get("date"))
    retry = Verdict.RETRY
    if 200 <= status < 300:
        return Outcome(Verdict.DELIVERED, Reason.DELIVERED, status)
    if status == 409:
        return Outcome(retry, Reason.IN_PROGRESS, status, retry_after, "409 request in progress")
    if status == 429:
        return Outcome(retry, Reason.RATE_LIMITED, status, retry_after, "429 rate limited")
    if status >= 500:
        return Outcome(retry, Reason.PROVIDER_5XX, status, retry_after, f"{status} provider error")
    if status in (401, 403):
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
    Raises ``OSError``/``ssl.SSLError`` for unreadable or invalid files.
    """
    context = ssl.create_default_context(cafile=ca_file or certifi.where())
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


class HttpDeliverer:
    """Deliver receipts with one shared ``httpx.AsyncClient``.

    Args:
        url: the provider endpoint (POST).
        timeout_seconds: deadline for the whole exchange, seconds.
        token: bearer token for ``Authorization``, or None.
        max_connections: HTTP connection pool size (normally the slot count).
        tls: the TLS context for an ``https`` provider (see :func:`tls_context`);
            built once and shared by every connection pool.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_seconds: float,
        token: str | None = None,
        max_connections: int = 100,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.url = url
        # One context for all pools: building one loads the CA bundle (~50 ms).
        tls = tls or tls_context()
        self.timeout_seconds = timeout_seconds
        headers = {"User-Agent": USER_AGENT, "Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        per = min(CONNECTIONS_PER_CLIENT, max(1, max_connections))
        self._clients = [
            httpx.AsyncClient(
                headers=headers,
                timeout=httpx.Timeout(timeout_seconds, connect=min(5.0, timeout_seconds)),
                limits=httpx.Limits(max_connections=per, max_keepalive_connections=per),
                follow_redirects=False,
                trust_env=False,
                verify=tls,
            )
            for _ in range(-(-max(1, max_connections) // per))
        ]
        # One entry per connection: a delivery borrows a client that has a free one.
        self._free = collections.deque(c for c in self._clients for _ in range(per))
        self._next = itertools.cycle(self._clients)

    async def aclose(self) -> None:
        """Close the HTTP connection pools."""
        for client in self._clients:
            await client.aclose()

    async def deliver(self, job: Job) -> Outcome:
        """POST *job*'s receipt and classify the answer; never raises for I/O errors."""
        # More deliveries than max_connections at once share clients round-robin.
        borrowed = bool(self._free)
        client = self._free.popleft() if borrowed else next(self._next)
        try:
            if _TRACING:
                return await tracing.traced_delivery(job, lambda: self._deliver(client, job))
            return await self._deliver(client, job)
        finally:
            if borrowed:
                self._free.append(client)

    async def _deliver(self, client: httpx.AsyncClient, job: Job) -> Outcome:
        body = json.dumps(
            {
                "order_id": job.order_id,
                "job_id": str(job.id),
                "idempotency_key": job.idempotency_key,
            },
            separators=(",", ":"),
        ).encode()
        # As UTF-8 bytes: httpx encodes str header values as ASCII and would raise for
        # an order id the queue accepts, such as "ørder-1" (a crashed delivery).
        headers = {
            b"Idempotency-Key": job.idempotency_key.encode("utf-8"),
            b"X-Receipts-Attempt": str(job.attempt).encode("ascii"),
        }
        if _TRACING and (traceparent := tracing.current_traceparent()):
            headers[b"traceparent"] = traceparent.encode("ascii")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_seconds
        try:
            async with asyncio.timeout_at(deadline):
                request = client.build_request("POST", self.url, content=body, headers=headers)
                response = await client.send(request, stream=True)
        except TimeoutError:
            return Outcome(
                Verdict.RETRY, Reason.TIMEOUT, None, None,
                f"no answer within {self.timeout_seconds:g}s",
            )
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            return Outcome(Verdict.RETRY, Reason.CONNECT_ERROR, None, None, _short(exc))
        except httpx.TimeoutException as exc:
            return Outcome(Verdict.RETRY, Reason.TIMEOUT, None, None, _short(exc))
        except (httpx.TransportError, httpx.DecodingError) as exc:
            return Outcome(
                Verdict.RETRY, Reason.CONNECTION_LOST, None, None, _short(exc)
            )
        except httpx.InvalidURL as exc:
            return Outcome(Verdict.RETRY, Reason.CONNECT_ERROR, None, None, _short(exc))
        try:
            if response.is_success:
                # Read the small body so the connection is reused; a provider
                # that stalls after its 2xx holds the slot SUCCESS_BODY_SECONDS.
                try:
                    async with asyncio.timeout_at(
                        min(deadline, loop.time() + SUCCESS_BODY_SECONDS)
                    ):
                        seen = 0
                        async for chunk in response.aiter_raw():
                            seen += len(chunk)
                            if seen > MAX_BODY_BYTES:
                                break
                except (TimeoutError, httpx.TransportError):
                    pass
                return Outcome(Verdict.DELIVERED, Reason.DELIVERED, response.status_code)
            # Only a failure's body matters (its reason); read a bounded prefix
            # within what is left of the deadline.
            data = bytearray()
            try:
                async with asyncio.timeout_at(deadline):
                    async for chunk in response.aiter_raw():
                        data += chunk
                        if len(data) >= MAX_BODY_BYTES:
                            break
            except (TimeoutError, httpx.TransportError):
                pass
            return classify(response.status_code, response.headers, bytes(data))
        finally:
            await response.aclose()



def _short(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:200]
