"""The lifecycle against an in-memory model: a Hypothesis state machine on a real database.

Hypothesis drives enqueue / claim / ack (single and batched, current and stale
attempts) / fail (retryable or permanent, due now or later) / expire / recover
/ time passing / operator retry / lowering max attempts, through the real
:class:`~receipts.jobqueue.JobQueue` statements, and after every step compares
every row with the model and checks docs/design.md §2's invariants and the table's
CHECK constraints. Bounded: ``RECEIPTS_MODEL_EXAMPLES`` examples (default 40)
of at most ``RECEIPTS_MODEL_STEPS`` steps (default 20) per server.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from receipts.db import make_pool
from receipts.enqueue import enqueue
from receipts.jobqueue import JobQueue
from receipts.model import Job, JobState
from receipts.operations import Operations, ReviewFilter
from tests.conftest import check_invariants, claim_jobs, make_settings, reschedule_one

MAX_ATTEMPTS = 3
LEASE_SECONDS = 120.0  # never runs out by itself within a test; expiry is a rule
ORDERS = ["o-1", "o-2", "o-3", "o-4", "o-5", "o'quote\"", "ørder-ü", "o 8"]
EXAMPLES = int(os.environ.get("RECEIPTS_MODEL_EXAMPLES", "40"))
STEPS = int(os.environ.get("RECEIPTS_MODEL_STEPS", "20"))

CHECKS_SQL = """
SELECT count(*) FILTER (WHERE NOT (state IN ('ready', 'running', 'done', 'failed'))),
       count(*) FILTER (WHERE attempts < 0),
       count(*) FILTER (WHERE (state = 'running') <> (lease_token IS NOT NULL)),
       count(*) FILTER (WHERE (lease_token IS NULL) <> (lease_until IS NULL)),
       count(*) FILTER (WHERE (state IN ('done', 'failed')) <> (finished_at IS NOT NULL))
FROM receipt_jobs
"""


@dataclass
class ModelJob:
    """What the model believes about one order's job."""

    order_id: str
    id: uuid.UUID
    state: JobState = JobState.READY
    attempts: int = 0
    token: uuid.UUID | None = None
    due: bool = True
    expired: bool = False

    def owned_by(self, job: Job) -> bool:
        """Would an ack with *job*'s token be accepted?"""
        return self.state is JobState.RUNNING and self.token == job.token and not self.expired


def _machine(runner: asyncio.Runner, queue: JobQueue, dsn: str) -> type[RuleBasedStateMachine]:
    conn = psycopg.connect(dsn, autocommit=True)

    def run(coro: Any) -> Any:
        return runner.run(coro)

    def sql(query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        cur = conn.execute(query, params)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []

    class QueueModel(RuleBasedStateMachine):
        attempts = Bundle("attempts")

        def __init__(self) -> None:
            super().__init__()
            self.jobs: dict[str, ModelJob] = {}
            self.max_attempts = MAX_ATTEMPTS
            self.queue = queue
            self.operations = Operations(queue.pool)

        @initialize(max_attempts=st.integers(1, MAX_ATTEMPTS))
        def empty_queue(self, max_attempts: int) -> None:
            sql("TRUNCATE receipt_jobs")
            self._set_max(max_attempts)

        def _set_max(self, max_attempts: int) -> None:
            self.max_attempts = max_attempts
            self.queue = JobQueue(queue.pool, lease_seconds=LEASE_SECONDS,
                                  max_attempts=max_attempts)

        def _by_id(self, job_id: uuid.UUID) -> ModelJob:
            return next(j for j in self.jobs.values() if j.id == job_id)

        def _eligible(self) -> list[ModelJob]:
            return [j for j in self.jobs.values() if j.state is JobState.READY and j.due
                    and j.attempts < self.max_attempts]

        # ----------------------------------------------------------- rules

        @rule(order_id=st.sampled_from(ORDERS))
        def enqueue_order(self, order_id: str) -> None:
            with psycopg.connect(dsn) as tx:
                created = enqueue(tx, order_id) is not None
            assert created == (order_id not in self.jobs)
            if created:
                (row,) = sql("SELECT id FROM receipt_jobs WHERE order_id = %s", (order_id,))
                self.jobs[order_id] = ModelJob(order_id, row[0])

        @rule(target=attempts, limit=st.integers(1, 4))
        def claim(self, limit: int) -> Any:
            eligible = self._eligible()
            claimed: list[Job] = run(claim_jobs(self.queue, limit))
            assert len(claimed) == min(limit, len(eligible))
            assert {c.id for c in claimed} <= {j.id for j in eligible}
            assert len({c.token for c in claimed}) == len(claimed)
            if claimed:  # the earliest due jobs, by (run_at, id)
                order = sql("SELECT id FROM receipt_jobs WHERE id = ANY(%s)"
                            " ORDER BY run_at, id", ([j.id for j in eligible],))
                assert {r[0] for r in order[: len(claimed)]} == {c.id for c in claimed}
            for c in claimed:
                model = self._by_id(c.id)
                assert c.attempt == model.attempts + 1 and c.order_id == model.order_id
                model.state, model.attempts, model.token = JobState.RUNNING, c.attempt, c.token
                model.expired = False
            return multiple(*claimed)

        def _expire(self, model: ModelJob) -> None:
            """The lease of *model*'s current attempt runs out (time moved, not waited)."""
            sql("UPDATE receipt_jobs SET lease_until = statement_timestamp() - interval '1 s'"
                " WHERE id = %s AND state = 'running'", (model.id,))
            if model.state is JobState.RUNNING:
                model.expired = True

        @rule(job=attempts, late=st.booleans())
        def ack(self, job: Job, late: bool) -> None:
            model = self._by_id(job.id)
            if late:
                self._expire(model)
            expected = model.owned_by(job)
            assert run(self.queue.ack([(job.id, job.token)])) == ({job.id} if expected else set())
            if expected:
                model.state, model.token = JobState.DONE, None

        @rule(jobs=st.lists(attempts, min_size=2, max_size=4, unique_by=lambda j: j.id))
        def ack_batch(self, jobs: list[Job]) -> None:
            expected = {j.id for j in jobs if self._by_id(j.id).owned_by(j)}
            assert run(self.queue.ack([(j.id, j.token) for j in jobs])) == expected
            for job_id in expected:
                model = self._by_id(job_id)
                model.state, model.token = JobState.DONE, None

        @rule(job=attempts, permanent=st.booleans(), later=st.booleans(), late=st.booleans())
        def fail(self, job: Job, permanent: bool, later: bool, late: bool) -> None:
            model = self._by_id(job.id)
            if late:
                self._expire(model)
            owned = model.owned_by(job)
            state = run(reschedule_one(self.queue, job, delay_seconds=3600 if later else 0,
                                              error="boom", permanent=permanent))
            if not owned:
                assert state is None
                return
            failed = permanent or model.attempts >= self.max_attempts
            assert state == (JobState.FAILED if failed else JobState.READY)
            model.state, model.token, model.due = state, None, not later

        @precondition(lambda self: any(j.state is JobState.RUNNING and not j.expired
                                       for j in self.jobs.values()))
        @rule(data=st.data())
        def lease_runs_out(self, data: st.DataObject) -> None:
            live = [j for j in self.jobs.values() if j.state is JobState.RUNNING and not j.expired]
            self._expire(data.draw(st.sampled_from(live)))

        @rule()
        def recover(self) -> None:
            expired = [j for j in self.jobs.values()
                       if j.state is JobState.RUNNING and j.expired]
            batch = run(self.queue.recover_expired(batch=100, delay_seconds=0))
            to_failed = [j for j in expired if j.attempts >= self.max_attempts]
            assert (batch.to_ready, batch.to_failed) == (len(expired) - len(to_failed),
                                                         len(to_failed))
            for j in expired:
                j.state = JobState.FAILED if j in to_failed else JobState.READY
                j.token, j.expired, j.due = None, False, True
            assert run(self.queue.fail_exhausted(batch=100)) == 0

        @rule()
        def time_passes(self) -> None:
            sql("UPDATE receipt_jobs SET run_at = statement_timestamp() - interval '1 s'"
                " WHERE state = 'ready' AND run_at > statement_timestamp()")
            for j in self.jobs.values():
                j.due = True

        @rule(data=st.data(), everything=st.booleans())
        def operator_retry(self, data: st.DataObject, everything: bool) -> None:
            # The operator's one door (retry_jobs): all or nothing, the confirmed count.
            failed = {j.id for j in self.jobs.values() if j.state is JobState.FAILED}
            target: ReviewFilter | list[uuid.UUID]
            if everything:
                target, confirmed = ReviewFilter(state=JobState.FAILED), len(failed)
                expected = failed
            else:
                pool = [j.id for j in self.jobs.values()] or [uuid.uuid4()]
                target = data.draw(st.lists(st.sampled_from(pool), max_size=3, unique=True))
                confirmed = len(target)
                expected = set(target) if set(target) <= failed else set()
            assert set(run(self.operations.retry_jobs(target, expected=confirmed))) == expected
            for job_id in expected:
                model = self._by_id(job_id)
                model.state, model.attempts, model.due = JobState.READY, 0, True

        @precondition(lambda self: self.max_attempts > 1)
        @rule(data=st.data())
        def lower_max_attempts(self, data: st.DataObject) -> None:
            new_max = data.draw(st.integers(1, self.max_attempts - 1))
            self._set_max(new_max)
            exhausted = [j for j in self.jobs.values()
                         if j.state is JobState.READY and j.attempts >= new_max]
            assert run(self.queue.fail_exhausted(batch=100)) == len(exhausted)
            for j in exhausted:
                j.state = JobState.FAILED

        # ------------------------------------------------------ invariants

        @invariant()
        def database_matches_the_model(self) -> None:
            rows = sql("SELECT order_id, id, state, attempts, lease_token,"
                       " run_at <= statement_timestamp(),"
                       " lease_until <= statement_timestamp() FROM receipt_jobs")
            assert len(rows) == len(self.jobs)
            for order_id, job_id, state, attempts, token, due, expired in rows:
                model = self.jobs[order_id]
                assert (job_id, state, attempts, token) == (
                    model.id, model.state, model.attempts, model.token), order_id
                if state == JobState.READY:
                    assert due == model.due, order_id
                if state == JobState.RUNNING:
                    assert expired == model.expired, order_id

        @invariant()
        def invariants_and_check_constraints_hold(self) -> None:
            check_invariants(dsn, self.max_attempts)
            assert sql(CHECKS_SQL) == [(0, 0, 0, 0, 0)]

    QueueModel.closing = conn  # type: ignore[attr-defined]
    return QueueModel


@pytest.mark.slow
def test_the_queue_behaves_like_its_lifecycle_model(dsn):
    with psycopg.connect(dsn) as conn:
        constraints = {r[0] for r in conn.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = 'receipt_jobs'::regclass AND contype = 'c' AND convalidated")}
    # One CHECK holds the state, attempts and the three pairings (migration 0012;
    # tests/integration/test_database_rules.py holds it to the nine it replaced).
    assert constraints == {"CHECK (receipts_job_rules(state, attempts, in_progress_count,"
                           " lease_token, lease_until, finished_at, order_id, run_at,"
                           " traceparent))"}, constraints
    with asyncio.Runner() as runner:
        cfg = make_settings(dsn, lease_seconds=LEASE_SECONDS)
        pool = make_pool(cfg, "model", max_size=2)
        runner.run(pool.open(wait=True, timeout=10))
        try:
            queue = JobQueue(pool, lease_seconds=LEASE_SECONDS, max_attempts=MAX_ATTEMPTS)
            machine = _machine(runner, queue, dsn)
            try:
                run_state_machine_as_test(machine, settings=settings(
                    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                    database=None, suppress_health_check=list(HealthCheck),
                ))
            finally:
                machine.closing.close()  # type: ignore[attr-defined]
        finally:
            runner.run(pool.close())
