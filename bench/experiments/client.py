"""The HTTP client alone, transport against transport: ``python -m bench.experiments.client``.

Starts the reference provider (``receipts provider``, ``--latency-ms``), then
for each round runs one child process per transport (``bench.child``'s
choices: ``aiohttp``, the deliverer's default; ``httpx``, httpx's own transport;
or a client library alone, :data:`RAW_CLIENTS`), alternating the order
(A B, B A, …) so drift favours none. Each
child sends ``--requests`` deliveries through :class:`receipts.delivery.HttpDeliverer`
with ``--concurrency`` at once (fresh order ids: no replays), after a
warm-up of one request per slot, with the worker's garbage-collector tuning
(:func:`receipts.runtime.worker_gc`) and its event loop (uvloop when
installed). It prints the client process's own CPU (user + system,
``getrusage``) per request, and at the end each transport's median and its
ratio to the first. No database: this is what a delivery costs in the HTTP
client, beside the queue's share that ``bench.experiments.cycle`` includes. A raw client
(``raw-aiohttp``, ``curl_cffi``, ``pyreqwest``, ``aiosonic``; each but the
first must be installed by hand, none is a dependency) sends the deliverer's
request through the library's own API, without the deliverer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from bench.child import TRANSPORTS


def _cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


#: Clients sent to without the deliverer (``--transports``): the same request (method,
#: headers, body) straight through each library's own API, the answer's body not read.
#: Each but ``raw-aiohttp`` needs its package installed (none is a dependency).
RAW_CLIENTS = ("raw-aiohttp", "curl_cffi", "pyreqwest", "aiosonic")


async def _raw_client(kind: str, url: str, concurrency: int
                      ) -> tuple[Callable[[Any], Awaitable[bool]], Callable[[], Awaitable[Any]]]:
    """(send(job) → delivered?, close) for a library of :data:`RAW_CLIENTS`, configured as
    the deliverer would be: no cookies, no redirects, no environment, no decompression."""
    from receipts.delivery import HttpDeliverer

    shape = HttpDeliverer(url, timeout_seconds=30)  # builds the body and headers only

    def request(job: Any) -> tuple[bytes, dict[str, str]]:
        return shape.body(job), dict(shape.headers(job))

    if kind == "raw-aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency, limit_per_host=0,
                                           keepalive_timeout=4),
            cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, trust_env=False,
            skip_auto_headers=("Accept-Encoding",),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))

        async def send_aiohttp(job: Any) -> bool:
            body, headers = request(job)
            response = await session.request("POST", url, data=body, headers=headers,
                                             allow_redirects=False)
            response.release()
            return 200 <= response.status < 300
        return send_aiohttp, session.close
    if kind == "curl_cffi":
        from curl_cffi import requests as curl

        curl_session = curl.AsyncSession(max_clients=concurrency, trust_env=False,
                                         allow_redirects=False, timeout=30)

        async def send_curl(job: Any) -> bool:
            body, headers = request(job)
            response = await curl_session.post(url, data=body, headers=headers)
            return bool(200 <= response.status_code < 300)
        return send_curl, curl_session.close
    if kind == "pyreqwest":
        from pyreqwest.client import ClientBuilder

        client = ClientBuilder().max_connections(concurrency).build()
        await client.__aenter__()

        async def send_pyreqwest(job: Any) -> bool:
            body, headers = request(job)
            response = await client.post(url).headers(headers).body_bytes(body).build().send()
            return 200 <= int(response.status) < 300
        return send_pyreqwest, client.close
    if kind == "aiosonic":
        import aiosonic
        from aiosonic.connectors import TCPConnector
        from aiosonic.pools import PoolConfig

        sonic = aiosonic.HTTPClient(
            connector=TCPConnector(pool_configs={":default": PoolConfig(size=concurrency)}))

        async def send_sonic(job: Any) -> bool:
            body, headers = request(job)
            response = await sonic.post(url, data=body, headers=headers)
            await response.content()
            return bool(200 <= response.status_code < 300)

        async def close_sonic() -> None:
            await sonic.connector.cleanup()
        return send_sonic, close_sonic
    raise ValueError(f"unknown client {kind!r}")


async def _run(url: str, transport: str, requests: int, concurrency: int) -> dict[str, Any]:
    from bench.child import http_deliverer
    from receipts.model import Job
    from receipts.runtime import worker_gc
    from receipts.settings import load_settings

    send: Callable[[Any], Awaitable[bool]]
    if transport in RAW_CLIENTS:
        send, close = await _raw_client(transport, url, concurrency)
    else:
        settings = load_settings(database_url="postgresql://bench@127.0.0.1:9/none",
                                 provider_url=url, concurrency=concurrency)
        deliverer = http_deliverer(settings, transport)

        async def send_delivery(job: Any) -> bool:
            return (await deliverer.deliver(job)).status in range(200, 300)
        send, close = send_delivery, deliverer.aclose
    prefix = uuid.uuid4().hex[:8]
    jobs = iter([Job(uuid.uuid4(), f"{prefix}-{i}", uuid.uuid4(), 1)
                 for i in range(requests + concurrency)])
    failed = 0

    async def slot(count: int | None) -> None:
        nonlocal failed
        for n, job in enumerate(jobs):
            if not await send(job):
                failed += 1
            if count is not None and n + 1 >= count:
                return

    await asyncio.gather(*(slot(1) for _ in range(concurrency)))  # warm-up: connections open
    with worker_gc():
        cpu, wall = _cpu(), time.monotonic()
        await asyncio.gather(*(slot(None) for _ in range(concurrency)))
        cpu, wall = _cpu() - cpu, time.monotonic() - wall
    await close()
    return {"transport": transport, "cpu_us_per_request": cpu / requests * 1e6,
            "requests_per_second": requests / wall, "failed": failed}


def child(argv: list[str]) -> None:
    url, transport, requests, concurrency = argv[0], argv[1], int(argv[2]), int(argv[3])
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(_run(url, transport, requests, concurrency))
    else:
        result = uvloop.run(_run(url, transport, requests, concurrency))
    print(json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.client",
                                description=__doc__.split("\n")[0])
    p.add_argument("--transports", default="aiohttp,httpx",
                   help=f"comma-separated, of {', '.join(TRANSPORTS + RAW_CLIENTS)}")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--latency-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    from receipts.embedded import free_port

    port = free_port()
    provider = subprocess.Popen(
        [sys.executable, "-m", "receipts", "provider", "--port", str(port),
         "--latency-ms", str(args.latency_ms)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/receipts"
    results: dict[str, list[dict[str, Any]]] = {t: [] for t in transports}
    try:
        _wait_for(port)
        print(f"load average at start: {os.getloadavg()}", flush=True)
        for n in range(args.rounds):
            for transport in (transports if n % 2 == 0 else transports[::-1]):
                out = subprocess.run(
                    [sys.executable, "-m", "bench.experiments.client", "--child", url, transport,
                     str(args.requests), str(args.concurrency)],
                    capture_output=True, text=True, check=True, timeout=900)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                results[transport].append(r)
                print(f"[{transport}] {r['cpu_us_per_request']:.1f} µs CPU/request, "
                      f"{r['requests_per_second']:,.0f} requests/s, {r['failed']} failed",
                      flush=True)
    finally:
        provider.terminate()
        provider.wait(10)
    base = statistics.median(r["cpu_us_per_request"] for r in results[transports[0]])
    for transport in transports:
        cpu = statistics.median(r["cpu_us_per_request"] for r in results[transport])
        print(f"{transport}: median {cpu:.1f} µs CPU/request ({cpu / base:.2f}× "
              f"{transports[0]}), {len(results[transport])} runs", flush=True)
    print(f"load average at end: {os.getloadavg()}", flush=True)
    return 0


def _wait_for(port: int) -> None:
    import socket

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the reference provider did not start")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
        raise SystemExit(0)
    raise SystemExit(main())
