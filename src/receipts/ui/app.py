"""Handlers of the review page: what each URL shows and what each form does.

``GET /`` the console: the shared summary, the queue-depth chart, the
provider's flow state, the workers, the bulk actions and a filtered, paged
list of one state's jobs; ``GET /jobs/{key}`` one job with its attempt
history; ``POST /confirm`` shows what an action would change; ``POST /act``
does it (named jobs: all or nothing; a filter: a bulk action, ``GET
/bulk/{id}`` shows its progress, ``POST /bulk/{id}/stop|resume``);
``POST /fleet/pause|resume`` the fleet-wide pause; ``POST /recover`` one
recovery sweep of expired leases; ``GET|POST /login``, ``POST /logout``;
``GET /healthz``; ``/static/review.css`` and ``/static/live.js``.

Every page comes from a template with autoescaping on, so every value from
the database (order ids, provider errors) is HTML-escaped; provider text is
also cut to a display length and stripped of control and bidi characters.
No page shows a DSN or a token: lease tokens appear as an 8-character prefix.
The pages work without scripts; ``live.js`` (same origin, the only script
the CSP allows) refreshes them in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import re
import signal
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from aiohttp import web

from receipts import bulk, fleet, recovery, review
from receipts.db import make_pool
from receipts.errors import DatabaseUnavailable, QueueError, StatementTimeout
from receipts.jobqueue import JobQueue
from receipts.logs import get_logger
from receipts.metrics import start_server
from receipts.model import JobState, Reason
from receipts.operations import Operations, ReviewFilter, bulk_view
from receipts.runtime import make_operations, make_queue
from receipts.settings import Settings
from receipts.ui.chart import depth_chart, legend
from receipts.ui.monitor import Monitor, Snapshot
from receipts.ui.session import (
    COOKIE,
    Session,
    Sessions,
    SignInThrottle,
    host_allowed,
    is_loopback,
    keeps_secure_cookie,
    same_origin,
)

log = get_logger("ui")

PAGE_SIZE = 50
MAX_SELECTION = 500
#: A list's count stops at this many (shown as "10,000+") or after LIST_COUNT_SECONDS
#: (a selective filter over many rows: shown as "many"), whichever comes first.
LIST_COUNT_CAP = 10_000
LIST_COUNT_SECONDS = 1.0
#: A filter action's count must finish within this (seconds), else it says "at least".
CONFIRM_COUNT_SECONDS = 2.0
CONFIRM_COUNT_CAP = 100_000
LIST_STATES = (JobState.READY, JobState.RUNNING, JobState.DONE, JobState.FAILED,
               JobState.DISCARDED)
ACTION_STATES = {"retry": (JobState.FAILED,), "discard": (JobState.READY, JobState.FAILED)}
PAUSE_CHOICES = (("15m", "15 minutes"), ("30m", "30 minutes"), ("1h", "1 hour"),
                 ("2h", "2 hours"), ("4h", "4 hours"), ("8h", "8 hours"), ("24h", "24 hours"))
#: Expired leases one "recover now" returns at most (batches of the recovery batch size).
RECOVER_MAX_BATCHES = 100
# C0/C1 controls and the bidirectional overrides/isolates (text that reorders itself).
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
CSP = ("default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'self'; "
       "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
#: The header live.js sends with its refreshes (they get 401/503 texts, not pages).
LIVE_HEADER = "X-Receipts-Live"
PAUSE_REASONS = {
    "manual": "an operator paused them",
    "outage": "the provider is failing (an outage)",
    "auth": "the provider refused our credentials (401/403)",
    "retry_after": "the provider asked us to wait (429 with Retry-After)",
    "rejecting": "the provider rejects nearly every receipt",
}


@dataclass(frozen=True, slots=True)
class UiOptions:
    """How the page reads and acts (from :class:`Settings`; tests pass their own).

    Attributes:
        refresh_seconds: how often pages refresh themselves and the shared reading.
        rate, burst: the fleet's provider rate limit (jobs/s, jobs), for display.
        recovery_delay_seconds, recovery_batch_size: as ``receipts recover``.
        bulk_policy: how bulk actions are batched and paced.
        idle_refresh_seconds: the shared reading's interval while nobody looks.
    """

    refresh_seconds: float = 5.0
    rate: float = 0.0
    burst: float = 1.0
    recovery_delay_seconds: float = 5.0
    recovery_batch_size: int = 100
    bulk_policy: bulk.BulkPolicy = field(default_factory=bulk.BulkPolicy)
    idle_refresh_seconds: float = 60.0

    @classmethod
    def from_settings(cls, settings: Settings) -> UiOptions:
        """The options *settings* describe."""
        return cls(refresh_seconds=settings.ui_refresh_seconds,
                   rate=settings.provider_rate_limit_per_second, burst=settings.burst,
                   recovery_delay_seconds=settings.recovery_delay_seconds,
                   recovery_batch_size=settings.recovery_batch_size)


@dataclass(frozen=True, slots=True)
class UiConfig:
    """How the page is served.

    Attributes:
        sessions: the token sessions, or None (read-only, and reading is open).
        loopback_only: serve only loopback ``Host`` names (a loopback bind).
    """

    sessions: Sessions | None
    loopback_only: bool

    @property
    def actions_enabled(self) -> bool:
        """True when an admin token is configured."""
        return self.sessions is not None and self.sessions.actions_enabled


class ListCache:
    """Pages of the job list, shared by viewers of the same view for one interval.

    Keyed by the view's query and cursor; at most *size* entries (least
    recently used go first); :meth:`clear` after every action.
    """

    def __init__(self, seconds: float, size: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.size = size
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self._pending: dict[str, asyncio.Future[Any]] = {}

    async def get(self, key: str, load: Callable[[], Awaitable[Any]]) -> Any:
        """The cached value of *key*, or *load*'s (one load for concurrent callers)."""
        hit = self._entries.get(key)
        if hit is not None and self._clock() - hit[0] < self.seconds:
            self._entries.move_to_end(key)
            return hit[1]
        pending = self._pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            value = await load()
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: nobody else may be waiting
            raise
        finally:
            self._pending.pop(key, None)
        future.set_result(value)
        self._entries[key] = (self._clock(), value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        """Forget every page (an action changed jobs)."""
        self._entries.clear()


@dataclass
class Console:
    """Everything the handlers share: the statements (recovery's queue, the operator's
    operations), the reading, the sessions."""

    queue: JobQueue
    operations: Operations
    monitor: Monitor
    config: UiConfig
    options: UiOptions
    lists: ListCache
    throttle: SignInThrottle
    runners: set[asyncio.Task[Any]] = field(default_factory=set)


CONSOLE: web.AppKey[Console] = web.AppKey("console", Console)
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


def _environment() -> jinja2.Environment:
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

    Fields: ``state`` (ready, running, done, failed, discarded), ``reason``
    (a reason label), ``status`` (100–599), ``since``/``until`` (ISO times,
    UTC unless they say otherwise), ``q`` (order id substring, ≤ 200
    characters) and, for running jobs, ``expired`` (1: leases that ran out,
    0: live ones).
    """
    state_text = str(data.get("state") or JobState.FAILED)
    try:
        state = JobState(state_text)
    except ValueError:
        raise BadInput("unknown state") from None
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
    expired_text = str(data.get("expired") or "")
    if expired_text not in ("", "0", "1"):
        raise BadInput("expired is 1 (leases that ran out) or 0 (live leases)")
    expired = None if not expired_text or state is not JobState.RUNNING else expired_text == "1"
    return ReviewFilter(state=state, reason=reason, status=status,
                        since=_parse_time(str(data.get("since") or ""), "since"),
                        until=_parse_time(str(data.get("until") or ""), "until"),
                        order_contains=query or None, expired=expired)


def filter_fields(view: ReviewFilter) -> dict[str, str]:
    """The query/form fields that reproduce *view* (empty ones left out)."""
    fields = {
        "state": str(view.state), "reason": view.reason or "",
        "status": "" if view.status is None else str(view.status),
        "since": view.since.isoformat() if view.since else "",
        "until": view.until.isoformat() if view.until else "",
        "q": view.order_contains or "",
        "expired": "" if view.expired is None else str(int(view.expired)),
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


def _parse_uuid(text: str, what: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise BadInput(f"{what} must be a UUID") from None


# ------------------------------------------------------------------ pages


def _author(session: Session | None) -> str:
    """Who acts, for ``paused_by`` and bulk actions: ``ui:<session id prefix>``."""
    return f"ui:{session.short_id}" if session else "ui:anonymous"


def _render(request: web.Request, name: str, status: int = 200, **context: Any) -> web.Response:
    console = request.app[CONSOLE]
    config = console.config
    session = _SESSION.get()
    context["title"] = clip(context.get("title", "receipts console"), 80)
    context.setdefault("current_state", "")
    context.setdefault("live", False)
    context.update(
        actions_enabled=config.actions_enabled,
        admin=bool(session and session.admin and config.actions_enabled),
        reader=bool(session and session.reader),
        viewer_required=bool(config.sessions and config.sessions.viewer_required),
        csrf=config.sessions.csrf_token(session) if config.sessions and session else "",
        refresh_seconds=console.options.refresh_seconds,
        now_ms=int(time.time() * 1000),
        path_qs=request.path_qs,
    )
    html = request.app[TEMPLATES].get_template(name).render(**context)
    return web.Response(text=html, status=status, content_type="text/html", charset="utf-8")


def _message(request: web.Request, status: int, heading: str, text: str,
             **extra: Any) -> web.Response:
    return _render(request, "message.html", status=status, heading=heading, text=text,
                   title=heading, **extra)


def _done_text(snapshot: Snapshot) -> tuple[str, str]:
    """The done card: (value, note): exact when counted, else the rounded estimate."""
    if snapshot.done is not None:
        return number(snapshot.done), "delivered, kept until retention"
    return f"≈ {rounded(snapshot.stats.done_estimate)}", "estimate (table statistics)"


async def index(request: web.Request) -> web.Response:
    """The console: shared summary, chart, provider, workers, bulk actions, one list."""
    console = request.app[CONSOLE]
    view = parse_filter(request.query)
    cursor = _parse_cursor(request.query.get("after", ""))
    snapshot = await console.monitor.current()
    key = urlencode(filter_fields(view)) + "|" + request.query.get("after", "")

    async def load() -> tuple[int | None, list[dict[str, Any]]]:
        return await review.page(console.operations, view, limit=PAGE_SIZE, after=cursor,
                                 count_seconds=LIST_COUNT_SECONDS, count_cap=LIST_COUNT_CAP)

    count, rows = await console.lists.get(key, load)
    next_url = None
    if len(rows) == PAGE_SIZE:
        last = rows[-1]
        next_url = "/?" + urlencode(filter_fields(view) | {
            "after": f"{last['sort_at'].isoformat()}~{last['id']}"})
    done_value, done_note = _done_text(snapshot)
    return _render(
        request, "index.html", snapshot=snapshot, stats=snapshot.stats, flow=snapshot.flow,
        workers=snapshot.workers, live_workers=snapshot.live_workers,
        bulk_actions=snapshot.bulk, view=view, fields=filter_fields(view),
        count=count, count_text=("many" if count is None else number(count)
                                 + ("+" if count >= LIST_COUNT_CAP else "")),
        rows=rows, next_url=next_url,
        first_url="/?" + urlencode(filter_fields(view)) if cursor else None,
        reasons=[str(r) for r in Reason], current_state=str(view.state),
        can_retry=view.state in ACTION_STATES["retry"],
        can_discard=view.state in ACTION_STATES["discard"],
        chart=depth_chart(list(console.monitor.history), snapshot.as_of,
                          interval_seconds=console.options.refresh_seconds),
        legend=legend(), history_since=(console.monitor.history[0].at
                                        if console.monitor.history else None),
        done_value=done_value, done_note=done_note, monitor_error=console.monitor.error,
        sample_seconds=console.monitor.interval(),
        rate=console.options.rate, burst=console.options.burst, live=True,
        title=f"receipts console · {view.state}")


async def job_page(request: web.Request) -> web.Response:
    """One job (by UUID or order id) and its attempt history."""
    console = request.app[CONSOLE]
    key = request.match_info["key"]
    row = await review.job(console.operations, key) if len(key) <= 200 else None
    if row is None:
        return _message(request, 404, "No such job",
                        f"No job has the id or order id {clip(key, 80)!r}.")
    attempts = row.pop("history")
    tag = row.pop("holder_tag")
    holder = None
    if tag is not None:
        workers = console.monitor.snapshot.workers if console.monitor.snapshot else []
        holder = next((w for w in workers if w["tag"] == tag), None)
    expired = bool(row["lease_until"] and row["lease_until"] <= datetime.now(UTC))
    return _render(request, "job.html", job=row, attempts=attempts, holder=holder,
                   expired=expired, title=f"job {clip(row['order_id'], 60)}",
                   current_state=str(row["state"]),
                   can_retry=row["state"] in ACTION_STATES["retry"],
                   can_discard=row["state"] in ACTION_STATES["discard"])


async def find(request: web.Request) -> web.Response:
    """``GET /find?key=…``: open a job by id or order id."""
    key = request.query.get("key", "").strip()
    if not key:
        raise web.HTTPSeeOther("/")
    raise web.HTTPSeeOther("/jobs/" + quote(key, safe=""))


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
    """Show what an action would change (the count) and ask for confirmation.

    For a filter, the count is taken at a moment, the action's cutoff: jobs
    that reach the state later are not part of it.
    """
    console = request.app[CONSOLE]
    do, target, _ = await _action_form(request)
    refused: list[tuple[str, str]] = []
    sample: list[dict[str, Any]] = []
    cutoff = ""
    exact = True
    if isinstance(target, ReviewFilter):
        at, count, exact = await bulk.confirmation(
            console.operations, target, timeout_seconds=CONFIRM_COUNT_SECONDS,
            cap=CONFIRM_COUNT_CAP)
        cutoff = at.isoformat()
        sample = await console.operations.review_jobs(dataclasses.replace(target, cutoff=at),
                                                      limit=10)
        fields = filter_fields(target)
    else:
        refused = [(r.id, r.state) for r in await review.refusals(
            console.operations, target, ACTION_STATES[do])]
        count = len(target)
        fields = {}
    return _render(request, "confirm.html", do=do, target_ids=[
        str(i) for i in target] if not isinstance(target, ReviewFilter) else [],
        scope="filter" if isinstance(target, ReviewFilter) else "selected",
        fields=fields, count=count, exact=exact, cutoff=cutoff, refused=refused,
        sample=sample, allowed=" or ".join(ACTION_STATES[do]), title=f"confirm {do}")


async def act(request: web.Request) -> web.Response:
    """Do a confirmed action: named jobs all or nothing; a filter as a bulk action."""
    console = request.app[CONSOLE]
    do, target, expected = await _action_form(request)
    session = _SESSION.get()
    if isinstance(target, ReviewFilter):
        form = await request.post()
        cutoff = _parse_time(str(form.get("cutoff", "")), "cutoff")
        if cutoff is None:
            raise BadInput("confirm the action first")
        row, runner = await bulk.start(
            console.operations, action=do, view=dataclasses.replace(target, cutoff=cutoff),
            expected=expected, created_by=_author(session))
        log.info("ui_action", extra={
            "action": do, "scope": "filter", "filter": bulk.describe_filter(target),
            "cutoff": cutoff.isoformat(), "expected": expected, "bulk_action": str(row["id"]),
            "session": session.short_id if session else None, "peer": request.remote})
        _start_runner(console, row, runner)
        raise web.HTTPSeeOther(f"/bulk/{row['id']}")
    if expected is None:
        raise BadInput("confirm the action first")
    # The one door the command line uses too: all or nothing, exactly *expected* jobs.
    if do == "retry":
        retried = await review.retry(console.operations, target, expected=expected)
        changed = retried.retried
    else:
        discarded = await review.discard(console.operations, target, expected=expected)
        changed = discarded.discarded
    console.lists.clear()
    log.info("ui_action", extra={
        "action": do, "scope": "selected", "ids": [str(i) for i in target],
        "expected": expected, "changed": len(changed),
        "session": session.short_id if session else None, "peer": request.remote})
    if expected == 0 or len(changed) != expected:
        return _message(
            request, 409, "Nothing changed",
            f"You confirmed {expected} job(s), but the jobs changed since then (another "
            "operator, a worker or recovery acted on them). Nothing was changed: review "
            "the list and try again.")
    verb = "Retried" if do == "retry" else "Discarded"
    return _render(request, "done.html", verb=verb, changed=changed,
                   title=verb.lower())


def _start_runner(console: Console, row: dict[str, Any], runner: uuid.UUID) -> None:
    """Run a bulk action in the background of this process (see :mod:`receipts.bulk`)."""

    def step(_: Any) -> None:
        console.lists.clear()

    task = asyncio.create_task(
        bulk.run(console.operations, row, runner, policy=console.options.bulk_policy,
                 on_step=step), name=f"bulk-{row['id']}")
    console.runners.add(task)
    task.add_done_callback(console.runners.discard)


async def bulk_page(request: web.Request) -> web.Response:
    """One bulk action's progress (it refreshes itself while it runs)."""
    console = request.app[CONSOLE]
    action_id = _parse_uuid(request.match_info["id"], "a bulk action id")
    row = await console.operations.bulk_get(action_id)
    if row is None:
        return _message(request, 404, "No such bulk action",
                        f"No bulk action has the id {action_id}.")
    abandoned = (row["status"] == "running"
                 and row["idle_seconds"] > console.options.bulk_policy.stale_seconds)
    return _render(request, "bulk.html", action=row, abandoned=abandoned,
                   filter_text=bulk.describe_filter(bulk_view(row)), live=True,
                   title=f"bulk {row['action']} · {row['status']}")


async def bulk_stop(request: web.Request) -> web.Response:
    """Stop a running bulk action after its current batch."""
    console = request.app[CONSOLE]
    action_id = _parse_uuid(request.match_info["id"], "a bulk action id")
    stopped = await console.operations.bulk_stop(action_id)
    session = _SESSION.get()
    log.info("ui_action", extra={"action": "bulk_stop", "bulk_action": str(action_id),
                                 "stopped": stopped,
                                 "session": session.short_id if session else None,
                                 "peer": request.remote})
    raise web.HTTPSeeOther(f"/bulk/{action_id}")


async def bulk_resume(request: web.Request) -> web.Response:
    """Resume a stopped, failed or abandoned bulk action from its cursor."""
    console = request.app[CONSOLE]
    action_id = _parse_uuid(request.match_info["id"], "a bulk action id")
    taken = await bulk.resume(console.operations, action_id,
                              policy=console.options.bulk_policy)
    session = _SESSION.get()
    log.info("ui_action", extra={"action": "bulk_resume", "bulk_action": str(action_id),
                                 "resumed": taken is not None,
                                 "session": session.short_id if session else None,
                                 "peer": request.remote})
    if taken is None:
        return _message(request, 409, "Not resumed",
                        "This bulk action is done, or another page is running it (it can be "
                        "taken over once it has made no progress for "
                        f"{console.options.bulk_policy.stale_seconds:g} s).")
    _start_runner(console, *taken)
    raise web.HTTPSeeOther(f"/bulk/{action_id}")


async def fleet_pause(request: web.Request) -> web.Response:
    """Pause every worker's deliveries for a while, with a reason."""
    console = request.app[CONSOLE]
    form = await request.post()
    session = _SESSION.get()
    try:
        seconds = fleet.parse_duration(str(form.get("duration", "")))
        outcome = await fleet.pause(console.operations, seconds=seconds,
                                    note=str(form.get("reason", "")), author=_author(session),
                                    replace=form.get("replace") == "1")
    except fleet.PauseError as exc:
        raise BadInput(str(exc)) from None
    log.info("ui_action", extra={"action": "pause", "seconds": seconds,
                                 "paused": outcome.paused, "replace": form.get("replace") == "1",
                                 "session": session.short_id if session else None,
                                 "peer": request.remote})
    await _reread(console)
    if not outcome.paused:
        return _message(request, 409, "Not paused", fleet.refusal(outcome) + ".")
    raise web.HTTPSeeOther("/#provider")


async def fleet_resume(request: web.Request) -> web.Response:
    """Lift the pause the page showed (not one that started since)."""
    console = request.app[CONSOLE]
    form = await request.post()
    session = _SESSION.get()
    expected = _parse_time(str(form.get("expected_until", "")), "expected_until")
    outcome = await fleet.resume(console.operations, author=_author(session),
                                 expected_until=expected)
    log.info("ui_action", extra={"action": "resume", "lifted": outcome.lifted,
                                 "reason": outcome.reason,
                                 "session": session.short_id if session else None,
                                 "peer": request.remote})
    await _reread(console)
    if not outcome.lifted:
        return _message(request, 409, "Not resumed",
                        "The pause changed since the page was drawn (another pod or operator "
                        "extended or replaced it), or it already ended; nothing was lifted. "
                        "Look at the provider panel again.")
    raise web.HTTPSeeOther("/#provider")


async def _reread(console: Console) -> None:
    """Read the shared state again after an action (its page shows the result); the action
    is done whatever this reading says, so a failure here is only logged by the monitor."""
    with contextlib.suppress(QueueError):
        await console.monitor.refresh()


async def recover(request: web.Request) -> web.Response:
    """One recovery sweep of expired leases now (bounded), as ``receipts recover`` starts."""
    console = request.app[CONSOLE]
    options = console.options
    returned = await recovery.return_expired(
        console.queue, batch_size=options.recovery_batch_size,
        delay_seconds=options.recovery_delay_seconds, max_batches=RECOVER_MAX_BATCHES)
    to_ready, to_failed = returned.to_ready, returned.to_failed
    console.lists.clear()
    session = _SESSION.get()
    log.info("ui_action", extra={"action": "recover", "to_ready": to_ready,
                                 "to_failed": to_failed,
                                 "session": session.short_id if session else None,
                                 "peer": request.remote})
    await _reread(console)
    return _message(request, 200, "Recovered expired leases",
                    f"{to_ready} expired lease(s) went back to ready (due after the recovery "
                    f"delay) and {to_failed} to failed (their last attempt).",
                    back="/?state=running")


async def login_page(request: web.Request) -> web.Response:
    """The token form (or why signing in cannot work here)."""
    config = request.app[CONSOLE].config
    if config.sessions is None:
        return _message(request, 403, "Read-only", "Actions are off: no admin token is set.")
    return _render(request, "login.html", title="sign in",
                   insecure=not _keeps_cookie(request), host=request.host,
                   next=_safe_next(request.query.get("next", "/")))


def _safe_next(path: str) -> str:
    """Where to go after signing in: a path on this site only."""
    return path if path.startswith("/") and not path.startswith("//") else "/"


async def login(request: web.Request) -> web.Response:
    """Check the token (in the middleware) and go back where the reader was."""
    form = await request.post()
    raise web.HTTPSeeOther(_safe_next(str(form.get("next", "/"))))


async def logout(request: web.Request) -> web.Response:
    """End the session: its id is revoked for every replica; a guest session replaces it."""
    console = request.app[CONSOLE]
    sessions = console.config.sessions
    response = web.HTTPSeeOther("/login" if sessions and sessions.viewer_required else "/")
    session = _SESSION.get()
    if sessions is not None:
        if session is not None and session.role != "guest":
            sessions.revoke(session.sid)
            await console.operations.revoke_session(
                session.sid, expires_at=datetime.fromtimestamp(session.expires, UTC)
                + timedelta(seconds=60))
            log.info("ui_signed_out", extra={"session": session.short_id,
                                             "role": session.role, "peer": request.remote})
        _set_cookie(response, sessions, sessions.issue("guest")[1])
    raise response


async def healthz(_: web.Request) -> web.Response:
    """The process is alive (no database access)."""
    return web.json_response({"status": "ok"})


def _static(name: str, content_type: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def serve(_: web.Request) -> web.Response:
        text = resources.files("receipts.ui").joinpath(f"static/{name}").read_text("utf-8")
        return web.Response(text=text, content_type=content_type,
                            headers={"Cache-Control": "max-age=300"})

    serve.__doc__ = f"``/static/{name}`` (inline code would need a weaker CSP)."
    return serve


# -------------------------------------------------------------- middleware

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: Paths anyone may fetch, even where reading needs a token.
_PUBLIC = {"/login", "/healthz", "/static/review.css", "/static/live.js"}
#: POSTs that need no session at all (the token form and sign-out).
_OPEN_POSTS = {"/login", "/logout"}
#: POSTs a reader may make without the admin role (it only shows what an action would do).
_READER_POSTS = {"/confirm"}


def _set_cookie(response: web.StreamResponse, sessions: Sessions, value: str) -> None:
    response.set_cookie(COOKIE, value, max_age=sessions.lifetime_seconds, path="/",
                        httponly=True, secure=True, samesite="Strict")


def _keeps_cookie(request: web.Request) -> bool:
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
    response = _message(request, 503, heading, text)
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
        response = _message(request, 400, "Bad request", str(exc))
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
        if session is None:
            session, new_cookie = sessions.issue("guest")
        _SESSION.set(session)
        if (sessions.viewer_required and not session.reader and request.method == "GET"
                and request.path not in _PUBLIC):
            if request.headers.get(LIVE_HEADER) == "1":
                return web.Response(status=401, text="Signed out: sign in again to read.")
            to_login = web.HTTPSeeOther("/login?" + urlencode({"next": request.path_qs}))
            if new_cookie is not None:
                _set_cookie(to_login, sessions, new_cookie)
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
            _set_cookie(exc, sessions, new_cookie)
        raise
    if new_cookie is not None and sessions is not None:
        _set_cookie(response, sessions, new_cookie)
    return response


async def _refuse_post(request: web.Request, sessions: Sessions | None
                       ) -> tuple[web.Response | None, str | None]:
    """(None, new session cookie or None) when the POST may proceed, else (the refusal, None)."""
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
        if COOKIE not in request.cookies and not _keeps_cookie(request):
            log.warning("ui_refused", extra={"why": "insecure-transport", "path": request.path,
                                             "peer": request.remote})
            return _message(request, 400, "Sign-in needs HTTPS here",
                            _insecure_text(request)), None
        log.warning("ui_refused", extra={"why": "csrf", "path": request.path,
                                         "peer": request.remote})
        return _message(request, 403, "Refused", "The form expired or came from elsewhere; "
                        "reload the page and try again."), None
    token = str(form.get("token", ""))
    if token:
        throttle = request.app[CONSOLE].throttle
        client = request.remote or "unknown"
        wait = throttle.retry_after(client)
        if wait > 0:
            log.warning("ui_refused", extra={"why": "throttled", "path": request.path,
                                             "peer": request.remote})
            refusal = _message(request, 429, "Too many attempts",
                               f"Too many wrong tokens from your address; try again in "
                               f"{int(wait) + 1} s.")
            refusal.headers["Retry-After"] = str(int(wait) + 1)
            return refusal, None
        role = sessions.role_for(token)
        if role is None:
            throttle.failed(client)
            log.warning("ui_refused", extra={"why": "token", "path": request.path,
                                             "peer": request.remote})
            return _message(request, 403, "Wrong token",
                            "That token is neither the admin nor the viewer token."), None
        throttle.succeeded(client)
        if role == "admin" or not session.admin:
            upgraded, cookie = sessions.issue(role)  # a new session id: no fixation
            _SESSION.set(upgraded)
            log.info("ui_signed_in", extra={"role": role, "session": upgraded.short_id,
                                            "peer": request.remote})
            session = upgraded
        else:
            cookie = None
        return _needs_admin(request, session, sessions), cookie
    return _needs_admin(request, session, sessions), None


def _needs_admin(request: web.Request, session: Session,
                 sessions: Sessions) -> web.Response | None:
    """The refusal of a POST that needs the admin role (None when allowed)."""
    if request.path in _OPEN_POSTS or (session.admin and sessions.actions_enabled):
        return None
    if request.path in _READER_POSTS and (session.reader or not sessions.viewer_required):
        return None
    if not sessions.actions_enabled:
        return _message(request, 403, "Read-only",
                        "This review page is read-only: RECEIPTS_UI_ADMIN_TOKEN is not set.")
    log.warning("ui_refused", extra={"why": "not-admin", "path": request.path,
                                     "peer": request.remote})
    return _message(request, 403, "Admin token required",
                    "Retry, discard, pause, resume and recover need the admin token: enter "
                    "it on the confirmation page or sign in.")


# ------------------------------------------------------------------ wiring


def make_app(queue: JobQueue, operations: Operations, *, admin_token: str | None,
             loopback_only: bool, viewer_token: str | None = None,
             options: UiOptions | None = None) -> web.Application:
    """The review page as an aiohttp application on the operator's *operations*
    and, for "recover now", recovery's *queue* (both open, built by the
    composition code: :func:`receipts.runtime.make_operations`, ``make_queue``).

    *admin_token* None makes it read-only (every action is refused);
    *viewer_token* makes reading need a token too; *loopback_only* serves
    only loopback ``Host`` names (see :func:`receipts.ui.session.host_allowed`).
    The shared reading (:class:`Monitor`) samples in the background while
    the application runs; bulk actions it started are stopped (resumable)
    when it shuts down.
    """
    options = options or UiOptions()
    sessions = Sessions(admin_token, viewer_token) if (admin_token or viewer_token) else None
    monitor = Monitor(queue, operations, refresh_seconds=options.refresh_seconds,
                      rate=options.rate, burst=options.burst, sessions=sessions,
                      idle_refresh_seconds=options.idle_refresh_seconds)
    console = Console(queue, operations, monitor, UiConfig(sessions, loopback_only), options,
                      ListCache(options.refresh_seconds), SignInThrottle())
    app = web.Application(middlewares=[guard], client_max_size=256 * 1024)
    app[CONSOLE] = console
    app[TEMPLATES] = _environment()
    app.cleanup_ctx.append(_background)
    app.router.add_get("/", index)
    app.router.add_get("/find", find)
    app.router.add_get("/jobs/{key}", job_page)
    app.router.add_post("/confirm", confirm)
    app.router.add_post("/act", act)
    app.router.add_get("/bulk/{id}", bulk_page)
    app.router.add_post("/bulk/{id}/stop", bulk_stop)
    app.router.add_post("/bulk/{id}/resume", bulk_resume)
    app.router.add_post("/fleet/pause", fleet_pause)
    app.router.add_post("/fleet/resume", fleet_resume)
    app.router.add_post("/recover", recover)
    app.router.add_get("/login", login_page)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/static/review.css", _static("review.css", "text/css"))
    app.router.add_get("/static/live.js", _static("live.js", "text/javascript"))
    return app


async def _background(app: web.Application) -> Any:
    """The monitor's sampling while the app runs; at the end, stop it and the bulk runners."""
    console = app[CONSOLE]
    sampling = asyncio.create_task(console.monitor.run(), name="ui-monitor")
    yield
    sampling.cancel()
    runners = list(console.runners)
    for task in runners:
        task.cancel()
    for task in (sampling, *runners):
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    for task in runners:  # leave them resumable at once, not after the stale time
        action_id = uuid.UUID(task.get_name().removeprefix("bulk-"))
        with contextlib.suppress(QueueError):
            await console.operations.bulk_stop(action_id)


async def run_ui(settings: Settings) -> None:
    """Serve the review page on ``ui_host:ui_port`` until SIGTERM/SIGINT.

    One pool of ``ui_pool_max_size`` connections (application name
    ``<name>-ui``): one for the shared reading, one for a bulk action, the
    rest for viewers' lists. Raises ``OSError`` when the port is taken.
    """
    pool = make_pool(settings, "ui", max_size=settings.ui_pool_max_size)
    queue = make_queue(settings, pool)
    admin = settings.ui_admin_token.get_secret_value() if settings.ui_admin_token else None
    viewer = settings.ui_viewer_token.get_secret_value() if settings.ui_viewer_token else None
    app = make_app(queue, make_operations(settings, pool), admin_token=admin, viewer_token=viewer,
                   loopback_only=is_loopback(settings.ui_host),
                   options=UiOptions.from_settings(settings))
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
                                  "mode": "admin" if admin else "read-only",
                                  "reading": "token" if viewer else "open",
                                  "database": settings.safe_dsn})
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await pool.close(timeout=5.0)
