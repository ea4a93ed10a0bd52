"""Trace context across the queue, with OpenTelemetry as an optional extra (``otel``).

Enqueue side: :func:`current_traceparent` gives the W3C ``traceparent`` of the
span active in the enqueuing code; :mod:`receipts.enqueue` stores it with the
job (column ``traceparent``, migration 0004). Delivery side:
:func:`traced_delivery` wraps one delivery attempt in a span that *links* to
the stored context (a job is delivered long after, and maybe more than once,
so the enqueuing span is not its parent), and :func:`current_traceparent`
then gives the header that carries the delivery span to the provider.

Only the OpenTelemetry API is used; exporting spans is the application's
choice of SDK. Without the API installed nothing here imports it and nothing
changes: :func:`otel_available` is False, the worker sends no ``traceparent``
header, and jobs are stored with a NULL ``traceparent``. This module imports
only the standard library, so the light ``import receipts`` stays light.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from receipts.model import Job, Outcome, Verdict

#: W3C Trace Context ``traceparent``, version 00: trace id, parent span id, flags
#: (lower-case hex; all-zero ids are invalid). The table's CHECK uses the same pattern.
TRACEPARENT_PATTERN = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
#: The instrumentation scope name of the delivery spans.
TRACER_NAME = "receipts"
#: Name of the span around one delivery attempt.
DELIVERY_SPAN = "receipts.deliver"


def otel_available() -> bool:
    """True when the OpenTelemetry API can be imported (the ``otel`` extra is installed).

    Looks the module up without importing it.
    """
    try:
        return importlib.util.find_spec("opentelemetry.trace") is not None
    except (ImportError, ValueError):
        return False


def current_traceparent() -> str | None:
    """The ``traceparent`` of the span active in this context, or None.

    None when OpenTelemetry was never imported by the process (then no span can
    be active, and it is not imported here), or when the current span context
    is invalid (no span, or a no-op tracer without a parent). Never raises.
    """
    trace: Any = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags) & 0xFF:02x}"


def check_traceparent(value: str | None) -> str | None:
    """Return *value* when it is a valid version-00 ``traceparent`` (or None), else None.

    Stored values are untrusted for the worker (any SQL client may write the
    column): an unparsable one is ignored rather than propagated.
    """
    if value is None:
        return None
    match = TRACEPARENT_PATTERN.match(value)
    if not match or set(match.group(1)) == {"0"} or set(match.group(2)) == {"0"}:
        return None
    return value


def _link_to(traceparent: str | None) -> list[Any]:
    """A span link to the stored enqueue context, or no link."""
    value = check_traceparent(traceparent)
    if value is None:
        return []
    from opentelemetry import trace

    _, trace_id, span_id, flags = value.split("-")
    ctx = trace.SpanContext(
        trace_id=int(trace_id, 16), span_id=int(span_id, 16), is_remote=True,
        trace_flags=trace.TraceFlags(int(flags, 16)),
    )
    return [trace.Link(ctx, attributes={"receipts.link": "enqueue"})]


@functools.cache
def _tracer() -> Any:
    """The package's tracer, got once (a proxy until the application sets a provider)."""
    from opentelemetry import trace

    return trace.get_tracer(TRACER_NAME)


async def traced_delivery(job: Job, attempt: Callable[[], Awaitable[Outcome]]) -> Outcome:
    """Run one delivery *attempt* inside a ``receipts.deliver`` span (kind CLIENT).

    The span links to ``job.traceparent`` when the job carries a valid one,
    records the job id, the attempt number, the outcome's reason label and
    HTTP status, and is marked as an error unless the receipt was delivered.
    While *attempt* runs the span is current, so :func:`current_traceparent`
    gives the header for the provider. Requires the OpenTelemetry API
    (call only when :func:`otel_available`); returns what *attempt* returns.
    """
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    with _tracer().start_as_current_span(
        DELIVERY_SPAN,
        kind=trace.SpanKind.CLIENT,
        links=_link_to(job.traceparent),
        attributes={"receipts.job.id": str(job.id), "receipts.attempt": job.attempt},
    ) as span:
        outcome = await attempt()
        span.set_attribute("receipts.reason", outcome.reason.value)
        if outcome.status is not None:
            span.set_attribute("http.response.status_code", outcome.status)
        if outcome.verdict is not Verdict.DELIVERED:
            span.set_status(Status(StatusCode.ERROR, outcome.reason.value))
        return outcome
