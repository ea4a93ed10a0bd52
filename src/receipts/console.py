"""The ``receipts`` console script's entry point: the CLI, or one line when it cannot run.

The command needs the worker's stack (pydantic-settings, psycopg_pool, httpx,
aiohttp, …), which the base install leaves out so that an orders service gets
only what ``enqueue`` needs. Without it the command says which extra to
install instead of printing a traceback.
"""

from __future__ import annotations

import sys

#: Modules of the worker's stack the command cannot run without.
WORKER_STACK = {"pydantic", "pydantic_settings", "psycopg_pool", "httpx", "aiohttp",
                "prometheus_client", "pythonjsonlogger", "jinja2"}


def main() -> int:
    """Run :func:`receipts.cli.main`; exit 2 with one line when the worker extra is missing."""
    try:
        from receipts.cli import main as cli_main  # extra: worker (its stack may be absent)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in WORKER_STACK:
            raise
        print("receipts: error: the receipts command needs the worker extra: "
              "pip install 'receipts-queue[worker,binary]'", file=sys.stderr)
        return 2
    return cli_main()
