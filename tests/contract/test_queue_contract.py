"""One contract, two queues: the in-memory fake and the real JobQueue on PostgreSQL.

The worker loop's unit tests run against ``tests.unit.fakes.FakeQueue`` for speed;
that is only sound while the fake keeps the rules the worker relies on. Every test
here runs against both (the ``driver`` fixture), so a rule the fake gets wrong
fails here, next to the same assertion passing on PostgreSQL:

* a claim takes at most its limit of due, ready jobs, each with a fresh token;
* an ack with the attempt's token completes the job once; a stale token, or a
  lease that ran out, changes nothing; so does an ack a claim carries;
* a retry makes the job ready again (due after its delay), the last attempt or a
  permanent answer fails it, and a refund gives the attempt back;
* a write whose answer was lost can be resolved by its token;
* a paused fleet claims nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import pytest

from receipts.db import make_pool
from receipts.jobqueue import JobQueue, WorkerQueue
from receipts.model import (
    Attempt,
    Job,
    JobState,
    Outcome,
    PauseReason,
    Reason,
    Reschedule,
    Verdict,
)
from tests.conftest import Server, enqueue_many, fetch_rows, make_settings
from tests.unit.fakes import FakeQueue, Row

LEASE_SECONDS = 30.0
MAX_ATTEMPTS = 3


class Driver(Protocol):
    """A queue under contract, and the few things a test does to it from outside."""

    queue: WorkerQueue

    def add(self, order_ids: Sequence[str]) -> None:
        """Enqueue *order_ids* (ready, due now)."""

    def expire_leases(self) -> None:
        """Every running job's lease ends now (time passing for a stalled worker)."""

    def row(self, job_id: uuid.UUID) -> tuple[JobState, int]:
        """The job's state and attempts as stored."""

    def last_error(self, job_id: uuid.UUID) -> str | None:
        """The job's ``last_error`` as stored."""


class FakeDriver:
    def __init__(self) -> None:
        self.fake = FakeQueue(lease_seconds=LEASE_SECONDS, max_attempts=MAX_ATTEMPTS)
        self.queue: WorkerQueue = self.fake

    def add(self, order_ids: Sequence[str]) -> None:
        for order_id in order_ids:
            row = Row(uuid.uuid4(), order_id, run_at=time.monotonic())
            self.fake.rows[row.id] = row

    def expire_leases(self) -> None:
        for row in self.fake.rows.values():
            if row.state is JobState.RUNNING:
                row.lease_until = time.monotonic() - 1.0

    def row(self, job_id: uuid.UUID) -> tuple[JobState, int]:
        row = self.fake.rows[job_id]
        return row.state, row.attempts

    def last_error(self, job_id: uuid.UUID) -> str | None:
        return self.fake.rows[job_id].last_error


class PostgresDriver:
    def __init__(self, dsn: str, queue: JobQueue) -> None:
        self.dsn = dsn
        self.queue: WorkerQueue = queue

    def add(self, order_ids: Sequence[str]) -> None:
        enqueue_many(self.dsn, list(order_ids))

    def expire_leases(self) -> None:
        fetch_rows(self.dsn, "UPDATE receipt_jobs SET lease_until = now() - interval '1 second'"
                             " WHERE state = 'running' RETURNING id")

    def row(self, job_id: uuid.UUID) -> tuple[JobState, int]:
        ((state, attempts),) = fetch_rows(
            self.dsn, "SELECT state, attempts FROM receipt_jobs WHERE id = %s", (job_id,))
        return JobState(state), int(attempts)  # type: ignore[call-overload]

    def last_error(self, job_id: uuid.UUID) -> str | None:
        ((error,),) = fetch_rows(
            self.dsn, "SELECT last_error FROM receipt_jobs WHERE id = %s", (job_id,))
        return error  # type: ignore[return-value]


@pytest.fixture(params=["fake", "postgres"])
async def driver(request: pytest.FixtureRequest) -> AsyncIterator[Driver]:
    if request.param == "fake":
        yield FakeDriver()
        return
    server: Server = request.getfixturevalue("pg18")
    dsn = server.new_database()
    pool = make_pool(make_settings(dsn), "test", max_size=2)
    await pool.open(wait=True, timeout=10)
    try:
        yield PostgresDriver(dsn, JobQueue(pool, lease_seconds=LEASE_SECONDS,
                                           max_attempts=MAX_ATTEMPTS))
    finally:
        await pool.close()
        server.drop_database(dsn)


async def claim(driver: Driver, limit: int) -> list[Job]:
    return [a.job for a in (await driver.queue.claim(limit)).attempts]


def answer(verdict: Verdict = Verdict.RETRY, reason: Reason = Reason.PROVIDER_5XX) -> Outcome:
    return Outcome(verdict, reason, 503 if verdict is Verdict.RETRY else 400, None,
                   f"{reason} from the contract")


async def write_back(driver: Driver, job: Job, outcome: Outcome | None = None, *,
                     delay_seconds: float = 0.0, refund: bool = False) -> JobState | None:
    states = await driver.queue.reschedule(
        [Reschedule(Attempt(job, time.monotonic()), outcome or answer(), delay_seconds, refund)])
    return states.get(job.id)


async def test_a_claim_takes_at_most_its_limit_each_job_once_with_a_fresh_token(driver):
    driver.add([f"order-{i}" for i in range(5)])
    first, second = await claim(driver, 3), await claim(driver, 3)
    assert (len(first), len(second)) == (3, 2)
    jobs = first + second
    assert len({j.id for j in jobs}) == 5 and len({j.token for j in jobs}) == 5
    assert {j.attempt for j in jobs} == {1}
    assert {j.order_id for j in jobs} == {f"order-{i}" for i in range(5)}
    assert await claim(driver, 3) == []
    assert all(driver.row(j.id) == (JobState.RUNNING, 1) for j in jobs)


async def test_a_claim_limit_below_one_is_refused(driver):
    with pytest.raises(ValueError):
        await driver.queue.claim(0)


async def test_an_ack_with_the_attempt_s_token_completes_the_job_once(driver):
    driver.add(["order-ack"])
    (job,) = await claim(driver, 1)
    assert await driver.queue.ack([(job.id, job.token)]) == {job.id}
    assert driver.row(job.id) == (JobState.DONE, 1)
    assert await driver.queue.ack([(job.id, job.token)]) == set()  # already done
    assert await claim(driver, 1) == []


async def test_a_stale_ack_changes_nothing_and_the_rest_of_its_batch_completes(driver):
    driver.add(["order-a", "order-b"])
    a, b = await claim(driver, 2)
    assert await driver.queue.ack([(a.id, uuid.uuid4()), (b.id, b.token)]) == {b.id}
    assert driver.row(a.id) == (JobState.RUNNING, 1)
    assert driver.row(b.id) == (JobState.DONE, 1)


async def test_a_claim_carrying_acks_completes_those_with_their_token_and_claims_as_before(driver):
    driver.add(["order-r1", "order-r2", "order-r3"])
    a, b = await claim(driver, 2)
    result = await driver.queue.claim(5, acks=[(a.id, a.token), (b.id, uuid.uuid4())])
    assert result.acked == {a.id}  # b's token is not the attempt's: a stale ack
    assert driver.row(a.id) == (JobState.DONE, 1)
    assert driver.row(b.id) == (JobState.RUNNING, 1)
    assert [j.order_id for j in (a.job for a in result.attempts)] == ["order-r3"]
    # Nothing left to claim: the acks still ride, and a repeated one changes nothing.
    empty = await driver.queue.claim(5, acks=[(a.id, a.token), (b.id, b.token)])
    assert empty.attempts == [] and empty.acked == {b.id}
    assert driver.row(b.id) == (JobState.DONE, 1)


async def test_a_claim_without_acks_reports_none(driver):
    driver.add(["order-plain"])
    result = await driver.queue.claim(1)
    assert result.acked is None and len(result.attempts) == 1


async def test_after_the_lease_ran_out_neither_ack_nor_retry_is_written(driver):
    driver.add(["order-late"])
    (job,) = await claim(driver, 1)
    driver.expire_leases()
    assert await driver.queue.ack([(job.id, job.token)]) == set()
    assert await write_back(driver, job) is None
    assert driver.row(job.id) == (JobState.RUNNING, 1)  # recovery's to return, not a claim's
    assert await claim(driver, 1) == []


async def test_a_retry_makes_the_job_ready_again_under_a_new_token(driver):
    driver.add(["order-retry"])
    (first,) = await claim(driver, 1)
    assert await write_back(driver, first) is JobState.READY
    assert driver.row(first.id) == (JobState.READY, 1)
    (second,) = await claim(driver, 1)
    assert second.id == first.id and second.attempt == 2 and second.token != first.token
    assert await driver.queue.ack([(first.id, first.token)]) == set()  # the old attempt's
    assert await driver.queue.ack([(second.id, second.token)]) == {second.id}


async def test_a_retry_is_not_claimed_before_its_delay(driver):
    driver.add(["order-later"])
    (job,) = await claim(driver, 1)
    assert await write_back(driver, job, delay_seconds=60.0) is JobState.READY
    assert await claim(driver, 1) == []


async def test_the_last_attempt_s_failure_fails_the_job_and_it_is_never_claimed(driver):
    driver.add(["order-5xx"])
    states = []
    for _ in range(MAX_ATTEMPTS):
        (job,) = await claim(driver, 1)
        states.append(await write_back(driver, job))
    assert states == [JobState.READY] * (MAX_ATTEMPTS - 1) + [JobState.FAILED]
    assert driver.row(job.id) == (JobState.FAILED, MAX_ATTEMPTS)
    assert await claim(driver, 1) == []


async def test_a_permanent_answer_fails_the_job_at_once(driver):
    driver.add(["order-400"])
    (job,) = await claim(driver, 1)
    assert await write_back(driver, job, answer(Verdict.PERMANENT, Reason.REJECTED)) is (
        JobState.FAILED)
    assert driver.row(job.id) == (JobState.FAILED, 1)


async def test_a_refund_gives_the_attempt_back(driver):
    driver.add(["order-outage"])
    (job,) = await claim(driver, 1)
    assert await write_back(driver, job, refund=True) is JobState.READY
    assert driver.row(job.id) == (JobState.READY, 0)
    (again,) = await claim(driver, 1)
    assert again.attempt == 1


async def test_a_job_given_back_unsent_keeps_its_last_error_and_its_attempt(driver):
    # The worker's prefetch: a job claimed ahead of the free slots and never sent.
    driver.add(["order-prefetched"])
    (job,) = await claim(driver, 1)
    assert await write_back(driver, job) is JobState.READY  # a 503: attempt 1 spent
    (job,) = await claim(driver, 1)
    assert job.attempt == 2
    states = await driver.queue.reschedule([Reschedule(
        Attempt(job, time.monotonic()), answer(), 0.0, refund=True, unsent=True)])
    assert states == {job.id: JobState.READY}
    assert driver.row(job.id) == (JobState.READY, 1)
    assert driver.last_error(job.id) == "provider_5xx from the contract"
    (again,) = await claim(driver, 1)  # due at once
    assert again.id == job.id and again.attempt == 2


async def test_an_in_progress_answer_gives_the_attempt_back(driver):
    driver.add(["order-409"])
    (job,) = await claim(driver, 1)
    assert await write_back(driver, job, answer(Verdict.RETRY, Reason.IN_PROGRESS)) is (
        JobState.READY)
    assert driver.row(job.id) == (JobState.READY, 0)


async def test_a_write_whose_answer_was_lost_is_resolved_by_its_token(driver):
    driver.add(["order-acked", "order-retried", "order-open"])
    acked, retried, still_open = await claim(driver, 3)
    await driver.queue.ack([(acked.id, acked.token)])
    await write_back(driver, retried, delay_seconds=60.0)
    pairs = [(j.id, j.token) for j in (acked, retried, still_open)]
    assert await driver.queue.resolve_writes(pairs) == {
        acked.id: JobState.DONE, retried.id: JobState.READY}
    assert await driver.queue.resolve_writes([(acked.id, uuid.uuid4())]) == {}


async def test_a_paused_fleet_claims_nothing_and_says_why(driver):
    driver.add(["order-paused"])
    flow = await driver.queue.extend_pause(PauseReason.OUTAGE, 60.0)
    assert flow.pause_reason is PauseReason.OUTAGE
    result = await driver.queue.claim(1)
    assert result.attempts == [] and result.flow.pause_reason is PauseReason.OUTAGE


async def test_a_paused_fleet_s_claim_still_writes_the_acks_it_carries(driver):
    driver.add(["order-before-the-pause", "order-held"])
    (job,) = await claim(driver, 1)
    await driver.queue.extend_pause(PauseReason.OUTAGE, 60.0)
    result = await driver.queue.claim(1, acks=[(job.id, job.token)])
    assert result.attempts == [] and result.flow.pause_reason is PauseReason.OUTAGE
    assert result.acked == {job.id} and driver.row(job.id) == (JobState.DONE, 1)
