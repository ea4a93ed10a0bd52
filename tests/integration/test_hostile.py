"""Hostile input, table by table: each gets a clear error or a bounded, documented behaviour.

* order ids (Python API and ``receipts enqueue``): empty, 10 KB, quotes, NUL,
  non-UTF-8, non-ASCII;
* provider answers: a 50 MB body, invalid JSON, a redirect loop, a slow drip,
  ``Retry-After`` of a year, negative, an HTTP date, garbage;
* settings: negative or absurd values, bad DSNs and URLs;
* a DSN to a closed port, a database without migrations: the CLI exits 1 with
  one line, a worker keeps running (not ready) and resumes by itself.

Never a secret in any output, never unbounded memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import tracemalloc
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiohttp import web

from receipts import cli
from receipts.delivery import HttpDeliverer
from receipts.embedded import free_port
from receipts.enqueue import enqueue
from receipts.errors import InvalidOrderId
from receipts.model import Job, Verdict
from receipts.retry import BackoffPolicy
from tests.chaos.run import read_events
from tests.conftest import Server, fetch_rows

SECRET = "s3cret-pw-7731"
TOKEN = "tok-s3cret-9912"
MB = 1024 * 1024


def _env(**values: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")}
    return base | {f"RECEIPTS_{k.upper()}": v for k, v in values.items()}


def _with_password(dsn: str) -> str:
    """*dsn* with a password (the test servers trust local users, so it is never checked)."""
    return psycopg.conninfo.make_conninfo(dsn, password=SECRET)


# ------------------------------------------------------------------ order ids

# name, value, accepted, error fragment
ORDER_IDS: list[tuple[str, str, bool, str]] = [
    ("empty", "", False, "non-empty"),
    ("10 KB", "x" * 10 * 1024, False, "longer than 200"),
    ("quotes", "o'; DROP TABLE receipt_jobs; --\"", True, ""),
    ("NUL byte", "a\x00b", False, "control characters"),
    ("newline", "a\nb", False, "control characters"),
    ("non-UTF-8 (lone surrogate)", "order-\udcff", False, "UTF-8"),
    ("non-ASCII UTF-8", "ørder-日本-1", True, ""),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "order_id", "accepted", "error"), ORDER_IDS,
                         ids=[row[0] for row in ORDER_IDS])
def test_enqueue_api_accepts_or_refuses_order_ids_without_poisoning_the_order_transaction(
    dsn, name, order_id, accepted, error
):
    with psycopg.connect(dsn) as conn, conn.transaction():
        if accepted:
            assert enqueue(conn, order_id) is not None
        else:
            with pytest.raises(InvalidOrderId, match=error):
                enqueue(conn, order_id)
        # The caller's order transaction is still usable: the check runs before any SQL.
        enqueue(conn, "order-after")
    stored = {r[0] for r in fetch_rows(dsn, "SELECT order_id FROM receipt_jobs")}
    assert stored == ({order_id, "order-after"} if accepted else {"order-after"})


# argv cannot carry NUL; non-UTF-8 arrives as raw bytes
CLI_ORDER_IDS: list[tuple[str, bytes, int, str]] = [
    ("empty", b"", 2, "argument ORDER_ID #1 (''): order id must be a non-empty"),
    ("10 KB", b"x" * 10 * 1024, 2, "longer than 200"),
    ("quotes", b"o'; DROP TABLE receipt_jobs; --\"", 0, "enqueued 1 job"),
    ("newline", b"a\nb", 2, "control characters"),
    ("non-UTF-8 bytes", b"order-\xff\xfe", 2, "UTF-8"),
    ("non-ASCII UTF-8", "ørder-日本-2".encode(), 0, "enqueued 1 job"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "arg", "code", "message"), CLI_ORDER_IDS,
                         ids=[row[0] for row in CLI_ORDER_IDS])
def test_cli_enqueue_answers_each_order_id_with_an_exit_status_and_one_line(
    dsn, name, arg, code, message
):
    result = subprocess.run([sys.executable, "-m", "receipts", "enqueue", arg],
                            env=_env(database_url=_with_password(dsn)),
                            capture_output=True, timeout=30)
    out = (result.stdout + result.stderr).decode("utf-8", "replace")
    assert result.returncode == code, out
    assert message in out and "Traceback" not in out and SECRET not in out
    assert len(out) < 500  # one line, never the 10 KB id echoed back
    count = fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs")[0][0]
    assert count == (1 if code == 0 else 0)


async def test_a_worker_delivers_order_ids_with_quotes_and_non_ascii_text(dsn, provider):
    """Regression: a non-ASCII order id crashed the delivery (httpx ASCII-encodes headers)."""
    from receipts.runtime import worker_runtime
    from tests.conftest import make_settings

    odd = ["ørder-日本-3", "o'\"; --", "order with spaces"]
    with psycopg.connect(dsn) as conn:
        for order_id in odd:
            enqueue(conn, order_id)
    settings = make_settings(dsn, provider_url=provider.url)
    async with worker_runtime(settings, metrics_port=0) as runtime:
        task = asyncio.create_task(runtime.worker.run())
        try:
            for _ in range(100):
                states = fetch_rows(dsn, "SELECT state FROM receipt_jobs")
                if all(s == ("done",) for s in states):
                    break
                await asyncio.sleep(0.05)
        finally:
            runtime.worker.stop()
            await asyncio.wait_for(task, 10)
    assert fetch_rows(dsn, "SELECT state, attempts FROM receipt_jobs") == [("done", 1)] * 3
    assert set(provider.provider.receipts) == {f"receipt:{o}" for o in odd}


# ------------------------------------------------------------ provider answers

CHUNK = b"x" * (64 * 1024)


async def _big(request: web.Request, status: int) -> web.StreamResponse:
    response = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
    response.content_length = 50 * MB
    await response.prepare(request)
    for _ in range(50 * MB // len(CHUNK)):
        await response.write(CHUNK)
    return response


async def _drip(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=422)
    await response.prepare(request)
    for _ in range(100):
        await response.write(b"x")
        await asyncio.sleep(0.2)
    return response


def _retry_after(value: str, *, date: str | None = None) -> Callable[..., Awaitable[Any]]:
    async def handler(_: web.Request) -> web.Response:
        headers = {"Retry-After": value}
        if date:
            headers["Date"] = date
        return web.json_response({"error": "slow down"}, status=429, headers=headers)
    return handler


def _fixed(status: int, body: bytes, **headers: str) -> Callable[..., Awaitable[Any]]:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(status=status, body=body, headers=headers)
    return handler


NOW = datetime(2030, 1, 1, tzinfo=UTC)
HTTP_NOW = format_datetime(NOW, usegmt=True)
YEAR = 365 * 86400

# name, handler, verdict, reason, retry_after_seconds (None: absent), worker delay bound
PROVIDER_ANSWERS: list[tuple[str, Callable[..., Awaitable[Any]], Verdict, str, float | None]] = [
    ("200 with a 50 MB body", lambda r: _big(r, 200), Verdict.DELIVERED, "delivered", None),
    ("422 with a 50 MB body", lambda r: _big(r, 422), Verdict.PERMANENT, "rejected", None),
    ("503 with a 50 MB body", lambda r: _big(r, 503), Verdict.RETRY, "provider_5xx", None),
    ("200 with invalid JSON", _fixed(200, b"{not json"), Verdict.DELIVERED, "delivered", None),
    ("422 with invalid JSON", _fixed(422, b"{oops \x00\xff"), Verdict.PERMANENT, "rejected",
     None),
    ("302 redirect loop", _fixed(302, b"", Location="/receipts"), Verdict.RETRY,
     "unexpected_status", None),
    ("308 redirect elsewhere", _fixed(308, b"", Location="http://169.254.169.254/"),
     Verdict.RETRY, "unexpected_status", None),
    # A 4xx whose body the deadline cut off is no verdict: a retry, like any timeout.
    ("422 dripping a byte every 0.2 s", _drip, Verdict.RETRY, "timeout", None),
    ("429 Retry-After: a year", _retry_after(str(YEAR)), Verdict.RETRY, "rate_limited",
     float(YEAR)),
    ("429 Retry-After: 20 digits", _retry_after("9" * 20), Verdict.RETRY, "rate_limited",
     999_999_999_999.0),
    ("429 Retry-After: negative", _retry_after("-5"), Verdict.RETRY, "rate_limited", None),
    ("429 Retry-After: garbage", _retry_after("soon, promise"), Verdict.RETRY, "rate_limited",
     None),
    ("429 Retry-After: HTTP date in 2 min", _retry_after(
        format_datetime(NOW + timedelta(minutes=2), usegmt=True), date=HTTP_NOW),
     Verdict.RETRY, "rate_limited", 120.0),
    ("429 Retry-After: HTTP date in the past", _retry_after(
        format_datetime(NOW - timedelta(days=1), usegmt=True), date=HTTP_NOW),
     Verdict.RETRY, "rate_limited", None),
]


@pytest.fixture
async def hostile_provider() -> AsyncIterator[tuple[dict[str, Any], str]]:
    """A provider whose POST /receipts answer is ``route["handler"]``; yields (route, url)."""
    app = web.Application()
    route: dict[str, Callable[..., Awaitable[Any]]] = {}

    async def dispatch(request: web.Request) -> web.StreamResponse:
        return await route["handler"](request)  # type: ignore[no-any-return]

    app.router.add_post("/receipts", dispatch)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield route, f"http://127.0.0.1:{port}/receipts"
    finally:
        await runner.cleanup()


@pytest.mark.solo  # the deadline's margin is 0.5 s: no busy neighbour
@pytest.mark.slow
@pytest.mark.parametrize(("name", "handler", "verdict", "reason", "retry_after"),
                         PROVIDER_ANSWERS, ids=[row[0] for row in PROVIDER_ANSWERS])
async def test_hostile_provider_answers_are_classified_within_the_deadline_and_bounded_memory(
    hostile_provider, name, handler, verdict, reason, retry_after
):
    route, url = hostile_provider
    route["handler"] = handler
    deliverer = HttpDeliverer(url, timeout_seconds=3)
    job = Job(uuid.uuid4(), "order-hostile", uuid.uuid4(), 1)
    tracemalloc.start()
    started = time.monotonic()
    try:
        outcome = await deliverer.deliver(job)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        await deliverer.aclose()
    elapsed = time.monotonic() - started
    assert (outcome.verdict, outcome.reason) == (verdict, reason), outcome
    assert elapsed < 3.5  # the delivery deadline bounds the whole exchange
    assert peak < 4 * MB  # a 50 MB answer is never held: at most MAX_BODY_BYTES are read
    assert len(outcome.detail) <= 250 and outcome.detail.isprintable()
    if retry_after is None:
        assert outcome.retry_after_seconds is None
    else:
        assert outcome.retry_after_seconds == pytest.approx(retry_after, abs=1)
    # What the worker does with it: the wait is bounded by RECEIPTS_RETRY_AFTER_MAX_SECONDS.
    policy = BackoffPolicy(base_seconds=5, cap_seconds=900, retry_after_max_seconds=3600)
    delay = policy.delay(1, retry_after_seconds=outcome.retry_after_seconds)
    assert 0 <= delay <= 3600
    if retry_after is not None:
        assert delay == pytest.approx(min(retry_after, 3600), abs=1)


# Answers no well-behaved HTTP server library would write: raw bytes on the socket.
# name, bytes (or a callable writing them), verdict, reason
async def _chunked_flood(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(50 * MB // len(CHUNK)):
        writer.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
        await writer.drain()


async def _headers_forever(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\n")
    for i in range(50 * MB // 64):
        writer.write(b"X-%d: %s\r\n" % (i, b"y" * 50))
        await writer.drain()


async def _status_then_silence(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\nbusy")
    await writer.drain()
    await asyncio.sleep(30)


async def _reset_mid_body(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\n"
                 b'{"error": "partial')
    await writer.drain()
    writer.transport.abort()


RAW_ANSWERS: list[tuple[str, Any, Verdict, str]] = [
    ("200 with a 50 MB chunked body", _chunked_flood, Verdict.DELIVERED, "delivered"),
    ("50 MB of headers", _headers_forever, Verdict.RETRY, "connection_lost"),
    ("not HTTP at all", b"SSH-2.0-OpenSSH_9.6\r\n\r\n", Verdict.RETRY, "connection_lost"),
    ("status line without a version", b"200 OK\r\n\r\n", Verdict.RETRY, "connection_lost"),
    ("100 Continue, then 201", b"HTTP/1.1 100 Continue\r\n\r\n"
     b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n", Verdict.DELIVERED, "delivered"),
    ("two different Content-Lengths", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
     b"Content-Length: 3\r\n\r\nok!", Verdict.RETRY, "connection_lost"),
    ("503 status, then silence", _status_then_silence, Verdict.RETRY, "provider_5xx"),
    ("503 reset mid-body", _reset_mid_body, Verdict.RETRY, "provider_5xx"),
    ("closed without a byte", b"", Verdict.RETRY, "connection_lost"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "answer", "verdict", "reason"), RAW_ANSWERS,
                         ids=[row[0] for row in RAW_ANSWERS])
async def test_raw_hostile_answers_are_classified_within_the_deadline_and_bounded_memory(
    name, answer, verdict, reason
):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            if callable(answer):
                await answer(writer)
            else:
                writer.write(answer)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    port = free_port()
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    deliverer = HttpDeliverer(f"http://127.0.0.1:{port}/receipts", timeout_seconds=3)
    tracemalloc.start()
    started = time.monotonic()
    try:
        outcome = await deliverer.deliver(Job(uuid.uuid4(), "order-raw", uuid.uuid4(), 1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        await deliverer.aclose()
        server.close()
    assert (outcome.verdict, outcome.reason) == (verdict, reason), outcome
    assert time.monotonic() - started < 3.5
    assert peak < 4 * MB
    assert len(outcome.detail) <= 250 and outcome.detail.isprintable()


# -------------------------------------------------------------------- settings

# variable (without prefix), value, message fragment
SETTINGS: list[tuple[str, str, str]] = [
    ("concurrency", "-1", "RECEIPTS_CONCURRENCY"),
    ("concurrency", "0", "RECEIPTS_CONCURRENCY"),
    ("concurrency", "1000000000", "RECEIPTS_CONCURRENCY"),
    ("concurrency", "lots", "RECEIPTS_CONCURRENCY"),
    ("lease_seconds", "-5", "RECEIPTS_LEASE_SECONDS"),
    ("lease_seconds", "0", "RECEIPTS_LEASE_SECONDS"),
    ("lease_seconds", "1e12", "RECEIPTS_LEASE_SECONDS"),
    ("lease_seconds", "nan", "RECEIPTS_LEASE_SECONDS"),
    ("lease_seconds", "inf", "RECEIPTS_LEASE_SECONDS"),
    ("delivery_timeout_seconds", "120", "RECEIPTS_DELIVERY_TIMEOUT_SECONDS (120) must be at most"),
    ("max_attempts", "0", "RECEIPTS_MAX_ATTEMPTS"),
    ("max_attempts", "99999999", "RECEIPTS_MAX_ATTEMPTS"),
    ("metrics_port", "70000", "RECEIPTS_METRICS_PORT"),
    ("metrics_port", "-1", "RECEIPTS_METRICS_PORT"),
    ("poll_interval_seconds", "-1", "RECEIPTS_POLL_INTERVAL_SECONDS"),
    ("retry_cap_seconds", "1", "RECEIPTS_RETRY_CAP_SECONDS must be at least"),
    ("log_level", "LOUD", "RECEIPTS_LOG_LEVEL"),
    ("pgbouncer", "maybe", "RECEIPTS_PGBOUNCER"),
    ("provider_url", f"ftp://user:{SECRET}@files/", "RECEIPTS_PROVIDER_URL"),
    ("database_url", f"mysql://root:{SECRET}@db/app", "RECEIPTS_DATABASE_URL"),
    ("database_url", f"postgresql://u:{SECRET}@db:99999/x", "RECEIPTS_DATABASE_URL"),
    ("database_url", f"host=db password={SECRET} bogus_key=1", "RECEIPTS_DATABASE_URL"),
    ("database_url", "", "RECEIPTS_DATABASE_URL"),
]


@pytest.mark.parametrize(("variable", "value", "message"), SETTINGS,
                         ids=[f"{v}={x[:20]}" for v, x, _ in SETTINGS])
def test_bad_settings_stop_every_command_with_exit_2_and_no_secret(
    monkeypatch, capsys, variable, value, message
):
    for key in [k for k in os.environ if k.startswith("RECEIPTS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("RECEIPTS_DATABASE_URL", f"postgresql://u:{SECRET}@127.0.0.1:9/x")
    monkeypatch.setenv("RECEIPTS_PROVIDER_TOKEN", TOKEN)
    monkeypatch.setenv(f"RECEIPTS_{variable.upper()}", value)
    for command in (["worker"], ["recover"], ["jobs", "stats"]):
        assert cli.main(command) == 2
        out = capsys.readouterr()
        text = out.out + out.err
        assert message in text and text.startswith("receipts: error: ")
        assert SECRET not in text and TOKEN not in text
        assert text.count("\n") == 1


# ----------------------------------------------------- unreachable or unmigrated


@pytest.mark.slow
def test_cli_commands_against_a_closed_port_exit_1_with_one_line_and_no_secret():
    closed = f"postgresql://postgres:{SECRET}@127.0.0.1:{free_port()}/receipts"
    commands = [["migrate"], ["recover"], ["jobs", "stats"], ["enqueue", "order-1"],
                ["jobs", "retry", "--all-failed"]]
    procs = [subprocess.Popen([sys.executable, "-m", "receipts", *c],
                              env=_env(database_url=closed, provider_token=TOKEN),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for c in commands]
    started = time.monotonic()
    for command, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=30)
        text = (out + err).decode()
        assert proc.returncode == 1, (command, text)
        assert "database unavailable" in text, (command, text)
        assert SECRET not in text and TOKEN not in text and "Traceback" not in text
        assert text.count("\n") == 1, (command, text)
    assert time.monotonic() - started < 20  # bounded: connect and pool timeouts


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture
def unmigrated(pg18: Server) -> Any:
    dsn = pg18.new_database(migrated=False)
    try:
        yield dsn
    finally:
        pg18.drop_database(dsn)


@pytest.mark.slow
async def test_workers_without_a_database_or_without_migrations_wait_not_ready_then_resume(
    unmigrated: str, provider, tmp_path: Path
):
    closed = f"postgresql://postgres:{SECRET}@127.0.0.1:{free_port()}/receipts"
    cases = {"no-migrations": _with_password(unmigrated), "closed-port": closed}
    procs, ports, logs = {}, {}, {}
    for name, dsn in cases.items():
        ports[name], logs[name] = free_port(), tmp_path / f"{name}.log"
        with logs[name].open("wb") as fh:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "receipts", "worker"],
                env=_env(database_url=dsn, provider_url=provider.url, provider_token=TOKEN,
                         metrics_port=str(ports[name]), poll_interval_seconds="0.1"),
                stdout=fh, stderr=subprocess.STDOUT)
    try:
        # A claim waits up to the 5 s pool timeout before failing: wait for that signal.
        deadline = time.monotonic() + 30
        while not all(read_events(logs[n], {"claim_failed"}) for n in cases):
            assert time.monotonic() < deadline, "no claim_failed logged within 30 s"
            await asyncio.sleep(0.1)
        for name, proc in procs.items():
            assert proc.poll() is None, (name, logs[name].read_text()[-800:])  # no crash loop
            assert await asyncio.to_thread(_get, f"http://127.0.0.1:{ports[name]}/healthz") == 200
            assert await asyncio.to_thread(_get, f"http://127.0.0.1:{ports[name]}/readyz") == 503
            assert _rss_mb(proc.pid) < 200
            failures = read_events(logs[name], {"claim_failed"})
            assert 1 <= len(failures) <= 12, name  # backed off, not spinning
        assert "run `receipts migrate` first" in read_events(
            logs["no-migrations"], {"claim_failed"})[0]["error"]
        assert "database unavailable" in read_events(
            logs["closed-port"], {"claim_failed"})[0]["error"]

        # Migrate and enqueue: the waiting worker resumes by itself and delivers.
        result = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "receipts", "migrate"],
            env=_env(database_url=unmigrated), capture_output=True, timeout=30)
        assert result.returncode == 0, result.stderr
        with psycopg.connect(unmigrated) as conn:
            enqueue(conn, "order-after-migrate")
        for _ in range(200):
            if fetch_rows(unmigrated, "SELECT state FROM receipt_jobs") == [("done",)]:
                break
            await asyncio.sleep(0.1)
        assert fetch_rows(unmigrated, "SELECT state FROM receipt_jobs") == [("done",)]
        assert await asyncio.to_thread(
            _get, f"http://127.0.0.1:{ports['no-migrations']}/readyz") == 200
    finally:
        for proc in procs.values():
            proc.terminate()
        codes = {n: await asyncio.to_thread(p.wait, 20) for n, p in procs.items()}
    assert codes == {"no-migrations": 0, "closed-port": 0}
    for name in cases:
        text = logs[name].read_text()
        assert SECRET not in text and TOKEN not in text, name
        assert all(line.startswith("{") for line in text.splitlines()), name  # JSON lines only
        json.loads(text.splitlines()[0])
