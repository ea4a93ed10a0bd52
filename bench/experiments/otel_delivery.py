"""What OpenTelemetry costs per delivery: the worker's CPU time with tracing off and on.

Runs alone from the project's virtualenv (the ``otel`` extra and the SDK, as in ``dev``)::

    .venv/bin/python -m bench.experiments.otel_delivery  # 5 rounds of 5,000 deliveries
    .venv/bin/python -m bench.experiments.otel_delivery --rounds 3 --deliveries 2000 --json out.json

The reference provider (``receipts provider``, 0 ms) runs as its own process;
this process delivers with ``HttpDeliverer`` at 50 concurrent deliveries and
measures its own CPU time (``time.process_time``) per delivery, in three modes,
interleaved per round:

* ``off``: the delivery path as without the ``otel`` extra (no span, no header);
* ``api``: the extra installed but no SDK configured (a no-op tracer: what a
  worker pays when OTel is installed and unused);
* ``sdk``: an SDK tracer provider with a batch processor and an exporter that
  drops the spans (recording, linking and sending the header, not exporting).

Every job carries a stored ``traceparent``, so the link is built each time.
Prints the median µs of CPU per delivery per mode and the difference to ``off``.
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
import urllib.request
import uuid
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from receipts import delivery
from receipts.delivery import HttpDeliverer
from receipts.embedded import free_port
from receipts.model import Job

STORED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class DropExporter(SpanExporter):
    """Accepts and forgets spans (export cost without a collector)."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class Switchable(trace.TracerProvider):
    """A global tracer provider whose delegate the benchmark switches per mode.

    receipts gets its tracer once; the tracer handed out here asks the current
    delegate's tracer on every span, so a mode switch takes effect at once.
    """

    def __init__(self) -> None:
        self.delegate: trace.TracerProvider = trace.NoOpTracerProvider()
        self._tracers: dict[int, trace.Tracer] = {}

    def current(self, name: str) -> trace.Tracer:
        key = id(self.delegate)
        if key not in self._tracers:
            self._tracers[key] = self.delegate.get_tracer(name)
        return self._tracers[key]

    def get_tracer(  # type: ignore[override]  # passes any further arguments on as given
            self, name: str, *args: Any, **kwargs: Any) -> trace.Tracer:
        switch = self

        class SwitchTracer(trace.Tracer):
            def start_span(self, *a: Any, **k: Any) -> trace.Span:
                return switch.current(name).start_span(*a, **k)

            def start_as_current_span(self, *a: Any, **k: Any) -> Any:
                return switch.current(name).start_as_current_span(*a, **k)

        return SwitchTracer()


async def deliver_all(url: str, count: int, concurrency: int) -> float:
    """CPU seconds of this process for *count* deliveries, *concurrency* at a time."""
    deliverer = HttpDeliverer(url, timeout_seconds=10, max_connections=concurrency)
    jobs = [Job(uuid.uuid4(), f"otel-{i}", uuid.uuid4(), 1, traceparent=STORED)
            for i in range(count)]
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def slot() -> None:
        while not queue.empty():
            outcome = await deliverer.deliver(queue.get_nowait())
            if outcome.reason.value != "delivered":
                raise RuntimeError(f"delivery failed: {outcome}")

    try:
        await asyncio.gather(*(slot() for _ in range(min(concurrency, 8))))  # warm up
        began = time.process_time()
        for job in jobs:
            queue.put_nowait(job)
        await asyncio.gather(*(slot() for _ in range(concurrency)))
        return time.process_time() - began
    finally:
        await deliverer.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--deliveries", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    port = free_port()
    provider = subprocess.Popen([sys.executable, "-m", "receipts", "provider", "--port",
                                 str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    switch = Switchable()
    trace.set_tracer_provider(switch)
    sdk = TracerProvider()
    sdk.add_span_processor(BatchSpanProcessor(DropExporter()))
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/receipts"
        modes: dict[str, list[float]] = {"off": [], "api": [], "sdk": []}
        load = [os.getloadavg()[0]]
        for _ in range(args.rounds):
            for mode in modes:
                delivery._TRACING = mode != "off"
                switch.delegate = sdk if mode == "sdk" else trace.NoOpTracerProvider()
                seconds = asyncio.run(deliver_all(url, args.deliveries, args.concurrency))
                modes[mode].append(seconds / args.deliveries * 1e6)
        load.append(os.getloadavg()[0])
    finally:
        provider.terminate()
        provider.wait(10)
        sdk.shutdown()
    medians = {mode: statistics.median(values) for mode, values in modes.items()}
    print(f"CPU per delivery, median of {args.rounds} rounds of {args.deliveries:,} "
          f"(load {load[0]:.1f} → {load[1]:.1f}):")
    for mode, value in medians.items():
        extra = "" if mode == "off" else f"  (+{value - medians['off']:.0f} µs)"
        print(f"  {mode:4} {value:7.0f} µs{extra}  runs: "
              + ", ".join(f"{v:.0f}" for v in modes[mode]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"us_per_delivery": modes, "median": medians, "load": load}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
