"""The completer: every outcome write of an attempt, coalesced and accounted once.

Acks (delivered) and reschedules (a known failure, an unknown outcome, or a
permanent failure) are handed here by the delivery tasks, which do not wait
for the write: a delivery slot is free again as soon as its outcome is known,
so the statement's round trip never lengthens a slot's cycle. One flusher
task takes everything handed in since its last statement (up to
``max_batch`` of each kind) and writes it with one guarded statement per
kind. While the queue keeps the worker busy (its claims come back full),
the flusher lingers ``linger_seconds`` (50 ms) before each statement unless
a full batch is already waiting or it is closing, so a busy worker writes about
a hundred outcomes per statement instead of a handful: most of a
statement's CPU (the round trip, the pool, the result) does not grow with its
size (bench/README.md, "This round", counts the statements) — while a lease is a
minute long. A batched ack is several times faster than one ack per job
(docs/design.md §10).
When the worker is not busy, an outcome is written at once unless the
previous statement began less than ``trickle_linger_seconds`` (250 ms) ago: a
steady trickle then shares one statement per kind per quarter second instead
of one per outcome or two (bench/README.md, "Fewer worker statements at a
trickle", measures it), and a lone reschedule waits for nothing. At an ordinary rate the
ack's round trip, not its rows, is most of what it costs the database. So at a
trickle an ack rides on the worker's next claim instead (:meth:`Completer.carried_by`:
one statement where there were two): while the worker claims at least every
``ride_seconds`` (half a second) on average, an ack waits up to that long for a claim to
carry it, and never past half the lease time its attempt had left.

The flusher owns a write once it is handed in: nothing the delivery task
does later (stop, abandon) affects it, and :meth:`Completer.close` flushes
what is pending. While writes fall behind (``backlog``), the claim loop
claims nothing new (:meth:`Completer.wait_for_room`), so a slow database
cannot grow the backlog without bound. When the database cannot be reached,
a write is retried until the lease it belongs to has certainly expired (more
than ``lease_seconds`` of this process's monotonic clock since the claim
returned, and the database counted the lease from an earlier instant); then
it is dropped as a lost lease: recovery owns that job now.

A write whose connection broke may still have committed. Before it is
retried, one ``resolve_writes`` statement on another connection asks which
of the batch's attempts already carry their own token as the row's
``last_token`` (ack and reschedule set it in the same statement): those are
settled as written, the others are written again. So a lost answer is
neither a false stale ack nor a missing ack in the counters.

Attempt records for the jobs' histories (``receipt_attempts``) are queued
here too and written, one statement per cycle, after the outcomes.

Accounting, written once for both kinds: a write the token/lease guard
refused is a stale ack (``receipts_stale_acks_total``) and a lost lease;
an ack that landed counts in ``receipts_acks_total``; a reschedule in
``receipts_retries_total{reason}`` or ``receipts_failures_total{reason}``.

With asynchronous commits (``watch_durability``, the default
``RECEIPTS_SYNCHRONOUS_COMMIT=off``) a write that landed is counted only once
it is proven durable (:mod:`receipts.durability`): every ack statement carries
the server's WAL positions back (:class:`~receipts.jobqueue.Acked`), and the
watch reads them on its own only when no ack has for ``watch_interval_seconds``
(a worker that acks steadily proves its writes without extra statements). So a
database crash that
undoes it leaves no count behind: the completer finds the row without its
token and writes the outcome again (``receipts_writes_rewritten_total``; the
lease still holds, the delivery is not repeated). A write refused while its
lease must still hold, after a statement failed for its connection since the
claim, was refused because the crash undid its claim: it is counted in
``receipts_writes_undone_total{statement="claim"}``, not as a stale ack
(docs/design.md §2, "What a database crash may undo"). The crash took the
attempt's claim with it, so the row's ``attempts`` no longer counts that
sending, and the job's next claim sends the receipt again under the same
idempotency key; the attempt therefore gets a record of its own in the job's
history (:data:`UNDONE_CLAIM`, written like any other), which the crash cannot
have undone: the resend leaves a trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from receipts.durability import CommitWatch
from receipts.errors import DatabaseUnavailable, QueueError
from receipts.jobqueue import WalPosition, WorkerQueue
from receipts.logs import get_logger, job_fields
from receipts.metrics import Metrics
from receipts.model import (
    Attempt,
    AttemptRecord,
    ClaimResult,
    JobState,
    Reason,
    Reschedule,
    Verdict,
)

log = get_logger("completion")

#: The error of the attempt record that an attempt whose claim a database crash undid
#: gets in its job's history: the row's ``attempts`` does not count that sending.
UNDONE_CLAIM = ("sent, then a database crash undid this attempt's claim: the row's "
                "attempts does not count it, and the job is sent again with the same key")

T = TypeVar("T")
R = TypeVar("R")

BACKOFF_FIRST_SECONDS = 0.05
BACKOFF_MAX_SECONDS = 5.0
#: The cap while the database cannot be reached: each such try already waited
#: for the pool (5 s), so a short cap keeps the writes, and /readyz, within
#: seconds of the database's return (docs/design.md §4, "Database outage").
UNAVAILABLE_BACKOFF_MAX_SECONDS = 1.0
#: How long the flusher waits for more outcomes before a statement while the
#: worker is busy (its claims come back full), seconds.
LINGER_SECONDS = 0.05
#: At a trickle (claims come back short), the least time between two statements
#: of the flusher, seconds; an outcome after a quieter spell is written at once.
#: A longer time writes fewer, fuller acks (each ack's round trip costs the
#: database several times one row) and leaves a delivered job ``running`` that
#: much longer; it is not in ``receipts_time_to_receipt_seconds``, which ends at
#: the provider's answer (bench/README.md, "Fewer worker statements at a trickle").
TRICKLE_LINGER_SECONDS = 0.25
#: At a trickle, how long an ack waits for the worker's next claim to carry it
#: (a riding ack: one statement where there were two), seconds; then it is
#: written on its own. Only while the worker's claims come at least this often
#: (their moving average; at 50 orders/s over 4 pods, about 3.5 a second), so
#: that the wait is likely to pay; a pod whose work stops writes its last acks
#: this long after their answers (bench/README.md, "Acks that ride on the next
#: claim").
RIDE_SECONDS = 0.5
#: The weight of each new gap between two claims in their moving average (whether
#: acks wait for a claim at all: ``Completer._claims_often``).
CLAIM_GAP_WEIGHT = 0.2
#: How long the durability watch waits, while writes wait for a proof, for an
#: ack to carry the WAL positions back before it reads them with a statement of
#: its own, seconds (the WAL writer flushes every 200 ms by default). Longer
#: than the trickle linger, so a worker acking steadily needs no reads.
WATCH_INTERVAL_SECONDS = 0.5
#: A refused write whose claim was sent less than the lease minus this long ago
#: was refused while its lease still held (clocks of the two hosts may run at
#: slightly different rates), seconds.
LEASE_CLOCK_MARGIN_SECONDS = 1.0


@dataclass(slots=True)
class _Pending(Generic[T]):
    item: T
    attempt: Attempt
    rewrite: bool = False  # written again after a database crash undid it
    grounded: bool = False  # a claim that carried it failed: the flusher writes it
    uncertain: bool = False  # ...and that claim may have landed: ask first
    written_at: float = 0.0  # time.monotonic() when its landed write was sent
    handed_at: float = 0.0  # time.monotonic() when the outcome was handed in


class _Lane(Generic[T, R]):
    """Pending writes of one kind and the statement that writes a batch of them."""

    def __init__(self, name: str, write: Callable[[list[T]], Awaitable[dict[uuid.UUID, Any]]],
                 lost: R) -> None:
        self.name = name
        self.write = write
        self.lost = lost  # the result of a write that was given up
        self.pending: list[_Pending[T]] = []


class Completer:
    """Coalesce and write attempt outcomes (see the module doc).

    Args:
        queue: the :class:`~receipts.jobqueue.JobQueue` (or a fake): ``ack``, ``reschedule``.
        metrics: the process's :class:`Metrics`.
        lease_seconds: the lease length, seconds (bounds write retries).
        max_batch: most attempts of one kind in one statement.
        linger_seconds: how long the flusher waits for more outcomes before a
            statement that is not full while the worker is busy, seconds (0:
            write at once, at a trickle too).
        trickle_linger_seconds: the least time between two statements of the
            flusher while the worker is not busy, seconds (see :attr:`busy`).
        watch_durability: the queue's sessions commit asynchronously: count a
            landed write only once it is proven durable, and tell writes a
            database crash undid from stale ones (see the module doc).
        watch_interval_seconds: while writes wait for a proof, how long the
            watch waits for an ack to carry the WAL positions before it reads
            them itself, seconds.
        worker: who this process is in attempt records (pod or host name).
        ride_seconds: at a trickle, how long an ack waits for a claim to carry
            it (:meth:`carried_by`), seconds; 0, or a queue without
            ``carries_acks``: every ack is a statement of its own.
    """

    def __init__(self, queue: WorkerQueue, metrics: Metrics, *, lease_seconds: float,
                 max_batch: int = 500, linger_seconds: float = LINGER_SECONDS,
                 trickle_linger_seconds: float = TRICKLE_LINGER_SECONDS,
                 watch_durability: bool = False,
                 watch_interval_seconds: float = WATCH_INTERVAL_SECONDS,
                 worker: str = "", ride_seconds: float = RIDE_SECONDS) -> None:
        self.queue = queue
        self.metrics = metrics
        self.lease_seconds = lease_seconds
        self.max_batch = max_batch
        self.linger_seconds = linger_seconds
        self.trickle_linger_seconds = trickle_linger_seconds
        self.worker = worker
        self.ride_seconds = ride_seconds
        self._riding = ride_seconds > 0 and bool(getattr(queue, "carries_acks", False))
        self._riders_out = 0  # claims in flight that carry acks
        self._last_claim = -1e9  # time.monotonic() when carried_by last ran a claim
        self._claim_gap = 0.0  # moving average of the seconds between claims (0: unknown)
        self._acks: _Lane[Attempt, bool] = _Lane("ack", self._write_acks, False)
        self._reschedules: _Lane[Reschedule, JobState | None] = _Lane(
            "reschedule", self._write_reschedules, None)
        self._records: list[AttemptRecord] = []
        self._wake = asyncio.Event()
        self._full = asyncio.Event()  # a full batch waits (or a close): stop lingering
        self._room = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self.healthy = True
        #: ``time.monotonic()`` when the statement in flight started (None: idle).
        self.busy_since: float | None = None
        #: Outcomes handed in and not yet settled (pending and in flight).
        self.backlog = 0
        self._busy = True
        self._last_write = -1e9  # time.monotonic() when the last statements began
        # time.monotonic() until which the flusher lingers now (-inf: not lingering); an
        # outcome handed in meanwhile that may not be held that long ends the linger.
        self._linger_until = -math.inf
        self._acked = 0  # acks accounted since receipts_acks_total was last increased
        self._watch: CommitWatch[tuple[_Lane[Any, Any], _Pending[Any], Any]] | None = (
            CommitWatch() if watch_durability else None)
        self.watch_interval_seconds = watch_interval_seconds
        self._watch_wake = asyncio.Event()
        self._watch_task: asyncio.Task[None] | None = None
        self._carried: WalPosition | None = None  # the last ack's WAL positions, not yet read
        self._carried_at = -1e9  # time.monotonic() when an ack last carried them
        # Unproven writes whose rows could not be asked about yet (the database was down).
        self._recheck: list[tuple[_Lane[Any, Any], _Pending[Any], Any]] = []

    @property
    def busy(self) -> bool:
        """Whether the flusher lingers: True while the queue keeps the worker busy.

        Set by the worker after every claim (a full claim: busy). When not
        busy, an outcome is written at once unless the previous statement began
        less than ``trickle_linger_seconds`` ago (then it waits for the rest of
        that time, with whatever else arrives): at most one statement per kind
        per trickle linger; an ack may instead wait for a claim to carry it
        (:meth:`_linger`, :meth:`carried_by`). The last of a backlog is written at once:
        turning busy off ends a linger in progress.
        """
        return self._busy

    @busy.setter
    def busy(self, value: bool) -> None:
        if self._busy and not value:
            self._full.set()
        self._busy = value

    def start(self) -> None:
        """Start the flusher task, and the durability watch when on (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="completer")
        if self._watch is not None and self._watch_task is None:
            self._watch_task = asyncio.create_task(self._watch_run(), name="durability-watch")

    @property
    def unproven(self) -> int:
        """Landed writes not yet proven durable, so not counted yet (0 without the watch)."""
        return len(self._watch) if self._watch is not None else 0

    def ack(self, attempt: Attempt) -> None:
        """Hand in a delivered *attempt*: it is written (or given up) in the background."""
        self._submit(self._acks, attempt, attempt)

    def reschedule(self, item: Reschedule) -> None:
        """Hand in a failed attempt: written back as ready (after its delay) or failed."""
        self._submit(self._reschedules, item, item.attempt)

    def record(self, record: AttemptRecord) -> None:
        """Queue *record* for the job's attempt history (written after the outcomes)."""
        self._records.append(record)
        self._wake.set()

    def _submit(self, lane: _Lane[T, R], item: T, attempt: Attempt) -> None:
        pending = _Pending(item, attempt, handed_at=time.monotonic())
        lane.pending.append(pending)
        self.backlog += 1
        self._wake.set()
        if len(lane.pending) >= self.max_batch or self._held_until(pending) < self._linger_until:
            # A full batch, or an outcome whose lease cannot wait out the linger in
            # progress (set for the outcomes before it): the flusher decides anew.
            self._full.set()

    async def wait_for_room(self, limit: int) -> None:
        """Return once fewer than *limit* outcomes wait to be settled."""
        while self.backlog >= limit:
            self._room.clear()
            await self._room.wait()

    def _settled(self, n: int) -> None:
        self.backlog -= n
        self._room.set()

    async def close(self, timeout_seconds: float) -> None:
        """Flush what is pending (for at most *timeout_seconds*), then stop.

        With the durability watch, landed writes are proven in the same time;
        those still unproven at the end are counted as written (they were).
        """
        deadline = time.monotonic() + timeout_seconds
        self._closing = True
        self._wake.set()
        self._full.set()
        self._watch_wake.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_seconds)
        except TimeoutError:
            self._task.cancel()
            log.warning("writes_abandoned", extra={"pending": self.backlog})
        if self._watch_task is None or self._watch is None:
            return
        self._watch_wake.set()  # the flusher is done: the watch may end once it is empty
        try:
            await asyncio.wait_for(asyncio.shield(self._watch_task),
                                   max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self._watch_task.cancel()
        left = self._watch.release()
        if left:
            log.info("writes_unproven", extra={"count": len(left)})
        for _lane, pending, result in [*left, *self._recheck]:
            self._account(pending, result)
        self._publish_acks()

    @property
    def _lanes(self) -> tuple[_Lane[Any, Any], ...]:
        return (self._acks, self._reschedules)

    def _waiting(self) -> int:
        return len(self._acks.pending) + len(self._reschedules.pending)

    async def _run(self) -> None:
        while True:
            if not self._records and not self._waiting():
                if self._closing and not self._riders_out:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            linger = self._linger()
            if linger > 0:
                # Let more outcomes arrive (one statement for dozens of them),
                # but not past a full batch or a close.
                self._full.clear()
                self._linger_until = time.monotonic() + linger
                try:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._full.wait(), linger)
                finally:
                    self._linger_until = -math.inf
                if self._riding and not self._busy:
                    # A claim may have carried the acks meanwhile: what is left
                    # decides anew (its deadlines are absolute, so this ends).
                    continue
            self._last_write = time.monotonic()
            for lane in self._lanes:
                if lane.pending:
                    await self._flush(lane, self._take(lane))
            if self._records:
                await self._write_records()

    def _take(self, lane: _Lane[T, R]) -> list[_Pending[T]]:
        """The next batch of *lane*: up to ``max_batch`` items, one per job.

        A statement's answer names the jobs it wrote, not the tokens, so two
        attempts of one job in one statement (a late one and the current one,
        or a write a crash undid beside the job's next attempt) would both
        read as written. The second waits for the next statement.
        """
        batch: list[_Pending[T]] = []
        seen: set[uuid.UUID] = set()
        rest: list[_Pending[T]] = []
        for p in lane.pending:
            if len(batch) < self.max_batch and p.attempt.job.id not in seen:
                seen.add(p.attempt.job.id)
                batch.append(p)
            else:
                rest.append(p)
        lane.pending = rest
        return batch

    def _linger(self) -> float:
        """How long to wait for more outcomes before the next statement, seconds.

        Busy (claims come back full): ``linger_seconds``. A trickle: whatever is
        left of ``trickle_linger_seconds`` since the previous statement began,
        so an outcome after a quiet spell is written at once while a steady
        trickle (more than one outcome per linger) shares one statement per
        linger instead of one per outcome. Acks alone, while the worker claims
        at least every ``ride_seconds`` (:meth:`_claims_often`): until the
        oldest has waited ``ride_seconds`` for a claim to carry it. Never past
        a full batch or a close, not at all at a trickle for acks a failed
        claim gave back, and never past half the lease time any waiting attempt had left
        when it was handed in (:meth:`_lease_cap`): a short lease with a small
        margin must not see its ack arrive late.
        """
        if self.linger_seconds <= 0 or self._closing or self._waiting() >= self.max_batch:
            return 0.0
        now = time.monotonic()
        if self._busy:
            left = self.linger_seconds
        else:
            if self._grounded():
                return 0.0
            left = self._last_write + self.trickle_linger_seconds - now
            if self._riding and self._acks.pending and not self._reschedules.pending \
                    and self._claims_often():
                # Acks alone: the oldest waits up to ride_seconds for a claim to carry it.
                left = max(left, self._acks.pending[0].handed_at + self.ride_seconds - now)
        return min(left, self._lease_cap() - now)

    def _lease_cap(self) -> float:
        """The latest ``time.monotonic()`` the waiting outcomes may be held to: the
        earliest :meth:`_held_until` of them (``inf`` when none waits)."""
        cap = math.inf
        for lane in self._lanes:
            for p in lane.pending:
                cap = min(cap, self._held_until(p))
        return cap

    def _held_until(self, p: _Pending[Any]) -> float:
        """The latest ``time.monotonic()`` *p* may wait to be written: halfway from its
        hand-in to its lease's end as this process counts it (the claim's send plus
        the lease)."""
        end = p.attempt.lease_start + self.lease_seconds
        return p.handed_at + (end - p.handed_at) / 2

    def _claims_often(self) -> bool:
        """Whether the worker's recent claims came at least every ``ride_seconds``
        (a moving average of the gaps between them), so an ack waiting for the next
        one is likely to ride: a pod claiming once a second or less (a slow trickle,
        PgBouncer's polling) would only make its acks wait."""
        return 0 < self._claim_gap <= self.ride_seconds

    async def _write_records(self) -> None:
        """Write the queued attempt records in one statement; best effort.

        The history is for review, not for correctness: a failed write is
        logged and counted, and its records are dropped rather than retried
        ahead of acks.
        """
        records = self._records[: self.max_batch]
        del self._records[: len(records)]
        try:
            start = time.perf_counter()
            await self.queue.record_attempts(records)
            self.metrics.statement_duration.labels("record_attempts").observe(
                time.perf_counter() - start)
        except QueueError as exc:
            self.metrics.db_errors.labels("record_attempts").inc()
            log.warning("attempts_not_recorded", extra={"count": len(records),
                                                         "error": str(exc)})

    async def _flush(self, lane: _Lane[T, R], batch: list[_Pending[T]]) -> None:
        """Write *batch*, retrying while its leases may still hold; settle every item.

        Items a failed claim carried (``uncertain``) are asked about first
        (``resolve_writes``), like any write whose answer was lost.
        """
        size = len(batch)
        carried = [p for p in batch if p.uncertain]
        try:
            if carried:
                await self._write_batch(lane, carried, uncertain=True)
                batch = [p for p in batch if not p.uncertain]
            await self._write_batch(lane, batch)
        finally:
            self._settled(size)
            self._publish_acks()

    def _grounded(self) -> bool:
        """Whether a failed claim gave acks back: the flusher writes them at once, on
        their own (a claim failing for its acks' sake must not keep failing)."""
        return any(p.grounded for p in self._acks.pending)

    async def carried_by(self, claim: Callable[[list[tuple[uuid.UUID, uuid.UUID]]],
                                               Awaitable[ClaimResult]]) -> ClaimResult:
        """Run *claim* (the worker's next claim), letting it carry the pending acks.

        *claim* is called with the (job id, token) pairs of up to ``max_batch``
        pending acks (an empty list when none may ride: none pending, the
        worker busy, a close, or riding off) and must return the
        :class:`~receipts.model.ClaimResult` of one statement that wrote them
        (:meth:`receipts.jobqueue.JobQueue.claim`'s ``acks``): its ``acked``
        names the jobs done, and its WAL positions serve the durability watch
        as an ack's do. The acks are then accounted as if the flusher had
        written them. When *claim* raises, they go back to the flusher, to be
        asked about first (``resolve_writes``) where the statement may have
        committed (``DatabaseUnavailable``, a cancellation), and the exception
        propagates. Only while not :attr:`busy`: a full claim's cycle stays as
        it was (bench/README.md, "Acks that ride on the next claim").
        """
        now = time.monotonic()
        if self._last_claim > 0:
            gap = now - self._last_claim
            self._claim_gap = gap if self._claim_gap <= 0 else (
                self._claim_gap + CLAIM_GAP_WEIGHT * (gap - self._claim_gap))
        self._last_claim = now
        if (not self._riding or self._busy or self._closing or not self._acks.pending
                or self._grounded()):
            return await claim([])
        batch = self._take(self._acks)
        self._riders_out += 1
        sent_at = time.monotonic()
        try:
            result = await claim([(p.attempt.job.id, p.attempt.job.token) for p in batch])
        except BaseException as exc:
            uncertain = isinstance(exc, DatabaseUnavailable) or not isinstance(exc, QueueError)
            for p in batch:
                p.grounded = True
                p.uncertain = p.uncertain or uncertain
            self._acks.pending[:0] = batch
            self._full.set()  # no more waiting for a claim: the flusher writes them now
            raise
        finally:
            self._riders_out -= 1
            self._wake.set()
        returned_at = time.monotonic()
        acked = result.acked if result.acked is not None else set()
        self._observe_carried(sent_at, getattr(acked, "position", None))
        try:
            for p in batch:
                self._landed(self._acks, p, p.attempt.job.id in acked, sent_at, returned_at)
        finally:
            self._settled(len(batch))
            self._publish_acks()
        return result

    def _publish_acks(self) -> None:
        if self._acked:
            self.metrics.acks.inc(self._acked)  # once per batch, not per job
            self._acked = 0

    async def _write_batch(self, lane: _Lane[T, R], batch: list[_Pending[T]], *,
                           uncertain: bool = False) -> None:
        """Write *batch* (*uncertain*: an earlier statement carrying it may have landed)."""
        backoff = BACKOFF_FIRST_SECONDS
        while batch:
            try:
                if uncertain:
                    self.busy_since = time.monotonic()
                    batch = await self._settle_landed(lane, batch)
                    uncertain = False
                    # Known not to have landed: those past their lease are lost now.
                    batch = self._drop_expired(lane, batch)
                    if not batch:
                        return
                start = time.perf_counter()
                self.busy_since = sent_at = time.monotonic()
                written = await lane.write([p.item for p in batch])
                returned_at = time.monotonic()
                took = time.perf_counter() - start
                self._observe_carried(sent_at, self._carried)
                self._carried = None
                self.metrics.statement_duration.labels(lane.name).observe(took)
                self.busy_since = None
                self.healthy = True
            except QueueError as exc:
                self.busy_since = None
                self.healthy = False
                uncertain = uncertain or isinstance(exc, DatabaseUnavailable)
                self.metrics.db_errors.labels(lane.name).inc()
                if not uncertain:
                    # A write that surely did not land is not retried past its lease.
                    # One that may have landed is kept until resolve_writes says, even
                    # past the lease: its outcome must be counted as it happened.
                    batch = self._drop_expired(lane, batch)
                log.warning("write_failed", extra={"statement": lane.name, "error": str(exc),
                                                   "retrying": len(batch)})
                if batch:
                    await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                    cap = (UNAVAILABLE_BACKOFF_MAX_SECONDS
                           if isinstance(exc, DatabaseUnavailable) else BACKOFF_MAX_SECONDS)
                    backoff = min(backoff * 2, cap)
                continue
            lost = lane.lost
            for p in batch:
                self._landed(lane, p, written.get(p.attempt.job.id, lost), sent_at, returned_at)
            return

    def _landed(self, lane: _Lane[T, R], pending: _Pending[T], result: Any,
                sent_at: float, returned_at: float) -> None:
        """Account a written item now, or, when the write landed and the watch is on,
        once it is proven durable."""
        if self._watch is not None and result:
            pending.written_at = sent_at
            self._watch.hold((lane, pending, result), sent_at=sent_at, returned_at=returned_at,
                             now=returned_at)
            self._watch_wake.set()
            return
        self._account(pending, result)

    async def _settle_landed(self, lane: _Lane[T, R], batch: list[_Pending[T]]
                             ) -> list[_Pending[T]]:
        """Settle the items whose earlier, unanswered write did land; return the others.

        Raises the queue's errors (the caller retries the whole batch).
        """
        sent_at = time.monotonic()
        landed = await self.queue.resolve_writes(
            [(p.attempt.job.id, p.attempt.job.token) for p in batch])
        returned_at = time.monotonic()
        if landed:
            log.info("write_confirmed", extra={"statement": lane.name, "count": len(landed)})
        rest = []
        for p in batch:
            state = landed.get(p.attempt.job.id)
            if state is None:
                rest.append(p)
                continue
            self._landed(lane, p, True if isinstance(p.item, Attempt) else state,
                         sent_at, returned_at)
        return rest

    # ------------------------------------------------------- durability watch

    async def _watch_run(self) -> None:
        """Read the WAL positions while landed writes wait for a proof; settle them."""
        assert self._watch is not None
        watch = self._watch
        while True:
            if not watch and not self._recheck:
                if self._closing and (self._task is None or self._task.done()):
                    return
                self._watch_wake.clear()
                await self._watch_wake.wait()
                continue
            # Closing: read more often (the WAL writer flushes on its own schedule).
            interval = self.watch_interval_seconds / (5 if self._closing else 1)
            await asyncio.sleep(interval)
            if (not self._closing and not self._recheck
                    and time.monotonic() - self._carried_at < interval):
                continue  # an ack carried the positions meanwhile: no read of our own
            read_at = time.monotonic()
            try:
                position = await self.queue.wal_position()
            except QueueError as exc:
                log.debug("wal_position_failed", extra={"error": str(exc)})
                await asyncio.sleep(self.watch_interval_seconds)
                continue
            durable, unproven = watch.observe(position, read_at=read_at, now=time.monotonic())
            for _lane, pending, result in durable:
                self._account(pending, result)
            self._publish_acks()
            unproven += self._recheck
            self._recheck = []
            if unproven:
                await self._check_unproven(unproven)

    def _observe_carried(self, read_at: float, position: WalPosition | None) -> None:
        """Take the WAL *position* an ack (or a claim carrying acks) just brought
        back, from a statement sent at *read_at*.

        Held writes they prove are counted now; writes they cannot prove (the
        ack ran on a younger connection) are asked about by the watch.
        """
        if position is None or self._watch is None:
            return
        self._carried_at = time.monotonic()
        if not self._watch:
            return
        durable, unproven = self._watch.observe(position, read_at=read_at, now=self._carried_at)
        for _lane, pending, result in durable:
            self._account(pending, result)
        if unproven:
            self._recheck += unproven
            self._watch_wake.set()

    async def _check_unproven(self, items: list[tuple[_Lane[Any, Any], _Pending[Any], Any]]
                              ) -> None:
        """Ask the rows about writes no read could prove: still there, or undone?

        A write whose row still carries its token is held again (proved by
        later reads); one whose row does not was undone by a crash, and goes
        back to its lane to be written again (the lease guard decides).
        """
        assert self._watch is not None
        # The answer names jobs, not tokens: one question per attempt of a job.
        groups: list[tuple[set[uuid.UUID], list[Any]]] = []
        for item in items:
            job_id = item[1].attempt.job.id
            for ids, group in groups:
                if job_id not in ids:
                    ids.add(job_id)
                    group.append(item)
                    break
            else:
                groups.append(({job_id}, [item]))
        for _, group in groups:
            await self._check_group(group)

    async def _check_group(self, items: list[tuple[_Lane[Any, Any], _Pending[Any], Any]]
                           ) -> None:
        """:meth:`_check_unproven` for attempts of distinct jobs (one statement)."""
        assert self._watch is not None
        sent_at = time.monotonic()
        try:
            there = await self.queue.resolve_writes(
                [(p.attempt.job.id, p.attempt.job.token) for _, p, _ in items])
        except QueueError as exc:
            log.debug("resolve_failed", extra={"error": str(exc)})
            self._recheck += items  # asked again after the next read
            return
        returned_at = time.monotonic()
        for lane, pending, result in items:
            if pending.attempt.job.id in there:
                self._watch.hold((lane, pending, result), sent_at=sent_at,
                                 returned_at=returned_at, now=returned_at)
                continue
            if self.queue.last_failure_at < pending.written_at:
                # No connection failed since the write: no crash undid it. A later
                # attempt wrote the row since (its token replaced ours): ours landed.
                self._account(pending, result)
                continue
            log.warning("write_undone", extra={**job_fields(pending.attempt.job, "undone"),
                                               "statement": lane.name, "then": "rewrite"})
            pending.rewrite = True
            lane.pending.append(pending)
            self.backlog += 1
            self._wake.set()

    def _drop_expired(self, lane: _Lane[T, R], batch: list[_Pending[T]]) -> list[_Pending[T]]:
        """Give up the items whose lease has certainly expired; return the rest."""
        now = time.monotonic()
        keep = []
        for p in batch:
            if now - p.attempt.claimed_at > self.lease_seconds:
                self.metrics.leases_lost.inc()
                log.warning("lease_lost",
                            extra={**job_fields(p.attempt.job, "write_unconfirmed"),
                                   "statement": lane.name})
            else:
                keep.append(p)
        return keep

    # ------------------------------------------------------------ the writes

    async def _write_acks(self, attempts: list[Attempt]) -> dict[uuid.UUID, Any]:
        done = await self.queue.ack([(a.job.id, a.job.token) for a in attempts])
        self._carried = getattr(done, "position", None)
        return {job_id: True for job_id in done}

    async def _write_reschedules(self, items: list[Reschedule]) -> dict[uuid.UUID, Any]:
        return dict(await self.queue.reschedule(items))

    # ------------------------------------------------------------ accounting

    def _account(self, pending: _Pending[Any], result: object) -> None:
        item, job = pending.item, pending.attempt.job
        if isinstance(item, Attempt):
            if result:
                if pending.rewrite:
                    self.metrics.writes_rewritten.labels("ack").inc()
                self._acked += 1
                if log.isEnabledFor(logging.DEBUG):  # skip building the fields at INFO
                    log.debug("delivered", extra=job_fields(job, Reason.DELIVERED))
                if item.enqueued_age_seconds is not None:
                    # Enqueue -> the provider's answer: the linger, the ack and its
                    # proof are the worker's bookkeeping, not the customer's wait.
                    age = item.enqueued_age_seconds + pending.handed_at - item.claimed_at
                    self.metrics.time_to_receipt.observe(age)
                return
            if self._undone(pending, "ack"):
                return
            self._stale()
            log.warning("stale_ack", extra=job_fields(job, "stale"))
            return
        assert isinstance(item, Reschedule)
        outcome = item.outcome
        fields = {**job_fields(job, outcome.reason), "status": outcome.status,
                  "error": outcome.detail or str(outcome.reason)}
        if result is not None and pending.rewrite:
            self.metrics.writes_rewritten.labels("reschedule").inc()
        if result is None:
            if self._undone(pending, "reschedule"):
                return
            self._stale()
            log.warning("stale_reschedule", extra=fields)
        elif item.unsent:  # claimed ahead, given back unsent: no attempt was made
            self.metrics.claims_returned.inc()
        elif result is JobState.FAILED:
            permanent = outcome.verdict is Verdict.PERMANENT
            reason = outcome.reason if permanent else Reason.MAX_ATTEMPTS
            self.metrics.failures.labels(reason).inc()
            log.warning("job_failed", extra={**fields, "failure": str(reason)})
        else:
            self.metrics.retries.labels(outcome.reason).inc()
            log.info("job_retry", extra={**fields, "delay_seconds": round(item.delay_seconds, 3),
                                         "refund": item.refund})

    def _undone(self, pending: _Pending[Any], statement: str) -> bool:
        """Count a refused write as undone by a database crash when it was; True if so.

        Only with asynchronous commits (the watch on). Nothing but a crash
        takes a token away while its lease holds (less than the lease since
        the claim was sent), so a write refused within the lease lost its
        claim to a crash (``claim``) when it is the rewrite of a write the
        crash undid, or when a statement failed for its connection since the
        claim was sent (a crash ends every connection). A rewrite refused
        after that is counted as its own ``statement`` (the claim may have
        survived and the lease run out meanwhile). Anything else is a stale
        write.
        """
        if self._watch is None:
            return False
        attempt = pending.attempt
        sent = attempt.claim_sent_at
        within_lease = (sent is not None and time.monotonic() - sent
                        < self.lease_seconds - LEASE_CLOCK_MARGIN_SECONDS)
        if within_lease and (pending.rewrite or self.queue.last_failure_at > (sent or 0.0)):
            what = "claim"
        elif pending.rewrite:
            what = statement
        else:
            return False
        self.metrics.writes_undone.labels(what).inc()
        log.warning("write_undone", extra={**job_fields(attempt.job, "undone"),
                                           "statement": statement, "undone": what})
        if what == "claim":
            item = pending.item
            outcome = item.outcome if isinstance(item, Reschedule) else None
            self.record(AttemptRecord(
                job_id=attempt.job.id, attempt=attempt.job.attempt,
                reason=outcome.reason if outcome else Reason.DELIVERED,
                status=outcome.status if outcome else None, error=UNDONE_CLAIM,
                worker=self.worker))
        return True

    def _stale(self) -> None:
        # The guard refused the write: our lease expired (and maybe a newer
        # attempt holds the row). The row was left untouched; the lease was lost.
        self.metrics.stale_acks.inc()
        self.metrics.leases_lost.inc()

