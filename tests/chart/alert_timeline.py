"""The alerts on a real fleet and a real Prometheus: ``python tests/chart/alert_timeline.py``.

Starts an embedded PostgreSQL 18, the reference provider, two ``receipts worker``
processes, ``receipts recover --loop 5``, an enqueuer (5 orders/s) and a real
Prometheus (``.tools/bin/prometheus``) that scrapes the workers every second and
evaluates the chart's rules as the defaults render them, with every duration divided by
``--scale`` (10: ``for: 5m`` becomes 30 s; the thresholds in seconds are given as values
divided the same way). Then it plays the events below and prints, per event, the alerts
that fired or resolved and how many seconds after the event (times are real seconds,
multiply by the scale for production's). About 12 minutes at scale 10. Not part of
``make test``: tests/chart/alert_scenarios.yaml checks the same rules with promtool.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from chartkit import find_tool, rules_spec_text, template

from receipts.embedded import EmbeddedPostgres, free_port
from receipts.enqueue import enqueue
from receipts.migrate import apply_migrations
from receipts.supervisor import Supervisor

REPO = Path(__file__).resolve().parents[2]


def scaled_rules(scale: float) -> str:
    """The defaults' rules with their thresholds and durations divided by *scale*."""
    def seconds(value: float) -> str:
        return f"{max(1, round(value / scale))}s"

    sets = [f"alerts.{key}={seconds(minutes * 60)}" for key, minutes in {
        "queueLagFor": 5, "providerPausedFor": 15, "providerRejectingFor": 10,
        "manualPauseGrace": 15, "manualPauseMaxFor": 240, "rateLimitSaturatedFor": 15,
        "providerAtCapacityFor": 10,
        "databaseNotReadyFor": 5, "expiredLeasesFor": 10, "workersDownFor": 5,
        "xminHorizonFor": 15, "ratioWindow": 30}.items()]
    sets += [f"alerts.{key}={round(value / scale)}" for key, value in {
        "queueLagSeconds": 300, "undeliveredAgeSeconds": 1800, "queueStatsMaxAgeSeconds": 120,
        "recoveryMaxAgeSeconds": 600, "longTransactionSeconds": 300,
        "pruningBehindSeconds": 7200}.items()]
    result = template((), ("prometheusOperator.enabled=true", *sets))
    assert result.returncode == 0, result.stderr
    text = rules_spec_text(result.stdout)
    # The durations the template writes itself (for: 5m, [15m:1m]).
    text = re.sub(r"for: (\d+)m", lambda m: f"for: {seconds(int(m[1]) * 60)}", text)
    return re.sub(r"\[(\d+)m:(\d+)m\]",
                  lambda m: f"[{seconds(int(m[1]) * 60)}:{seconds(int(m[2]) * 60)}]", text)


class Timeline:
    """Polls Prometheus's /api/v1/alerts every second and notes each change of the
    firing set (seconds since the start)."""

    def __init__(self, base: str) -> None:
        self.base, self.start = base, time.monotonic()
        self.firing: set[str] = set()
        self.changes: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.monotonic() - self.start

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                with urllib.request.urlopen(f"{self.base}/api/v1/alerts", timeout=5) as r:
                    alerts = yaml.safe_load(r.read())["data"]["alerts"]
            except OSError:
                continue
            firing = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
            for name in sorted(firing - self.firing):
                self.changes.append((self.now(), name, "fired"))
            for name in sorted(self.firing - firing):
                self.changes.append((self.now(), name, "resolved"))
            self.firing = firing

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="alert_timeline.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=10.0)
    args = p.parse_args(argv)
    s = args.scale
    folder = Path(tempfile.mkdtemp(prefix="receipts-alerts-"))
    (folder / "rules.yaml").write_text(scaled_rules(s))
    pg = EmbeddedPostgres(fast=True).start()
    dsn = pg.dsn
    apply_migrations(dsn)
    sup = Supervisor(folder, cwd=REPO, stop_timeout_seconds=20.0)
    provider_port = free_port()
    sup.start("provider", ["provider", "--port", str(provider_port), "--latency-ms", "200"],
              port=provider_port, health_path="/stats").wait_healthy(timeout_seconds=30)
    provider = sup["provider"]
    env = {"RECEIPTS_DATABASE_URL": dsn,
           "RECEIPTS_PROVIDER_URL": f"http://127.0.0.1:{provider_port}/receipts",
           "RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS": "1", "RECEIPTS_LEASE_SECONDS": "10",
           "RECEIPTS_LEASE_MARGIN_SECONDS": "2", "RECEIPTS_DELIVERY_TIMEOUT_SECONDS": "5",
           "RECEIPTS_CONCURRENCY": "16", "RECEIPTS_LOG_LEVEL": "WARNING"}
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports, 1):
        sup.start(f"w-{i}", ["worker"], {**env, "RECEIPTS_METRICS_PORT": str(port)},
                  port=port).wait_healthy(timeout_seconds=30)
    sup.start("recover", ["recover", "--loop", "5"], env)
    prom_port = free_port()
    (folder / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(folder / "rules.yaml")],
        "scrape_configs": [{"job_name": "receipts", "static_configs": [
            {"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": "shop", "pod": f"w-{i}"}}
            for i, port in enumerate(ports, 1)]}]}))
    prom = subprocess.Popen(
        [find_tool("prometheus"), f"--config.file={folder / 'prometheus.yml'}",
         f"--storage.tsdb.path={folder / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
         "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop_enqueue = threading.Event()

    def enqueuer() -> None:
        import psycopg

        n = 0
        while not stop_enqueue.wait(0.2):
            try:
                with psycopg.connect(dsn, connect_timeout=2) as conn:
                    enqueue(conn, f"order-{n}")
                n += 1
            except psycopg.Error:
                pass

    threading.Thread(target=enqueuer, daemon=True).start()
    time.sleep(5)
    timeline = Timeline(f"http://127.0.0.1:{prom_port}")
    events: list[tuple[float, str]] = []

    def event(what: str, hold_seconds: float, action: Any = None) -> None:
        events.append((timeline.now(), what))
        print(f"{timeline.now():6.0f}s  {what}", flush=True)
        if action:
            action()
        time.sleep(hold_seconds)

    try:
        event("healthy fleet (no rate limit, no Pushgateway, no kube-state-metrics)", 60)
        event("provider answers 503 to everything", 150,
              lambda: provider.request("PUT", "/faults", json={"status": 503}))
        event("provider healthy again", 90,
              lambda: provider.request("PUT", "/faults", json={"status": None}))
        event("database stopped", 90, lambda: pg.stop("immediate"))
        event("database started again", 90, pg.start)
        def kill_mid_delivery() -> None:
            sup["recover"].kill()
            provider.request("PUT", "/faults", json={"latency_seconds": 3.0})
            time.sleep(3)  # every slot of w-1 now holds a slow delivery
            sup["w-1"].kill()

        event("recovery stopped, provider slow (3 s), worker w-1 killed mid-delivery", 120,
              kill_mid_delivery)
        event("every worker stopped", 60, lambda: sup["w-2"].kill())
    finally:
        timeline.stop()
        stop_enqueue.set()
        prom.terminate()
        prom.wait(30)
        sup.close()
        pg.cleanup()
    print("\nevent (at s)                                       | alerts (s after the event)")
    bounds = [t for t, _ in events[1:]] + [float("inf")]
    for (at, what), end in zip(events, bounds, strict=True):
        mine = [f"{name} {kind} +{t - at:.0f}s" for t, name, kind in timeline.changes
                if at <= t < end]
        print(f"{what[:50]:50} ({at:4.0f}) | {'; '.join(mine) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
