"""Worker and CLI output: JSON log lines with the job fields, and no DSN password anywhere."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import psycopg
import pytest

from receipts.supervisor import Child, Supervisor, run_command
from tests.conftest import RunningProvider, enqueue_many, fetch_rows
from tests.integration._operate import wait_for

PASSWORD = "Sup3r-Secret-Pw"
JOB_FIELDS = {"job_id", "order_id", "attempt", "token", "outcome"}


def _with_password(dsn: str) -> str:
    """*dsn* (key/value form) plus a password; trust auth ignores it, logs must hide it."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info["password"] = PASSWORD
    return psycopg.conninfo.make_conninfo(**info)  # type: ignore[arg-type]


def _worker_env(dsn: str, provider_url: str, **extra: str) -> dict[str, str]:
    env = {
        "RECEIPTS_DATABASE_URL": dsn,
        "RECEIPTS_PROVIDER_URL": provider_url,
        "RECEIPTS_CONCURRENCY": "8",
        "RECEIPTS_LEASE_SECONDS": "30",
        "RECEIPTS_DELIVERY_TIMEOUT_SECONDS": "5",
        "RECEIPTS_POLL_INTERVAL_SECONDS": "0.1",
        "RECEIPTS_RETRY_BASE_SECONDS": "0.05",
        "RECEIPTS_RETRY_CAP_SECONDS": "0.2",
        "RECEIPTS_METRICS_PORT": "0",
        "RECEIPTS_LOG_LEVEL": "DEBUG",
    }
    return env | extra


async def _run_worker_until(env: dict[str, str], done: Callable[[Child], Awaitable[bool]], *,
                            timeout_seconds: float) -> tuple[int | None, str, str]:
    """Run ``receipts worker`` until *done(worker)*, then SIGTERM it: (exit, stdout, stderr)."""
    sup = Supervisor(stop_timeout_seconds=30)
    worker = sup.start("worker", ["worker"], env)
    try:
        await wait_for(lambda: done(worker), timeout_seconds=timeout_seconds,
                       what="the worker's work")
    finally:
        # Off the loop: the worker's last deliveries go to the provider in this loop.
        await asyncio.to_thread(sup.close)
    return worker.returncode, worker.stdout_text, worker.stderr_text


def _json_lines(text: str) -> list[dict[str, object]]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return [json.loads(ln) for ln in lines]  # every line must parse


@pytest.mark.slow
async def test_worker_logs_are_json_lines_with_the_job_fields_and_no_password(
    dsn: str, provider: RunningProvider
) -> None:
    # 60 orders: enough acceptances around the rejections to judge them; 15 % 503s
    # give retries and leave a job five in a row (max attempts) about 0.5 % of runs.
    provider.set_faults(error_rate=0.15, reject_rate=0.2)
    enqueue_many(dsn, [f"log-{i:02d}" for i in range(60)])

    async def drained(_: Child) -> bool:
        # Rejections of the batch's last orders may have no acceptance after them to
        # judge them by: held (ready, their attempt given back), not failed. Done when
        # nothing else is left and some rejection was judged.
        rows = await asyncio.to_thread(
            fetch_rows, dsn,
            "SELECT count(*) FILTER (WHERE state = 'running' OR (state = 'ready' AND"
            " NOT starts_with(coalesce(last_error, ''), 'held rejection: '))),"
            " count(*) FILTER (WHERE state = 'failed') FROM receipt_jobs")
        return rows[0][0] == 0 and rows[0][1] > 0

    code, out, err = await _run_worker_until(_worker_env(_with_password(dsn), provider.url),
                                             drained, timeout_seconds=30)
    assert code == 0, err
    assert PASSWORD not in out + err
    records = _json_lines(out)
    events = {r["event"] for r in records}
    assert {"worker_started", "job_retry", "job_failed", "delivered", "stopped"} <= events
    started = next(r for r in records if r["event"] == "worker_started")
    assert "password=***" in str(started["database"])
    job_records = [r for r in records if r["event"] in ("job_retry", "job_failed", "delivered")]
    for record in job_records:
        assert record.keys() >= JOB_FIELDS, record
        assert str(record["order_id"]).startswith("log-")
        assert isinstance(record["attempt"], int) and record["attempt"] >= 1
        token = str(record["token"])
        assert len(token) == 8 and int(token, 16) >= 0
        assert {"time", "level", "logger"} <= record.keys()
    failed = [r for r in records if r["event"] == "job_failed"]
    assert all(r["outcome"] == "rejected" for r in failed)
    assert len(failed) == fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs"
                                          " WHERE state = 'failed'")[0][0]


@pytest.mark.slow
async def test_a_worker_without_its_database_logs_json_without_the_password() -> None:
    from receipts.embedded import free_port

    bad = f"postgresql://receipts:{PASSWORD}@127.0.0.1:{free_port()}/receipts"

    async def claims_failed(worker: Child) -> bool:
        return '"event": "claim_failed"' in worker.stdout_text

    code, out, err = await _run_worker_until(_worker_env(bad, "http://127.0.0.1:9/r"),
                                             claims_failed, timeout_seconds=10)
    assert code == 0, err
    assert PASSWORD not in out + err
    records = _json_lines(out)
    assert any(r["event"] == "claim_failed" for r in records)
    assert any("password=***" in str(r.get("database")) for r in records)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["jobs", "stats"], ["jobs", "list", "--json"],
                                     ["migrate"], ["recover"], ["enqueue", "o-1"]])
@pytest.mark.parametrize("form", ["uri", "keyvalue"])
def test_cli_errors_for_an_unreachable_database_never_show_the_password(
    command: list[str], form: str
) -> None:
    from receipts.embedded import free_port

    port = free_port()
    dsn = (f"postgresql://receipts:{PASSWORD}@127.0.0.1:{port}/receipts" if form == "uri"
           else f"host=127.0.0.1 port={port} user=receipts password={PASSWORD} dbname=receipts")
    result = run_command(command, {"RECEIPTS_DATABASE_URL": dsn}, timeout_seconds=30)
    assert result.returncode == 1, result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    assert "receipts: error:" in result.stderr
    assert "Connection refused" in result.stderr or "connection" in result.stderr.lower()


@pytest.mark.slow
@pytest.mark.parametrize("dsn", [
    f"postgresql://receipts:{PASSWORD}@127.0.0.1:notaport/receipts",
    f"mysql://receipts:{PASSWORD}@127.0.0.1/receipts",
    f"host=127.0.0.1 password={PASSWORD} bogus_option=1",
    f"host=127.0.0.1 password='{PASSWORD} x",
])
def test_cli_settings_errors_for_a_bad_dsn_never_show_the_password(dsn: str) -> None:
    result = run_command(["jobs", "stats"], {"RECEIPTS_DATABASE_URL": dsn})
    assert result.returncode == 2, result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    assert "RECEIPTS_DATABASE_URL" in result.stderr
