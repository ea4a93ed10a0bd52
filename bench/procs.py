"""Start, release and stop the benchmark's child processes; sample connections."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from receipts.embedded import free_port
from receipts.supervisor import ChildError, Supervisor

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_SECONDS = 60.0  # a child imports its queue library before "ready"


def _env(src: Path | None = None) -> dict[str, str]:
    """What the children need besides the supervisor's clean environment.

    ``BENCH_RECEIPTS_SRC``, when set, is the folder whose ``receipts`` package the
    children import (an older checkout's ``src``, for an A/B in one server).

    ``RECEIPTS_ADMISSION_*`` variables of the bench's own environment pass
    through, so an experiment can pin admission control's bounds (the same
    min and max: a fixed claim rate) without a new option. *src*: a folder
    holding another ``receipts`` package (an earlier release's ``src``), found
    before this checkout's.
    """
    # BENCH_RECEIPTS_SRC: the receipts package the children import instead of this
    # checkout's (an A/B of two versions of the worker in one benchmark server).
    # An explicit *src* wins over it.
    chosen = str(src) if src else os.environ.get("BENCH_RECEIPTS_SRC", "")
    path = os.pathsep.join(
        p for p in (chosen, str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    admission = {k: v for k, v in os.environ.items() if k.startswith("RECEIPTS_ADMISSION_")}
    return {"PYTHONPATH": path, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp"),
            **admission}


class Children:
    """Child processes of ``bench.child`` that start together on :meth:`go`.

    Each prints ``ready`` once it has imported and set up what it needs, then
    waits for one line on stdin. *ports*: where each serves ``/metrics`` once
    released (a receipts worker given ``--metrics-port``), for
    ``procs[i].scrape()``; None when it serves nothing. *src*: run another
    ``receipts`` package (see :func:`_env`). Raises ``RuntimeError`` (with the
    child's output) when one exits or stays silent for ``START_TIMEOUT_SECONDS``.
    """

    def __init__(self, argvs: Sequence[Sequence[str]],
                 ports: Sequence[int | None] | None = None, *, src: Path | None = None) -> None:
        self._sup = Supervisor(cwd=ROOT, stop_timeout_seconds=30.0)
        ports = list(ports) if ports is not None else [None] * len(argvs)
        try:
            self.procs = [self._sup.start(f"child-{i}", argv, _env(src), module="bench.child",
                                          stdin=True, port=port)
                          for i, (argv, port) in enumerate(zip(argvs, ports, strict=True))]
            for proc in self.procs:
                proc.wait_for_output("ready\n", timeout_seconds=START_TIMEOUT_SECONDS)
        except ChildError as exc:
            self._sup.close()
            raise RuntimeError(f"benchmark child did not start: {exc}") from exc

    def go(self) -> float:
        """Release every child at once; returns the monotonic start time."""
        start = time.monotonic()
        for proc in self.procs:
            proc.send_input("go\n")
        return start

    def cpu_seconds(self, tails: list[str]) -> float:
        """CPU seconds the children reported on exit (see ``bench.child``)."""
        total = 0.0
        for tail in tails:
            for line in reversed(tail.strip().splitlines()):
                if line.startswith('{"cpu_seconds"'):
                    total += float(json.loads(line)["cpu_seconds"])
                    break
        return total

    def stop(self) -> list[str]:
        """SIGTERM every child, wait (≤ 30 s, then SIGKILL); returns their stderr tails."""
        self._sup.close()
        return [proc.stderr_text[-2000:] for proc in self.procs]

    def alive(self) -> bool:
        """True while every child runs."""
        return all(proc.running for proc in self.procs)


class Provider:
    """``receipts provider`` on a free port (the reference HTTP provider).

    Raises :class:`~receipts.supervisor.ChildError` when it does not answer
    within 20 s.
    """

    def __init__(self, latency_ms: float) -> None:
        self.port = free_port()
        self._sup = Supervisor(cwd=ROOT, stop_timeout_seconds=10.0)
        self._sup.start("provider", ["provider", "--port", str(self.port),
                                     "--latency-ms", str(latency_ms)], _env(),
                        port=self.port, health_path="/stats")
        try:
            self._sup["provider"].wait_healthy(timeout_seconds=20)
        except ChildError:
            self._sup.close()
            raise

    @property
    def url(self) -> str:
        """Where the workers POST receipts."""
        return self._sup["provider"].url("/receipts")

    def set_faults(self, **faults: Any) -> None:
        """``PUT /faults`` (any :class:`receipts.provider.Faults` field; None resets one)."""
        self._sup["provider"].request("PUT", "/faults", json=faults).raise_for_status()

    def answers(self) -> list[tuple[float, int]]:
        """(monotonic seconds, HTTP status) of every answer so far, in order.

        The provider's ``time.monotonic()``: the machine's clock, comparable
        with this process's.
        """
        return [(float(t), int(s)) for t, s in
                self._sup["provider"].get_json("/answers", timeout_seconds=30.0)]

    def stats(self) -> dict[str, Any]:
        """``GET /stats``: counters; ``receipts`` = distinct idempotency keys recorded."""
        return dict(self._sup["provider"].get_json("/stats", timeout_seconds=30.0))

    def stop(self) -> None:
        """SIGTERM, wait ≤ 10 s, then SIGKILL."""
        self._sup.close()


class ConnectionSampler:
    """Samples ``pg_stat_activity`` of one database in a thread (every 50 ms).

    Client sessions only: an autovacuum worker of the database (which shows
    there with an empty ``application_name``) is not one of ours.

    ``peak`` maps application_name → the most connections seen at once
    (the sampler's own connection excluded); ``peak_total`` the most in all.
    """

    def __init__(self, dsn: str, interval_seconds: float = 0.05) -> None:
        self.dsn = dsn
        self.interval = interval_seconds
        self.peak: dict[str, int] = {}
        self.peak_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ConnectionSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True,
                             application_name="bench-sampler") as conn:
            while not self._stop.is_set():
                rows: list[Any] = conn.execute(
                    "SELECT coalesce(application_name, ''), count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    "   AND application_name NOT LIKE 'bench-%%'"
                    "   AND backend_type = 'client backend'"  # not autovacuum workers
                    " GROUP BY 1"
                ).fetchall()
                total = 0
                for name, n in rows:
                    self.peak[name] = max(self.peak.get(name, 0), int(n))
                    total += int(n)
                self.peak_total = max(self.peak_total, total)
                self._stop.wait(self.interval)
