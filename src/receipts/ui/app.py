"""The review page as an aiohttp application (:func:`make_app`) and the ``receipts ui``
process (:func:`run_ui`): routes, the reads before the first request (signed-out
sessions, the chart's kept hour), the background work while it runs (the shared reading,
taking over orphaned bulk actions) and what it releases at the end.

The page is split by concern: :mod:`receipts.ui.state` (what handlers share),
:mod:`receipts.ui.display` (display helpers, templates), :mod:`receipts.ui.form` (form
parsing), :mod:`receipts.ui.guard` (access guards) and :mod:`receipts.ui.handlers`
(what each URL shows and does)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

from aiohttp import web

from receipts import bulk
from receipts.db import make_pool
from receipts.errors import QueueError
from receipts.jobqueue import JobQueue
from receipts.logs import get_logger
from receipts.metrics import start_server
from receipts.operations import Operations
from receipts.proxy import parse_networks
from receipts.runtime import make_operations, make_queue
from receipts.settings import Settings
from receipts.ui.display import (
    environment,
)
from receipts.ui.guard import (
    guard,
)
from receipts.ui.handlers import (
    _static,
    act,
    bulk_page,
    bulk_resume,
    bulk_stop,
    confirm,
    failures,
    find,
    fleet_pause,
    fleet_resume,
    healthz,
    index,
    job_page,
    login,
    login_page,
    logout,
    recover,
    start_runner,
)
from receipts.ui.monitor import Monitor
from receipts.ui.session import (
    Sessions,
    SignInThrottle,
    UserHeader,
    is_loopback,
)
from receipts.ui.state import (
    CONSOLE,
    TEMPLATES,
    Console,
    ListCache,
    UiConfig,
    UiOptions,
    load_revocations,
)

log = get_logger("ui")


log = get_logger("ui")
#: How long (seconds) the page waits at start for the database's list of signed-out
#: sessions and the chart's kept samples before it serves (a request with a session
#: reads the list itself if this did not finish).
STARTUP_READ_SECONDS = 3.0


def make_app(queue: JobQueue, operations: Operations, *, admin_token: str | None,
             loopback_only: bool, viewer_token: str | None = None,
             options: UiOptions | None = None,
             user_header: UserHeader | None = None) -> web.Application:
    """The review page as an aiohttp application on the operator's *operations*
    and, for "recover now", recovery's *queue* (both open, built by the
    composition code: :func:`receipts.runtime.make_operations`, ``make_queue``).

    *admin_token* None makes it read-only (every action is refused);
    *viewer_token* makes reading need a token too; *loopback_only* serves
    only loopback ``Host`` names (see :func:`receipts.ui.session.host_allowed`);
    *user_header* names the user from an authenticating proxy. Before it
    serves, it reads the signed-out sessions and the chart's kept samples
    (:func:`_startup`). While it runs, the shared reading (:class:`Monitor`)
    samples in the background and running bulk actions nobody runs are taken
    over (:func:`receipts.bulk.adopt`); at the end, the bulk actions it runs
    are released for the next page to take over at once.
    """
    options = options or UiOptions()
    sessions = Sessions(admin_token, viewer_token) if (admin_token or viewer_token) else None
    monitor = Monitor(queue, operations, refresh_seconds=options.refresh_seconds,
                      rate=options.rate, burst=options.burst, sessions=sessions,
                      idle_refresh_seconds=options.idle_refresh_seconds)
    console = Console(queue, operations, monitor,
                      UiConfig(sessions, loopback_only, user_header), options,
                      ListCache(options.refresh_seconds), SignInThrottle())
    app = web.Application(middlewares=[guard], client_max_size=256 * 1024)
    app[CONSOLE] = console
    app[TEMPLATES] = environment()
    app.on_startup.append(_startup)
    app.cleanup_ctx.append(_background)
    app.router.add_get("/", index)
    app.router.add_get("/find", find)
    app.router.add_get("/failures", failures)
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


async def _startup(app: web.Application) -> None:
    """Before the first request: the signed-out sessions (so a revoked cookie replayed
    right after a restart is refused) and the chart's kept hour, each within
    :data:`STARTUP_READ_SECONDS`. A database that does not answer in time delays
    neither: a request with a session then reads the list itself (or gets 503)."""
    console = app[CONSOLE]
    if console.queue.pool.closed:
        return
    for read in (load_revocations(console), console.monitor.load_history()):
        try:
            async with asyncio.timeout(STARTUP_READ_SECONDS):
                await read
        except (QueueError, TimeoutError) as exc:
            log.warning("ui_database_error", extra={"error": str(exc) or "timed out",
                                                    "path": "(start)"})


async def _background(app: web.Application) -> Any:
    """While the app runs: the monitor's sampling, and taking over orphaned bulk actions.
    At the end: stop both, and release the bulk actions this process ran, so that the
    next page (this one restarted, or another replica) takes them over at once."""
    console = app[CONSOLE]
    sampling = asyncio.create_task(console.monitor.run(), name="ui-monitor")
    adopting = asyncio.create_task(_adopt_orphans(console), name="ui-bulk-adopt")
    yield
    runners = list(console.runners)
    tokens = dict(console.tokens)
    for task in (sampling, adopting, *runners):
        task.cancel()
    for task in (sampling, adopting, *runners):
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    for action_id, runner in tokens.items():
        with contextlib.suppress(QueueError):
            if await console.operations.bulk_release(action_id, runner=runner):
                log.info("bulk_action_released", extra={"action_id": str(action_id)})


async def _adopt_orphans(console: Console) -> None:
    """Take over running bulk actions nobody runs, now and then, without a click
    (:func:`receipts.bulk.adopt`): one released by a page that shut down at once, one
    whose page was killed once it has been silent for the policy's stale time."""
    policy = console.options.bulk_policy
    every = max(0.5, min(15.0, policy.stale_seconds / 4))
    while True:
        if not console.queue.pool.closed:
            with contextlib.suppress(QueueError):
                running = set(console.tokens)
                for row, runner in await bulk.adopt(console.operations, policy=policy,
                                                    running=running):
                    start_runner(console, row, runner)
        await asyncio.sleep(every)


async def run_ui(settings: Settings) -> None:
    """Serve the review page on ``ui_host:ui_port`` until SIGTERM/SIGINT.

    One pool of ``ui_pool_max_size`` connections (application name
    ``<name>-ui``): one for the shared reading, one for a bulk action, the
    rest for viewers' lists. The pool opens (without waiting) before the page
    binds, so the start can read the signed-out sessions; it is closed on
    any way out, a taken port included. Raises ``OSError`` when the port is
    taken.
    """
    pool = make_pool(settings, "ui", max_size=settings.ui_pool_max_size)
    queue = make_queue(settings, pool)
    admin = settings.ui_admin_token.get_secret_value() if settings.ui_admin_token else None
    viewer = settings.ui_viewer_token.get_secret_value() if settings.ui_viewer_token else None
    proxies = parse_networks(settings.ui_trusted_proxies)
    app = make_app(queue, make_operations(settings, pool), admin_token=admin, viewer_token=viewer,
                   loopback_only=is_loopback(settings.ui_host),
                   options=UiOptions.from_settings(settings),
                   user_header=UserHeader(settings.ui_user_header, proxies) if proxies else None)
    await pool.open(wait=False)
    try:
        runner = await start_server(app, settings.ui_port, host=settings.ui_host)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("ui_started", extra={"host": settings.ui_host, "port": settings.ui_port,
                                      "mode": "admin" if admin else "read-only",
                                      "reading": "token" if viewer else "open",
                                      "user_header": settings.ui_user_header if proxies else None,
                                      "database": settings.safe_dsn})
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
    finally:
        await pool.close(timeout=5.0)
