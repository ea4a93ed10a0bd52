"""Run and watch child processes: start, health, metrics, signals, bounded stop.

One :class:`Supervisor` owns the child processes of the demo, the chaos run,
the acceptance tests and the benchmark (usually ``python -m receipts …``).
It gives each child a clean environment, waits for its health endpoint,
scrapes its ``/metrics`` with prometheus-client's parser, sends it signals
(SIGTERM, SIGKILL, SIGSTOP, SIGCONT) and stops it with a bounded wait that
escalates to SIGKILL. Leaving the ``with`` block stops every child still
running, whatever happened inside it.

The environment of a child holds only what a Python process needs (``PATH``,
``HOME``, ``TMPDIR``, ``TZ``, the locale variables and ``PYTHONPATH``) plus
the variables the caller names: a ``RECEIPTS_*`` setting exported in the parent's shell never
leaks into a child, so each child runs with exactly the settings written
next to its start.

A child's output goes to ``<workdir>/<name>.log`` (standard output and
standard error together) when the supervisor has a *workdir*, else it is
kept in memory, the two streams apart (:attr:`Child.stdout_text`,
:attr:`Child.stderr_text`).

Each call is synchronous; asyncio callers run them with ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: Variables of the parent's environment every child gets: what a Python
#: process needs to find programs, its home, temporary folder, time zone and
#: locale, and the module path that let the parent import this package (so
#: ``python -m receipts`` runs the same code). Everything else (``RECEIPTS_*``
#: included) is named by the caller.
PASSED_THROUGH = ("PATH", "HOME", "TMPDIR", "TZ", "LANG", "LANGUAGE", "PYTHONPATH")
LOCALE_PREFIX = "LC_"
#: How much of a child's output an error message quotes (characters).
TAIL_CHARS = 2000
_POLL_SECONDS = 0.05

LabelSet = tuple[tuple[str, str], ...]


class ChildError(RuntimeError):
    """A child exited or stayed silent when it was expected to answer.

    The message names the child and ends with the tail of its output;
    :attr:`returncode` is ``None`` while the child still runs.
    """

    def __init__(self, child: Child, what: str) -> None:
        self.name = child.name
        self.returncode = child.returncode
        self.tail = child.tail()
        super().__init__(f"{child.name} (pid {child.pid}) {what}; last output:\n{self.tail}")


class MetricSamples(dict[tuple[str, LabelSet], float]):
    """One scrape: ``{(sample name, sorted (label, value) pairs): value}``.

    Sample names are as exposed (``receipts_acks_total``, ``…_bucket``,
    ``…_created``); a metric without labels has the empty label tuple.
    """

    def value(self, name: str, /, **labels: str) -> float:
        """The value of one series; ``KeyError`` when it is not exposed."""
        return self[(name, tuple(sorted(labels.items())))]

    def total(self, name: str) -> float:
        """The sum of *name* over every label set; 0.0 when it is not exposed."""
        return sum(v for (n, _), v in self.items() if n == name)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``{value of *label*: sample value}`` for the series of *name* that carry it."""
        return {dict(lbls)[label]: v for (n, lbls), v in self.items()
                if n == name and label in dict(lbls)}


def parse_metrics(text: str) -> MetricSamples:
    """Prometheus text exposition → :class:`MetricSamples` (prometheus-client's parser).

    Raises ``ValueError`` on text that is not the exposition format.
    """
    samples = MetricSamples()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return samples


def child_env(env: Mapping[str, str] | None = None, *,
              parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: :data:`PASSED_THROUGH` and ``LC_*`` of *parent*, then *env*.

    *parent* defaults to ``os.environ``. Nothing else of the parent is kept,
    in particular no ``RECEIPTS_*`` variable the caller did not name.
    """
    source = os.environ if parent is None else parent
    kept = {k: v for k, v in source.items()
            if k in PASSED_THROUGH or k.startswith(LOCALE_PREFIX)}
    return kept | dict(env or {})


def run_command(args: Sequence[str], env: Mapping[str, str] | None = None, *,
                timeout_seconds: float = 60.0, module: str = "receipts",
                cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m MODULE ARGS`` to its end in :func:`child_env` (*env*); capture text.

    Raises ``subprocess.TimeoutExpired`` (after killing it) when it runs
    longer than *timeout_seconds*; a non-zero exit is the caller's to judge.
    """
    return subprocess.run([sys.executable, "-m", module, *args], env=child_env(env),
                          cwd=cwd, text=True, capture_output=True,
                          timeout=timeout_seconds, check=False)


class Child:
    """One child process started by a :class:`Supervisor`.

    *port* is where it serves HTTP on 127.0.0.1 (``/healthz``, ``/metrics``),
    ``None`` when it serves nothing. Signals go to its pid only.
    """

    def __init__(self, name: str, popen: subprocess.Popen[bytes], *, port: int | None,
                 health_path: str, log_path: Path | None, http: httpx.Client) -> None:
        self.name = name
        self.popen = popen
        self.port = port
        self.health_path = health_path
        self.log_path = log_path
        self.paused = False
        self._http = http
        self._lock = threading.Condition()
        self._out: list[str] = []
        self._err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(stream, sink), daemon=True,
                             name=f"{name}-{label}")
            for stream, sink, label in ((popen.stdout, self._out, "stdout"),
                                        (popen.stderr, self._err, "stderr"))
            if stream is not None
        ]
        for reader in self._readers:
            reader.start()

    def __repr__(self) -> str:
        return f"<Child {self.name} pid={self.pid} returncode={self.returncode}>"

    # ------------------------------------------------------------- state

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """Exit status (negative: killed by that signal); ``None`` while it runs."""
        return self.popen.poll()

    @property
    def running(self) -> bool:
        """True until the child has exited (a paused child is running)."""
        return self.popen.poll() is None

    # ------------------------------------------------------------ output

    def _read(self, stream: IO[bytes], sink: list[str]) -> None:
        for raw in iter(stream.readline, b""):
            with self._lock:
                sink.append(raw.decode("utf-8", "replace"))
                self._lock.notify_all()
        stream.close()

    @property
    def stdout_text(self) -> str:
        """Standard output so far (in-memory children; empty when it goes to a log file)."""
        with self._lock:
            return "".join(self._out)

    @property
    def stderr_text(self) -> str:
        """Standard error so far (in-memory children; empty when it goes to a log file)."""
        with self._lock:
            return "".join(self._err)

    def output(self) -> str:
        """Everything the child wrote so far: its log file, or stdout then stderr."""
        if self.log_path is not None:
            try:
                return self.log_path.read_text("utf-8", "replace")
            except FileNotFoundError:
                return ""
        return self.stdout_text + self.stderr_text

    def tail(self, chars: int = TAIL_CHARS) -> str:
        """The last *chars* characters of :meth:`output`."""
        return self.output()[-chars:]

    def wait_for_output(self, needle: str, *, count: int = 1,
                        timeout_seconds: float = 20.0) -> None:
        """Block until *needle* occurs *count* times in :meth:`output` (e.g. a log event).

        Raises :class:`ChildError` when the child exits first (and its final
        output lacks it) or after *timeout_seconds*.
        """
        deadline = time.monotonic() + timeout_seconds
        while True:
            if self.output().count(needle) >= count:
                return
            if not self.running:
                for reader in self._readers:
                    reader.join(1.0)
                if self.output().count(needle) >= count:
                    return
                raise ChildError(self, f"exited with {self.returncode} before writing "
                                       f"{needle!r} {count} time(s)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildError(self, f"did not write {needle!r} {count} time(s) "
                                       f"within {timeout_seconds:g}s")
            with self._lock:
                self._lock.wait(min(left, _POLL_SECONDS))

    def send_input(self, text: str) -> None:
        """Write *text* to the child's standard input (started with ``stdin=True``)."""
        if self.popen.stdin is None:
            raise RuntimeError(f"{self.name} was started without stdin")
        self.popen.stdin.write(text.encode())
        self.popen.stdin.flush()

    # -------------------------------------------------------------- HTTP

    def url(self, path: str) -> str:
        """``http://127.0.0.1:PORT`` + *path*; ``RuntimeError`` when it has no port."""
        if self.port is None:
            raise RuntimeError(f"{self.name} serves no HTTP port")
        return f"http://127.0.0.1:{self.port}{path}"

    def request(self, method: str, path: str, *, json: Any = None,
                timeout_seconds: float = 5.0) -> httpx.Response:
        """One HTTP request to the child; the response whatever its status.

        Raises ``httpx.HTTPError`` when the child does not answer within
        *timeout_seconds*, and :class:`ChildError` when it is paused (a
        stopped process would only time out).
        """
        if self.paused:
            raise ChildError(self, f"is paused (SIGSTOP); {method} {path} would hang")
        return self._http.request(method, self.url(path), json=json, timeout=timeout_seconds)

    def get_json(self, path: str, *, timeout_seconds: float = 5.0) -> Any:
        """GET *path* and decode its JSON body; ``httpx.HTTPStatusError`` on a non-2xx."""
        response = self.request("GET", path, timeout_seconds=timeout_seconds)
        return response.raise_for_status().json()

    def wait_healthy(self, *, timeout_seconds: float = 20.0) -> Child:
        """Block until ``GET health_path`` answers 200; returns the child itself.

        Raises :class:`ChildError` (with the tail of its output) when the
        child exits first or does not answer within *timeout_seconds*.
        """
        deadline = time.monotonic() + timeout_seconds
        while True:
            if not self.running:
                raise ChildError(self, f"exited with {self.returncode} before "
                                       f"{self.health_path} answered")
            try:
                if self.request("GET", self.health_path, timeout_seconds=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ChildError(self, f"did not answer {self.url(self.health_path)} "
                                       f"within {timeout_seconds:g}s")
            time.sleep(_POLL_SECONDS)

    def scrape(self, *, timeout_seconds: float = 2.0) -> MetricSamples:
        """``GET /metrics`` parsed by :func:`parse_metrics`.

        Raises ``httpx.HTTPError`` when it does not answer 200 in time,
        :class:`ChildError` when the child is paused.
        """
        response = self.request("GET", "/metrics", timeout_seconds=timeout_seconds)
        return parse_metrics(response.raise_for_status().text)

    # ----------------------------------------------------------- signals

    def send_signal(self, sig: signal.Signals) -> None:
        """Send *sig* to the child, if it still runs (pause/resume keep :attr:`paused`)."""
        if self.running:
            self.popen.send_signal(sig)

    def pause(self) -> None:
        """SIGSTOP: the child stops running (and answering) until :meth:`resume`."""
        self.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self.send_signal(signal.SIGCONT)
        self.paused = False

    def kill(self, *, timeout_seconds: float = 10.0) -> int:
        """SIGKILL and reap; returns the exit status (``-9`` unless it had already exited)."""
        self.send_signal(signal.SIGKILL)
        self.paused = False
        return self.wait(timeout_seconds=timeout_seconds)

    def wait(self, *, timeout_seconds: float) -> int:
        """Wait for the child to exit; its exit status.

        Raises ``subprocess.TimeoutExpired`` when it still runs after
        *timeout_seconds*.
        """
        code = self.popen.wait(timeout_seconds)
        for reader in self._readers:
            reader.join(1.0)
        return code

    def terminate(self) -> None:
        """Ask the child to stop: SIGCONT when paused, then SIGTERM; does not wait."""
        if self.paused:
            self.resume()
        self.send_signal(signal.SIGTERM)

    def stop(self, *, timeout_seconds: float = 20.0) -> int:
        """SIGTERM, wait up to *timeout_seconds*, then SIGKILL; returns the exit status.

        Idempotent: a child that already exited just reports its status.
        """
        self.terminate()
        try:
            return self.wait(timeout_seconds=timeout_seconds)
        except subprocess.TimeoutExpired:
            return self.kill()


class Supervisor:
    """The child processes of one run, stopped together at the end of a ``with`` block.

    *workdir*: where children's output files go (``<name>.log``); ``None``
    keeps output in memory. *cwd*: the children's working directory
    (default: the parent's). *stop_timeout_seconds*: how long leaving the
    block waits for the children to exit after SIGTERM before SIGKILL.
    """

    def __init__(self, workdir: Path | None = None, *, cwd: Path | None = None,
                 stop_timeout_seconds: float = 20.0) -> None:
        self.workdir = workdir
        self.cwd = cwd
        self.stop_timeout_seconds = stop_timeout_seconds
        self.children: list[Child] = []
        self._http = httpx.Client(trust_env=False,
                                  limits=httpx.Limits(max_keepalive_connections=0))

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __getitem__(self, name: str) -> Child:
        """The child called *name*; ``KeyError`` when there is none."""
        for child in self.children:
            if child.name == name:
                return child
        raise KeyError(name)

    def start(self, name: str, args: Sequence[str], env: Mapping[str, str] | None = None, *,
              port: int | None = None, health_path: str = "/healthz",
              module: str = "receipts", stdin: bool = False) -> Child:
        """Start ``python -m MODULE ARGS`` as *name* in :func:`child_env` (*env*).

        *port*: where it will serve HTTP (the caller puts it in *env* or
        *args*; for a worker ``RECEIPTS_METRICS_PORT``); *health_path*: what
        :meth:`Child.wait_healthy` polls there. *stdin*: give it a pipe for
        :meth:`Child.send_input` (otherwise it reads nothing). The child runs
        in its own session, so a terminal's Ctrl-C reaches only the parent,
        which stops the children in order. Does not wait for it to be healthy.
        Raises ``ValueError`` when *name* is taken.
        """
        if any(child.name == name for child in self.children):
            raise ValueError(f"a child called {name!r} was already started")
        log_path = None if self.workdir is None else self.workdir / f"{name}.log"
        argv = [sys.executable, "-m", module, *args]
        stdin_arg = subprocess.PIPE if stdin else subprocess.DEVNULL
        if log_path is not None:
            with log_path.open("wb") as fh:
                popen = subprocess.Popen(argv, env=child_env(env), cwd=self.cwd,
                                         stdin=stdin_arg, stdout=fh, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        else:
            popen = subprocess.Popen(argv, env=child_env(env), cwd=self.cwd, stdin=stdin_arg,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        child = Child(name, popen, port=port, health_path=health_path, log_path=log_path,
                      http=self._http)
        self.children.append(child)
        return child

    def running(self) -> list[Child]:
        """The children that have not exited (paused ones included)."""
        return [child for child in self.children if child.running]

    def stop_all(self, *, timeout_seconds: float = 20.0) -> dict[str, int]:
        """Stop every child: SIGTERM to all at once, then one shared bounded wait.

        Children still running after *timeout_seconds* get SIGKILL. Returns
        ``{name: exit status}`` for every child ever started (``-9``: killed).
        Idempotent.
        """
        for child in self.running():
            child.terminate()
        deadline = time.monotonic() + timeout_seconds
        codes: dict[str, int] = {}
        for child in self.children:
            try:
                codes[child.name] = child.wait(
                    timeout_seconds=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[child.name] = child.kill()
        return codes

    def close(self) -> None:
        """:meth:`stop_all` (bounded by *stop_timeout_seconds*), release the HTTP client.

        Safe to call twice.
        """
        try:
            self.stop_all(timeout_seconds=self.stop_timeout_seconds)
        finally:
            for child in self.children:
                if child.popen.stdin is not None:
                    child.popen.stdin.close()
            self._http.close()
