"""An operator's pause and resume of the whole fleet's deliveries, as rules (no printing).

``receipts jobs pause|resume`` (:mod:`receipts.cli`) and the review page
(:mod:`receipts.ui`) call these with an open
:class:`~receipts.operations.Operations`; the statements are
``pause_fleet`` and ``resume_fleet`` (docs/design.md, "Fleet pause and
resume").

The rules:

* A pause has an end: ``--for`` from :data:`MIN_PAUSE_SECONDS` to
  :data:`MAX_PAUSE_SECONDS` (a forgotten pause with no end would stop every
  receipt). It is written as the ``retry_after`` pause every worker, released
  ones included, honours without probing, and ends by itself.
* A pause has a reason (the note, ≤ 200 characters, one line) and an author
  (``paused_by``: ``cli:<user>@<host>`` or ``ui:<session>``), shown to every
  operator and in the pause's log line.
* A manual pause never shortens a longer automatic one (outage, auth,
  Retry-After) unless the operator says so (``replace``); it replaces an
  earlier manual pause, longer or shorter.
* Resume lifts any pause, automatic ones included, with no probe: the
  operator has decided the provider is fine. The page lifts only the pause it
  showed (``expected_until``), so a click never ends a pause that started
  after the page was drawn.
"""

from __future__ import annotations

import contextlib
import getpass
import re
import socket
from datetime import datetime

from receipts.enqueue import NOTIFY_CHANNEL
from receipts.errors import QueueError
from receipts.logs import get_logger
from receipts.operations import Operations, PauseOutcome, ResumeOutcome

log = get_logger("fleet")

#: The shortest and longest manual pause, seconds.
MIN_PAUSE_SECONDS = 10.0
MAX_PAUSE_SECONDS = 7 * 86_400.0
NOTE_MAX_CHARS = 200
_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


class PauseError(ValueError):
    """A pause request the rules refuse (bad duration or note); the message says why."""


def parse_duration(text: str) -> float:
    """Seconds from ``90s``, ``15m``, ``2h``, ``1h30m``, ``1d`` or a plain number of seconds.

    Raises :class:`PauseError` for anything else, or outside
    :data:`MIN_PAUSE_SECONDS`–:data:`MAX_PAUSE_SECONDS`.
    """
    cleaned = text.strip().lower().replace(" ", "")
    seconds: float | None = None
    if re.fullmatch(r"\d+(\.\d+)?", cleaned):
        seconds = float(cleaned)
    else:
        match = _DURATION.match(cleaned)
        if match and cleaned:
            d, h, m, s = (int(g or 0) for g in match.groups())
            seconds = float(d * 86_400 + h * 3_600 + m * 60 + s)
    if seconds is None:
        raise PauseError(f"a duration is like 90s, 15m, 2h or 1h30m, not {text!r}")
    if not MIN_PAUSE_SECONDS <= seconds <= MAX_PAUSE_SECONDS:
        raise PauseError(f"a pause lasts from {MIN_PAUSE_SECONDS:g} s to 7 days, "
                         f"not {describe_seconds(seconds)}")
    return seconds


def check_note(text: str) -> str:
    """The pause's reason as stored: stripped, one line; raises :class:`PauseError`
    when empty, longer than 200 characters, or holding control or bidi characters."""
    note = text.strip()
    if not note:
        raise PauseError("say why the fleet is paused (--reason); operators read it")
    if len(note) > NOTE_MAX_CHARS:
        raise PauseError(f"the reason is at most {NOTE_MAX_CHARS} characters")
    if _CONTROL.search(note):
        raise PauseError("the reason must be one line of text without control characters")
    return note


def cli_author() -> str:
    """``cli:<user>@<host>`` for a pause set from the command line (≤ 100 characters)."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in a container without /etc/passwd entries
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"[:100]


def describe_seconds(seconds: float) -> str:
    """A short duration: ``45 s``, ``15 min``, ``2 h 30 min``, ``3 d 4 h``."""
    total = round(seconds)
    if total < 60:
        return f"{total} s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes} min" + (f" {secs} s" if secs else "")
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h" + (f" {minutes} min" if minutes else "")
    return f"{hours // 24} d" + (f" {hours % 24} h" if hours % 24 else "")


async def pause(operations: Operations, *, seconds: float, note: str, author: str,
                replace: bool = False) -> PauseOutcome:
    """Pause the fleet for *seconds* (checked with :func:`parse_duration`'s bounds).

    Raises :class:`PauseError` for a bad duration or note; returns the
    outcome (refused while a longer automatic pause is in force, unless
    *replace*).
    """
    if not MIN_PAUSE_SECONDS <= seconds <= MAX_PAUSE_SECONDS:
        raise PauseError(f"a pause lasts from {MIN_PAUSE_SECONDS:g} s to 7 days")
    checked = check_note(note)
    outcome = await operations.pause_fleet(seconds, note=checked, paused_by=author[:100],
                                           replace=replace)
    if outcome.paused:
        # Workers learn of a pause from their next claim; wake them for one now, so their
        # gauges (and the alerts that read them) follow within a moment. Best effort: the
        # pause holds anyway, and they see it at their next poll.
        with contextlib.suppress(QueueError):
            await operations.wake_fleet(channel=NOTIFY_CHANNEL)
    log.warning("fleet_paused" if outcome.paused else "fleet_pause_refused", extra={
        "by": author[:100], "note": checked, "seconds": seconds, "replace": replace,
        "until": outcome.paused_until.isoformat() if outcome.paused_until else None,
        "previous_reason": outcome.previous_reason})
    return outcome


async def resume(operations: Operations, *, author: str,
                 expected_until: datetime | None = None) -> ResumeOutcome:
    """Lift the fleet's pause (only the one ending at *expected_until*, when given)."""
    outcome = await operations.resume_fleet(expected_until=expected_until)
    log.warning("fleet_resumed" if outcome.lifted else "fleet_resume_refused", extra={
        "by": author[:100], "reason": outcome.reason, "note": outcome.note,
        "until": outcome.paused_until.isoformat() if outcome.paused_until else None})
    return outcome


def refusal(outcome: PauseOutcome) -> str:
    """One line: why a pause was refused (a longer automatic pause is in force)."""
    until = outcome.previous_until.isoformat() if outcome.previous_until else "?"
    return (f"an automatic {outcome.previous_reason} pause is already in force until {until}, "
            "longer than the one asked for; nothing changed (replace it explicitly to end "
            "it at your time instead)")
