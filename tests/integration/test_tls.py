"""An https provider signed by a private CA, with and without mutual TLS (real TLS, openssl)."""

from __future__ import annotations

import ssl
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from receipts.delivery import HttpDeliverer, tls_context
from receipts.embedded import free_port
from receipts.model import Job, Reason, Verdict
from receipts.settings import SettingsError, load_settings


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=receipts test CA", "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", "san.ext",
                 "-out", f"{name}.pem", cwd=d)
    return d


async def _serve(pki: Path, *, require_client_cert: bool) -> AsyncIterator[str]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki / "server.pem", pki / "server.key")
    if require_client_cert:
        context.load_verify_locations(pki / "ca.pem")
        context.verify_mode = ssl.CERT_REQUIRED

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"receipt_id": "r-1"})

    app = web.Application()
    app.router.add_post("/receipts", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    try:
        yield f"https://127.0.0.1:{port}/receipts"
    finally:
        await runner.cleanup()


@pytest.fixture
async def https(pki: Path) -> AsyncIterator[str]:
    async for url in _serve(pki, require_client_cert=False):
        yield url


@pytest.fixture
async def mtls(pki: Path) -> AsyncIterator[str]:
    async for url in _serve(pki, require_client_cert=True):
        yield url


async def _deliver(url: str, tls: ssl.SSLContext | None) -> tuple[Verdict, Reason]:
    deliverer = HttpDeliverer(url, timeout_seconds=5, max_connections=1, tls=tls)
    try:
        outcome = await deliverer.deliver(Job(uuid.uuid4(), "order-1", uuid.uuid4(), 1))
    finally:
        await deliverer.aclose()
    return outcome.verdict, outcome.reason


@pytest.mark.slow
async def test_a_private_ca_is_trusted_only_when_configured(https, pki):
    assert await _deliver(https, None) == (Verdict.RETRY, Reason.CONNECT_ERROR)
    assert await _deliver(https, tls_context(str(pki / "ca.pem"))) == (
        Verdict.DELIVERED, Reason.DELIVERED)


async def test_mutual_tls_presents_the_client_certificate(mtls, pki):
    ca = str(pki / "ca.pem")
    assert (await _deliver(mtls, tls_context(ca)))[0] is Verdict.RETRY
    with_cert = tls_context(ca, str(pki / "client.pem"), str(pki / "client.key"))
    assert await _deliver(mtls, with_cert) == (Verdict.DELIVERED, Reason.DELIVERED)


def test_an_unreadable_ca_file_is_refused_by_name(tmp_path):
    with pytest.raises(SettingsError, match="RECEIPTS_PROVIDER_CA_FILE"):
        load_settings(database_url="postgresql://u@h/d",
                      provider_ca_file=str(tmp_path / "missing.pem"))
