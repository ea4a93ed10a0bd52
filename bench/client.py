"""The HTTP client alone, transport against transport: ``python -m bench.client``.

Starts the reference provider (``receipts provider``, ``--latency-ms``), then
for each round runs one child process per transport (``bench.child``'s
choices: ``aiohttp``, the deliverer's default; ``httpx``, httpx's own
transport), alternating the order (A B, B A, …) so drift favours none. Each
child sends ``--requests`` deliveries through :class:`receipts.delivery.HttpDeliverer`
with ``--concurrency`` at once (fresh order ids: no replays), after a
warm-up of one request per slot, with the worker's garbage-collector tuning
(:func:`receipts.runtime.worker_gc`) and its event loop (uvloop when
installed). It prints the client process's own CPU (user + system,
``getrusage``) per request, and at the end each transport's median and its
ratio to the first. No database: this is what a delivery costs in the HTTP
client, beside the queue's share that ``bench.cycle`` includes.
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
from typing import Any

from bench.child import TRANSPORTS


def _cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _run(url: str, transport: str, requests: int, concurrency: int) -> dict[str, Any]:
    from bench.child import http_deliverer
    from receipts.model import Job, Verdict
    from receipts.runtime import worker_gc
    from receipts.settings import load_settings

    settings = load_settings(database_url="postgresql://bench@127.0.0.1:9/none",
                             provider_url=url, concurrency=concurrency)
    deliverer = http_deliverer(settings, transport)
    prefix = uuid.uuid4().hex[:8]
    jobs = iter([Job(uuid.uuid4(), f"{prefix}-{i}", uuid.uuid4(), 1)
                 for i in range(requests + concurrency)])
    failed = 0

    async def slot(count: int | None) -> None:
        nonlocal failed
        for n, job in enumerate(jobs):
            if (await deliverer.deliver(job)).verdict is not Verdict.DELIVERED:
                failed += 1
            if count is not None and n + 1 >= count:
                return

    await asyncio.gather(*(slot(1) for _ in range(concurrency)))  # warm-up: connections open
    with worker_gc():
        cpu, wall = _cpu(), time.monotonic()
        await asyncio.gather(*(slot(None) for _ in range(concurrency)))
        cpu, wall = _cpu() - cpu, time.monotonic() - wall
    await deliverer.aclose()
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
    p = argparse.ArgumentParser(prog="python -m bench.client", description=__doc__.split("\n")[0])
    p.add_argument("--transports", default="aiohttp,httpx",
                   help=f"comma-separated, of {', '.join(TRANSPORTS)}")
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
                    [sys.executable, "-m", "bench.client", "--child", url, transport,
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
