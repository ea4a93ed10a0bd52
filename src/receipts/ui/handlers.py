"""Handlers of the review page: what each URL shows and what each form does.

``GET /`` the console: the shared summary (throughput and attempt time
included), the charts, the provider's flow state, the workers, the bulk
actions and a filtered, paged list of one state's jobs; ``GET /failures``
failures grouped by cause; ``GET /jobs/{key}`` one job with its attempt
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
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any
from urllib.parse import quote, urlencode

from aiohttp import web

from receipts import bulk, fleet, recovery, review
from receipts.errors import QueueError
from receipts.logs import get_logger
from receipts.model import Reason
from receipts.operations import ReviewFilter, bulk_view
from receipts.ui.chart import (
    depth_chart,
    latency_chart,
    latency_legend,
    legend,
    throughput_chart,
)
from receipts.ui.display import (
    clip,
    message,
    number,
    render,
    rounded,
)
from receipts.ui.form import (
    BadInput,
    action_form,
    filter_fields,
    parse_cursor,
    parse_filter,
    parse_time,
    parse_uuid,
)
from receipts.ui.guard import (
    keeps_cookie,
    set_cookie,
)
from receipts.ui.monitor import LIVE_SECONDS, Snapshot
from receipts.ui.state import (
    ACTION_STATES,
    CONSOLE,
    SESSION,
    Console,
    audit_fields,
    author_of,
)

log = get_logger("ui")


PAGE_SIZE = 50
#: A list's count stops at this many (shown as "10,000+") or after LIST_COUNT_SECONDS
#: (a selective filter over many rows: shown as "many"), whichever comes first.
LIST_COUNT_CAP = 10_000
LIST_COUNT_SECONDS = 1.0
#: A filter action's count must finish within this (seconds), else it says "at least".
CONFIRM_COUNT_SECONDS = 2.0
CONFIRM_COUNT_CAP = 100_000
#: Expired leases one "recover now" returns at most (batches of the recovery batch size).
RECOVER_MAX_BATCHES = 100
#: Failure groups shown at most; the most recent failed jobs, and the ready jobs carrying
#: an error, grouped at most (bounded work: 1,000,000 failed rows cost what these do).
GROUPS_SHOWN = 200
GROUPS_FAILED_CAP = 100_000
GROUPS_READY_CAP = 100_000


def _done_text(snapshot: Snapshot) -> tuple[str, str]:
    """The done card: (value, note): exact when counted, else the rounded estimate."""
    if snapshot.done is not None:
        return number(snapshot.done), "delivered, kept until retention"
    return f"≈ {rounded(snapshot.stats.done_estimate)}", "estimate (table statistics)"


async def index(request: web.Request) -> web.Response:
    """The console: shared summary, chart, provider, workers, bulk actions, one list."""
    console = request.app[CONSOLE]
    view = parse_filter(request.query)
    cursor = parse_cursor(request.query.get("after", ""))
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
    return render(
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
        rates=console.monitor.rates,
        per_minute=console.monitor.rates.per_minute(snapshot.as_of),
        throughput=throughput_chart(console.monitor.rates.minutes, snapshot.as_of),
        latency=latency_chart(console.monitor.rates.minutes, snapshot.as_of),
        latency_legend=latency_legend(), live_seconds=LIVE_SECONDS,
        sample_seconds=console.monitor.interval(),
        rate=console.options.rate, burst=console.options.burst, live=True,
        title=f"receipts console · {view.state}")


async def failures(request: web.Request) -> web.Response:
    """Failures grouped by cause: failed jobs (and ready ones carrying an error, held
    rejections among them) by the first 60 characters of the error, each group with its
    count, first and last time, reason and status, and its retry / discard (a bulk action
    over exactly that group). ``?q=`` keeps groups whose error contains the text,
    ``?state=failed|ready`` one state's groups."""
    console = request.app[CONSOLE]
    snapshot = await console.monitor.current()
    state = request.query.get("state", "")
    if state not in ("", "failed", "ready"):
        raise BadInput("state is failed or ready")
    query = request.query.get("q", "").strip()
    if len(query) > 200:
        raise BadInput("the error search is at most 200 characters")

    async def load() -> list[dict[str, Any]]:
        return await console.operations.failure_groups(
            limit=GROUPS_SHOWN, failed_cap=GROUPS_FAILED_CAP, ready_cap=GROUPS_READY_CAP)

    groups = await console.lists.get("failure-groups", load)
    needle = query.casefold()
    shown = [g for g in groups if (not state or g["state"] == state)
             and (not needle or needle in (g["prefix"] or "").casefold())]
    return render(request, "failures.html", groups=shown, total=len(groups), state=state,
                   q=query, snapshot=snapshot, as_of=snapshot.as_of, live=True,
                   failed_capped=any(g["capped"] for g in groups if g["state"] == "failed"),
                   ready_capped=any(g["capped"] for g in groups if g["state"] == "ready"),
                   shown_max=GROUPS_SHOWN, failed_cap=GROUPS_FAILED_CAP,
                   ready_cap=GROUPS_READY_CAP, failed_total=snapshot.stats.failed,
                   action_states=ACTION_STATES,
                   monitor_error=console.monitor.error, current_state="failures",
                   title="receipts console · failures by cause")


async def job_page(request: web.Request) -> web.Response:
    """One job (by UUID or order id) and its attempt history."""
    console = request.app[CONSOLE]
    key = request.match_info["key"]
    row = await review.job(console.operations, key) if len(key) <= 200 else None
    if row is None:
        return message(request, 404, "No such job",
                        f"No job has the id or order id {clip(key, 80)!r}.")
    attempts = row.pop("history")
    tag = row.pop("holder_tag")
    holder = None
    if tag is not None:
        workers = console.monitor.snapshot.workers if console.monitor.snapshot else []
        holder = next((w for w in workers if w["tag"] == tag), None)
    expired = bool(row["lease_until"] and row["lease_until"] <= datetime.now(UTC))
    return render(request, "job.html", job=row, attempts=attempts, holder=holder,
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


async def confirm(request: web.Request) -> web.Response:
    """Show what an action would change (the count) and ask for confirmation.

    For a filter, the count is taken at a moment, the action's cutoff: jobs
    that reach the state later are not part of it.
    """
    console = request.app[CONSOLE]
    do, target, _ = await action_form(request)
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
    return render(request, "confirm.html", do=do, target_ids=[
        str(i) for i in target] if not isinstance(target, ReviewFilter) else [],
        scope="filter" if isinstance(target, ReviewFilter) else "selected",
        fields=fields, count=count, exact=exact, cutoff=cutoff, refused=refused,
        sample=sample, allowed=" or ".join(ACTION_STATES[do]), title=f"confirm {do}")


async def act(request: web.Request) -> web.Response:
    """Do a confirmed action: named jobs all or nothing; a filter as a bulk action."""
    console = request.app[CONSOLE]
    do, target, expected = await action_form(request)
    if isinstance(target, ReviewFilter):
        form = await request.post()
        cutoff = parse_time(str(form.get("cutoff", "")), "cutoff")
        if cutoff is None:
            raise BadInput("confirm the action first")
        view = dataclasses.replace(target, cutoff=cutoff)
        already = await console.operations.bulk_find(action=do, view=view)
        if already is not None:  # the same form again (a reload, a replay): the same action
            log.info("ui_action", extra={
                "action": do, "scope": "filter", "filter": bulk.describe_filter(target),
                "cutoff": cutoff.isoformat(), "bulk_action": str(already["id"]),
                "again": True, **audit_fields(request)})
            raise web.HTTPSeeOther(f"/bulk/{already['id']}?again=1")
        row, runner = await bulk.start(console.operations, action=do, view=view,
                                       expected=expected, created_by=author_of(request))
        log.info("ui_action", extra={
            "action": do, "scope": "filter", "filter": bulk.describe_filter(target),
            "cutoff": cutoff.isoformat(), "expected": expected, "bulk_action": str(row["id"]),
            **audit_fields(request)})
        start_runner(console, row, runner)
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
        **audit_fields(request)})
    if expected == 0 or len(changed) != expected:
        return message(
            request, 409, "Nothing changed",
            f"You confirmed {expected} job(s), but the jobs changed since then (another "
            "operator, a worker or recovery acted on them). Nothing was changed: review "
            "the list and try again.")
    verb = "Retried" if do == "retry" else "Discarded"
    return render(request, "done.html", verb=verb, changed=changed,
                   title=verb.lower())


def start_runner(console: Console, row: dict[str, Any], runner: uuid.UUID) -> None:
    """Run a bulk action in the background of this process (see :mod:`receipts.bulk`)."""

    def step(_: Any) -> None:
        console.lists.clear()

    action_id = row["id"]
    task = asyncio.create_task(
        bulk.run(console.operations, row, runner, policy=console.options.bulk_policy,
                 on_step=step), name=f"bulk-{action_id}")
    console.runners.add(task)
    console.tokens[action_id] = runner

    def done(finished: asyncio.Task[Any]) -> None:
        console.runners.discard(finished)
        if console.tokens.get(action_id) == runner:
            del console.tokens[action_id]

    task.add_done_callback(done)


def progress_rate(action: dict[str, Any]) -> tuple[float | None, float | None]:
    """(jobs examined per second, seconds left) of a bulk action's row, from its counts and
    times: the rate over its life so far, and the time the rest of its confirmed count
    takes at that rate (None when unknown: no batch yet, or no confirmed count)."""
    if action["status"] != "running" and action["finished_at"] is None:
        return None, None
    end = action["finished_at"] or action["updated_at"]
    seconds = (end - action["created_at"]).total_seconds()
    if seconds <= 0 or not action["examined"]:
        return None, None
    rate = action["examined"] / seconds
    if action["status"] != "running" or action["expected"] is None:
        return rate, None
    left = max(0, int(action["expected"]) - int(action["changed"]))
    return rate, left / rate if rate > 0 else None


async def bulk_page(request: web.Request) -> web.Response:
    """One bulk action's progress (it refreshes itself while it runs)."""
    console = request.app[CONSOLE]
    action_id = parse_uuid(request.match_info["id"], "a bulk action id")
    row = await console.operations.bulk_get(action_id)
    if row is None:
        return message(request, 404, "No such bulk action",
                        f"No bulk action has the id {action_id}.")
    abandoned = (row["status"] == "running"
                 and row["idle_seconds"] > console.options.bulk_policy.stale_seconds)
    rate, eta = progress_rate(row)
    return render(request, "bulk.html", action=row, abandoned=abandoned,
                   filter_text=bulk.describe_filter(bulk_view(row)), live=True,
                   rate=rate, eta=eta, again=request.query.get("again") == "1",
                   stale_seconds=console.options.bulk_policy.stale_seconds,
                   title=f"bulk {row['action']} · {row['status']}")


async def bulk_stop(request: web.Request) -> web.Response:
    """Stop a running bulk action after its current batch."""
    console = request.app[CONSOLE]
    action_id = parse_uuid(request.match_info["id"], "a bulk action id")
    stopped = await console.operations.bulk_stop(action_id)
    log.info("ui_action", extra={"action": "bulk_stop", "bulk_action": str(action_id),
                                 "stopped": stopped,
                                 **audit_fields(request)})
    raise web.HTTPSeeOther(f"/bulk/{action_id}")


async def bulk_resume(request: web.Request) -> web.Response:
    """Resume a stopped, failed or abandoned bulk action from its cursor."""
    console = request.app[CONSOLE]
    action_id = parse_uuid(request.match_info["id"], "a bulk action id")
    taken = await bulk.resume(console.operations, action_id,
                              policy=console.options.bulk_policy)
    log.info("ui_action", extra={"action": "bulk_resume", "bulk_action": str(action_id),
                                 "resumed": taken is not None,
                                 **audit_fields(request)})
    if taken is None:
        return message(request, 409, "Not resumed",
                        "This bulk action is done, or another page is running it (it can be "
                        "taken over once it has made no progress for "
                        f"{console.options.bulk_policy.stale_seconds:g} s).")
    start_runner(console, *taken)
    raise web.HTTPSeeOther(f"/bulk/{action_id}")


async def fleet_pause(request: web.Request) -> web.Response:
    """Pause every worker's deliveries for a while, with a reason."""
    console = request.app[CONSOLE]
    form = await request.post()
    try:
        seconds = fleet.parse_duration(str(form.get("duration", "")))
        outcome = await fleet.pause(console.operations, seconds=seconds,
                                    note=str(form.get("reason", "")), author=author_of(request),
                                    replace=form.get("replace") == "1")
    except fleet.PauseError as exc:
        raise BadInput(str(exc)) from None
    log.info("ui_action", extra={"action": "pause", "seconds": seconds,
                                 "paused": outcome.paused, "replace": form.get("replace") == "1",
                                 **audit_fields(request)})
    await _reread(console)
    if not outcome.paused:
        return message(request, 409, "Not paused", fleet.refusal(outcome) + ".")
    raise web.HTTPSeeOther("/#provider")


async def fleet_resume(request: web.Request) -> web.Response:
    """Lift the pause the page showed (not one that started since)."""
    console = request.app[CONSOLE]
    form = await request.post()
    expected = parse_time(str(form.get("expected_until", "")), "expected_until")
    outcome = await fleet.resume(console.operations, author=author_of(request),
                                 expected_until=expected)
    log.info("ui_action", extra={"action": "resume", "lifted": outcome.lifted,
                                 "reason": outcome.reason,
                                 **audit_fields(request)})
    await _reread(console)
    if not outcome.lifted:
        return message(request, 409, "Not resumed",
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
    log.info("ui_action", extra={"action": "recover", "to_ready": to_ready,
                                 "to_failed": to_failed,
                                 **audit_fields(request)})
    await _reread(console)
    return message(request, 200, "Recovered expired leases",
                    f"{to_ready} expired lease(s) went back to ready (due after the recovery "
                    f"delay) and {to_failed} to failed (their last attempt).",
                    back="/?state=running")


async def login_page(request: web.Request) -> web.Response:
    """The token form (or why signing in cannot work here)."""
    config = request.app[CONSOLE].config
    if config.sessions is None:
        return message(request, 403, "Read-only", "Actions are off: no admin token is set.")
    return render(request, "login.html", title="sign in",
                   insecure=not keeps_cookie(request), host=request.host,
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
    session = SESSION.get()
    if sessions is not None:
        if session is not None and session.role != "guest":
            sessions.revoke(session.sid)
            await console.operations.revoke_session(
                session.sid, expires_at=datetime.fromtimestamp(session.expires, UTC)
                + timedelta(seconds=60))
            log.info("ui_signed_out", extra={"session": session.short_id,
                                             "role": session.role, "peer": request.remote})
        set_cookie(response, sessions, sessions.issue("guest")[1])
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
