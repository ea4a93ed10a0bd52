"""Fixtures the acceptance tests share: child processes and the reference provider as one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from receipts.embedded import free_port
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

