"""The reference receipt provider (``receipts provider``): a real HTTP server.

It behaves like a well-behaved receipt API that honours idempotency keys, and
can misbehave on purpose for the demo, the tests and staging.

``POST /receipts`` with ``Idempotency-Key`` and a JSON body:

* the first success for a key records one receipt; later requests with that
  key replay the stored answer (``Idempotent-Replayed: true``) and count as a
  *duplicate suppressed*;
* a key whose first request is still being processed answers 409;
* faults, drawn per request from a seeded RNG (:class:`Faults`): latency,
  503, 429 with ``Retry-After``, 422 for a fixed share of keys (permanent),
  and three "unknown outcome" faults that happen *after* the receipt was
  recorded: a hang (the client times out), a reset connection, and a hang
  after the response headers;
* rejections that no rule can fit to one shape (:class:`Faults`): every
  request rejected (``reject_statuses``, rotating through the statuses
  given) with bodies that differ every time (``reject_body``: ``json``, or
  ``json_ids`` with a random request id and an ISO timestamp, or an ``html``
  error page, or ``text``), optionally only in alternating phases
  (``flap_seconds``: reject everything, then accept everything, each that
  long, from the moment the faults were set); and orders that are genuinely
  invalid (``invalid_pattern``: an order id matching the regular expression
  gets a 422 with such a body, every time);
* a concurrency capacity (``capacity``, requests worked on at once; None:
  unlimited): a keyed request that arrives while ``capacity`` are already
  being worked on is answered at once with a 503, or a 429 with
  ``Retry-After`` (``capacity_answer``), or, with ``capacity_answer``
  ``latency``, accepted but slowed: its latency is multiplied by load ÷
  capacity, as a saturated server's is. It can change while it runs.

``GET /stats`` returns counters as JSON (``concurrent`` requests now,
``max_concurrent`` since the last reset, ``over_capacity`` answers), ``GET
/loads`` the load each keyed request found on arrival (itself included) as
``[monotonic seconds, load]``, ``GET /receipts`` every recorded key
with its request count, ``GET /requests`` every keyed POST as ``[key, attempt]``
(attempt from ``X-Receipts-Attempt``) in arrival order, ``GET /answers``
every answer with a status as ``[monotonic seconds, status]`` (the machine's
monotonic clock, comparable across its processes), ``GET /healthz`` says it
is up, ``PUT /faults``
changes faults at run time (JSON with any :class:`Faults` field), ``POST
/reset`` forgets everything.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import random
import re
import string
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from receipts.logs import get_logger

log = get_logger("provider")


@dataclass(frozen=True, slots=True)
class Faults:
    """Fault injection settings; every ``*_rate`` is a probability in [0, 1].

    Attributes:
        latency_seconds: added to every processed request, seconds.
        latency_jitter_seconds: uniform extra latency in [0, this], seconds.
        error_rate: answer 503 before doing anything.
        rate_limit_rate: answer 429 with ``Retry-After: retry_after_seconds``.
        retry_after_seconds: value of that header (seconds; may be any string
            via ``retry_after_raw``).
        retry_after_raw: if set, sent verbatim as ``Retry-After`` instead.
        reject_rate: share of keys (by hash, so stable per key) answered 422.
        timeout_rate: record the receipt, then hang ``hang_seconds`` (client times out).
        reset_rate: record the receipt, then drop the connection without answering.
        hang_after_headers_rate: record, send 200 headers, then hang before the body.
        hang_seconds: how long a hang lasts, seconds.
        status: if set, every POST answers this status (e.g. 401) and records nothing.
        body_bytes: size of the JSON answer padding (to test huge bodies).
        reject_statuses: if set (4xx statuses), every POST is rejected, the
            status rotating through these, and records nothing.
        reject_body: the style of a rejection's body: ``json`` (one message),
            ``json_ids`` (a random request id and an ISO timestamp in it),
            ``html`` (an error page with a reference id and a time), ``text``.
        flap_seconds: with ``reject_statuses``, reject only in alternating
            phases of this many seconds (reject, accept, reject, …, counted
            from when the faults were set); 0: always.
        invalid_pattern: a regular expression; an order id it matches (search)
            is answered 422, every time, and never recorded.
        capacity: requests worked on at once before it is over capacity
            (None: unlimited; ≥ 1).
        capacity_answer: what a request beyond the capacity gets: ``503``,
            ``429`` (with ``Retry-After: retry_after_seconds``) or ``latency``
            (accepted, its latency × load ÷ capacity).
    """

    latency_seconds: float = 0.0
    latency_jitter_seconds: float = 0.0
    error_rate: float = 0.0
    rate_limit_rate: float = 0.0
    retry_after_seconds: float = 1.0
    retry_after_raw: str | None = None
    reject_rate: float = 0.0
    timeout_rate: float = 0.0
    reset_rate: float = 0.0
    hang_after_headers_rate: float = 0.0
    hang_seconds: float = 30.0
    status: int | None = None
    body_bytes: int = 0
    reject_statuses: tuple[int, ...] | None = None
    reject_body: str = "json"
    flap_seconds: float = 0.0
    invalid_pattern: str | None = None
    capacity: int | None = None
    capacity_answer: str = "503"

    @classmethod
    def from_mapping(cls, data: dict[str, Any], base: Faults | None = None) -> Faults:
        """A copy of *base* (or defaults) with the known keys of *data* applied.

        Raises ``ValueError`` for an unknown key, a value of the wrong type (a
        number given as text, a non-finite number), a rate outside [0, 1], a
        negative duration or size, a status outside 100–599 or a rejection
        status outside 400–499, an unknown body style or a pattern that does
        not compile.
        """
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown fault setting(s): {', '.join(sorted(unknown))}")
        data = dict(data)
        if isinstance(data.get("capacity_answer"), int) and not isinstance(
                data["capacity_answer"], bool):
            data["capacity_answer"] = str(data["capacity_answer"])  # 429 as the CLI takes it
        for name, value in data.items():
            _check_type(name, value)
        if data.get("status") is not None and not 100 <= data["status"] <= 599:
            raise ValueError("status must be an HTTP status (100-599)")
        if data.get("reject_statuses") is not None:
            statuses = tuple(int(s) for s in data["reject_statuses"])
            if not statuses or not all(400 <= s <= 499 for s in statuses):
                raise ValueError("reject_statuses must be a non-empty list of 4xx statuses")
            data["reject_statuses"] = statuses
        if data.get("invalid_pattern") is not None:
            try:
                re.compile(str(data["invalid_pattern"]))
            except re.error as exc:
                raise ValueError(f"invalid_pattern does not compile: {exc}") from None
        result = replace(base or cls(), **data)
        if result.reject_body not in REJECT_BODIES:
            raise ValueError(f"reject_body must be one of {', '.join(REJECT_BODIES)}")
        if result.capacity_answer not in CAPACITY_ANSWERS:
            raise ValueError(f"capacity_answer must be one of {', '.join(CAPACITY_ANSWERS)}")
        if result.capacity is not None and result.capacity < 1:
            raise ValueError("capacity must be at least 1 (or null: unlimited)")
        if result.capacity is not None and result.capacity > _MAXIMA["capacity"]:
            raise ValueError(f"capacity must be at most {_MAXIMA['capacity']:,}")
        for f in fields(cls):
            value = getattr(result, f.name)
            if f.name.endswith("_rate") and not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"{f.name} must be between 0 and 1")
            if f.name in _NON_NEGATIVE:
                most = _MAXIMA[f.name]
                if not (math.isfinite(float(value)) and 0 <= float(value) <= most):
                    raise ValueError(f"{f.name} must be a number from 0 to {most:,}")
        return result


#: The type each fault setting takes from JSON (None is also allowed where the default is).
_KINDS: dict[str, type] = {
    "status": int, "body_bytes": int, "retry_after_raw": str, "reject_body": str,
    "invalid_pattern": str, "reject_statuses": list, "capacity": int, "capacity_answer": str,
}
_OPTIONAL = ("retry_after_raw", "status", "reject_statuses", "invalid_pattern", "capacity")


def _check_type(name: str, value: Any) -> None:
    """Refuse a fault setting of the wrong JSON type (every other one is a number)."""
    if value is None and name in _OPTIONAL:
        return
    kind = _KINDS.get(name, float)
    if isinstance(value, bool):
        ok = False
    elif kind is float:
        ok = isinstance(value, int | float) and math.isfinite(value)
    elif kind is list:
        ok = isinstance(value, list | tuple) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value)
    else:
        ok = isinstance(value, kind)
    if not ok:
        what = {float: "a finite number", int: "an integer", str: "a string",
                list: "a list of integers"}[kind]
        raise ValueError(f"{name} must be {what}")


#: How many requests' loads ``GET /loads`` keeps (the most recent).
LOADS_KEPT = 100_000
_NON_NEGATIVE = ("latency_seconds", "latency_jitter_seconds", "retry_after_seconds",
                 "hang_seconds", "body_bytes", "flap_seconds")
#: The largest value each bounded setting takes: an hour of latency or hanging, a day of
#: Retry-After or flapping, a 64 MiB body, a million requests at once.
_MAXIMA: dict[str, float] = {
    "latency_seconds": 3600, "latency_jitter_seconds": 3600, "hang_seconds": 3600,
    "retry_after_seconds": 86_400, "flap_seconds": 86_400, "body_bytes": 64 * 1024 * 1024,
    "capacity": 1_000_000,
}
#: The styles of a rejection's body (:attr:`Faults.reject_body`).
REJECT_BODIES = ("json", "json_ids", "html", "text")
#: What a request beyond the capacity gets (:attr:`Faults.capacity_answer`).
CAPACITY_ANSWERS = ("503", "429", "latency")
_BASE62 = string.ascii_letters + string.digits


class ReferenceProvider:
    """State and request handling of the reference provider.

    Args:
        faults: initial :class:`Faults`.
        token: when set, requests must carry ``Authorization: Bearer <token>``.
        seed: seed of the fault RNG (None: random).
    """

    def __init__(self, faults: Faults | None = None, *, token: str | None = None,
                 seed: int | None = None) -> None:
        self.faults = faults or Faults()
        #: When the faults were last set (monotonic): the origin of flapping phases.
        self.faults_at = time.monotonic()
        self._rotation = itertools.count()
        self.token = token
        self.rng = random.Random(seed)
        self.receipts: dict[str, dict[str, Any]] = {}
        self.in_progress: set[str] = set()
        self.stats: Counter[str] = Counter()
        self.request_log: list[tuple[str, str]] = []
        #: (time.monotonic() of the answer, HTTP status) of every answer sent with
        #: a status (rate and pause tests read it; hangs and resets are not in it).
        self.answers: list[tuple[float, int]] = []
        #: Keyed requests being worked on now, and the most at once since the reset.
        self.concurrent = 0
        self.max_concurrent = 0
        #: (time.monotonic() of the arrival, load it found, itself included) of
        #: every keyed request (GET /loads).
        #: (monotonic time, load) of the most recent requests (bounded: a long run keeps
        #: the last LOADS_KEPT).
        self.loads: deque[tuple[float, int]] = deque(maxlen=LOADS_KEPT)

    def reset(self) -> None:
        """Forget every receipt and counter (the requests being worked on stay counted)."""
        self.receipts.clear()
        self.in_progress.clear()
        self.stats.clear()
        self.request_log.clear()
        self.answers.clear()
        self.loads.clear()
        self.max_concurrent = self.concurrent

    def _rejects(self, key: str) -> bool:
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        return int.from_bytes(digest[:4], "big") / 2**32 < self.faults.reject_rate

    async def handle_post(self, request: web.Request) -> web.StreamResponse:
        """``POST /receipts``: see the module doc for the behaviour."""
        f = self.faults
        self.stats["requests"] += 1
        authorization = request.headers.get("Authorization")
        if self.token is not None and authorization != f"Bearer {self.token}":
            return self._answer(401, {"error": "invalid credentials"})
        if f.status is not None:
            return self._answer(f.status, {"error": f"forced status {f.status}"})
        if f.reject_statuses and self._rejecting_now():
            statuses = f.reject_statuses
            return self._rejection(statuses[next(self._rotation) % len(statuses)])
        key = request.headers.get("Idempotency-Key", "")
        if not key:
            return self._answer(400, {"error": "Idempotency-Key header is required"})
        # Every keyed request, before any fault: (key, X-Receipts-Attempt), for tests
        # that must prove which attempts reached the provider (GET /requests).
        self.request_log.append((key, request.headers.get("X-Receipts-Attempt", "")))
        try:
            body = await request.json()
            order_id = str(body["order_id"])
        except (ValueError, KeyError, TypeError):
            return self._answer(400, {"error": "body must be JSON with order_id"})
        load = self.concurrent + 1
        self.loads.append((time.monotonic(), load))
        self.max_concurrent = max(self.max_concurrent, load)
        if f.capacity is not None and load > f.capacity and f.capacity_answer != "latency":
            self.stats["over_capacity"] += 1
            if f.capacity_answer == "429":
                retry_after = f.retry_after_raw or f"{f.retry_after_seconds:g}"
                return self._answer(429, {"error": "over capacity, slow down"},
                                    {"Retry-After": retry_after})
            return self._answer(503, {"error": "over capacity"})
        self.concurrent += 1
        try:
            return await self._process(request, f, key, order_id, load)
        finally:
            self.concurrent -= 1

    async def _process(self, request: web.Request, f: Faults, key: str, order_id: str,
                       load: int) -> web.StreamResponse:
        """The rest of a keyed POST once it is being worked on (*load*: the requests
        worked on at its arrival, itself included)."""
        if f.invalid_pattern is not None and re.search(f.invalid_pattern, order_id):
            self.stats["invalid_orders"] += 1
            return self._rejection(422, f"order {order_id} cannot receive a receipt")
        if f.error_rate and self.rng.random() < f.error_rate:
            return self._answer(503, {"error": "injected provider error"})
        if f.rate_limit_rate and self.rng.random() < f.rate_limit_rate:
            retry_after = f.retry_after_raw or f"{f.retry_after_seconds:g}"
            return self._answer(429, {"error": "slow down"}, {"Retry-After": retry_after})
        if key in self.receipts:
            self.stats["duplicates_suppressed"] += 1
            self.receipts[key]["requests"] += 1
            return self._answer(200, self.receipts[key]["answer"], {"Idempotent-Replayed": "true"})
        if key in self.in_progress:
            return self._answer(409, {"error": "a request with this key is in progress"})
        if f.reject_rate and self._rejects(key):
            return self._answer(422, {"error": "order cannot receive a receipt"})
        self.in_progress.add(key)
        try:
            delay = f.latency_seconds + self.rng.uniform(0, f.latency_jitter_seconds)
            if f.capacity is not None and load > f.capacity:  # capacity_answer "latency"
                self.stats["over_capacity"] += 1
                delay *= load / f.capacity
            if delay > 0:
                await asyncio.sleep(delay)
            answer = {"receipt_id": hashlib.sha256(key.encode("utf-8", "surrogatepass"))
                      .hexdigest()[:16], "order_id": order_id}
            if f.body_bytes:
                answer["padding"] = "x" * f.body_bytes
            self.receipts[key] = {"order_id": order_id, "requests": 1, "answer": answer,
                                  "at": time.time()}
            self.stats["receipts"] += 1
        finally:
            self.in_progress.discard(key)
        draw = self.rng.random()
        if draw < f.timeout_rate:
            self.stats["fault_timeout"] += 1
            await asyncio.sleep(f.hang_seconds)
        elif draw < f.timeout_rate + f.reset_rate:
            self.stats["fault_reset"] += 1
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError  # nothing more to send on a dead connection
        elif draw < f.timeout_rate + f.reset_rate + f.hang_after_headers_rate:
            self.stats["fault_hang_after_headers"] += 1
            response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await asyncio.sleep(f.hang_seconds)
            return response
        return self._answer(201, answer)

    def _rejecting_now(self) -> bool:
        """True while ``reject_statuses`` applies: always, or in a rejecting phase."""
        period = self.faults.flap_seconds
        if period <= 0:
            return True
        return int((time.monotonic() - self.faults_at) // period) % 2 == 0

    def _rejection(self, status: int, message: str = "request rejected") -> web.Response:
        """A 4xx whose body varies as a real API's does (:attr:`Faults.reject_body`)."""
        style = self.faults.reject_body
        request_id = "req_" + "".join(self.rng.choice(_BASE62) for _ in range(16))
        stamp = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        self.stats[f"status_{status}"] += 1
        self.stats["rejections"] += 1
        self.answers.append((time.monotonic(), status))
        if style == "json":
            return web.json_response({"error": message}, status=status)
        if style == "json_ids":
            return web.json_response({"error": f"{message} (request {request_id} at {stamp})",
                                      "request_id": request_id, "timestamp": stamp},
                                     status=status)
        if style == "html":
            page = (f"<html><head><title>{status} Error</title></head><body><h1>{status}</h1>"
                    f"<p>{message}.</p><p>Reference #{request_id} &middot; {stamp}</p>"
                    f"<hr><address>edge-{self.rng.randrange(1, 99)}</address></body></html>")
            return web.Response(text=page, status=status, content_type="text/html")
        return web.Response(text=f"{status} {message} [{request_id}] {stamp}", status=status)

    def _answer(self, status: int, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> web.Response:
        self.stats[f"status_{status}"] += 1
        self.answers.append((time.monotonic(), status))
        return web.json_response(body, status=status, headers=headers)

    def snapshot(self) -> dict[str, Any]:
        """Counters as a JSON-able dict (``receipts`` = distinct keys delivered)."""
        data: dict[str, Any] = dict(self.stats)
        data["receipts"] = len(self.receipts)
        data.setdefault("duplicates_suppressed", 0)
        data.setdefault("requests", 0)
        data["concurrent"] = self.concurrent
        data["max_concurrent"] = self.max_concurrent
        data.setdefault("over_capacity", 0)
        data["faults"] = asdict(self.faults)
        return data

    def app(self) -> web.Application:
        """The aiohttp application serving this provider."""

        async def stats(_: web.Request) -> web.Response:
            return web.json_response(self.snapshot())

        async def receipts(_: web.Request) -> web.Response:
            return web.json_response(
                {k: {"order_id": v["order_id"], "requests": v["requests"]}
                 for k, v in self.receipts.items()}
            )

        async def requests_log(_: web.Request) -> web.Response:
            return web.json_response(self.request_log)

        async def answers(_: web.Request) -> web.Response:
            return web.json_response(self.answers)

        async def loads(_: web.Request) -> web.Response:
            return web.json_response(list(self.loads))

        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        async def put_faults(request: web.Request) -> web.Response:
            try:
                data = await request.json()
                if not isinstance(data, dict):
                    raise ValueError("body must be a JSON object")
                self.faults = Faults.from_mapping(data, self.faults)
                self.faults_at = time.monotonic()
            except (ValueError, TypeError) as exc:
                return web.json_response({"error": str(exc)}, status=400)
            log.info("faults_changed", extra={"faults": asdict(self.faults)})
            return web.json_response(asdict(self.faults))

        async def reset(_: web.Request) -> web.Response:
            self.reset()
            return web.json_response({"status": "reset"})

        app = web.Application(client_max_size=1024 * 1024)
        app.router.add_post("/receipts", self.handle_post)
        app.router.add_get("/receipts", receipts)
        app.router.add_get("/stats", stats)
        app.router.add_get("/requests", requests_log)
        app.router.add_get("/answers", answers)
        app.router.add_get("/loads", loads)
        app.router.add_get("/healthz", healthz)
        app.router.add_put("/faults", put_faults)
        app.router.add_post("/reset", reset)
        return app


async def serve(provider: ReferenceProvider, host: str, port: int,
                stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
    """Serve *provider* on *host*:*port* until *stop* is set.

    Sets *ready* once listening. Raises ``OSError`` when the port is taken.
    """
    runner = web.AppRunner(provider.app(), access_log=None, handle_signals=False,
                           shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, backlog=1024)
    await site.start()
    log.info("provider_started", extra={"host": host, "port": port,
                                        "faults": asdict(provider.faults)})
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()

