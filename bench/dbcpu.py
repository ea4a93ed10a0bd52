"""The database server's CPU split by who spent it, from ``/proc``, sampled in a thread.

:class:`CpuBreakdown` reads utime + stime of every child of the postmaster
every ``interval_seconds`` (0.1 s) and adds each process's CPU to a class:
client backends by their ``application_name`` (``pg_stat_activity``, looked up
once per new backend; the caller's *classify* names the class), the
auxiliary processes by their process title (:func:`process_class`:
``autovacuum workers``, ``checkpointer``, ``walwriter``, ``bgwriter``,
``other background``). :meth:`CpuBreakdown.mark` returns the CPU seconds
each class has spent so far; the difference of two marks is a phase's split,
and its classes add up to the whole server's CPU between them
(:meth:`bench.pg.Bench.server_cpu_seconds`):

* the postmaster's own time is ``other background``;
* a process that ended between two samples: the CPU it spent after the last
  sample (and all of a process born and ended between two samples) reaches
  the postmaster's ``cutime``/``cstime`` when it is reaped; when every
  process seen to vanish in that interval was of one class, the class gets
  it, otherwise it is ``ended between samples``;
* a child that ended before its title or ``application_name`` was read is
  ``unidentified (ended young)``.

Linux ``/proc`` only: elsewhere every mark is empty.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import psycopg

#: Classes of the server's own processes (:func:`process_class`).
AUTOVACUUM = "autovacuum workers"
CHECKPOINTER = "checkpointer"
WALWRITER = "walwriter"
BGWRITER = "bgwriter"
OTHER_BACKGROUND = "other background"
#: CPU of processes that ended between two samples and could not be given a class.
ENDED = "ended between samples"
#: A child whose title or application_name was never read (it ended first).
UNIDENTIFIED = "unidentified (ended young)"

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_class(title: str) -> str | None:
    """The class of a PostgreSQL process from its title (``/proc/PID/cmdline``).

    ``None`` for a client backend (its class comes from its ``application_name``)
    and for a title not yet set (a child just forked still shows the
    postmaster's command line: read it again later); otherwise
    :data:`AUTOVACUUM` (``autovacuum worker``), :data:`CHECKPOINTER`,
    :data:`WALWRITER`, :data:`BGWRITER` (``background writer``), or
    :data:`OTHER_BACKGROUND` (the autovacuum launcher, I/O workers, the logical
    replication launcher, WAL summarizer, background workers…). A
    ``cluster_name`` prefix (``postgres: 18/main: checkpointer``) is allowed.
    """
    words = title.split()
    if not words or words[0] != "postgres:":
        return None
    rest = " ".join(words[1:])
    if len(words) > 2 and words[1].endswith(":"):  # a cluster_name
        rest = " ".join(words[2:])
    if rest.startswith("autovacuum worker"):
        return AUTOVACUUM
    if rest.startswith("checkpointer"):
        return CHECKPOINTER
    if rest.startswith("walwriter"):
        return WALWRITER
    if rest.startswith("background writer"):
        return BGWRITER
    for aux in ("autovacuum launcher", "io worker", "logical replication", "walsummarizer",
                "walreceiver", "walsender", "archiver", "startup", "background worker",
                "stats collector", "parallel worker", "slotsync"):
        if rest.startswith(aux):
            return OTHER_BACKGROUND
    return None  # "postgres: user db host(port) STATE": a client backend


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(ppid, own CPU seconds, reaped children's CPU seconds) of *pid*, or None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # after the command: state(0) ppid(1) … utime(11) stime(12) cutime(13) cstime(14)
    return (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK,
            (int(fields[13]) + int(fields[14])) / _TICK)


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    """The live children of *pid* (``/proc/PID/task/PID/children``, else a scan of /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        pass
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and st[0] == pid:
                out.append(int(entry.name))
    return out


class CpuBreakdown:
    """Samples the server's processes in a thread; CPU seconds per class (module doc).

    Args:
        server_pid: the postmaster's pid (``Bench.server_pid()``).
        dsn: a database of the server, for ``pg_stat_activity`` (one connection,
            ``application_name`` *app_name*: its backend is the caller's to classify).
        classify: ``application_name`` → class of a client backend.
        interval_seconds: how often ``/proc`` is read.
    """

    def __init__(self, server_pid: int, dsn: str, classify: Callable[[str], str], *,
                 interval_seconds: float = 0.1, app_name: str = "bench-cpu") -> None:
        self.pid = server_pid
        self.classify = classify
        self.interval = interval_seconds
        self._conn = psycopg.connect(dsn, autocommit=True, application_name=app_name)
        self._lock = threading.Lock()
        #: pid → [class or None (a backend not yet identified), CPU at start, last CPU]
        self._procs: dict[int, list[Any]] = {}
        self._pending: dict[int, int] = {}  # backend pid → lookups tried
        self._spent: dict[str, float] = {}  # ended processes' CPU, per class
        self._own0 = 0.0
        self._own = 0.0
        self._reaped = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.samples = 0
        self.ended_unseen = 0.0

    def start(self) -> CpuBreakdown:
        """Take the first reading (CPU so far is not counted) and start sampling."""
        with self._lock:
            st = _stat(self.pid)
            if st is not None:
                self._own0 = self._own = st[1]
                self._reaped = st[2]
            self._sample(first=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop sampling and close the connection."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._conn.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                self._sample()

    def _identify(self, pids: list[int]) -> dict[int, str]:
        try:
            rows = self._conn.execute(
                "SELECT /* bench */ pid, coalesce(application_name, '') FROM pg_stat_activity"
                " WHERE pid = ANY(%s) AND backend_type = 'client backend'", (pids,)).fetchall()
        except psycopg.Error:
            return {}
        return {int(pid): str(app) for pid, app in rows if app}

    def _sample(self, first: bool = False) -> None:
        st = _stat(self.pid)
        if st is None:
            return
        self.samples += 1
        self._own = st[1]
        reaped, self._reaped = st[2] - self._reaped, st[2]
        live = set(_children(self.pid))
        for pid in live:
            stat = _stat(pid)
            if stat is None:
                continue
            seen = self._procs.get(pid)
            if seen is None:
                cls = process_class(_title(pid))
                self._procs[pid] = [cls, stat[1] if first else 0.0, stat[1]]
                if cls is None:
                    self._pending[pid] = 0
            else:
                seen[2] = stat[1]
        if self._pending:
            for pid in list(self._pending):
                title = _title(pid)  # a child just forked had the postmaster's title
                cls = process_class(title)
                if cls is not None:
                    self._procs[pid][0] = cls
                    del self._pending[pid]
            found = self._identify(list(self._pending)) if self._pending else {}
            for pid, app in found.items():
                self._procs[pid][0] = self.classify(app)
                del self._pending[pid]
            for pid in list(self._pending):
                self._pending[pid] += 1
                if self._pending[pid] > 50:  # 5 s without an application_name
                    self._procs[pid][0] = UNIDENTIFIED
                    del self._pending[pid]
        gone = [pid for pid in self._procs if pid not in live]
        tails = reaped - sum(self._procs[pid][2] for pid in gone)
        classes = {self._procs[pid][0] or UNIDENTIFIED for pid in gone}
        for pid in gone:
            cls, start, last = self._procs.pop(pid)
            self._pending.pop(pid, None)
            cls = cls or UNIDENTIFIED
            self._spent[cls] = self._spent.get(cls, 0.0) + last - start
        if tails > 0:
            # CPU after the last sample of the processes reaped meanwhile (and of
            # any born and ended between two samples): theirs when they share a class.
            cls = classes.pop() if len(classes) == 1 else ENDED
            self._spent[cls] = self._spent.get(cls, 0.0) + tails
            if cls == ENDED:
                self.ended_unseen += tails

    def mark(self) -> dict[str, float]:
        """CPU seconds per class since :meth:`start` (a fresh sample first).

        The postmaster's own CPU counts as :data:`OTHER_BACKGROUND`; backends
        not yet identified as :data:`UNIDENTIFIED`.
        """
        with self._lock:
            self._sample()
            out = dict(self._spent)
            for cls, start, last in self._procs.values():
                key = cls or UNIDENTIFIED
                out[key] = out.get(key, 0.0) + last - start
            out[OTHER_BACKGROUND] = out.get(OTHER_BACKGROUND, 0.0) + self._own - self._own0
            return out


def between(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds per class between two :meth:`CpuBreakdown.mark` readings (≥ 0)."""
    return {k: max(0.0, after.get(k, 0.0) - before.get(k, 0.0))
            for k in sorted(set(before) | set(after))}


def per_order_us(seconds: Mapping[str, float], orders: int) -> dict[str, float]:
    """CPU seconds per class → µs per order, largest first (orders < 1 counts as 1)."""
    n = max(orders, 1)
    return {k: round(v / n * 1e6, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}


def cpu_ratio(queue_us: float | None, baseline_us: float | None) -> float | None:
    """The queue phase's database CPU per order over the baseline's (None when either is
    missing or the baseline is 0)."""
    if queue_us is None or not baseline_us:
        return None
    return round(queue_us / baseline_us, 2)
