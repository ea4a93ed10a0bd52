"""In-memory fakes of the worker's two dependencies: the queue and the deliverer.

:class:`FakeQueue` keeps the lease protocol's rules (claim only due, ready
rows under the attempt limit and outside a pause; writes guarded by token) and
the fleet-wide flow row, all in memory on the monotonic clock, so the claim
loop's bookkeeping can be tested in milliseconds. ``tests/contract`` runs one
suite against this fake and the real ``JobQueue`` on PostgreSQL, so the two
keep the same rules.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from receipts.errors import DatabaseUnavailable
from receipts.jobqueue import Acked, QueueStats, WalPosition
from receipts.model import (
    Attempt,
    AttemptRecord,
    ClaimResult,
    FlowState,
    Job,
    JobState,
    Outcome,
    PauseReason,
    Reason,
    Reschedule,
    Verdict,
)


@dataclass
class Row:
    id: uuid.UUID
    order_id: str
    state: JobState = JobState.READY
    attempts: int = 0
    run_at: float = 0.0
    token: uuid.UUID | None = None
    lease_until: float = 0.0
    in_progress_count: int = 0
    last_error: str | None = None
    last_token: uuid.UUID | None = None


@dataclass
class FakeQueue:
    """The worker's queue statements over in-memory rows (see the module doc)."""

    lease_seconds: float = 30.0
    max_attempts: int = 5
    rate: float = 0.0
    rows: dict[uuid.UUID, Row] = field(default_factory=dict)
    pause_reason: PauseReason | None = None
    paused_until: float = 0.0
    pause_seconds: float = 0.0
    probe_until: float | None = None
    claims: list[tuple[int, int]] = field(default_factory=list)  # (limit, returned)
    fail_claims: int = 0  # the next N claims raise DatabaseUnavailable
    hang_claims: bool = False  # claims never answer (a half-open connection)
    #: While set and cleared, claim statements wait for it before they claim.
    claim_gate: asyncio.Event | None = None
    claims_waiting: int = 0  # claim statements waiting at the gate now
    lose_ack_answers: int = 0  # the next N acks commit, then their answer is lost
    #: While set and cleared, ack statements wait for it (a slow database).
    ack_gate: asyncio.Event | None = None
    ack_statements: int = 0
    acks_waiting: int = 0  # ack statements waiting at the gate now
    pauses: list[tuple[PauseReason, float]] = field(default_factory=list)
    resumed: int = 0
    probe_outcomes: list[str] = field(default_factory=list)  # every answered probe's reason
    refunds: int = 0
    records: list[AttemptRecord] = field(default_factory=list)
    #: What each commit probe answers, seconds (a list is consumed in order, its
    #: last value repeated); an exception instance is raised instead.
    probe_seconds: list[float | Exception] = field(default_factory=lambda: [0.001])
    probes: int = 0
    wal_reads: int = 0
    #: The write-ahead log: every claim, ack and reschedule is one record. With
    #: ``auto_flush`` each is flushed at once; otherwise only by :meth:`flush`,
    #: and :meth:`crash` undoes what was not flushed.
    auto_flush: bool = True
    lsn: int = 0
    flushed: int = 0
    journal: list[tuple[int, uuid.UUID, Row]] = field(default_factory=list)
    connection_since: float = float("-inf")
    last_failure_at: float = float("-inf")
    #: Acks carry the WAL positions back, as :meth:`receipts.jobqueue.JobQueue.ack`
    #: does (read before the ack's own record, as the statement reads them).
    carry_positions: bool = False
    resolves: int = 0  # resolve_writes statements
    #: Claims take acks to write in the same statement, as JobQueue's do
    #: (``claim(acks=…)``); off, the completer writes every ack on its own.
    carries_acks: bool = False
    riding_acks: int = 0  # acks written by claims

    def add(self, n: int) -> list[uuid.UUID]:
        ids = []
        for i in range(n):
            row = Row(uuid.uuid4(), f"order-{len(self.rows) + i}")
            self.rows[row.id] = row
            ids.append(row.id)
        return ids

    def count(self, state: JobState) -> int:
        return sum(1 for r in self.rows.values() if r.state is state)

    def _flow(self) -> FlowState:
        now = time.monotonic()
        if self.pause_reason is None or (
                not self.pause_reason.probed and self.paused_until <= now):
            return FlowState()
        due = self.paused_until
        if self.pause_reason.probed and self.probe_until is not None:
            due = self.probe_until
        return FlowState(self.pause_reason, due - now)

    async def claim(self, limit: int, *, probe: bool = False,
                    after: tuple[datetime, uuid.UUID] | None = None,
                    shared_bucket: bool = True,
                    acks: Sequence[tuple[uuid.UUID, uuid.UUID]] = ()) -> ClaimResult:
        # The fake has no index to walk: a watermark changes nothing here.
        if limit < 1:  # as JobQueue.claim (tests/contract holds the two to one contract)
            raise ValueError("claim limit must be at least 1")
        if self.fail_claims:
            self.fail_claims -= 1
            raise DatabaseUnavailable("database unavailable: fake outage")
        while self.hang_claims:
            await asyncio.sleep(3600)
        if self.claim_gate is not None:
            self.claims_waiting += 1
            try:
                await self.claim_gate.wait()
            finally:
                self.claims_waiting -= 1
        now = time.monotonic()
        attempts = []
        if probe or not self._flow().paused:
            due = sorted((r for r in self.rows.values()
                          if r.state is JobState.READY and r.run_at <= now
                          and r.attempts < self.max_attempts), key=lambda r: r.run_at)
            for row in due[:limit]:
                self._log(row)
                row.state, row.attempts = JobState.RUNNING, row.attempts + 1
                row.token, row.lease_until = uuid.uuid4(), now + self.lease_seconds
                job = Job(row.id, row.order_id, row.token, row.attempts)
                attempts.append(Attempt(job, now, claim_sent_at=now))
        self.claims.append((limit, len(attempts)))
        acked = self._ack(acks) if acks else None
        self.riding_acks += len(acks)
        await asyncio.sleep(0)
        if acks and self.lose_ack_answers:
            self.lose_ack_answers -= 1
            raise DatabaseUnavailable("database unavailable: connection lost after commit")
        return ClaimResult(attempts, self._flow(), acked)

    def _owned(self, job_id: uuid.UUID, token: uuid.UUID) -> Row | None:
        row = self.rows.get(job_id)
        if row and row.token == token and row.lease_until > time.monotonic():
            return row
        return None

    def _ack(self, pairs: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> Acked:
        done = Acked()
        if self.carry_positions:
            done.position = WalPosition(self.lsn, self.flushed, self.connection_since)
        for job_id, token in pairs:
            row = self._owned(job_id, token)
            if row:
                self._log(row)
                row.state, row.token, row.last_token = JobState.DONE, None, token
                done.add(job_id)
        return done

    async def ack(self, pairs: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> set[uuid.UUID]:
        self.ack_statements += 1
        if self.ack_gate is not None:
            self.acks_waiting += 1
            try:
                await self.ack_gate.wait()
            finally:
                self.acks_waiting -= 1
        done = self._ack(pairs)
        if self.lose_ack_answers:
            self.lose_ack_answers -= 1
            raise DatabaseUnavailable("database unavailable: connection lost after commit")
        return done

    async def reschedule(self, items: Sequence[Reschedule]) -> dict[uuid.UUID, JobState]:
        out = {}
        for item in items:
            row = self._owned(item.attempt.job.id, item.attempt.job.token)
            if row is None:
                continue
            self._log(row)
            permanent = item.outcome.verdict is Verdict.PERMANENT
            back = not permanent and (item.refund or (
                item.outcome.reason is Reason.IN_PROGRESS and row.in_progress_count < 20))
            self.refunds += int(back)
            row.attempts -= int(back)
            row.in_progress_count += int(item.outcome.reason is Reason.IN_PROGRESS)
            final = permanent or row.attempts >= self.max_attempts
            row.state = JobState.FAILED if final else JobState.READY
            row.run_at = time.monotonic() + item.delay_seconds
            row.token = None
            if not item.unsent:
                row.last_error = item.outcome.detail
            row.last_token = item.attempt.job.token
            out[row.id] = row.state
        return out

    async def resolve_writes(self, pairs: Sequence[tuple[uuid.UUID, uuid.UUID]]
                             ) -> dict[uuid.UUID, JobState]:
        self.resolves += 1
        return {job_id: self.rows[job_id].state for job_id, token in pairs
                if job_id in self.rows and self.rows[job_id].last_token == token}

    async def record_attempts(self, records: Sequence[AttemptRecord]) -> None:
        self.records.extend(records)

    async def extend_pause(self, reason: PauseReason, seconds: float, *,
                           next_probe_seconds: float | None = None,
                           probe_outcome: str | None = None) -> FlowState:
        self.pauses.append((reason, seconds))
        now = time.monotonic()
        until = now + seconds
        active = self._flow().paused
        if not active or until > self.paused_until:
            self.pause_reason, self.paused_until = reason, until
        self.pause_seconds = max(self.pause_seconds, seconds) if active else seconds
        next_probe = seconds if next_probe_seconds is None else next_probe_seconds
        self.probe_until = min(self.paused_until, now + next_probe)
        if probe_outcome is not None:
            self.probe_outcomes.append(probe_outcome)
        return self._flow()

    async def begin_probe(self, guard_seconds: float) -> tuple[datetime, FlowState] | None:
        now = time.monotonic()
        if self.pause_reason is None or not self.pause_reason.probed:
            return None
        due = self.paused_until if self.probe_until is None else self.probe_until
        if due > now:
            return None
        self.probe_until = now + guard_seconds
        stamp = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=self.probe_until)
        return stamp, FlowState(self.pause_reason, self.pause_seconds)

    async def resume(self, probe_until: datetime, *, probe_outcome: str = "delivered") -> bool:
        if self.pause_reason is None or not self.pause_reason.probed or self.probe_until is None:
            return False
        stamp = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=self.probe_until)
        if stamp != probe_until:
            return False
        self.pause_reason, self.paused_until, self.pause_seconds = None, 0.0, 0.0
        self.probe_until = None
        self.resumed += 1
        self.probe_outcomes.append(probe_outcome)
        return True

    async def commit_probe(self) -> float:
        self.probes += 1
        answer = self.probe_seconds[0] if len(self.probe_seconds) == 1 else (
            self.probe_seconds.pop(0))
        if isinstance(answer, Exception):
            raise answer
        return answer

    def _log(self, row: Row) -> None:
        """Journal *row* as it was before a write (one WAL record)."""
        self.lsn += 1
        self.journal.append((self.lsn, row.id, replace(row)))
        if self.auto_flush:
            self.flush()

    def flush(self) -> None:
        """The WAL writer: everything written so far is on disk."""
        self.flushed = self.lsn
        self.journal.clear()

    def crash(self) -> None:
        """The server dies: unflushed writes are undone, every connection is new."""
        for _, job_id, before in reversed(self.journal):
            self.rows[job_id] = before
        self.journal.clear()
        self.lsn = self.flushed
        # Every connection ended: the next statement fails, then a new one is made.
        self.last_failure_at = self.connection_since = time.monotonic()

    async def wal_position(self) -> WalPosition:
        self.wal_reads += 1
        return WalPosition(self.lsn, self.flushed, self.connection_since)

    async def queue_stats(self) -> QueueStats:
        return QueueStats(ready_due=self.count(JobState.READY), ready=self.count(JobState.READY),
                          running=self.count(JobState.RUNNING), expired=0,
                          failed=self.count(JobState.FAILED), lag_seconds=0.0,
                          done_estimate=self.count(JobState.DONE), dead_tuples=0,
                          oldest_transaction_age_seconds=0.0, oldest_undelivered_age_seconds=0.0)


class ScriptedDeliverer:
    """A deliverer whose answer is chosen per call by *answer(job)*; may block on a gate.

    Attributes:
        calls: jobs delivered so far, in order.
        release: while cleared, deliveries wait (to hold slots busy).
        in_flight: deliveries currently inside :meth:`deliver`.
        most_in_flight: the highest :attr:`in_flight` seen.
        latency_seconds: each delivery takes at least this long (0: answers at once).
    """

    def __init__(self, answer: Callable[[Job], Outcome] | None = None) -> None:
        self.answer = answer or (lambda job: Outcome(Verdict.DELIVERED, Reason.DELIVERED, 200))
        self.latency_seconds = 0.0
        self.calls: list[Job] = []
        self.release = asyncio.Event()
        self.release.set()
        self.in_flight = 0
        self.most_in_flight = 0

    async def deliver(self, job: Job) -> Outcome:
        self.calls.append(job)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.release.wait()
            if self.latency_seconds:
                await asyncio.sleep(self.latency_seconds)
            return self.answer(job)
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        return None


def outcome(status: int, retry_after: float | None = None) -> Outcome:
    """The outcome the HTTP deliverer gives for *status* (a subset of its table)."""
    if 200 <= status < 300:
        return Outcome(Verdict.DELIVERED, Reason.DELIVERED, status)
    if status == 409:
        return Outcome(Verdict.RETRY, Reason.IN_PROGRESS, status, retry_after, "409")
    if status == 429:
        return Outcome(Verdict.RETRY, Reason.RATE_LIMITED, status, retry_after, "429")
    if status in (401, 403):
        return Outcome(Verdict.RETRY, Reason.AUTH_REJECTED, status, None, str(status))
    if status >= 500:
        return Outcome(Verdict.RETRY, Reason.PROVIDER_5XX, status, retry_after, str(status))
    return Outcome(Verdict.PERMANENT, Reason.REJECTED, status, None, str(status))
