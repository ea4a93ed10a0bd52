"""``receipts check`` (the chart's `helm test`): a real PostgreSQL and a real HTTP provider,
the command run as a process; one line per check, exit 0 or 1, no secret printed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from aiohttp import web

from receipts.embedded import free_port
from tests.conftest import RunningProvider, fetch_rows

PASSWORD_DSN = "postgresql://receipts:n0t-Sh0wn@127.0.0.1:{port}/shop?connect_timeout=2"


async def receipts_check(dsn: str, provider_url: str, **env: str
                         ) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")}
    full = {**clean, "RECEIPTS_DATABASE_URL": dsn, "RECEIPTS_PROVIDER_URL": provider_url,
            "RECEIPTS_DELIVERY_TIMEOUT_SECONDS": "3", **env}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "receipts", "check", env=full,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return subprocess.CompletedProcess([], process.returncode, out.decode(), err.decode())


@pytest.fixture
def empty_dsn(server) -> Iterator[str]:
    url = server.new_database(migrated=False)
    yield url
    server.drop_database(url)


@pytest.mark.slow
async def test_a_migrated_database_and_an_answering_provider_pass(
        dsn: str, provider: RunningProvider) -> None:
    result = await receipts_check(dsn, provider.url, RECEIPTS_PROVIDER_TOKEN="tok_s3cret")
    assert result.returncode == 0, result.stdout + result.stderr
    database, reach = result.stdout.splitlines()
    assert database.startswith("database: ok: ") and "(up to date)" in database
    # The reference provider does not allow OPTIONS: any answer proves the way there.
    assert reach.startswith(f"provider: ok: {provider.url}: reachable (HTTP 405 in ")
    assert "tok_s3cret" not in result.stdout + result.stderr
    # Nothing was delivered or written.
    assert provider.provider.receipts == {}
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs") == [(0,)]


@pytest.mark.slow
async def test_a_provider_nobody_answers_for_fails_naming_it(dsn: str) -> None:
    url = f"http://127.0.0.1:{free_port()}/receipts"
    result = await receipts_check(dsn, url)
    assert result.returncode == 1
    database, reach = result.stdout.splitlines()
    assert database.startswith("database: ok")
    assert reach.startswith(f"provider: FAILED: {url}: NothingSent")


@pytest.mark.slow
async def test_a_provider_refusing_the_token_fails(dsn: str, stub) -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=401)

    stub.answer(refuse)
    result = await receipts_check(dsn, stub.url, RECEIPTS_PROVIDER_TOKEN="wrong-token")
    assert result.returncode == 1
    assert "HTTP 401" in result.stdout and "refuses our token" in result.stdout
    assert "wrong-token" not in result.stdout + result.stderr
    (seen,) = stub.requests
    assert seen["key"] == "" and seen["body"] == ""  # no receipt, no idempotency key


async def test_an_unset_provider_url_fails_saying_so(dsn: str) -> None:
    result = await receipts_check(dsn, "")
    assert result.returncode == 1
    assert result.stdout.splitlines()[1] == (
        "provider: FAILED: RECEIPTS_PROVIDER_URL is not set (the URL receipts are POSTed to)")


@pytest.mark.slow
async def test_a_provider_answering_404_passes_with_a_word_on_the_path(dsn: str, stub) -> None:
    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404)

    stub.answer(not_found)
    result = await receipts_check(dsn, stub.url)
    assert result.returncode == 0, result.stdout + result.stderr
    reach = result.stdout.splitlines()[1]
    assert reach.startswith(f"provider: ok: {stub.url}: reachable (HTTP 404 in ")
    assert "check the path of RECEIPTS_PROVIDER_URL" in reach


@pytest.mark.slow
async def test_an_unmigrated_database_fails_saying_what_to_run(empty_dsn: str,
                                                              provider: RunningProvider) -> None:
    result = await receipts_check(empty_dsn, provider.url)
    assert result.returncode == 1
    assert result.stdout.splitlines()[0].startswith("database: FAILED")
    assert "receipts migrate" in result.stdout


@pytest.mark.slow
async def test_an_unreachable_database_fails_without_its_password(
        provider: RunningProvider) -> None:
    result = await receipts_check(PASSWORD_DSN.format(port=free_port()), provider.url)
    assert result.returncode == 1
    assert result.stdout.splitlines()[0].startswith("database: FAILED")
    assert "n0t-Sh0wn" not in result.stdout + result.stderr
    assert result.stdout.splitlines()[1].startswith("provider: ok")


@pytest.mark.parametrize("status", [500, 502, 503, 504])
async def test_a_provider_answering_a_server_error_fails(dsn: str, stub, status: int) -> None:
    # 503 is the provider (or its load balancer) saying it does not serve; 502/504 a gateway
    # that could not reach it: an answer, but no proof that receipts can be delivered.
    async def unavailable(request: web.Request) -> web.Response:
        return web.Response(status=status)

    stub.answer(unavailable)
    result = await receipts_check(dsn, stub.url)
    assert result.returncode == 1, result.stdout
    reach = result.stdout.splitlines()[1]
    assert reach.startswith("provider: FAILED: ") and f"HTTP {status}" in reach
    assert "not serving" in reach


async def test_a_provider_that_does_not_implement_options_passes(dsn: str, stub) -> None:
    async def not_implemented(request: web.Request) -> web.Response:
        return web.Response(status=501)

    stub.answer(not_implemented)
    result = await receipts_check(dsn, stub.url)
    assert result.returncode == 0, result.stdout


async def test_a_proxy_refusing_its_credentials_fails(dsn: str, stub) -> None:
    # A forward proxy that wants other credentials answers the request itself, 407.
    async def proxy_auth_required(request: web.Request) -> web.Response:
        return web.Response(status=407, headers={"Proxy-Authenticate": 'Basic realm="egress"'})

    stub.answer(proxy_auth_required)
    proxy = stub.url.rsplit("/", 1)[0].replace("http://", "http://alice:n0t-Sh0wn@")
    result = await receipts_check(dsn, "http://receipts.provider.test/receipts",
                                  RECEIPTS_PROVIDER_PROXY=proxy)
    assert result.returncode == 1, result.stdout
    reach = result.stdout.splitlines()[1]
    assert "HTTP 407" in reach and "proxy refuses" in reach
    assert "n0t-Sh0wn" not in result.stdout + result.stderr
