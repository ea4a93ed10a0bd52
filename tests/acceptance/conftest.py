"""Fixtures the acceptance tests share: child processes and the reference provider as one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from receipts.embedded import free_port
from receipts.enqueue import enqueue_many
from receipts.supervisor import Child, Supervisor


@pytest.fixture
def sup(tmp_path) -> Iterator[Supervisor]:
    """The test's child processes, logging to tmp_path/<name>.log; all stopped at the end."""
    with Supervisor(tmp_path) as supervisor:
        yield supervisor


@pytest.fixture
def provider(sup: Supervisor) -> Child:
    """`receipts provider` as a process, healthy; faults via ``PUT /faults``, what it
    answered via ``GET /answers``. (It stands in, for these tests, for the in-process
    provider of tests/conftest.py: acceptance tests drive real processes.)"""
    port = free_port()
    return sup.start("provider", ["provider", "--port", str(port)], port=port).wait_healthy()


class Trickle:
    """The shop's ordinary traffic: valid orders enqueued at *per_second* until stopped."""

    def __init__(self, dsn: str, per_second: float, prefix: str = "ok-t") -> None:
        self.dsn, self.per_second, self.prefix = dsn, per_second, prefix
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                with conn.transaction():  # as an orders service does: with its order
                    enqueue_many(conn, [f"{self.prefix}{self.sent}"])
                self.sent += 1
                self._stop.wait(max(0.0, start + self.sent / self.per_second - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
