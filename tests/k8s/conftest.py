"""Fixtures of the cluster suite: a real Kubernetes, a PostgreSQL and the reference provider.

The suite runs only under ``make test-k8s`` (scripts/k8s/cluster.sh test), which builds and
starts a single-node Kubernetes 1.20 and exports where it is (``KUBECONFIG``,
``RECEIPTS_K8S_NODE_IP``, ``RECEIPTS_K8S_IMAGE``, ``RECEIPTS_K8S_STATE``); without them
nothing here is collected, so ``make test`` skips it.

The pods reach the node by its bridge address (there is no kube-proxy and no cluster DNS):
the embedded PostgreSQL and the reference provider (``receipts provider``) listen there, on
ports picked free, and are stopped by their PIDs at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from receipts.embedded import EmbeddedPostgres, free_port

ENV_KEYS = ("KUBECONFIG", "RECEIPTS_K8S_NODE_IP", "RECEIPTS_K8S_IMAGE", "RECEIPTS_K8S_STATE")

if not all(os.environ.get(key) for key in ENV_KEYS):
    collect_ignore_glob = ["test_*.py"]

NAMESPACE = "receipts-k8s"


def _run_dir() -> Path:
    """Where helper PIDs are registered for `cluster.sh down` (a safety net if pytest dies)."""
    path = Path(os.environ["RECEIPTS_K8S_STATE"]) / "run"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def node_ip() -> str:
    """The node's address on the pod bridge (pods reach host services there)."""
    return os.environ["RECEIPTS_K8S_NODE_IP"]


@pytest.fixture(scope="session")
def postgres(node_ip: str) -> Iterator[str]:
    """DSN (as seen from the pods) of a database ``receipts`` on an embedded PostgreSQL 18
    listening on 127.0.0.1 and the node's bridge address; pods connect with trust auth."""
    server = EmbeddedPostgres(fast=True, settings={
        "listen_addresses": f"'127.0.0.1,{node_ip}'", "max_connections": "300"})
    server.prepare()
    pod_net = node_ip.rsplit(".", 1)[0] + ".0/24"
    with (server.data / "pg_hba.conf").open("a") as fh:
        fh.write(f"host all all {pod_net} trust\n")
    server.start()
    try:
        server.create_database("receipts")
        yield f"postgresql://postgres@{node_ip}:{server.port}/receipts"
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def provider(node_ip: str) -> Iterator[str]:
    """Base URL (``http://<node>:<port>``) of a real ``receipts provider`` process."""
    port = free_port()
    log = open(Path(tempfile.gettempdir()) / f"receipts-k8s-provider-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "receipts"), "provider", "--host", node_ip,
         "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pid_file = _run_dir() / "test-provider.pid"
    pid_file.write_text(str(proc.pid))
    base = f"http://{node_ip}:{port}"
    try:
        import urllib.request

        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/healthz", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the reference provider did not start") from None
                time.sleep(0.1)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        pid_file.unlink(missing_ok=True)
        log.close()


@pytest.fixture(scope="session")
def helm_home() -> Iterator[dict[str, str]]:
    """Environment for helm and kubectl, helm's homes in a temporary folder."""
    home = Path(tempfile.mkdtemp(prefix="receipts-k8s-helm-"))
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        (home / var.lower()).mkdir()
        env[var] = str(home / var.lower())
    env["HELM_NO_PLUGINS"] = "1"
    yield env
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def db(postgres: str, node_ip: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection to the test database, from the host (127.0.0.1)."""
    dsn = postgres.replace(f"@{node_ip}:", "@127.0.0.1:")
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn
