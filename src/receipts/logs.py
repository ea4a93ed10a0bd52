"""JSON logs: one object per line on stdout (python-json-logger).

Each record carries ``time``, ``level``, ``logger`` and a stable ``event``
name (the log message), plus structured fields passed through ``extra=``:
job events use ``job_id``, ``order_id``, ``attempt``, ``token`` (first 8
characters only) and ``outcome``. Every rendered line goes through
:func:`receipts.settings.redact_dsn`, so a DSN password never leaves the
process even when a library puts one in an error message.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from pythonjsonlogger.json import JsonFormatter

from receipts.settings import redact_dsn

if TYPE_CHECKING:
    from receipts.jobqueue import Job

LOGGER_NAME = "receipts"


class _RedactingFormatter(JsonFormatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact_dsn(super().format(record))


def configure_logging(level: str = "INFO", stream: Any = None) -> None:
    """Send all logs as JSON lines to *stream* (stdout) at *level* and above.

    Replaces existing root handlers; safe to call more than once.
    """
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(
        _RedactingFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger",
                           "message": "event"},
            timestamp=False,
            json_ensure_ascii=False,
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Libraries speak at WARNING unless we are debugging.
    for noisy in ("httpx", "httpcore", "psycopg", "psycopg.pool", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def get_logger(name: str) -> logging.Logger:
    """A logger under the ``receipts`` namespace (``receipts.<name>``)."""
    return logging.getLogger(f"{LOGGER_NAME}.{name}")


def job_fields(job: Job, outcome: str) -> dict[str, object]:
    """The structured fields every job log line carries (token cut to 8 characters)."""
    return {
        "job_id": str(job.id),
        "order_id": job.order_id,
        "attempt": job.attempt,
        "token": job.token_prefix,
        "outcome": outcome,
    }
