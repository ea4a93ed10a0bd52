"""Egress against real servers: Debian's nginx as the provider, tinyproxy and squid as proxies.

Each test starts what it needs on 127.0.0.1 with a config it writes
(:mod:`tests.servers`): keep-alive limits, a large response head, mutual
TLS with and without a client certificate, forward proxying and ``CONNECT``
tunnels, ``NO_PROXY``, ``RECEIPTS_PROVIDER_PROXY`` winning, and proxy
credentials that never show.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import pytest

from receipts.delivery import HttpDeliverer, tls_context
from receipts.model import Job, Outcome, Reason, Verdict
from receipts.runtime import make_deliverer
from receipts.settings import load_settings
from receipts.transport import AiohttpTransport, HttpxTransport
from tests.servers import Nginx, Pki, Squid, Tinyproxy, large_head

SECRET = "pr0xy-s3cret-4471"


def a_job(n: int | str = 1) -> Job:
    return Job(uuid.uuid4(), f"order-{n}", uuid.uuid4(), 1)


async def deliver(deliverer: HttpDeliverer, count: int = 1) -> list[Outcome]:
    try:
        return list(await asyncio.gather(*(deliverer.deliver(a_job(i)) for i in range(count))))
    finally:
        await deliverer.aclose()


def settings_for(url: str, **extra: object):
    return load_settings(database_url="postgresql://app@127.0.0.1:9/db", provider_url=url,
                         delivery_timeout_seconds=5, **extra)


# ------------------------------------------------------------------ keep-alive


@pytest.mark.slow
async def test_a_keep_alive_connection_nginx_closes_when_idle_is_resent_and_burns_no_attempt():
    """Bursts about 1 s apart against keepalive_timeout 1s: reused connections die under
    the request. Each such request is sent once more on a fresh connection, within
    its attempt; httpx's own transport, side by side, is the yardstick.

    To make the race certain rather than occasional, the event loop is busy (blocked)
    between bursts, as a loaded worker's may be: nginx's closes are not noticed before
    the next burst picks the connections (otherwise only the few closes that land
    between the pick and the write are caught, ~1 % of deliveries)."""
    nginx = Nginx()
    ours_site = nginx.site(keepalive_timeout="1s")
    theirs_site = nginx.site(keepalive_timeout="1s")
    with nginx:
        ours = AiohttpTransport(max_connections=20)
        theirs = HttpxTransport(max_connections=20)
        ours_d = HttpDeliverer(ours_site.url, timeout_seconds=5, transport=ours)
        theirs_d = HttpDeliverer(theirs_site.url, timeout_seconds=5, transport=theirs)
        seen: dict[str, Counter[str]] = {"ours": Counter(), "theirs": Counter()}

        try:
            for n in range(3):
                # Every delivery's task is created here, so each takes its connection
                # from the pool before the loop next looks at the sockets.
                outcomes = await asyncio.gather(
                    *(ours_d.deliver(a_job(f"ours-{n}-{i}")) for i in range(20)),
                    *(theirs_d.deliver(a_job(f"theirs-{n}-{i}")) for i in range(20)))
                seen["ours"].update(str(o.reason) for o in outcomes[:20])
                seen["theirs"].update(str(o.reason) for o in outcomes[20:])
                time.sleep(1.2)  # the stimulus: ~1 s idle, the loop busy while nginx closes
        finally:
            await ours_d.aclose()
            await theirs_d.aclose()
        log = nginx.requests()
    assert seen["ours"] == Counter({"delivered": 60})  # no attempt burned
    assert ours.stale_retries > 0  # the race did happen, and was absorbed
    assert 60 - seen["ours"]["delivered"] <= 60 - seen["theirs"]["delivered"]
    # nginx answered each delivery once: every resent request had never reached it.
    served = [row for row in log if row[0] == 201]
    assert len(served) == 60 + seen["theirs"]["delivered"]


async def test_nginx_ending_connections_after_three_requests_costs_nothing():
    nginx = Nginx()
    site = nginx.site(keepalive_requests=3)
    with nginx:
        transport = AiohttpTransport(max_connections=4)
        deliverer = HttpDeliverer(site.url, timeout_seconds=5, transport=transport)
        outcomes = []
        try:
            for _ in range(6):
                outcomes += await asyncio.gather(*(deliverer.deliver(a_job()) for _ in range(4)))
        finally:
            await deliverer.aclose()
        log = nginx.requests()
    assert {o.reason for o in outcomes} == {Reason.DELIVERED} and len(outcomes) == 24
    assert max(number for *_, number in log) == 3  # nginx did close every third request
    assert len({conn for _, _, conn, _ in log}) >= 8


async def test_a_76_kb_response_head_on_a_200_is_delivered():
    nginx = Nginx()
    site = nginx.site(location=large_head(20, 3800))
    with nginx:
        (outcome,) = await deliver(HttpDeliverer(site.url, timeout_seconds=5))
    assert (outcome.verdict, outcome.reason, outcome.status) == (
        Verdict.DELIVERED, Reason.DELIVERED, 200)


# ------------------------------------------------------------------ mutual TLS


async def test_mutual_tls_with_the_client_certificate_is_delivered_and_without_it_is_classified(
        pki: Pki):
    nginx = Nginx()
    site = nginx.site(pki=pki, verify_client=True)
    with nginx:
        with_cert = tls_context(pki.ca, pki.client_cert, pki.client_key)
        (good,) = await deliver(HttpDeliverer(site.url, timeout_seconds=5, tls=with_cert))
        (missing,) = await deliver(HttpDeliverer(site.url, timeout_seconds=5,
                                                 tls=tls_context(pki.ca)))
        (untrusted,) = await deliver(HttpDeliverer(site.url, timeout_seconds=5))
    assert (good.verdict, good.status) == (Verdict.DELIVERED, 201)
    # nginx's own answer to a missing certificate: an HTML 400, classified like any 4xx.
    assert (missing.reason, missing.status) == (Reason.REJECTED, 400)
    assert "No required SSL certificate was sent" in missing.detail
    # A provider certificate from a CA we were not told to trust: nothing was sent.
    assert untrusted.reason is Reason.CONNECT_ERROR
    assert "certificate" in untrusted.detail.lower()


# ---------------------------------------------------------------------- proxies


@pytest.mark.slow
@pytest.mark.parametrize("proxy_kind", [Tinyproxy, Squid], ids=["tinyproxy", "squid"])
async def test_plain_and_tls_providers_are_reached_through_a_proxy(proxy_kind, pki: Pki):
    nginx = Nginx()
    plain = nginx.site()
    tls = nginx.site(pki=pki, verify_client=True)
    with nginx, proxy_kind() as proxy:
        (forwarded,) = await deliver(HttpDeliverer(plain.url, timeout_seconds=5,
                                                   proxy=proxy.url))
        (tunnelled,) = await deliver(HttpDeliverer(
            tls.url, timeout_seconds=5, proxy=proxy.url,
            tls=tls_context(pki.ca, pki.client_cert, pki.client_key)))
        await asyncio.sleep(0)  # the deliverers closed their connections: the tunnel ends
        log = proxy.wait_for_log("CONNECT") if isinstance(proxy, Squid) else proxy.log_text()
    assert (forwarded.reason, tunnelled.reason) == (Reason.DELIVERED, Reason.DELIVERED)
    assert f"127.0.0.1:{plain.port}/receipts" in log  # forwarded: the absolute URL
    assert "CONNECT" in log and f"127.0.0.1:{tls.port}" in log  # TLS end to end, tunnelled


@pytest.mark.slow
async def test_the_environment_proxy_applies_unless_no_proxy_matches_and_the_setting_wins():
    nginx = Nginx()
    site = nginx.site()
    with nginx, Tinyproxy() as tiny, Squid() as squid:
        env = {"HTTP_PROXY": squid.url, "https_proxy": "http://127.0.0.1:9"}
        (via_env,) = await deliver(make_deliverer(settings_for(site.url), env))
        # squid writes a transaction's line when it ends, a moment after the answer.
        squid_after_env = squid.wait_for_log("/receipts").count("/receipts")
        (bypassed,) = await deliver(make_deliverer(
            settings_for(site.url), env | {"NO_PROXY": "localhost,127.0.0.0/8"}))
        (setting_wins,) = await deliver(make_deliverer(
            settings_for(site.url, provider_proxy=tiny.url), env | {"NO_PROXY": "*"}))
        squid_log, tiny_log = squid.log_text(), tiny.wait_for_log("/receipts")
    assert {via_env.reason, bypassed.reason, setting_wins.reason} == {Reason.DELIVERED}
    assert squid_after_env == 1
    assert squid_log.count("/receipts") == 1  # NO_PROXY sent the second one direct
    assert tiny_log.count("/receipts") == 1  # RECEIPTS_PROVIDER_PROXY beat HTTP_PROXY, NO_PROXY


async def test_proxy_credentials_are_sent_to_the_proxy_and_never_shown(pki: Pki, caplog):
    nginx = Nginx()
    plain = nginx.site()
    tls = nginx.site(pki=pki)
    with nginx, Tinyproxy(user="alice", password=SECRET) as proxy:
        wrong = proxy.url.replace(SECRET, SECRET + "-wrong")
        (good,) = await deliver(HttpDeliverer(plain.url, timeout_seconds=5, proxy=proxy.url))
        (good_tls,) = await deliver(HttpDeliverer(tls.url, timeout_seconds=5, proxy=proxy.url,
                                                  tls=tls_context(pki.ca)))
        (refused,) = await deliver(HttpDeliverer(plain.url, timeout_seconds=5, proxy=wrong))
        (refused_tls,) = await deliver(HttpDeliverer(tls.url, timeout_seconds=5, proxy=wrong,
                                                     tls=tls_context(pki.ca)))
    assert (good.reason, good_tls.reason) == (Reason.DELIVERED, Reason.DELIVERED)
    # The proxy's refusal is never the provider's verdict on the order: our credentials,
    # retried (tinyproxy answers a forward request 401, the standard says 407).
    assert refused.reason is Reason.AUTH_REJECTED and refused.status in (401, 407)
    # Refused before the tunnel: nothing reached the provider.
    assert refused_tls.reason is Reason.CONNECT_ERROR
    assert "proxy refused the tunnel: 401" in refused_tls.detail  # tinyproxy's 401, again
    choice = settings_for(tls.url, provider_proxy=wrong).provider_proxy_choice({})
    texts = [o.detail for o in (good, good_tls, refused, refused_tls)]
    texts += [choice.describe(), str(choice.safe_url), caplog.text]
    assert not [t for t in texts if SECRET in t]
    assert choice.describe() == f"http://alice:***@127.0.0.1:{proxy.port} (RECEIPTS_PROVIDER_PROXY)"


async def test_tls_sends_the_provider_s_host_name(pki: Pki):
    nginx = Nginx()
    site = nginx.site(pki=pki, location="default_type text/plain;\n"
                                        "        return 201 'sni=$ssl_server_name';")
    with nginx:
        transport = AiohttpTransport(tls=tls_context(pki.ca))
        try:
            by_name = site.url.replace("127.0.0.1", "localhost")
            answer = await transport.sender(by_name)("POST", [], b"")
            body = bytearray()
            await answer.read_into(body, 1024)
            await answer.release()
        finally:
            await transport.aclose()
    assert (answer.status, bytes(body)) == (201, b"sni=localhost")
