"""What the console reads from query strings and forms: the list filter, cursors, job ids
and the action forms. Anything it cannot use raises :class:`BadInput` (shown with status
400)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from receipts.model import JobState, Reason
from receipts.operations import ReviewFilter
from receipts.ui.state import (
    ACTION_STATES,
)

MAX_SELECTION = 500


class BadInput(ValueError):
    """A form or query value the page cannot use; shown to the user with status 400."""


def parse_time(text: str, name: str) -> datetime | None:
    """An ISO date and time from the field *name* (UTC unless it says otherwise), None when
    empty; raises :class:`BadInput`."""
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
    characters), ``error`` (a failure group's key: the first 60 characters
    of the last error, exactly) and, for running jobs, ``expired`` (1: leases
    that ran out, 0: live ones).
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
    error = str(data.get("error") or "")
    if len(error) > 60:
        raise BadInput("a failure group's error is at most 60 characters")
    expired_text = str(data.get("expired") or "")
    if expired_text not in ("", "0", "1"):
        raise BadInput("expired is 1 (leases that ran out) or 0 (live leases)")
    expired = None if not expired_text or state is not JobState.RUNNING else expired_text == "1"
    return ReviewFilter(state=state, reason=reason, status=status,
                        since=parse_time(str(data.get("since") or ""), "since"),
                        until=parse_time(str(data.get("until") or ""), "until"),
                        order_contains=query or None, expired=expired,
                        error_prefix=error or None)


def filter_fields(view: ReviewFilter) -> dict[str, str]:
    """The query/form fields that reproduce *view* (empty ones left out)."""
    fields = {
        "state": str(view.state), "reason": view.reason or "",
        "status": "" if view.status is None else str(view.status),
        "since": view.since.isoformat() if view.since else "",
        "until": view.until.isoformat() if view.until else "",
        "q": view.order_contains or "",
        "expired": "" if view.expired is None else str(int(view.expired)),
        "error": view.error_prefix or "",
    }
    return {k: v for k, v in fields.items() if v}


def parse_cursor(text: str) -> tuple[datetime, uuid.UUID] | None:
    """A list page's keyset cursor (``time~uuid``), None when empty; raises :class:`BadInput`."""
    if not text:
        return None
    at, _, job_id = text.partition("~")
    try:
        return datetime.fromisoformat(at), uuid.UUID(job_id)
    except ValueError:
        raise BadInput("bad page cursor") from None


def parse_ids(values: list[str]) -> list[uuid.UUID]:
    """Job ids of a selection (at most :data:`MAX_SELECTION`, duplicates dropped); raises
    :class:`BadInput`."""
    if len(values) > MAX_SELECTION:
        raise BadInput(f"select at most {MAX_SELECTION} jobs at once")
    try:
        return list(dict.fromkeys(uuid.UUID(v) for v in values))
    except ValueError:
        raise BadInput("job ids must be UUIDs") from None


def parse_uuid(text: str, what: str) -> uuid.UUID:
    """*text* as a UUID (*what* names it in the error); raises :class:`BadInput`."""
    try:
        return uuid.UUID(text)
    except ValueError:
        raise BadInput(f"{what} must be a UUID") from None


async def action_form(request: web.Request) -> tuple[str, Any, int | None]:
    """Parse an action form: (do, ids or filter, expected count or None)."""
    form = await request.post()
    do, _, scope = str(form.get("action", "")).partition(":")
    if do not in ACTION_STATES:
        raise BadInput("unknown action")
    target: Any
    if scope == "selected":
        target = parse_ids([str(v) for v in form.getall("id", [])])
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
