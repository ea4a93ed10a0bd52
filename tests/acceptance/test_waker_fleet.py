"""The fleet's waker with real worker processes: election, kill -9, a frozen waker,
pickup with the default settings, and an upgrade beside released (0.2.0) parts.

Workers run with the default settings (ports aside): polling every 1 s, five times
less often while a waker is heard, so a job picked up well under a second after its
commit was picked up through a wake-up, not by a poll.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from receipts.enqueue import NOTIFY_CHANNEL, enqueue, enqueue_many
from receipts.supervisor import Child
from receipts.waker import MEMBERS_PAYLOAD
from tests.acceptance.test_flow_fleet import answers, start_workers, until
from tests.conftest import fetch_rows


@pytest.fixture
def dsn(pg18) -> Iterator[str]:
    """PostgreSQL 18 only: what these runs prove (processes electing a waker through a
    session lock) does not depend on the server version; the in-process tests of
    tests/integration/test_wakeups.py run on every server."""
    database = pg18.new_database()
    yield database
    pg18.drop_database(database)






def elected(workers: list[Child]) -> list[Child]:
    return [w for w in workers if not w.paused and w.running
            and w.scrape().value("receipts_waker_elected") == 1]


def the_waker(workers: list[Child], timeout_seconds: float = 15.0) -> Child:
    until(lambda: len(elected(workers)) == 1, "one waker elected", timeout_seconds)
    (waker,) = elected(workers)
    return waker


def checkout(dsn: str, order: str, *, old_enqueuer: bool = False) -> float:
    """One order transaction enqueueing its receipt; the monotonic time it committed.

    *old_enqueuer*: as receipts 0.2.0's enqueue did, also pg_notify in the transaction.
    """
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            enqueue(conn, order)
            if old_enqueuer:
                conn.execute("SELECT pg_notify(%s, '')", (NOTIFY_CHANNEL,))
        return time.monotonic()


def pickups(provider: Child, committed: list[float]) -> list[float]:
    """Seconds from each commit to the provider's answer to that job (in commit order)."""
    times = sorted(t for t, status in answers(provider) if status < 300)
    assert len(times) == len(committed)
    return [t - c for t, c in zip(times, committed, strict=True)]


@pytest.mark.slow
def test_a_killed_waker_is_replaced_within_seconds_and_pickup_stays_fast(dsn, sup, provider):
    workers = start_workers(sup, dsn, provider, 3)
    waker = the_waker(workers)
    committed = []
    for i in range(8):  # ~4 per second, one per transaction, into an idle queue
        committed.append(checkout(dsn, f"before-{i}"))
        until(lambda n=i + 1: len(answers(provider)) == n, "the job delivered", 5)
        time.sleep(0.25)
    before = pickups(provider, committed)
    wakes = waker.scrape().total("receipts_waker_wakes_total")
    # The waker announced the jobs; a worker that had not heard it yet may still find one
    # of the first jobs by its own 1 s poll before the waker's probe does (then there is
    # nothing left to announce). The pickup times below say no job waited for a poll.
    assert wakes >= len(committed) - 2
    assert max(before) < 1.0, before  # the poll, now ≥ 3.75 s, did not find them

    killed_at = time.monotonic()
    waker.kill()  # kill -9: no step-down, the server frees the lock when the session drops
    survivors = [w for w in workers if w is not waker]
    successor = the_waker(survivors, timeout_seconds=15)
    replaced = time.monotonic() - killed_at
    start = len(committed)
    for i in range(4):
        committed.append(checkout(dsn, f"after-{i}"))
        until(lambda n=start + i + 1: len(answers(provider)) == n, "the job delivered", 5)
    after = pickups(provider, committed)[start:]
    print(f"\n[figures] pickup with the defaults, 3 workers: max {max(before) * 1000:.0f} ms "
          f"(8 jobs); waker killed -9, successor elected after {replaced:.1f} s; then max "
          f"{max(after) * 1000:.0f} ms")
    assert replaced < 10.0
    assert successor.scrape().total("receipts_waker_wakes_total") >= 4
    assert max(after) < 1.0, after


@pytest.mark.slow
def test_a_frozen_waker_loses_its_session_and_the_fleet_elects_another(dsn, sup, provider):
    workers = start_workers(sup, dsn, provider, 2)
    waker = the_waker(workers)
    frozen_at = time.monotonic()
    waker.pause()  # SIGSTOP: its connection stays open, but its session falls idle
    try:
        (other,) = [w for w in workers if w is not waker]
        until(lambda: other.scrape().value("receipts_waker_elected") == 1,
              "the other pod elected", 20)
        replaced = time.monotonic() - frozen_at
        committed = [checkout(dsn, "while-frozen")]
        until(lambda: len(answers(provider)) == 1, "the job delivered", 5)
        print(f"\n[figures] waker frozen (SIGSTOP): another elected after {replaced:.1f} s")
        assert replaced < 15.0
        assert pickups(provider, committed)[0] < 1.0
    finally:
        waker.resume()
    # Thawed, it finds its session ended by the server and rejoins as a listener.
    until(lambda: waker.scrape().value("receipts_waker_elected") == 0
          and len(elected(workers)) == 1, "one waker again", 20)


@pytest.mark.slow
def test_an_upgrade_released_workers_are_woken_and_old_enqueuers_keep_working(
        dsn, sup, provider):
    """A released worker listens on receipts_ready and polls every second; a released
    enqueuer notifies in its own transaction. Beside a new worker, both keep working.
    The released worker is woken for work the new pods cannot take, not for work the
    waker's own pod takes (that probe notifies nobody)."""
    heard: list[tuple[float, str]] = []
    ready = threading.Event()
    stop = threading.Event()

    def released_worker_listener() -> None:
        # What receipts 0.2.0's worker does to be woken: LISTEN on receipts_ready.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            ready.set()
            while not stop.is_set():
                heard.extend((time.monotonic(), n.payload) for n in conn.notifies(timeout=0.2))

    def woken_since(seen: int) -> list[str]:
        """What the released worker heard after the first *seen*, up to a sentinel."""
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_notify(%s, 'sentinel')", (NOTIFY_CHANNEL,))
        until(lambda: any(p == "sentinel" for _, p in heard[seen:]), "the sentinel", 5)
        got = [p for _, p in heard[seen:]]
        return got[:got.index("sentinel")]

    thread = threading.Thread(target=released_worker_listener, daemon=True)
    thread.start()
    try:
        assert ready.wait(10)
        # One slot: the new pod (the waker) can take one job at a time.
        (worker,) = start_workers(sup, dsn, provider, 1, concurrency="1")
        the_waker([worker])
        seen = len(heard)
        committed = checkout(dsn, "from-a-new-enqueuer")  # no notification of its own
        until(lambda: len(answers(provider)) == 1, "delivered", 5)
        assert pickups(provider, [committed])[0] < 1.0
        assert woken_since(seen) == []  # the waker's own pod took it, in-process

        seen = len(heard)
        with psycopg.connect(dsn) as conn, conn.transaction():
            enqueue_many(conn, ["more-1", "more-2", "more-3"])  # more than its one slot
        committed = time.monotonic()
        until(lambda: len(heard) > seen, "the released worker woken by the new waker", 5)
        assert heard[seen][0] - committed < 1.0 and heard[seen][1] == MEMBERS_PAYLOAD
        until(lambda: len(answers(provider)) == 4, "delivered", 10)

        committed = checkout(dsn, "from-a-released-enqueuer", old_enqueuer=True)
        until(lambda: len(answers(provider)) == 5, "delivered", 5)
        assert pickups(provider, [0.0] * 4 + [committed])[4] < 1.0
    finally:
        stop.set()
        thread.join(5)
    # The ack follows the provider's answer within the completer's trickle linger (250 ms).
    until(lambda: fetch_rows(dsn, "SELECT state, count(*) FROM receipt_jobs GROUP BY state")
          == [("done", 5)], "every job acked", 5)
