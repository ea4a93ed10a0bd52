"""Start, release and stop the benchmark's child processes; sample connections."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("XDG_RUNTIME_DIR", "/tmp")
    return env


class Children:
    """Child processes of ``bench.child`` that start together on :meth:`go`."""

    def __init__(self, argvs: Sequence[Sequence[str]]) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.child", *argv],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, env=_env(), cwd=str(ROOT),
            )
            for argv in argvs
        ]
        for proc in self.procs:
            line = proc.stdout.readline() if proc.stdout else ""
            if line.strip() != "ready":
                err = proc.stderr.read() if proc.stderr else ""
                self.stop()
                raise RuntimeError(f"benchmark child did not start: {line!r} {err[-800:]}")

    def go(self) -> float:
        """Release every child at once; returns the monotonic start time."""
        start = time.monotonic()
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
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

    def stop(self, timeout_seconds: float = 30.0) -> list[str]:
        """SIGTERM every child and wait; returns their stderr tails."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        tails = []
        for proc in self.procs:
            try:
                _, err = proc.communicate(timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            tails.append((err or "")[-2000:])
        return tails

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)


class Provider:
    """``receipts provider`` on a free port (the reference HTTP provider)."""

    def __init__(self, latency_ms: float) -> None:
        from receipts.embedded import free_port

        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "receipts", "provider", "--port", str(self.port),
             "--latency-ms", str(latency_ms)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=str(ROOT),
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("the reference provider did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/receipts"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ConnectionSampler:
    """Samples ``pg_stat_activity`` of one database in a thread (every 50 ms).

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
                    " GROUP BY 1"
                ).fetchall()
                total = 0
                for name, n in rows:
                    self.peak[name] = max(self.peak.get(name, 0), int(n))
                    total += int(n)
                self.peak_total = max(self.peak_total, total)
                self._stop.wait(self.interval)
