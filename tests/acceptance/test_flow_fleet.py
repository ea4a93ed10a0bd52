"""Provider flow control across a fleet: real worker processes, a real provider, PostgreSQL.

Each test starts several ``receipts worker`` processes against one database and
one reference provider process, with the default settings except ports, and
watches what the provider saw (``GET /answers``: the monotonic time and status
of every answer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from receipts.embedded import free_port
from receipts.supervisor import Child, Supervisor
from tests.conftest import check_invariants, enqueue_many, fetch_rows

#: How long the provider answers 503 to everything in the outage test, seconds.
OUTAGE_SECONDS = 60.0


def until(predicate: Callable[[], bool], what: str, timeout_seconds: float) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_seconds:g}s: {what}"
        time.sleep(0.1)


@pytest.fixture
def dsn(pg18) -> Iterator[str]:
    """A fresh migrated database on PostgreSQL 18 only: these runs take minutes each, and
    what they prove (flow control across processes) does not depend on the server version."""
    database = pg18.new_database()
    yield database
    pg18.drop_database(database)


@pytest.fixture
def sup(tmp_path) -> Iterator[Supervisor]:
    with Supervisor(tmp_path) as supervisor:
        yield supervisor


@pytest.fixture
def provider(sup) -> Child:
    port = free_port()
    return sup.start("provider", ["provider", "--port", str(port)], port=port).wait_healthy()


def set_faults(provider: Child, **faults: object) -> None:
    provider.request("PUT", "/faults", json=faults).raise_for_status()


def answers(provider: Child) -> list[tuple[float, int]]:
    return [(t, s) for t, s in provider.get_json("/answers")]


def start_workers(sup: Supervisor, dsn: str, provider: Child, n: int,
                  **settings: str) -> list[Child]:
    workers = []
    for i in range(n):
        port = free_port()
        env = {"RECEIPTS_DATABASE_URL": dsn, "RECEIPTS_PROVIDER_URL": provider.url("/receipts"),
               "RECEIPTS_METRICS_PORT": str(port),
               **{f"RECEIPTS_{k.upper()}": v for k, v in settings.items()}}
        workers.append(sup.start(f"worker-{i}", ["worker"], env, port=port))
    return [w.wait_healthy() for w in workers]


def states(dsn: str) -> dict[str, int]:
    return dict(fetch_rows(dsn, "SELECT state, count(*) FROM receipt_jobs GROUP BY state"))


def test_a_provider_outage_fails_no_job_and_the_fleet_resumes_by_itself(dsn, sup, provider):
    enqueue_many(dsn, [f"order-{i}" for i in range(1000)])
    set_faults(provider, status=503)
    workers = start_workers(sup, dsn, provider, 2)  # default settings
    started = time.monotonic()
    until(lambda: any(w.scrape().total("receipts_provider_paused") == 1 for w in workers),
          "a worker to pause the fleet", 30)
    time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - started)))
    during = len(answers(provider))
    set_faults(provider, status=None)
    healthy_at = time.monotonic()
    until(lambda: states(dsn).get("done") == 1000, "every job delivered", 240)
    resumed = next(t for t, status in answers(provider) if status < 300) - healthy_at
    drained = time.monotonic() - healthy_at
    assert states(dsn) == {"done": 1000}
    check_invariants(dsn, 5)
    probes = sum(w.scrape().total("receipts_provider_probes_total") for w in workers)
    print(f"\n[figures] outage {OUTAGE_SECONDS:g}s: {during} provider requests during it "
          f"(1000 jobs queued), {probes:g} probes; first receipt {resumed:.1f}s after recovery, "
          f"all delivered {drained:.1f}s after recovery")
    assert during < 2 * 32 + 20  # the slots in flight at detection, then single probes
    assert max(a for (a,) in fetch_rows(dsn, "SELECT attempts FROM receipt_jobs")) <= 2


def test_a_retry_after_answer_to_one_worker_pauses_every_worker(dsn, sup, provider):
    enqueue_many(dsn, [f"order-{i}" for i in range(3000)])
    set_faults(provider, latency_seconds=0.05)
    workers = start_workers(sup, dsn, provider, 3, concurrency="4")
    until(lambda: states(dsn).get("done", 0) >= 50, "deliveries under way", 30)
    set_faults(provider, rate_limit_rate=1.0, retry_after_seconds=30)
    until(lambda: any(s == 429 for _, s in answers(provider)), "a 429", 10)
    set_faults(provider, rate_limit_rate=0.0)
    first_429 = next(t for t, s in answers(provider) if s == 429)
    until(lambda: all(w.scrape().total("receipts_provider_paused") == 1 for w in workers),
          "every worker to honour the pause", 10)
    until(lambda: any(t > first_429 + 31 for t, _ in answers(provider)), "the pause to end", 60)
    # Requests already claimed when the 429 was answered may still arrive just after it.
    silent = [t - first_429 for t, _ in answers(provider) if 0.5 < t - first_429 < 30]
    assert silent == [], f"requests during the fleet-wide pause at {silent[:5]}"
    until(lambda: states(dsn).get("done", 0) >= 200, "delivery resumed", 30)


def test_a_fleet_rate_limit_holds_across_processes_retries_included(dsn, sup, provider):
    enqueue_many(dsn, [f"order-{i}" for i in range(3000)])
    set_faults(provider, error_rate=0.1)  # retries count like first attempts
    start_workers(sup, dsn, provider, 3, provider_rate_limit_per_second="50",
                  retry_base_seconds="0.5", retry_cap_seconds="1")
    until(lambda: len(answers(provider)) > 0, "the first request", 30)
    time.sleep(42)  # the measured interval itself: 4 windows of 10 s after the first second
    times = sorted(t for t, _ in answers(provider))
    start = times[0] + 2.0  # past the initial burst (one second's worth of tokens)
    windows = [sum(1 for t in times if start + 10 * k <= t < start + 10 * (k + 1))
               for k in range(4)]
    failures = sum(1 for _, s in answers(provider) if s == 503)
    print(f"\n[figures] 3 workers, limit 50/s: requests per 10 s window {windows}, "
          f"{failures} answered 503 (retried)")
    assert failures > 0
    assert all(450 <= w <= 550 for w in windows), windows
