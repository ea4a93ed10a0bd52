"""How the console shows things: display helpers (every database value clipped and
stripped of control and bidi characters; times, durations and counts as people read them)
and the template environment (autoescaping on, so every value is HTML-escaped), with
:func:`render` and :func:`message` for every page."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from typing import Any

import jinja2
from aiohttp import web

from receipts.ui.state import (
    CONSOLE,
    LIST_STATES,
    SESSION,
    TEMPLATES,
    user_of,
)

PAUSE_CHOICES = (("15m", "15 minutes"), ("30m", "30 minutes"), ("1h", "1 hour"),
                 ("2h", "2 hours"), ("4h", "4 hours"), ("8h", "8 hours"), ("24h", "24 hours"))


# C0/C1 controls and the bidirectional overrides/isolates (text that reorders itself).
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
PAUSE_REASONS = {
    "manual": "an operator paused them",
    "outage": "the provider is failing (an outage)",
    "auth": "the provider refused our credentials (401/403)",
    "retry_after": "the provider asked us to wait (429 with Retry-After)",
    "rejecting": "the provider rejects nearly every receipt",
}


def clip(value: object, limit: int = 200) -> str:
    """*value* as one display line: control/bidi characters → U+FFFD, cut to *limit*."""
    text = "" if value is None else str(value)
    text = _UNPRINTABLE.sub("\ufffd", text.replace("\r\n", " ").replace("\n", " ")
                            .replace("\t", " "))
    if len(text) > limit:
        return f"{text[:limit]}… (+{len(text) - limit} characters)"
    return text


def when(value: datetime | None) -> str:
    """A database time as ``YYYY-MM-DD HH:MM:SS UTC`` (empty for None)."""
    if value is None:
        return ""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def epoch_ms(value: datetime | None) -> int:
    """A time as Unix milliseconds (0 for None), for live.js's clocks."""
    return 0 if value is None else int(value.timestamp() * 1000)


def duration(seconds: float | None) -> str:
    """Seconds as a short human duration (``850 ms``, ``12.3 s``, ``4 min 5 s``, ``2 h 3 min``)."""
    if seconds is None:
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min"
    return f"{hours // 24} d {hours % 24} h"


def number(value: int | float | None) -> str:
    """A count with thousands separators (``1,000,000``)."""
    return "" if value is None else f"{value:,}"


def rounded(value: int) -> str:
    """An estimate to two significant figures (``≈ 12,000``, ``≈ 1.2 million``)."""
    if value < 100:
        return f"{value}"
    if value >= 1_000_000:
        return f"{value / 1_000_000:.2g} million"
    digits = len(str(value)) - 2
    return f"{round(value, -digits):,}"


def environment() -> jinja2.Environment:
    """The template environment: autoescaping on, strict undefined names, the display filters
    and the globals every page uses."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("receipts.ui", "templates"),
        autoescape=True,  # every {{ value }} is HTML-escaped
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(clip=clip, when=when, duration=duration, number=number,
                       epoch_ms=epoch_ms, rounded=rounded)
    env.globals.update(pause_reasons=PAUSE_REASONS, pause_choices=PAUSE_CHOICES,
                       states=[str(s) for s in LIST_STATES])
    return env


def render(request: web.Request, name: str, status: int = 200, **context: Any) -> web.Response:
    """The page *name* (a template) with *context* and what every page shows (role, CSRF token,
    the proxy-named user, refresh interval), as an HTML response of *status*."""
    console = request.app[CONSOLE]
    config = console.config
    session = SESSION.get()
    context["title"] = clip(context.get("title", "receipts console"), 80)
    context.setdefault("current_state", "")
    context.setdefault("live", False)
    context.update(
        actions_enabled=config.actions_enabled,
        admin=bool(session and session.admin and config.actions_enabled),
        reader=bool(session and session.reader),
        viewer_required=bool(config.sessions and config.sessions.viewer_required),
        csrf=config.sessions.csrf_token(session) if config.sessions and session else "",
        user=user_of(request),
        refresh_seconds=console.options.refresh_seconds,
        now_ms=int(time.time() * 1000),
        path_qs=request.path_qs,
    )
    html = request.app[TEMPLATES].get_template(name).render(**context)
    return web.Response(text=html, status=status, content_type="text/html", charset="utf-8")


def message(request: web.Request, status: int, heading: str, text: str,
             **extra: Any) -> web.Response:
    """A page with one heading and one line of text (errors, refusals, outcomes), of *status*."""
    return render(request, "message.html", status=status, heading=heading, text=text,
                   title=heading, **extra)
