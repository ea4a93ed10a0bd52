"""The worker loop in-process against a real database and the reference provider."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from receipts.delivery import Deliverer
from receipts.runtime import worker_runtime
from receipts.settings import Settings
from tests.conftest import check_invariants, enqueue_many, fetch_rows, make_settings


class Running:
    """A Worker running in this event loop (built by the composition root), with its metrics."""

    def __init__(self, settings: Settings, deliverer: Deliverer | None = None) -> None:
        self.settings = settings
        self._root = worker_runtime(settings, deliverer=deliverer, metrics_port=0)
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Running:
        self.runtime = await self._root.__aenter__()
        self.worker = self.runtime.worker
        self.metrics = self.runtime.metrics
        self.task = asyncio.create_task(self.worker.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.worker.stop()
        assert self.task is not None
        await asyncio.wait_for(self.task, 30)
        await self._root.__aexit__(None, None, None)

    def value(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels or None) or 0.0


async def until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def states(dsn: str) -> dict[str, int]:
    return dict(fetch_rows(dsn, "SELECT state, count(*) FROM receipt_jobs GROUP BY state"))


@pytest.mark.slow
async def test_a_worker_delivers_every_job_exactly_once_at_the_provider(dsn, provider):
    enqueue_many(dsn, [f"order-{i}" for i in range(300)])
    settings = make_settings(dsn, provider_url=provider.url, concurrency=16)
    async with Running(settings) as run:
        await until(lambda: states(dsn) == {"done": 300})
        await until(lambda: run.value("receipts_acks_total") == 300)
        assert run.value("receipts_stale_acks_total") == 0
    assert len(provider.provider.receipts) == 300
    assert {v["requests"] for v in provider.provider.receipts.values()} == {1}


@pytest.mark.slow
async def test_claims_never_exceed_free_slots(dsn, provider):
    provider.set_faults(latency_seconds=0.2)
    enqueue_many(dsn, [f"order-{i}" for i in range(40)])
    settings = make_settings(dsn, provider_url=provider.url, concurrency=5)
    async with Running(settings) as run:
        await until(lambda: states(dsn) == {"done": 40})
        # What the worker recorded at every claim: never more asked for than slots free.
        assert run.worker.max_overclaim == 0
        assert run.value("receipts_jobs_claimed_total") == 40


@pytest.mark.slow
async def test_a_job_that_always_gets_5xx_fails_after_max_attempts(dsn, provider):
    provider.set_faults(error_rate=1.0)
    enqueue_many(dsn, ["order-doomed"])
    settings = make_settings(dsn, provider_url=provider.url, max_attempts=4,
                             retry_base_seconds=0.01, retry_cap_seconds=0.05)
    async with Running(settings) as run:
        deadline = time.monotonic() + 30
        while states(dsn) != {"failed": 1}:
            check_invariants(dsn, 4)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await until(lambda: run.value("receipts_retries_total", reason="provider_5xx") == 3)
        await until(lambda: run.value("receipts_failures_total", reason="max_attempts") == 1)
    assert fetch_rows(dsn, "SELECT attempts, last_error FROM receipt_jobs") == [
        (4, "503 provider error")]


@pytest.mark.slow
async def test_a_rejection_among_accepted_orders_fails_the_job_with_its_reason(dsn, provider):
    """The provider accepts the orders sent around it and rejects this one twice (the
    confirmation, in the same lease): a verdict about the order."""
    provider.set_faults(invalid_pattern="^order-bad")
    enqueue_many(dsn, [f"order-{i}" for i in range(30)] + ["order-bad"]
                 + [f"order-{i}" for i in range(30, 60)])
    settings = make_settings(dsn, provider_url=provider.url, concurrency=4)
    async with Running(settings) as run:
        await until(lambda: states(dsn) == {"done": 60, "failed": 1})
        await until(lambda: run.value("receipts_failures_total", reason="rejected") == 1)
    assert fetch_rows(dsn, "SELECT attempts, last_error FROM receipt_jobs"
                           " WHERE state = 'failed'") == [
        (1, "422 order order-bad cannot receive a receipt")]
    assert [key for key, _ in provider.provider.request_log].count("receipt:order-bad") == 2


async def test_a_lone_rejection_is_held_and_given_back_not_failed(dsn, provider):
    provider.set_faults(reject_rate=1.0)
    enqueue_many(dsn, ["order-bad"])
    settings = make_settings(dsn, provider_url=provider.url)
    async with Running(settings) as run:
        await until(lambda: run.value("receipts_retries_total", reason="rejected") >= 2)
    assert fetch_rows(dsn, "SELECT state, attempts, last_error FROM receipt_jobs") == [
        ("ready", 0, "held rejection: 422 order cannot receive a receipt")]
    assert run.value("receipts_failures_total", reason="rejected") == 0


@pytest.mark.slow
async def test_rejected_credentials_pause_claiming_instead_of_burning_attempts(dsn, provider):
    provider.set_faults(status=401)
    enqueue_many(dsn, [f"order-{i}" for i in range(50)])
    settings = make_settings(dsn, provider_url=provider.url, concurrency=4,
                             auth_pause_seconds=0.2)
    async with Running(settings) as run:
        await until(lambda: run.value("receipts_provider_paused", reason="auth") == 1)
        # Two failed probes: the pause doubled twice; only probes (each of at most the
        # 4 free slots) went out.
        await until(lambda: run.value("receipts_provider_probes_total", result="failed") >= 2)
        probes = run.value("receipts_provider_probes_total", result="failed")
        assert provider.provider.stats["requests"] <= 4 + 4 * (probes + 1)
        # Jobs in flight when the credentials were refused kept their attempt.
        assert fetch_rows(dsn, "SELECT max(attempts) FROM receipt_jobs")[0][0] <= 1
        provider.set_faults(status=None)
        await until(lambda: states(dsn) == {"done": 50}, timeout=30)
        assert run.value("receipts_provider_paused", reason="auth") == 0
        assert run.value("receipts_provider_probes_total", result="resumed") == 1


@pytest.mark.slow
async def test_the_worker_clock_and_timezone_do_not_matter(dsn, provider, monkeypatch):
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)  # an hour ahead
    monkeypatch.setenv("PGTZ", "Pacific/Kiritimati")
    enqueue_many(dsn, [f"order-{i}" for i in range(20)])
    settings = make_settings(dsn, provider_url=provider.url, lease_seconds=15,
                             lease_margin_seconds=5, delivery_timeout_seconds=5)
    async with Running(settings) as run:
        await until(lambda: states(dsn) == {"done": 20})
        assert run.value("receipts_stale_acks_total") == 0


@pytest.mark.slow
async def test_stop_lets_inflight_deliveries_finish_and_ack(dsn, provider):
    provider.set_faults(latency_seconds=0.8)
    enqueue_many(dsn, [f"order-{i}" for i in range(10)])
    settings = make_settings(dsn, provider_url=provider.url, concurrency=3)
    run = Running(settings)
    async with run:
        await until(lambda: run.worker.inflight == 3)
    assert states(dsn) == {"done": 3, "ready": 7}
    assert run.value("receipts_jobs_claimed_total") == 3


@pytest.mark.slow
async def test_stop_abandons_deliveries_past_the_grace_period_to_recovery(dsn, provider):
    provider.set_faults(latency_seconds=10)
    enqueue_many(dsn, ["order-slow"])
    settings = make_settings(dsn, provider_url=provider.url, shutdown_grace_seconds=0.3,
                             delivery_timeout_seconds=20)
    run = Running(settings)
    start = time.monotonic()
    async with run:
        await until(lambda: run.worker.inflight == 1)
    assert time.monotonic() - start < 10
    assert states(dsn) == {"running": 1}  # its lease will expire; recovery returns it


@pytest.mark.slow
async def test_the_worker_survives_a_database_outage_and_resumes(provider):
    from receipts.embedded import EmbeddedPostgres

    pg = EmbeddedPostgres(fast=True).start()
    try:
        from receipts.migrate import apply_migrations

        dsn = pg.create_database("outage")
        apply_migrations(dsn)
        enqueue_many(dsn, [f"before-{i}" for i in range(10)])
        settings = make_settings(dsn, provider_url=provider.url)
        async with Running(settings) as run:
            await until(lambda: states(dsn) == {"done": 10})
            pg.stop()
            await until(lambda: not run.worker.is_ready(), timeout=20)
            await asyncio.sleep(1.0)
            assert run.task is not None and not run.task.done()
            pg.start()
            enqueue_many(dsn, [f"after-{i}" for i in range(10)])
            await until(lambda: states(dsn) == {"done": 20}, timeout=60)
            await until(run.worker.is_ready, timeout=10)
    finally:
        pg.cleanup()


@pytest.mark.slow
async def test_a_deliverer_that_raises_reschedules_the_job_instead_of_stranding_it(dsn):
    class Broken:
        calls = 0

        async def deliver(self, job):
            Broken.calls += 1
            raise RuntimeError("bug in a deliverer")

        async def aclose(self) -> None:
            return None

    enqueue_many(dsn, ["order-bug"])
    settings = make_settings(dsn, max_attempts=2, retry_base_seconds=0.01,
                             retry_cap_seconds=0.02)
    run = Running(settings, deliverer=Broken())
    async with run:
        await until(lambda: states(dsn) == {"failed": 1})
        await until(lambda: run.value("receipts_retries_total", reason="internal_error") == 1)
    assert Broken.calls == 2
    (last_error,), = fetch_rows(dsn, "SELECT last_error FROM receipt_jobs")
    assert "bug in a deliverer" in last_error
