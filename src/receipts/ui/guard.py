"""The console's access guard, one middleware in front of every handler: the ``Host``
check, sessions (revocations read before they are trusted), read access, and on every POST
the origin, CSRF and token checks with sign-in pacing and the admin role
(:mod:`receipts.ui.session` holds the rules); database errors become "Slow", "Busy" or
"Database unavailable"; every response gets the security headers (CSP and friends)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlencode

from aiohttp import web

from receipts.errors import DatabaseUnavailable, QueueError, StatementTimeout
from receipts.logs import get_logger
from receipts.ui.display import (
    clip,
    message,
)
from receipts.ui.form import (
    BadInput,
)
from receipts.ui.session import (
    COOKIE,
    Session,
    Sessions,
    host_allowed,
    keeps_secure_cookie,
    same_origin,
)
from receipts.ui.state import (
    CONSOLE,
    SESSION,
    UiConfig,
    load_revocations,
)

log = get_logger("ui")


CSP = ("default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'self'; "
       "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
#: The header live.js sends with its refreshes (they get 401/503 texts, not pages).
LIVE_HEADER = "X-Receipts-Live"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: Paths anyone may fetch, even where reading needs a token.
_PUBLIC = {"/login", "/healthz", "/static/review.css", "/static/live.js"}
#: POSTs that need no session at all (the token form and sign-out).
_OPEN_POSTS = {"/login", "/logout"}
#: POSTs a reader may make without the admin role (it only shows what an action would do).
_READER_POSTS = {"/confirm"}


def set_cookie(response: web.StreamResponse, sessions: Sessions, value: str) -> None:
    """Set the session cookie *value* on *response*: ``HttpOnly; Secure; SameSite=Strict``, for
    the session's lifetime."""
    response.set_cookie(COOKIE, value, max_age=sessions.lifetime_seconds, path="/",
                        httponly=True, secure=True, samesite="Strict")


def keeps_cookie(request: web.Request) -> bool:
    """Whether the browser will keep the ``Secure`` session cookie on this request's page
    (:func:`receipts.ui.session.keeps_secure_cookie`)."""
    return keeps_secure_cookie(request.scheme, request.headers.get("X-Forwarded-Proto"),
                               request.headers.get("Host"))


def _insecure_text(request: web.Request) -> str:
    return (f"This page is served over plain HTTP at {clip(request.host, 100)}, so the "
            "browser does not keep its session cookie (it is marked Secure) and no form can "
            "be sent. Serve the page over HTTPS (an Ingress with TLS, setting "
            "X-Forwarded-Proto), or reach it on localhost (kubectl port-forward).")


def _database_error(request: web.Request, exc: QueueError) -> web.Response:
    """The page for a database error: slow, busy, or unavailable (they need different acts)."""
    console = request.app[CONSOLE]
    log.warning("ui_database_error", extra={"error": str(exc), "path": request.path,
                                            "slow": isinstance(exc, StatementTimeout)})
    live = request.headers.get(LIVE_HEADER) == "1"
    if isinstance(exc, StatementTimeout):
        heading, text = "Slow", (
            "The database took too long to answer this page's query and it was stopped (the "
            "statement timeout protects the checkout). The database is up: narrow the filter "
            "or try again in a moment.")
    elif isinstance(exc, DatabaseUnavailable) and console.monitor.answered_within(
            3 * console.options.refresh_seconds + 5):
        heading, text = "Busy", (
            "The database answered a moment ago, but this page's query found no free "
            "connection or no answer in time; try again in a moment.")
    elif isinstance(exc, DatabaseUnavailable):
        heading, text = "Database unavailable", (
            "The queue database did not answer; try again shortly.")
    else:
        heading, text = "Database error", "The query failed; the page's log says why."
    if live:
        return web.Response(status=503, text=f"{heading}: {text}",
                            headers={"Retry-After": "5"})
    response = message(request, 503, heading, text)
    response.headers["Retry-After"] = "5"
    return response


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Host check, sessions, read access, CSRF/origin/token checks on POST, errors, headers."""
    config = request.app[CONSOLE].config
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
        response = message(request, 400, "Bad request", str(exc))
    except QueueError as exc:
        response = _database_error(request, exc)
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
        if session is not None and session.role != "guest" and not sessions.revocations_loaded:
            # The start's read did not finish (the database was away): read the list now,
            # or answer 503 (QueueError), rather than trust a cookie that may be signed out.
            await load_revocations(request.app[CONSOLE])
            session = sessions.verify(request.cookies.get(COOKIE))
        if session is None:
            session, new_cookie = sessions.issue("guest")
        SESSION.set(session)
        if (sessions.viewer_required and not session.reader and request.method == "GET"
                and request.path not in _PUBLIC):
            if request.headers.get(LIVE_HEADER) == "1":
                return web.Response(status=401, text="Signed out: sign in again to read.")
            to_login = web.HTTPSeeOther("/login?" + urlencode({"next": request.path_qs}))
            if new_cookie is not None:
                set_cookie(to_login, sessions, new_cookie)
            raise to_login
    if request.method == "POST":
        refused, upgraded = await _refuse_post(request, sessions)
        if refused is not None:
            return refused
        new_cookie = upgraded or new_cookie
    request.app[CONSOLE].monitor.viewed()
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if new_cookie is not None and sessions is not None:
            set_cookie(exc, sessions, new_cookie)
        raise
    if new_cookie is not None and sessions is not None:
        set_cookie(response, sessions, new_cookie)
    return response


async def _refuse_post(request: web.Request, sessions: Sessions | None
                       ) -> tuple[web.Response | None, str | None]:
    """(None, new session cookie or None) when the POST may proceed, else (the refusal, None)."""
    if sessions is None:
        return message(request, 403, "Read-only",
                        "This review page is read-only: RECEIPTS_UI_ADMIN_TOKEN is not set."), None
    if not same_origin(request.headers.get("Host"), request.headers.get("Origin"),
                       request.headers.get("Sec-Fetch-Site"), request.headers.get("Referer")):
        log.warning("ui_refused", extra={"why": "cross-origin", "path": request.path,
                                         "peer": request.remote})
        return message(request, 403, "Refused", "This request came from another site."), None
    form = await request.post()
    session = SESSION.get()
    if session is None or not sessions.csrf_matches(session, str(form.get("csrf", ""))):
        if COOKIE not in request.cookies and not keeps_cookie(request):
            log.warning("ui_refused", extra={"why": "insecure-transport", "path": request.path,
                                             "peer": request.remote})
            return message(request, 400, "Sign-in needs HTTPS here",
                            _insecure_text(request)), None
        log.warning("ui_refused", extra={"why": "csrf", "path": request.path,
                                         "peer": request.remote})
        return message(request, 403, "Refused", "The form expired or came from elsewhere; "
                        "reload the page and try again."), None
    token = str(form.get("token", ""))
    if token:
        throttle = request.app[CONSOLE].throttle
        client = request.remote or "unknown"
        if not throttle.may_check(client):  # throttled, and a token was checked this second
            log.warning("ui_refused", extra={"why": "throttled", "path": request.path,
                                             "peer": request.remote})
            return _throttled(request, throttle.check_seconds), None
        role = sessions.role_for(token)
        if role is None:
            throttled = throttle.retry_after(client) > 0
            throttle.failed(client)
            log.warning("ui_refused", extra={"why": "throttled" if throttled else "token",
                                             "path": request.path, "peer": request.remote})
            if throttled:
                return _throttled(request, throttle.retry_after(client)), None
            return message(request, 403, "Wrong token",
                            "That token is neither the admin nor the viewer token."), None
        # The right token passes even while this address is throttled (see SignInThrottle).
        if role == "admin" or not session.admin:
            upgraded, cookie = sessions.issue(role)  # a new session id: no fixation
            SESSION.set(upgraded)
            log.info("ui_signed_in", extra={"role": role, "session": upgraded.short_id,
                                            "peer": request.remote})
            session = upgraded
        else:
            cookie = None
        return _needs_admin(request, session, sessions), cookie
    return _needs_admin(request, session, sessions), None


def _throttled(request: web.Request, wait: float) -> web.Response:
    """The 429 of a throttled address (*wait*: seconds until it is worth trying again)."""
    seconds = max(1, round(wait))
    refusal = message(request, 429, "Too many attempts",
                       "Too many wrong tokens from your address: its tokens are checked at "
                       "most once a second, and wrong ones are refused for a while; the right "
                       f"token still signs you in. Try again in {seconds} s.")
    refusal.headers["Retry-After"] = str(seconds)
    return refusal


def _needs_admin(request: web.Request, session: Session,
                 sessions: Sessions) -> web.Response | None:
    """The refusal of a POST that needs the admin role (None when allowed)."""
    if request.path in _OPEN_POSTS or (session.admin and sessions.actions_enabled):
        return None
    if request.path in _READER_POSTS and (session.reader or not sessions.viewer_required):
        return None
    if not sessions.actions_enabled:
        return message(request, 403, "Read-only",
                        "This review page is read-only: RECEIPTS_UI_ADMIN_TOKEN is not set.")
    log.warning("ui_refused", extra={"why": "not-admin", "path": request.path,
                                     "peer": request.remote})
    return message(request, 403, "Admin token required",
                    "Retry, discard, pause, resume and recover need the admin token: enter "
                    "it on the confirmation page or sign in.")
