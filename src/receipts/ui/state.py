"""What the console's handlers share: its options, its configuration, the shared
reading and caches (:class:`Console`, stored on the application as :data:`CONSOLE`), the
session of the request being handled (:data:`SESSION`), and who the request is
(:func:`user_of`: the user a trusted proxy names; :func:`author_of`: the author written
into a pause or a bulk action; :func:`audit_fields`: the fields of a ``ui_action`` line).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import jinja2
from aiohttp import web

from receipts import bulk
from receipts.jobqueue import JobQueue
from receipts.model import JobState
from receipts.operations import Operations
from receipts.settings import Settings
from receipts.ui.monitor import Monitor
from receipts.ui.session import (
    Session,
    Sessions,
    SignInThrottle,
    UserHeader,
)

LIST_STATES = (JobState.READY, JobState.RUNNING, JobState.DONE, JobState.FAILED,
               JobState.DISCARDED)
ACTION_STATES = {"retry": (JobState.FAILED,), "discard": (JobState.READY, JobState.FAILED)}


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
        user_header: the header an authenticating proxy names the user in, and
            the proxies believed (None: no such proxy; sessions name actors).
    """

    sessions: Sessions | None
    loopback_only: bool
    user_header: UserHeader | None = None

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
    """Everything the handlers share: the statements, the reading, the sessions."""

    queue: JobQueue
    operations: Operations
    monitor: Monitor
    config: UiConfig
    options: UiOptions
    lists: ListCache
    throttle: SignInThrottle
    runners: set[asyncio.Task[Any]] = field(default_factory=set)
    #: The runner token of each bulk action this process runs (to release it at the end).
    tokens: dict[uuid.UUID, uuid.UUID] = field(default_factory=dict)
CONSOLE: web.AppKey[Console] = web.AppKey("console", Console)
TEMPLATES: web.AppKey[jinja2.Environment] = web.AppKey("templates", jinja2.Environment)


# The session of the request being handled (set by the guard middleware; each
# request runs in its own task, so this never leaks between requests).
SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "receipts_ui_session", default=None)


def user_of(request: web.Request) -> str | None:
    """The user an authenticating proxy named in the trusted header, or None (no such
    header, or the request did not come from a configured proxy)."""
    header = request.app[CONSOLE].config.user_header
    if header is None:
        return None
    return header.user(request.remote, request.headers.get(header.name))


def author_of(request: web.Request) -> str:
    """Who acts, for ``paused_by`` and bulk actions: ``ui:<user>`` when a trusted proxy
    names the user, else ``ui:<session id prefix>``."""
    user = user_of(request)
    if user:
        return f"ui:{user}"
    session = SESSION.get()
    return f"ui:{session.short_id}" if session else "ui:anonymous"


def audit_fields(request: web.Request) -> dict[str, Any]:
    """The audit fields of an action: the session, the proxy-named user, the peer."""
    session = SESSION.get()
    return {"session": session.short_id if session else None, "user": user_of(request),
            "peer": request.remote}


async def load_revocations(console: Console) -> None:
    """Read the signed-out sessions every replica recorded (raises the queue's errors)."""
    if console.config.sessions is not None:
        console.config.sessions.update_revoked(await console.operations.revoked_sessions())
