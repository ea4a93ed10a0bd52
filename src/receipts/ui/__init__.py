"""The review web page (``receipts ui``): queue summary, failed jobs, attempt history, actions.

Server-rendered HTML (aiohttp + Jinja2 with autoescaping), no JavaScript, no
build step. Read-only unless ``RECEIPTS_UI_ADMIN_TOKEN`` is set; then retry
and discard (one job, a selection or a whole filter, after a confirmation
that shows the count) need the token and pass CSRF and origin checks
(:mod:`receipts.ui.session`). See docs/review-page.md.
"""

from receipts.ui.app import make_app, run_ui

__all__ = ["make_app", "run_ui"]
