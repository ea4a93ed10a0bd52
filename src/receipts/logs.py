"""JSON logs: one object per line (python-json-logger).

Each record carries ``time`` (RFC 3339, UTC, milliseconds:
``2026-12-01T04:53:13.683Z``), ``level``, ``logger`` and ``event``, plus
structured fields passed through ``extra=``: job events use ``job_id``,
``order_id``, ``attempt``, ``token`` (first 8 characters only) and ``outcome``.

``event`` is a stable snake_case name for lines of the ``receipts`` loggers
(the catalogue is in docs/operations.md, "Logs and their events"). Lines of other loggers
(psycopg.pool, asyncio, aiohttp, …) get ``event: "library_message"`` and their
prose, whitespace folded onto one line, in ``message``: a library's wording
never becomes an event name.

Secrets never leave the process: before a record is serialised, every string
in it (the event, each field, a formatted exception) goes through
:func:`receipts.dsn.redact_dsn`, and the literal secrets handed to
:func:`configure_logging` (the DSN password, the provider token) are replaced
by ``***`` wherever they appear, even outside a DSN. Redacting the fields
rather than the rendered line keeps every line valid JSON.
"""

from __future__ import annotations

import datetime
import logging
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pythonjsonlogger.json import JsonFormatter

from receipts.dsn import redact_dsn

if TYPE_CHECKING:
    from receipts.model import Job

LOGGER_NAME = "receipts"
MASK = "***"
# The event of every line a foreign (library) logger writes; its text goes to "message".
LIBRARY_EVENT = "library_message"
_PLAIN = (int, float, bool, type(None), datetime.date, datetime.time)


class RedactingJsonFormatter(JsonFormatter):
    """A :class:`JsonFormatter` that masks DSN passwords and known secrets in every field.

    Args:
        secrets: literal strings to mask (empty strings and strings shorter
            than 4 characters are ignored: masking them would garble logs).
        *args, **kwargs: passed to :class:`JsonFormatter`.
    """

    def __init__(self, *args: Any, secrets: Iterable[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def redact(self, value: Any) -> Any:
        """*value* with secrets masked; containers are walked, other objects become text."""
        if isinstance(value, str):
            text = redact_dsn(value)
            for secret in self.secrets:
                text = text.replace(secret, MASK)
            return text
        if isinstance(value, _PLAIN):
            return value
        if isinstance(value, dict):
            return {str(k): self.redact(v) for k, v in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [self.redact(v) for v in value]
        return self.redact(str(value))

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """RFC 3339 in UTC with milliseconds, e.g. ``2026-12-01T04:53:13.683Z``."""
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord,
                   message_dict: dict[str, Any]) -> None:
        """Standard fields; a foreign logger's text moves from ``event`` to ``message``."""
        super().add_fields(log_data, record, message_dict)
        if not _is_ours(record.name):
            prose = log_data.get("event")
            log_data["event"] = LIBRARY_EVENT
            log_data["message"] = " ".join(str(prose or "").split())

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        """Mask secrets in every field before serialisation."""
        return {k: self.redact(v) for k, v in log_data.items()}


def _is_ours(name: str) -> bool:
    return name == LOGGER_NAME or name.startswith(LOGGER_NAME + ".")


def configure_logging(level: str = "INFO", stream: Any = None, *,
                      secrets: Iterable[str] = ()) -> None:
    """Send all logs as JSON lines to *stream* (default stdout) at *level* and above.

    *secrets* are literal strings masked wherever they appear (pass the DSN
    password and the provider token). Replaces existing root handlers; safe to
    call more than once. Raises ``ValueError`` for an unknown *level*.
    """
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(
        RedactingJsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger",
                           "message": "event"},
            timestamp=False,
            json_ensure_ascii=False,
            secrets=secrets,
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
    """The structured fields every job log line carries (token cut to 8 characters).

    Keys: ``job_id`` (UUID text), ``order_id``, ``attempt`` (1-based int),
    ``token`` (first 8 hex characters of the lease token), ``outcome`` (the
    delivery outcome or ack result, e.g. ``delivered``, ``provider_5xx``, ``stale``).
    """
    return {
        "job_id": str(job.id),
        "order_id": job.order_id,
        "attempt": job.attempt,
        "token": job.token_prefix,
        "outcome": outcome,
    }
