"""Trace context from the order request to the provider call (the ``otel`` extra).

The OpenTelemetry SDK (in-memory exporter) stands in for the application's
tracing setup. Enqueueing inside a span stores its ``traceparent``; delivering
that job creates a ``receipts.deliver`` span linked to it, and the provider (a
real HTTP server here) receives the delivery span's ``traceparent``. Without
OpenTelemetry (its import blocked in a fresh interpreter) nothing of it runs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from receipts import enqueue, enqueue_many
from receipts.delivery import HttpDeliverer
from receipts.embedded import free_port
from receipts.model import Job, Verdict
from receipts.tracing import DELIVERY_SPAN, check_traceparent, current_traceparent
from tests.conftest import fetch_rows

REPO = Path(__file__).resolve().parents[2]
EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def tracer() -> Iterator[trace.Tracer]:
    """An SDK tracer provider (set once per process, as an application does)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)
    yield trace.get_tracer("orders-service")


@pytest.fixture
def spans(tracer: trace.Tracer) -> Iterator[InMemorySpanExporter]:
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


def traceparent_of(span: trace.Span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class Recorder:
    """A real HTTP provider that answers 200 (or *status*) and records request headers."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.headers: list[dict[str, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        await request.read()
        return web.json_response({"ok": True}, status=self.status)


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[Recorder, str]]:
    rec = Recorder()
    app = web.Application()
    app.router.add_post("/receipts", rec.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield rec, f"http://127.0.0.1:{port}/receipts"
    finally:
        await runner.cleanup()


# ------------------------------------------------------------ enqueue side


@pytest.mark.slow
def test_enqueue_inside_a_span_stores_its_traceparent(dsn, tracer, spans):
    with psycopg.connect(dsn) as conn:
        with tracer.start_as_current_span("POST /orders") as span:
            enqueue(conn, "traced-1")
            enqueue_many(conn, ["traced-2", "traced-3"])
            expected = traceparent_of(span)
            assert current_traceparent() == expected
        enqueue(conn, "untraced")
    rows = dict(fetch_rows(dsn, "SELECT order_id, traceparent FROM receipt_jobs"))
    assert rows == {"traced-1": expected, "traced-2": expected, "traced-3": expected,
                    "untraced": None}
    assert int(expected[-2:], 16) & 1  # the sampled flag travels with it


@pytest.mark.slow
def test_no_span_no_traceparent(dsn, tracer):
    assert current_traceparent() is None
    with psycopg.connect(dsn) as conn:
        enqueue(conn, "plain")
    assert fetch_rows(dsn, "SELECT traceparent FROM receipt_jobs") == [(None,)]


@pytest.mark.parametrize("value", [
    None, "", "garbage", "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
])
def test_stored_values_that_are_not_a_valid_traceparent_are_ignored(value):
    assert check_traceparent(value) is None


# ------------------------------------------------------------ delivery side


@pytest.mark.slow
async def test_the_delivery_span_links_to_the_enqueue_and_the_provider_gets_it(
    dsn, tracer, spans, recorder
):
    rec, url = recorder
    with psycopg.connect(dsn) as conn, tracer.start_as_current_span("POST /orders") as order:
        job_id = enqueue(conn, "order-7")
    stored = fetch_rows(dsn, "SELECT traceparent FROM receipt_jobs")[0][0]
    assert stored == traceparent_of(order)

    job = Job(job_id, "order-7", uuid.uuid4(), 2, traceparent=stored)  # as the claim returns it
    deliverer = HttpDeliverer(url, timeout_seconds=5)
    try:
        outcome = await deliverer.deliver(job)
    finally:
        await deliverer.aclose()
    assert outcome.verdict is Verdict.DELIVERED

    (delivery,) = [s for s in spans.get_finished_spans() if s.name == DELIVERY_SPAN]
    assert delivery.kind is trace.SpanKind.CLIENT
    assert delivery.parent is None  # its own trace: a job is delivered later, maybe twice
    (link,) = delivery.links
    assert link.context.trace_id == order.get_span_context().trace_id
    assert link.context.span_id == order.get_span_context().span_id
    assert delivery.attributes["receipts.job.id"] == str(job_id)
    assert delivery.attributes["receipts.attempt"] == 2
    assert delivery.attributes["receipts.reason"] == "delivered"
    assert delivery.attributes["http.response.status_code"] == 200
    assert delivery.status.is_ok
    (headers,) = rec.headers
    ctx = delivery.context
    assert headers["traceparent"] == (
        f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}")


async def test_a_failed_delivery_marks_its_span_and_a_bad_stored_value_adds_no_link(
    tracer, spans, recorder
):
    rec, url = recorder
    rec.status = 503
    job = Job(uuid.uuid4(), "order-8", uuid.uuid4(), 1, traceparent="not-a-traceparent")
    deliverer = HttpDeliverer(url, timeout_seconds=5)
    try:
        outcome = await deliverer.deliver(job)
    finally:
        await deliverer.aclose()
    assert outcome.verdict is Verdict.RETRY
    (delivery,) = [s for s in spans.get_finished_spans() if s.name == DELIVERY_SPAN]
    assert not delivery.links
    assert delivery.status.status_code is trace.StatusCode.ERROR
    assert delivery.attributes["receipts.reason"] == "provider_5xx"
    assert rec.headers[0]["traceparent"].split("-")[1] == f"{delivery.context.trace_id:032x}"


async def test_concurrent_deliveries_each_carry_their_own_span(tracer, spans, recorder):
    rec, url = recorder
    jobs = [Job(uuid.uuid4(), f"order-{i}", uuid.uuid4(), 1) for i in range(20)]
    deliverer = HttpDeliverer(url, timeout_seconds=5)
    try:
        await asyncio.gather(*(deliverer.deliver(job) for job in jobs))
    finally:
        await deliverer.aclose()
    sent = {h["traceparent"].split("-")[2] for h in rec.headers}
    delivered = {f"{s.context.span_id:016x}" for s in spans.get_finished_spans()
                 if s.name == DELIVERY_SPAN}
    assert len(sent) == 20 and sent == delivered


# ------------------------------------------------------------ OTel absent


ABSENT = textwrap.dedent("""
    import asyncio, json, sys, threading, uuid
    from http.server import BaseHTTPRequestHandler, HTTPServer
    sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
    import psycopg
    from receipts import enqueue
    from receipts import delivery, tracing
    from receipts.model import Job

    seen = []
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(dict(self.headers))
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
        def log_message(self, *args):
            pass
    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    with psycopg.connect(sys.argv[1]) as conn:
        enqueue(conn, "absent-1")

    async def main():
        d = delivery.HttpDeliverer(f"http://127.0.0.1:{server.server_port}/r", timeout_seconds=5)
        try:
            return await d.deliver(Job(uuid.uuid4(), "absent-1", uuid.uuid4(), 1,
                                       traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"))
        finally:
            await d.aclose()
    outcome = asyncio.run(main())
    server.shutdown()
    print(json.dumps({"available": tracing.otel_available(), "tracing": delivery._TRACING,
                      "verdict": outcome.verdict.value, "headers": sorted(seen[0]),
                      "loaded": sorted(m for m in sys.modules if m.startswith("opentelemetry"))}))
""")


@pytest.mark.slow
def test_without_opentelemetry_nothing_changes(dsn):
    result = subprocess.run([sys.executable, "-c", ABSENT, dsn], capture_output=True,
                            text=True, timeout=60, cwd=str(REPO))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["available"] is False and report["tracing"] is False
    assert report["verdict"] == "delivered"
    assert "traceparent" not in {h.lower() for h in report["headers"]}
    assert report["loaded"] == ["opentelemetry"]  # only the blocking placeholder
    assert fetch_rows(dsn, "SELECT traceparent FROM receipt_jobs") == [(None,)]
