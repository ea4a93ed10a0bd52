"""Handlers of the review page: what each URL shows and what each form does.

``GET /`` summary and a filtered, paged list; ``GET /jobs/{key}`` one job with
its attempt history; ``POST /confirm`` shows the count an action would
change; ``POST /act`` does it (all or nothing: only if that count still
holds); ``GET|POST /login`` and ``POST /logout``; ``GET /healthz``.

Every page comes from a template with autoescaping on, so every value from
the database (order ids, provider errors) is HTML-escaped; provider text is
also cut to a display length and stripped of control and bidi characters.
No page shows a DSN or a token: lease tokens appear as an 8-character prefix.
"""

from __future__ import annotations

import asyncio
import contextvars
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import urlencode

import jinja2
from aiohttp import web

from receipts.errors import QueueError
from receipts.jobqueue import JobQueue, ReviewFilter
from receipts.logs import get_logger
from receipts.model import JobState, Reason
from receipts.settings import Settings
from receipts.ui.session import (
    COOKIE,
    Session,
    Sessions,
    host_allowed,
    is_loopback,
    same_origin,
)

log = get_logger("ui")

PAGE_SIZE = 50
MAX_SELECTION = 500
LIST_STATES = (JobState.FAILED, JobState.DISCARDED, JobState.READY)
ACTION_STATES = {"retry": (JobState.FAILED,), "discard": (JobState.READY, JobState.FAILED)}
# C0/C1 controls and the bidirectional overrides/isolates (text that reorders itself).
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
CSP = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")

@dataclass(frozen=True, slots=True)
class UiConfig:
    """How the page is served.

    Attributes:
        sessions: the admin-token sessions, or None for a read-only page.
        loopback_only: serve only loopback ``Host`` names (a loopback bind).
    """

    sessions: Sessions | None
    loopback_only: bool


QUEUE: web.AppKey[JobQueue] = web.AppKey("queue", JobQueue)
CONFIG: web.AppKey[UiConfig] = web.AppKey("config", UiConfig)
TEMPLATES: web.AppKey[jinja2.Environment] = web.AppKey("templates", jinja2.Environment)


# The session of the request being handled (set by the guard middleware; each
# request runs in its own task, so this never leaks between requests).
_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "receipts_ui_session", default=None)


class BadInput(ValueError):
    """A form or query value the page cannot use; shown to the user with status 400."""


# ------------------------------------------------------------------ display


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


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("receipts.ui", "templates"),
        autoescape=True,  # every {{ value }} is HTML-escaped
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(clip=clip, when=when, duration=duration)
    return env


# ------------------------------------------------------------------ input


def _parse_time(text: str, name: str) -> datetime | None:
    text = text.strip()
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise BadInput(f"{name} must be a date and time like 2026-01-31T09:30") from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def parse_filter(data: Any) -> ReviewFilter:
    """A :class:`ReviewFilter` from query or form fields; raises :class:`BadInput`.

    Fields: ``state`` (failed, discarded, ready), ``reason`` (a reason label),
    ``status`` (100–599), ``since``/``until`` (ISO times, UTC unless they say
    otherwise) and ``q`` (order id substring, ≤ 200 characters).
    """
    state_text = str(data.get("state") or JobState.FAILED)
    try:
        state = JobState(state_text)
    except ValueError:
        raise BadInput("unknown state") from None
    if state not in LIST_STATES:
        raise BadInput("the list shows failed, discarded or ready jobs")
    reason = str(data.get("reason") or "").strip() or None
    if reason is not None and reason not in set(Reason):
        raise BadInput("unknown reason")
    status_text = str(data.get("status") or "").strip()
    status = None
    if status_text:
        if not status_text.isdigit() or not 100 <= int(status_text) <= 599:
            raise BadInput("status must be an HTTP status from 100 to 599")
        status = int(status_text)
    query = str(data.get("q") or "").strip()
    if len(query) > 200:
        raise BadInput("the order id search is at most 200 characters")
    return ReviewFilter(state=state, reason=reason, status=status,
                        since=_parse_time(str(data.get("since") or ""), "since"),
                        until=_parse_time(str(data.get("until") or ""), "until"),
                        order_contains=query or None)


def filter_fields(view: ReviewFilter) -> dict[str, str]:
    """The query/form fields that reproduce *view* (empty ones left out)."""
    fields = {
        "state": str(view.state), "reason": view.reason or "",
        "status": "" if view.status is None else str(view.status),
        "since": view.since.isoformat() if view.since else "",
        "until": view.until.isoformat() if view.until else "",
        "q": view.order_contains or "",
    }
    return {k: v for k, v in fields.items() if v}


def _parse_cursor(text: str) -> tuple[datetime, uuid.UUID] | None:
    if not text:
        return None
    at, _, job_id = text.partition("~")
    try:
        return datetime.fromisoformat(at), uuid.UUID(job_id)
    except ValueError:
        raise BadInput("bad page cursor") from None


def _parse_ids(values: list[str]) -> list[uuid.UUID]:
    if len(values) > MAX_SELECTION:
        raise BadInput(f"select at most {MAX_SELECTION} jobs at once")
    try:
        return list(dict.fromkeys(uuid.UUID(v) for v in values))
    except ValueError:
        raise BadInput("job ids must be UUIDs") from None


# ------------------------------------------------------------------ pages


def _render(request: web.Request, name: str, status: int = 200, **context: Any) -> web.Response:
    config = request.app[CONFIG]
    session = _SESSION.get()
    context.setdefault("title", "receipts review")
    context.update(
        actions_enabled=config.sessions is not None,
        admin=bool(session and session.admin),
        csrf=config.sessions.csrf_token(session) if config.sessions and session else "",
    )
    html = request.app[TEMPLATES].get_template(name).render(**context)
    return web.Response(text=html, status=status, content_type="text/html", charset="utf-8")


def _message(request: web.Request, status: int, heading: str, text: str) -> web.Response:
    return _render(request, "message.html", status=status, heading=heading, text=text)


async def index(request: web.Request) -> web.Response:
    """The summary and one page of the filtered list."""
    queue = request.app[QUEUE]
    view = parse_filter(request.query)
    cursor = _parse_cursor(request.query.get("after", ""))
    stats, oldest, pause, count, rows = await asyncio.gather(
        queue.queue_stats(), queue.oldest_failed(), queue.provider_pause(),
        queue.review_count(view), queue.review_jobs(view, limit=PAGE_SIZE, after=cursor))
    next_url = None
    if len(rows) == PAGE_SIZE:
        last = rows[-1]
        next_url = "/?" + urlencode(filter_fields(view) | {
            "after": f"{last['sort_at'].isoformat()}~{last['id']}"})
    return _render(
        request, "index.html", stats=stats, oldest_failed=oldest, pause=pause, view=view,
        fields=filter_fields(view), count=count, rows=rows, next_url=next_url,
        first_url="/?" + urlencode(filter_fields(view)) if cursor else None,
        reasons=[str(r) for r in Reason], states=[str(s) for s in LIST_STATES],
        can_retry=view.state in ACTION_STATES["retry"],
        can_discard=view.state in ACTION_STATES["discard"],
    )


async def job_page(request: web.Request) -> web.Response:
    """One job (by UUID or order id) and its attempt history."""
    queue = request.app[QUEUE]
    key = request.match_info["key"]
    row = await queue.show_job(key) if len(key) <= 200 else None
    if row is None:
        return _message(request, 404, "No such job", f"No job has the id or order id {key!r}.")
    attempts = await queue.job_attempts(row["id"])
    token = row.pop("lease_token", None)
    row["lease_token_prefix"] = token.hex[:8] if token else None
    return _render(request, "job.html", job=row, attempts=attempts,
                   title=f"job {row['order_id']}",
                   can_retry=row["state"] in ACTION_STATES["retry"],
                   can_discard=row["state"] in ACTION_STATES["discard"])


async def find(request: web.Request) -> web.Response:
    """``GET /find?key=…``: open a job by id or order id."""
    key = request.query.get("key", "").strip()
    if not key:
        raise web.HTTPSeeOther("/")
    raise web.HTTPSeeOther("/jobs/" + _quote_path(key))


def _quote_path(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


async def _action_form(request: web.Request) -> tuple[str, Any, int | None]:
    """Parse an action form: (do, ids or filter, expected count or None)."""
    form = await request.post()
    do, _, scope = str(form.get("action", "")).partition(":")
    if do not in ACTION_STATES:
        raise BadInput("unknown action")
    target: Any
    if scope == "selected":
        target = _parse_ids([str(v) for v in form.getall("id", [])])
        if not target:
            raise BadInput("select at least one job")
    elif scope == "filter":
        target = parse_filter(form)
        if target.state not in ACTION_STATES[do]:
            raise BadInput(f"{do} applies to {' or '.join(ACTION_STATES[do])} jobs only")
    else:
        raise BadInput("unknown scope")
    expected_text = str(form.get("expected", ""))
    expected = int(expected_text) if expected_text.isdigit() else None
    return do, target, expected


async def confirm(request: web.Request) -> web.Response:
    """Show what an action would change (the count) and ask for confirmation."""
    queue = request.app[QUEUE]
    do, target, _ = await _action_form(request)
    refused: list[tuple[str, str]] = []
    sample: list[dict[str, Any]] = []
    if isinstance(target, ReviewFilter):
        count = await queue.review_count(target)
        sample = await queue.review_jobs(target, limit=10)
        fields = filter_fields(target)
    else:
        states = await queue.job_states(target)
        refused = [(str(i), str(states.get(i, "unknown"))) for i in target
                   if states.get(i) not in ACTION_STATES[do]]
        count = len(target)
        fields = {}
    return _render(request, "confirm.html", do=do, target_ids=[
        str(i) for i in target] if not isinstance(target, ReviewFilter) else [],
        scope="filter" if isinstance(target, ReviewFilter) else "selected",
        fields=fields, count=count, refused=refused, sample=sample,
        allowed=" or ".join(ACTION_STATES[do]), title=f"confirm {do}")


async def act(request: web.Request) -> web.Response:
    """Do a confirmed action, only if the confirmed count still holds."""
    queue = request.app[QUEUE]
    do, target, expected = await _action_form(request)
    if expected is None:
        raise BadInput("confirm the action first")
    run = queue.retry_jobs if do == "retry" else queue.discard_jobs
    changed = await run(target, expected=expected)
    scope = "filter" if isinstance(target, ReviewFilter) else "selected"
    log.info("ui_action", extra={"action": do, "scope": scope, "expected": expected,
                                 "changed": len(changed), "peer": request.remote})
    if expected == 0 or len(changed) != expected:
        return _message(
            request, 409, "Nothing changed",
            f"You confirmed {expected} job(s), but the jobs changed since then (another "
            "operator, a worker or recovery acted on them). Nothing was changed: review "
            "the list and try again.")
    verb = "Retried" if do == "retry" else "Discarded"
    return _render(request, "done.html", verb=verb, changed=[str(c) for c in changed],
                   title=verb.lower())


async def login_page(request: web.Request) -> web.Response:
    """The token form."""
    if request.app[CONFIG].sessions is None:
        return _message(request, 403, "Read-only", "Actions are off: no admin token is set.")
    return _render(request, "login.html", title="sign in")


async def login(request: web.Request) -> web.Response:
    """Check the token (in the middleware) and go back to the list."""
    raise web.HTTPSeeOther("/")


async def logout(request: web.Request) -> web.Response:
    """End the admin session (a fresh guest session replaces it)."""
    sessions = request.app[CONFIG].sessions
    response = web.HTTPSeeOther("/")
    if sessions is not None:
        _set_cookie(response, sessions, sessions.issue("guest")[1])
    raise response


async def healthz(_: web.Request) -> web.Response:
    """The process is alive (no database access)."""
    return web.json_response({"status": "ok"})


async def stylesheet(_: web.Request) -> web.Response:
    """The one stylesheet (inline styles would need a weaker CSP)."""
    css = resources.files("receipts.ui").joinpath("static/review.css").read_text("utf-8")
    return web.Response(text=css, content_type="text/css",
                        headers={"Cache-Control": "max-age=300"})


# -------------------------------------------------------------- middleware

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# POSTs that need the admin session (or the token in the form); /confirm only shows a count.
_NEEDS_ADMIN = {"/act", "/login"}


def _set_cookie(response: web.StreamResponse, sessions: Sessions, value: str) -> None:
    response.set_cookie(COOKIE, value, max_age=sessions.lifetime_seconds, path="/",
                        httponly=True, secure=True, samesite="Strict")


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Host check, sessions, CSRF/origin/token checks on POST, errors, security headers."""
    config = request.app[CONFIG]
    raised = None
    try:
        if not host_allowed(request.headers.get("Host"), loopback_only=config.loopback_only):
            response: web.StreamResponse = web.Response(
                status=421, text="This page is served on localhost only.\n")
        else:
            response = await _guarded(request, handler, config)
    except web.HTTPException as exc:  # redirects
        response = raised = exc
    except BadInput as exc:
        response = _message(request, 400, "Bad request", str(exc))
    except QueueError as exc:
        log.warning("ui_database_error", extra={"error": str(exc), "path": request.path})
        response = _message(request, 503, "Database unavailable",
                            "The queue database did not answer; try again shortly.")
    headers = response.headers
    headers["Content-Security-Policy"] = CSP
    headers["X-Content-Type-Options"] = "nosniff"
    headers["X-Frame-Options"] = "DENY"
    headers["Referrer-Policy"] = "same-origin"
    headers.setdefault("Cache-Control", "no-store")
    if raised is not None:
        raise raised
    return response


async def _guarded(request: web.Request, handler: Handler,
                   config: UiConfig) -> web.StreamResponse:
    sessions = config.sessions
    new_cookie = None
    if sessions is not None:
        session = sessions.verify(request.cookies.get(COOKIE))
        if session is None:
            session, new_cookie = sessions.issue("guest")
        _SESSION.set(session)
    if request.method == "POST":
        refused, upgraded = await _refuse_post(request, sessions)
        if refused is not None:
            return refused
        new_cookie = upgraded or new_cookie
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if new_cookie is not None and sessions is not None:
            _set_cookie(exc, sessions, new_cookie)
        raise
    if new_cookie is not None and sessions is not None:
        _set_cookie(response, sessions, new_cookie)
    return response


async def _refuse_post(request: web.Request, sessions: Sessions | None
                       ) -> tuple[web.Response | None, str | None]:
    """(None, new admin cookie or None) when the POST may proceed, else (the 403 page, None)."""
    if sessions is None:
        return _message(request, 403, "Read-only",
                        "This review page is read-only: RECEIPTS_UI_ADMIN_TOKEN is not set."), None
    if not same_origin(request.headers.get("Host"), request.headers.get("Origin"),
                       request.headers.get("Sec-Fetch-Site"), request.headers.get("Referer")):
        log.warning("ui_refused", extra={"why": "cross-origin", "path": request.path,
                                         "peer": request.remote})
        return _message(request, 403, "Refused", "This request came from another site."), None
    form = await request.post()
    session = _SESSION.get()
    if session is None or not sessions.csrf_matches(session, str(form.get("csrf", ""))):
        log.warning("ui_refused", extra={"why": "csrf", "path": request.path,
                                         "peer": request.remote})
        return _message(request, 403, "Refused", "The form expired or came from elsewhere; "
                        "reload the page and try again."), None
    if session.admin:
        return None, None
    token = str(form.get("token", ""))
    if token and sessions.token_matches(token):
        upgraded, cookie = sessions.issue("admin")  # a new session id: no fixation
        _SESSION.set(upgraded)
        log.info("ui_signed_in", extra={"peer": request.remote})
        return None, cookie
    if request.path in _NEEDS_ADMIN:
        log.warning("ui_refused", extra={"why": "token", "path": request.path,
                                         "peer": request.remote})
        return _message(request, 403, "Admin token required",
                        "Retry and discard need the admin token: enter it on the "
                        "confirmation page or sign in."), None
    return None, None


# ------------------------------------------------------------------ wiring


def make_app(queue: JobQueue, *, admin_token: str | None, loopback_only: bool) -> web.Application:
    """The review page as an aiohttp application on an open :class:`JobQueue`.

    *admin_token* None makes it read-only (every POST is refused);
    *loopback_only* serves only loopback ``Host`` names (see
    :func:`receipts.ui.session.host_allowed`).
    """
    app = web.Application(middlewares=[guard], client_max_size=256 * 1024)
    app[QUEUE] = queue
    app[CONFIG] = UiConfig(Sessions(admin_token) if admin_token else None, loopback_only)
    app[TEMPLATES] = _environment()
    app.router.add_get("/", index)
    app.router.add_get("/find", find)
    app.router.add_get("/jobs/{key}", job_page)
    app.router.add_post("/confirm", confirm)
    app.router.add_post("/act", act)
    app.router.add_get("/login", login_page)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/static/review.css", stylesheet)
    return app


async def run_ui(settings: Settings) -> None:
    """Serve the review page on ``ui_host:ui_port`` until SIGTERM/SIGINT.

    One small pool (2 connections, application name ``<name>-ui``). Raises
    ``OSError`` when the port is taken.
    """
    import signal

    from receipts.db import make_pool
    from receipts.metrics import start_server

    pool = make_pool(settings, "ui", max_size=2)
    queue = JobQueue(pool, lease_seconds=settings.lease_seconds,
                     max_attempts=settings.max_attempts, schema=settings.db_schema)
    token = settings.ui_admin_token.get_secret_value() if settings.ui_admin_token else None
    app = make_app(queue, admin_token=token, loopback_only=is_loopback(settings.ui_host))
    # Bind first: a taken port or a bad host raises OSError before any pool
    # task or signal handler exists (the pool's reconnect task once kept a
    # failed start from ever ending, deaf to SIGTERM).
    runner = await start_server(app, settings.ui_port, host=settings.ui_host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await pool.open(wait=False)
    log.info("ui_started", extra={"host": settings.ui_host, "port": settings.ui_port,
                                  "mode": "admin" if token else "read-only",
                                  "database": settings.safe_dsn})
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await pool.close(timeout=5.0)
