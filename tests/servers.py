"""Real servers for tests, started unprivileged on 127.0.0.1 with a config the test writes.

* :func:`make_pki`: a private CA, a server certificate for 127.0.0.1 and
  ``localhost``, and a client certificate, made with ``openssl``.
* :class:`Nginx`: Debian's nginx as a receipt provider. Each
  :meth:`Nginx.site` is one ``server`` block (plain or TLS, optionally
  demanding a client certificate; any keep-alive limits; any ``location``
  body), all served by one nginx process.
* :class:`Tinyproxy` and :class:`Squid`: Debian's forward proxies
  (``CONNECT`` included), optionally demanding Basic credentials.

Every server is waited for by connecting to its port (never a fixed sleep)
and stopped at the end of its ``with`` block; each writes its log into the
test's folder (:meth:`Nginx.requests`, ``.log_text()``). The binaries come
from ``scripts/install-tools.sh``; a test that needs a missing one fails
saying so (:func:`need`).

The pytest fixtures at the bottom (``pki``, ``nginx``) are imported by
``tests/conftest.py``, so every test can ask for them; the proxies are
context managers (``with Tinyproxy(user=…, password=…) as proxy:``). A
provider that demands a client certificate, and one that rejects everything::

    async def test_something(nginx: Nginx, pki: Pki) -> None:
        mtls = nginx.site(pki=pki, verify_client=True)      # no certificate → 400
        rejecting = nginx.site(location="return 400 '{\"error\": \"bad\"}';")
        with nginx:
            ...  # deliver to mtls.url / rejecting.url; nginx.requests() is its access log
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from receipts.embedded import free_port

START_SECONDS = 15.0


def need(binary: str) -> str:
    """The path of *binary* (``nginx``, ``tinyproxy``, ``squid``); fails the test when
    it is not installed (``make tools``, which ``make test`` runs, installs them)."""
    for folder in ("", "/usr/sbin/", "/usr/bin/"):
        path = shutil.which(binary) if not folder else folder + binary
        if path and os.access(path, os.X_OK):
            return path
    pytest.fail(f"{binary} is not installed (run `make tools`)")


def wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    """Return once 127.0.0.1:*port* accepts a connection; fail if *proc* exits first."""
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: "
                               f"{log.read_text(errors='replace')[-2000:] if log.exists() else ''}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"{what} did not listen on {port} within {START_SECONDS:g}s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _open_folder(prefix: str) -> Path:
    """A temporary folder that servers dropping privileges (squid) can write to."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o777)
    return path


# ------------------------------------------------------------------ certificates


@dataclass(frozen=True)
class Pki:
    """PEM files of a private CA, a server certificate (127.0.0.1, localhost) and a
    client certificate signed by it."""

    folder: Path

    @property
    def ca(self) -> str:
        return str(self.folder / "ca.pem")

    @property
    def server_cert(self) -> str:
        return str(self.folder / "server.pem")

    @property
    def server_key(self) -> str:
        return str(self.folder / "server.key")

    @property
    def client_cert(self) -> str:
        return str(self.folder / "client.pem")

    @property
    def client_key(self) -> str:
        return str(self.folder / "client.key")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(folder: Path) -> Pki:
    """Create the CA, server and client certificates in *folder* (EC keys: fast)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *key, "-days", "2", "-subj", "/CN=receipts test CA",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=folder)
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", *key, "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=folder)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", "san.ext",
                 "-out", f"{name}.pem", cwd=folder)
    folder.chmod(0o755)
    for path in folder.iterdir():  # the keys for their owner only (nginx reads them as root)
        path.chmod(0o600 if path.suffix == ".key" else 0o644)
    return Pki(folder)


# ------------------------------------------------------------------------ nginx

#: What the provider's ``location`` answers unless a site says otherwise: a 201 receipt.
RECEIPT = ("default_type application/json;\n"
           "        return 201 '{\"receipt_id\": \"nginx\"}';")


@dataclass
class Site:
    """One ``server`` block of :class:`Nginx`; ``url`` is ready once added."""

    port: int
    tls: bool
    url: str


@dataclass
class Nginx:
    """Debian's nginx as a provider: add sites, then use it as a context manager.

    Each site's access log line is ``<status> <request> <connection>
    <connection_requests>`` (:meth:`requests` parses them).
    """

    folder: Path = field(default_factory=lambda: _open_folder("nginx-"))
    blocks: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    def site(self, *, location: str = RECEIPT, pki: Pki | None = None,
             verify_client: bool = False, keepalive_timeout: str = "75s",
             keepalive_requests: int = 1000, extra: str = "") -> Site:
        """Add a ``server`` on a free port: ``location /`` answers with *location*
        (nginx directives; default :data:`RECEIPT`). *pki* makes it TLS with the
        server certificate; *verify_client* demands a client certificate signed
        by the CA (nginx answers 400 without one)."""
        port = free_port()
        tls = ""
        if pki is not None:
            tls = (f"ssl_certificate {pki.server_cert};\n"
                   f"    ssl_certificate_key {pki.server_key};\n")
            if verify_client:
                tls += f"    ssl_client_certificate {pki.ca};\n    ssl_verify_client on;\n"
        self.blocks.append(f"""
  server {{
    listen 127.0.0.1:{port}{' ssl' if pki else ''};
    {tls}
    keepalive_timeout {keepalive_timeout};
    keepalive_requests {keepalive_requests};
    access_log {self.folder}/access.log receipts;
    {extra}
    location / {{
        {location}
    }}
  }}""")
        scheme = "https" if pki else "http"
        return Site(port, pki is not None, f"{scheme}://127.0.0.1:{port}/receipts")

    def __enter__(self) -> Nginx:
        binary = need("nginx")
        for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi", "logs"):
            (self.folder / sub).mkdir(exist_ok=True)
        user = "user root root;" if os.geteuid() == 0 else ""
        conf = self.folder / "nginx.conf"
        conf.write_text(f"""{user}
daemon off;
master_process on;
worker_processes 1;
pid {self.folder}/nginx.pid;
error_log {self.folder}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  log_format receipts '$status "$request" $connection $connection_requests';
  client_body_temp_path {self.folder}/client_body;
  proxy_temp_path {self.folder}/proxy;
  fastcgi_temp_path {self.folder}/fastcgi;
  uwsgi_temp_path {self.folder}/uwsgi;
  scgi_temp_path {self.folder}/scgi;
  {''.join(self.blocks)}
}}
""")
        log = self.folder / "stderr.log"
        with log.open("wb") as stderr:
            self.proc = subprocess.Popen([binary, "-c", str(conf), "-p", str(self.folder)],
                                         stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            for port in self.ports():
                wait_for_port(port, self.proc, "nginx", log)
        except BaseException:
            self.__exit__()
            raise
        return self

    def ports(self) -> list[int]:
        return [int(b.split("listen 127.0.0.1:")[1].split()[0].rstrip(";")) for b in self.blocks]

    def __exit__(self, *_: object) -> None:
        if self.proc is not None:
            _stop(self.proc)
        shutil.rmtree(self.folder, ignore_errors=True)

    def requests(self) -> list[tuple[int, str, int, int]]:
        """Access-log lines so far: (status, request line, connection id, request
        number on that connection)."""
        path = self.folder / "access.log"
        rows = []
        for line in path.read_text().splitlines() if path.exists() else []:
            status, rest = line.split(" ", 1)
            request, _, conn = rest.rpartition('" ')
            connection, number = conn.split()
            rows.append((int(status), request.lstrip('"'), int(connection), int(number)))
        return rows


def large_head(headers: int = 20, size: int = 3800) -> str:
    """nginx directives answering 200 with *headers* headers of *size* bytes each
    (nginx's configuration parser takes at most ~4 KB per parameter)."""
    adds = "\n        ".join(f"add_header X-Large-{i} {'h' * size} always;"
                            for i in range(headers))
    return f"{adds}\n        {RECEIPT.replace('201', '200')}"


# ---------------------------------------------------------------------- proxies


@dataclass
class Tinyproxy:
    """Debian's tinyproxy on a free port (``CONNECT`` to any port allowed); with
    *user*/*password*, Basic proxy credentials are required."""

    user: str | None = None
    password: str | None = None
    port: int = field(default_factory=free_port)
    folder: Path = field(default_factory=lambda: _open_folder("tinyproxy-"))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The proxy URL, with the credentials when there are some."""
        auth = f"{self.user}:{self.password}@" if self.user else ""
        return f"http://{auth}127.0.0.1:{self.port}"

    def __enter__(self) -> Tinyproxy:
        binary = need("tinyproxy")
        conf = self.folder / "tinyproxy.conf"
        auth = f"BasicAuth {self.user} {self.password}\n" if self.user else ""
        user = "User root\nGroup root\n" if os.geteuid() == 0 else ""
        conf.write_text(f"""Port {self.port}
Listen 127.0.0.1
Timeout 30
{user}LogFile "{self.folder}/tinyproxy.log"
LogLevel Info
PidFile "{self.folder}/tinyproxy.pid"
MaxClients 100
Allow 127.0.0.1
{auth}""")
        self.proc = subprocess.Popen([binary, "-d", "-c", str(conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(self.port, self.proc, "tinyproxy", self.folder / "tinyproxy.log")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc is not None:
            _stop(self.proc)
        shutil.rmtree(self.folder, ignore_errors=True)

    def log_text(self) -> str:
        path = self.folder / "tinyproxy.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for_log(self, text: str, seconds: float = 10.0) -> str:
        """The log once it contains *text* (or as it is after *seconds*)."""
        return _log_with(self.log_text, text, seconds)


@dataclass
class Squid:
    """Debian's squid on a free port, no cache, ``CONNECT`` to any port from 127.0.0.1."""

    port: int = field(default_factory=free_port)
    folder: Path = field(default_factory=lambda: _open_folder("squid-"))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Squid:
        binary = need("squid")
        conf = self.folder / "squid.conf"
        user = "cache_effective_user proxy\n" if os.geteuid() == 0 else ""
        conf.write_text(f"""http_port 127.0.0.1:{self.port}
acl local src 127.0.0.1/32
http_access allow local
http_access deny all
cache deny all
cache_mem 8 MB
{user}pid_filename {self.folder}/squid.pid
access_log stdio:{self.folder}/access.log
cache_log {self.folder}/cache.log
cache_store_log none
coredump_dir {self.folder}
shutdown_lifetime 0 seconds
""")
        conf.chmod(0o644)
        self.proc = subprocess.Popen([binary, "-N", "-f", str(conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(self.port, self.proc, "squid", self.folder / "cache.log")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc is not None:
            _stop(self.proc)
        shutil.rmtree(self.folder, ignore_errors=True)

    def log_text(self) -> str:
        path = self.folder / "access.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for_log(self, text: str, seconds: float = 10.0) -> str:
        """The access log once it contains *text* (squid logs a transaction, a
        ``CONNECT`` tunnel included, when it ends)."""
        return _log_with(self.log_text, text, seconds)


def _log_with(read: Callable[[], str], text: str, seconds: float) -> str:
    """*read*'s text once it contains *text*, or as it is after *seconds*."""
    deadline = time.monotonic() + seconds
    while text not in (log := read()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return log


# ----------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def pki() -> Iterator[Pki]:
    """A private CA with server and client certificates (made once per session)."""
    folder = Path(tempfile.mkdtemp(prefix="pki-"))  # not _open_folder: no one else writes
    try:
        yield make_pki(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def nginx() -> Iterator[Nginx]:
    """An :class:`Nginx` to add sites to; start it with ``with nginx:``."""
    server = Nginx()
    try:
        yield server
    finally:
        server.__exit__()
