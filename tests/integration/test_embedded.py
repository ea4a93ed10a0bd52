"""The embedded PostgreSQL changes nothing until asked, and says what it changed."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from receipts.embedded import EmbeddedPostgres, grant_server_user_access


@pytest.fixture
def base_dir() -> Iterator[Path]:
    """An empty folder the server user can reach (pytest's tmp_path is private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="receipts-embedded-test-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_constructing_a_server_touches_nothing_until_prepare(base_dir: Path) -> None:
    server = EmbeddedPostgres(fast=True, base_dir=str(base_dir))
    assert list(base_dir.iterdir()) == []
    server.stop()  # stopping a server never prepared is a no-op
    try:
        server.start()
        (folder,) = base_dir.iterdir()
        assert (folder / "data" / "PG_VERSION").is_file()
        with psycopg.connect(server.dsn, connect_timeout=5) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.cleanup()
    assert list(base_dir.iterdir()) == []


def test_granting_access_is_idempotent() -> None:
    server = EmbeddedPostgres()
    grant_server_user_access(server.bin)
    assert grant_server_user_access(server.bin) == []  # the second call changes nothing
