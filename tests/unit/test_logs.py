"""JSON log lines: always valid JSON, RFC 3339 UTC time, stable events, secrets masked."""

from __future__ import annotations

import io
import json
import logging
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from receipts.logs import configure_logging, get_logger, job_fields
from receipts.model import Job

SECRET = "hunter2-but-longer"


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    configure_logging("DEBUG", stream, secrets=[SECRET, "", "abc"])
    try:
        yield stream
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def _records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.mark.parametrize("text", [
    f"host=db password={SECRET}",                       # key/value DSN at the end of a field
    f"host=db password='{SECRET}' dbname=x",
    f"could not connect to postgresql://app:{SECRET}@db:5432/receipts",
    f'{{"dsn": "postgresql://app:{SECRET}@db/x"}}',     # quotes that JSON must escape
    f"the token is {SECRET}",                          # a known secret outside any DSN
])
def test_secrets_are_masked_and_the_line_stays_json(lines: io.StringIO, text: str) -> None:
    get_logger("test").warning("event_name", extra={"error": text, "nested": {"x": [text]}})
    get_logger("test").info(text)
    out = lines.getvalue()
    assert SECRET not in out
    first, second = _records(lines)
    assert first["event"] == "event_name" and "***" in str(first["error"])
    assert "***" in str(first["nested"]) and "***" in str(second["event"])


def test_exceptions_are_rendered_as_masked_text(lines: io.StringIO) -> None:
    try:
        raise RuntimeError(f"connect failed: postgresql://u:{SECRET}@h/db")
    except RuntimeError:
        get_logger("test").exception("boom")
    (record,) = _records(lines)
    assert "RuntimeError" in str(record["exc_info"]) and SECRET not in lines.getvalue()


def test_job_lines_carry_the_job_fields_with_an_8_character_token(lines: io.StringIO) -> None:
    job = Job(id=uuid.uuid4(), order_id="order-7", token=uuid.uuid4(), attempt=3)
    get_logger("worker").info("job_retry", extra={**job_fields(job, "provider_5xx"),
                                                  "when": uuid.uuid4()})
    (record,) = _records(lines)
    assert record["job_id"] == str(job.id) and record["order_id"] == "order-7"
    assert record["attempt"] == 3 and record["outcome"] == "provider_5xx"
    assert record["token"] == job.token.hex[:8]
    assert record["level"] == "INFO" and record["logger"] == "receipts.worker"
    assert isinstance(record["time"], str)


def test_short_or_empty_secrets_are_not_masked(lines: io.StringIO) -> None:
    get_logger("test").info("abc def")
    (record,) = _records(lines)
    assert record["event"] == "abc def"


def test_time_is_rfc3339_utc_with_milliseconds(lines: io.StringIO) -> None:
    before = datetime.now(UTC)
    get_logger("test").info("tick")
    (record,) = _records(lines)
    stamp = str(record["time"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", stamp), stamp
    parsed = datetime.fromisoformat(stamp)  # Python 3.11 reads the Z
    assert parsed.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=1) <= parsed <= datetime.now(UTC) + timedelta(seconds=1)


def test_a_library_s_multi_line_prose_goes_to_message_not_event(lines: io.StringIO) -> None:
    # What psycopg.pool writes about once a second while the database is away.
    prose = ("error connecting in 'pool-1': connection failed: connection to server at\n"
             f"  \"10.0.0.5\", port 5432 failed: password={SECRET}\n\tConnection refused")
    logging.getLogger("psycopg.pool").warning(prose)
    logging.getLogger("asyncio").error("Task exception was never retrieved")
    pool_line, asyncio_line = _records(lines)
    assert pool_line["event"] == "library_message" and pool_line["logger"] == "psycopg.pool"
    message = str(pool_line["message"])
    assert "\n" not in message and "\t" not in message and "  " not in message
    assert message.startswith("error connecting in 'pool-1': connection failed:")
    assert SECRET not in lines.getvalue() and "***" in message
    assert asyncio_line["event"] == "library_message"
    assert asyncio_line["message"] == "Task exception was never retrieved"


def test_our_own_lines_keep_their_event_name_and_have_no_message(lines: io.StringIO) -> None:
    get_logger("worker").warning("claim_failed", extra={"error": "boom"})
    logging.getLogger("receipts").info("worker_started")
    first, second = _records(lines)
    assert first["event"] == "claim_failed" and "message" not in first
    assert second["event"] == "worker_started"
