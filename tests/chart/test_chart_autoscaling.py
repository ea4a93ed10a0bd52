"""The KEDA scaling signal, as the chart renders it, on a real PostgreSQL 18.

* Its plan: one cheap statement over the partial indexes, with 1,000,000 done rows.
* Its arithmetic: a real `receipts worker` process drains a Poisson load of 2 and of
  20 jobs/s from the reference provider (`receipts provider`), then a backlog, then a
  paused fleet; the rendered query is sampled and KEDA's formula applied to each sample
  (ceil(metric / target), clamped to min/max replicas, minReplicas when the metric does not
  exceed the activation threshold), per sample and with KEDA's cooldown before scaling to
  zero. The replica counts seen are printed (``pytest -s``).

Until migration 0003 (the provider flow-control table) is on the branch, the tests create
`receipt_flow` themselves with that migration's exact DDL (IF NOT EXISTS, so they keep
working once it lands).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from chartkit import one, render, template

from receipts.embedded import free_port
from receipts.enqueue import enqueue_async
from receipts.statements import statements
from tests.conftest import Server

# The worker under test: 4 slots at 0.75 utilisation → a target of 3 per pod.
SLOTS, MAX_ATTEMPTS, MIN_REPLICAS, MAX_REPLICAS = 4, 5, 0, 4
TRUTH = ("SELECT count(*) FILTER (WHERE state = 'ready' AND run_at <= statement_timestamp()),"
         " count(*) FILTER (WHERE state = 'running') FROM receipt_jobs")
# The trigger before this change (due ready rows only), sampled alongside for comparison.
OLD_QUERY = ("SELECT count(*) FROM receipt_jobs"
             " WHERE state = 'ready' AND run_at <= statement_timestamp()")


@dataclass(frozen=True)
class Trigger:
    """The ScaledObject's numbers, read from the rendered chart."""

    query: str
    target: float
    activation: float
    min_replicas: int
    max_replicas: int
    cooldown_seconds: float

    def replicas(self, metric: float) -> int:
        """KEDA's answer for one sample of the metric alone (AverageValue, no cooldown)."""
        if metric <= self.activation:
            return self.min_replicas  # inactive: KEDA scales to minReplicaCount
        wanted = math.ceil(metric / self.target)
        return min(self.max_replicas, max(self.min_replicas, 1, wanted))

    def with_cooldown(self, samples: list[Sample]) -> list[int]:
        """Replicas over a series of samples: an inactive trigger keeps 1 pod until
        cooldownPeriod has passed since it was last active, then minReplicaCount."""
        last_active: float | None = None
        out = []
        for s in samples:
            if s.metric > self.activation:
                last_active = s.at
            inactive_for = math.inf if last_active is None else s.at - last_active
            if s.metric <= self.activation and inactive_for < self.cooldown_seconds:
                out.append(max(1, self.min_replicas))
            else:
                out.append(self.replicas(s.metric))
        return out


def rendered_trigger(tmp_path: Path, max_replicas: int = MAX_REPLICAS) -> Trigger:
    values = tmp_path / "autoscaling-values.yaml"
    values.write_text(yaml.safe_dump({
        "config": {"concurrency": SLOTS, "maxAttempts": MAX_ATTEMPTS},
        "autoscaling": {"enabled": True, "minReplicas": MIN_REPLICAS,
                        "maxReplicas": max_replicas,
                        "keda": {"enabled": True, "utilisation": 0.75}},
    }))
    spec = one(render((values,)), "ScaledObject")["spec"]
    (trigger,) = spec["triggers"]
    meta = trigger["metadata"]
    return Trigger(meta["query"], float(meta["targetQueryValue"]),
                   float(meta["activationTargetQueryValue"]), spec["minReplicaCount"],
                   spec["maxReplicaCount"], float(spec["cooldownPeriod"]))


def set_pause(dsn: str, reason: str | None) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE receipt_flow SET pause_reason = %s, paused_until ="
                     " CASE WHEN %s::text IS NULL THEN NULL ELSE now() + interval '1 minute' END",
                     (reason, reason))


# ------------------------------------------------------------------ the plan


@pytest.fixture(scope="module")
def big_dsn(pg18: Server) -> Iterator[str]:
    """1,000,000 done rows, 50,000 due ready rows, 1,000 running (generate_series)."""
    dsn = pg18.new_database()
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Bulk load without the indexes, then rebuild the migration's exact definitions.
        indexes = conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'receipt_jobs'"
            " AND indexname LIKE 'receipt_jobs_%' AND indexname NOT IN"
            " ('receipt_jobs_pkey', 'receipt_jobs_order_id_key')").fetchall()
        for name, _ in indexes:
            conn.execute(f'DROP INDEX "{name}"')
        conn.execute("""
            INSERT INTO receipt_jobs (id, order_id, state, attempts, run_at, finished_at)
            SELECT gen_random_uuid(), 'big-' || g,
                   CASE WHEN g <= 1000000 THEN 'done' ELSE 'ready' END,
                   CASE WHEN g <= 1000000 THEN 1 ELSE 0 END,
                   statement_timestamp() - make_interval(secs => (1050000 - g) / 1000.0),
                   CASE WHEN g <= 1000000 THEN statement_timestamp() - interval '1 day' END
            FROM generate_series(1, 1050000) AS g""")
        conn.execute("SET maintenance_work_mem = '256MB'")
        for _, definition in indexes:
            conn.execute(definition)
        conn.execute(statements()["claim"].format(limit=1000),
                     {"max_attempts": MAX_ATTEMPTS, "lease_seconds": 600.0, "probe": False,
                      "after_run_at": None, "after_id": None})
        conn.execute("VACUUM (ANALYZE) receipt_jobs")
    try:
        yield dsn
    finally:
        pg18.drop_database(dsn)


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _explain(conn: psycopg.Connection[Any], query: str) -> tuple[dict[str, Any],
                                                                  list[dict[str, Any]]]:
    (doc,), = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query}").fetchall()
    top = (doc if isinstance(doc, list) else json.loads(doc))[0]
    return top, list(_nodes(top["Plan"]))


@pytest.mark.slow
@pytest.mark.parametrize("paused", [False, True], ids=["flowing", "paused"])
def test_the_signal_is_one_cheap_statement_over_the_partial_indexes(
    big_dsn: str, tmp_path: Path, paused: bool
) -> None:
    trigger = rendered_trigger(tmp_path, max_replicas=10)  # counts stop at 10 × 3 = 30
    set_pause(big_dsn, "outage" if paused else None)
    with psycopg.connect(big_dsn, autocommit=True) as conn:
        _explain(conn, trigger.query)  # warm the cache; measure the second run
        top, nodes = _explain(conn, trigger.query)
        (value,), = conn.execute(trigger.query).fetchall()
        (pages,), = conn.execute("SELECT relpages FROM pg_class"
                                 " WHERE oid = 'receipt_jobs'::regclass").fetchall()
    scans = {n.get("Index Name") or n["Node Type"]: n for n in nodes
             if n.get("Relation Name") == "receipt_jobs"}
    assert set(scans) == {"receipt_jobs_ready", "receipt_jobs_expired"}, sorted(scans)
    assert scans["receipt_jobs_ready"]["Actual Rows"] <= (1 if paused else 30)
    buffers = top["Plan"].get("Shared Hit Blocks", 0) + top["Plan"].get("Shared Read Blocks", 0)
    print(f"\n[autoscaling] signal ({'paused' if paused else 'flowing'}) on 1,000,000 done"
          f" + 50,000 due + 1,000 running rows = {value}: {top['Execution Time']:.2f} ms,"
          f" {top['Planning Time']:.2f} ms planning, {buffers} buffers (table {pages} pages)")
    # Flowing: each part stops at maxReplicas × target (30), the most KEDA can act on.
    # Paused: running jobs at the target's share of a pod, ceil(30 × 3 / 4), at least 1.
    assert value == (23 if paused else 60)
    assert buffers < 200, buffers  # the done rows cost nothing
    assert top["Execution Time"] < 50


# ------------------------------------------------------- the arithmetic, under load


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")} | env
    with log.open("wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "receipts", *args], env=full,
                                stdout=fh, stderr=subprocess.STDOUT)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


async def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while not await asyncio.to_thread(_answers, url):
        assert proc.poll() is None, f"{url}: process exited:\n{log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"{url} did not answer:\n{log.read_text()[-2000:]}"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def worker_and_provider(dsn: str, tmp_path: Path) -> AsyncIterator[None]:
    """`receipts provider` (100 ± 50 ms per receipt) and one `receipts worker` (4 slots)."""
    provider_port, metrics_port = free_port(), free_port()
    provider_log, worker_log = tmp_path / "provider.log", tmp_path / "worker.log"
    procs = [_spawn(["provider", "--port", str(provider_port), "--latency-ms", "100",
                     "--jitter-ms", "50"], {}, provider_log)]
    try:
        await _wait_http(f"http://127.0.0.1:{provider_port}/stats", procs[0], provider_log)
        procs.append(_spawn(["worker"], {
            "RECEIPTS_DATABASE_URL": dsn,
            "RECEIPTS_PROVIDER_URL": f"http://127.0.0.1:{provider_port}/receipts",
            "RECEIPTS_CONCURRENCY": str(SLOTS),
            "RECEIPTS_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
            "RECEIPTS_POLL_INTERVAL_SECONDS": "0.5",
            "RECEIPTS_METRICS_PORT": str(metrics_port),
        }, worker_log))
        await _wait_http(f"http://127.0.0.1:{metrics_port}/readyz", procs[1], worker_log)
        yield
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@dataclass
class Sample:
    at: float
    phase: str
    metric: float
    replicas: int
    due: int
    running: int
    old_metric: int


class Sampler:
    """Runs the rendered query every *every_seconds* in a snapshot with the ground truth."""

    def __init__(self, trigger: Trigger, conn: psycopg.AsyncConnection[Any]) -> None:
        self.trigger, self.conn = trigger, conn
        self.samples: list[Sample] = []
        self.phase = "start"

    async def sample(self) -> Sample:
        async with self.conn.transaction():
            await self.conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            (metric,), = await (await self.conn.execute(self.trigger.query)).fetchall()
            (due, running), = await (await self.conn.execute(TRUTH)).fetchall()
            (old,), = await (await self.conn.execute(OLD_QUERY)).fetchall()
        sample = Sample(time.monotonic(), self.phase, float(metric),
                        self.trigger.replicas(float(metric)), due, running, old)
        self.samples.append(sample)
        return sample

    async def run(self, every_seconds: float = 0.2) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(every_seconds)

    def of(self, phase: str) -> list[Sample]:
        return [s for s in self.samples if s.phase == phase]


async def poisson_load(dsn: str, rate: float, seconds: float, rng: random.Random) -> int:
    """Enqueue jobs with exponential gaps (mean 1/rate) for *seconds*; return how many."""
    count = 0
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        deadline = time.monotonic() + seconds
        next_at = time.monotonic()
        while True:
            next_at += rng.expovariate(rate)
            if next_at > deadline:
                return count
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            async with conn.transaction():
                await enqueue_async(conn, f"poisson-{uuid.uuid4()}")
            count += 1


async def enqueue_backlog(dsn: str, n: int) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        for i in range(n):
            await enqueue_async(conn, f"backlog-{i}-{uuid.uuid4()}")


@pytest.mark.slow
async def test_keda_formula_on_the_rendered_query_under_poisson_load(
    pg18: Server, tmp_path: Path
) -> None:
    trigger = rendered_trigger(tmp_path)
    assert (trigger.target, trigger.activation) == (3, 0)  # floor(4 × 0.75); any job wakes
    dsn = pg18.new_database()
    rng = random.Random(20261201)
    started = time.monotonic()
    async with worker_and_provider(dsn, tmp_path), \
            await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        sampler = Sampler(trigger, conn)
        sampling = asyncio.create_task(sampler.run())
        try:
            for rate in (2, 20):
                sampler.phase = f"{rate}/s"
                await poisson_load(dsn, rate, 8.0, rng)

            sampler.phase = "backlog"
            await enqueue_backlog(dsn, 300)
            deadline = time.monotonic() + 10
            while not any(s.replicas == MAX_REPLICAS for s in sampler.of("backlog")):
                assert time.monotonic() < deadline, "no scale-out under a backlog"
                await asyncio.sleep(0.05)

            # The provider is paused (the row set by hand): due jobs stop counting.
            set_pause(dsn, "outage")
            sampler.phase = "paused"
            await asyncio.sleep(2.0)  # the length of the observation, not a wait for a signal
            set_pause(dsn, None)

            sampler.phase = "drain"
            sampling.cancel()  # from here on this loop samples, on the same connection
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
            deadline = time.monotonic() + 30
            while True:
                last = await sampler.sample()
                if last.due == last.running == 0:
                    break
                assert time.monotonic() < deadline, "the backlog did not drain"
                await asyncio.sleep(0.2)
        finally:
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
    elapsed = time.monotonic() - started

    report = [f"\n[autoscaling] {len(sampler.samples)} samples in {elapsed:.1f}s"
              f" (target {trigger.target:g}, min {trigger.min_replicas},"
              f" max {trigger.max_replicas})"]
    cooled = dict(zip(map(id, sampler.samples), trigger.with_cooldown(sampler.samples),
                      strict=True))
    for phase in ("2/s", "20/s", "backlog", "paused", "drain"):
        got = sampler.of(phase)
        counts = dict(sorted(collections.Counter(s.replicas for s in got).items()))
        with_cooldown = dict(sorted(collections.Counter(cooled[id(s)] for s in got).items()))
        busy = sum(1 for s in got if s.due or s.running)
        old_zero = sum(1 for s in got if (s.due or s.running) and s.old_metric == 0)
        report.append(f"  {phase:8s} replicas per sample {counts}, with cooldown {with_cooldown};"
                      f" {busy}/{len(got)} samples with jobs due or in flight, of which the old"
                      f" due-only query read 0 in {old_zero}")
    print("\n".join(report))

    # Never 0 replicas while jobs are due or in flight, in any phase.
    for s in sampler.samples:
        if s.due or s.running:
            assert s.replicas >= 1, s
    # While traffic flows the fleet is never scaled to zero (the cooldown outlasts the gaps
    # between jobs in flight), and light load asks for about one pod: 2 in flight on
    # average at 20/s against a target of 3, more only in Poisson bursts.
    first_active = next(i for i, s in enumerate(sampler.samples) if s.metric > 0)
    flowing = [s for s in sampler.samples[first_active:] if s.phase in ("2/s", "20/s")]
    assert flowing and all(cooled[id(s)] >= 1 for s in flowing)
    for phase in ("2/s", "20/s"):
        active = sorted(s.replicas for s in sampler.of(phase) if s.metric > 0)
        assert active and active[len(active) // 2] <= 2, active
    # A backlog scales out to the maximum.
    assert max(s.replicas for s in sampler.of("backlog")) == MAX_REPLICAS
    # Paused: jobs still due, yet no scale-out: at most the pods holding the running jobs.
    paused = sampler.of("paused")
    assert paused and any(s.due > 0 for s in paused)
    for s in paused:
        assert s.replicas <= max(1, math.ceil(s.running / SLOTS)), s
    # Once nothing is due or in flight, the fleet may go to zero.
    assert sampler.samples[-1].replicas == 0


@pytest.mark.slow
def test_a_configured_schema_qualifies_the_keda_query_and_reaches_the_pods(
    pg18: Server, tmp_path: Path
):
    docs = render(sets=("config.databaseSchema=public", "autoscaling.enabled=true",
                        "autoscaling.keda.enabled=true"))
    (trigger,) = one(docs, "ScaledObject")["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    assert '"public".receipt_jobs' in query and '"public".receipt_flow' in query
    config = one(docs, "ConfigMap")["data"]
    assert config["RECEIPTS_DATABASE_SCHEMA"] == "public"
    dsn = pg18.new_database()
    try:
        enqueue_count = 3
        with psycopg.connect(dsn, autocommit=True) as conn:
            for i in range(enqueue_count):
                conn.execute("INSERT INTO receipt_jobs (id, order_id) VALUES"
                             " (gen_random_uuid(), %s)", (f"k-{i}",))
            conn.execute("CREATE SCHEMA decoy")  # a leaked search_path points here
            conn.execute("SET search_path = decoy")
            with pytest.raises(psycopg.errors.UndefinedTable):
                conn.execute(rendered_trigger(tmp_path).query)  # unqualified: lost
            assert conn.execute(query).fetchone() == (enqueue_count,)
    finally:
        pg18.drop_database(dsn)
    refused = template(sets=("config.databaseSchema=Bad;Name",))
    assert refused.returncode != 0 and "databaseSchema" in refused.stderr
