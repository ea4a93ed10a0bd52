"""A provider behind TLS that refuses our client certificate: a pause, not failed jobs.

Real worker processes deliver to Debian's nginx (``tests/servers.py``) that demands a
client certificate signed by a private CA. Without one, nginx finishes the handshake and
answers every request ``400 No required SSL certificate was sent``: the same permanent
answer for every order, which the fleet must treat as a systemic rejection (pause, probe,
no job failed), and recover from by itself once the certificate is mounted.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from receipts.embedded import free_port
from receipts.supervisor import Child, Supervisor
from tests.acceptance.test_flow_fleet import failed_count, states, until
from tests.conftest import check_invariants, enqueue_many, fetch_rows
from tests.servers import Nginx, Pki


@pytest.fixture
def database(pg18) -> Iterator[str]:
    """A fresh migrated database on PostgreSQL 18 (a fleet run; the server version does
    not change what it proves)."""
    dsn = pg18.new_database()
    yield dsn
    pg18.drop_database(dsn)


@pytest.fixture
def fleet(tmp_path) -> Iterator[Supervisor]:
    with Supervisor(tmp_path) as supervisor:
        yield supervisor


def start_tls_workers(sup: Supervisor, dsn: str, url: str, pki: Pki, n: int, *,
                      client_cert: bool, prefix: str) -> list[Child]:
    workers = []
    for i in range(n):
        port = free_port()
        env = {"RECEIPTS_DATABASE_URL": dsn, "RECEIPTS_PROVIDER_URL": url,
               "RECEIPTS_PROVIDER_CA_FILE": pki.ca, "RECEIPTS_METRICS_PORT": str(port)}
        if client_cert:
            env |= {"RECEIPTS_PROVIDER_CLIENT_CERT_FILE": pki.client_cert,
                    "RECEIPTS_PROVIDER_CLIENT_KEY_FILE": pki.client_key}
        workers.append(sup.start(f"{prefix}-{i}", ["worker"], env, port=port))
    return [w.wait_healthy() for w in workers]


@pytest.mark.slow
def test_nginx_refusing_a_missing_client_certificate_pauses_the_fleet_until_it_is_mounted(
        database: str, fleet: Supervisor, nginx: Nginx, pki: Pki):
    dsn, sup = database, fleet
    site = nginx.site(pki=pki, verify_client=True)
    with nginx:
        enqueue_many(dsn, [f"order-{i}" for i in range(200)])
        workers = start_tls_workers(sup, dsn, site.url, pki, 2, client_cert=False,
                                    prefix="no-cert")
        until(lambda: any(w.scrape().value("receipts_provider_paused", reason="rejecting") == 1
                          for w in workers), "a worker to pause the fleet for rejecting", 30)
        until(lambda: sum(w.scrape().total("receipts_provider_probes_total")
                          for w in workers) >= 1, "a probe rejected again", 30)
        refused = sum(1 for status, *_ in nginx.requests() if status == 400)
        assert refused > 0
        assert failed_count(dsn) == 0
        # Every rejected attempt was given back: the certificate, not the orders, was wrong.
        assert fetch_rows(dsn, "SELECT max(attempts) FROM receipt_jobs WHERE state = 'ready'") == [
            (0,)]  # a probe in flight holds its attempt until it is answered
        assert fetch_rows(dsn, "SELECT pause_reason, pause_cause FROM receipt_flow") == [
            ("outage", "rejecting")]
        for w in workers:
            assert w.stop() == 0
        # The certificate is mounted (a new rollout): the next probe resumes the fleet.
        fixed = start_tls_workers(sup, dsn, site.url, pki, 2, client_cert=True, prefix="cert")
        until(lambda: states(dsn).get("done") == 200, "every job delivered", 120)
        assert states(dsn) == {"done": 200}
        assert sum(w.scrape().value("receipts_failures_total", reason="rejected")
                   for w in fixed) == 0
        assert fetch_rows(dsn, "SELECT pause_reason FROM receipt_flow") == [(None,)]
        check_invariants(dsn, 5)
