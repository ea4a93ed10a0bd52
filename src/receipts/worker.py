"""The worker loop: claim only for free slots, deliver, hand the outcome on.

Shape (docs/design.md §4, §11):

* ``concurrency`` delivery slots. The claim loop claims at most the number of
  free slots (capped at ``claim_batch_max``) and only when one is free, so a
  claimed job starts its delivery at once; the one exception is the prefetch.
* Prefetch (claiming ahead): while the queue has work, a claim also takes the
  jobs that the slots will free during the next claim's round trip (about
  ``2 × limit × claim round trip ÷ delivery round trip``, at most half of
  the limit), held in a short local queue and sent the moment a slot frees.
  Without it every slot idled for a claim's round trip between two
  deliveries: one pod kept 0.73 of its slots busy against a 50 ms provider
  (bench/README.md). A prefetched job's lease ticks while it waits, so it
  waits at most ``PREFETCH_MAX_WAIT_SECONDS``, and never so long that a
  delivery started then could outlast the lease's room for it (lease minus
  margin minus delivery timeout: :meth:`Worker.prefetch_max_wait`); a pause, a
  stop or a longer wait gives it back unsent, with its attempt (no attempt was
  made).
* One statement per pool connection borrow; no connection is held across a
  provider call. Outcome writes (acks and reschedules) are handed to the
  :class:`~receipts.completion.Completer`, which coalesces them; a slot is
  free again as soon as its delivery's outcome is known, not when the write
  lands. While writes fall behind by a whole set of slots, nothing new is
  claimed.
* A short claim means the queue looked empty: sleep a jittered poll interval,
  cut short by a wake-up on the pod's LISTEN session (:mod:`receipts.waker`:
  one extra direct connection, off behind PgBouncer transaction pooling; the
  fleet's elected waker notifies when new due work appears). While a waker is
  heard the poll is ``WAKER_POLL_FACTOR`` times longer. Polling is always the
  safety net.
* Provider flow control: every claim reads the fleet-wide pause; while it
  holds, the pod sleeps until the next probe is due (every few seconds,
  however long the pause) or the pause ends, holding no connection and no
  lock. One pod wins the probe and claims a few jobs (``probe_jobs``, at
  most its free slots); an acceptance resumes the fleet, a probe entirely
  failed or rejected doubles the pause. Outcomes feed the
  :class:`~receipts.flow.ProviderGate` through its shell
  (:class:`~receipts.gate.GateShell`), which may extend the pause (outage,
  systemic rejection, 401/403, ``Retry-After``) and judges a 4xx on evidence
  (acceptances of other jobs around it), holding it (the job's lease, not
  its slot) meanwhile. Under a fleet-wide rate limit a claim
  charges the pod's own token bucket at its announced share
  (:mod:`receipts.ratelimit`; the shared bucket row when no share is
  known), and a claim that ran out of tokens sleeps until the next ones.
* Claims start at the waker's watermark (:meth:`Wakeups.claim_bound`), not
  at the ready index's first entry.
* Adaptive concurrency (off by default, ``RECEIPTS_ADAPTIVE_CONCURRENCY``): a
  claim takes no more than ``min(slots, limit) - in flight``, the limit an
  AIMD rule adapts to the provider's answers (:mod:`receipts.capacity`),
  started at the fleet's mean limit from the heartbeat rows. It sits beside
  the rate limit, ``Retry-After`` and the pause, and replaces none of them.
* Admission control (off by default, ``RECEIPTS_ADMISSION_CONTROL``): claims
  also spend a local token bucket whose rate an AIMD limiter adapts to the
  latency of a small durable commit (the commit probe),
  so a drain leaves the checkout database its headroom
  (:mod:`receipts.admission`).
* Database outage: the loop backs off (jittered; ≤ 1 s while the database
  cannot be reached, ≤ 30 s after an error in a statement), ``/readyz`` says
  not ready, and it resumes by itself within seconds of the database's return.
* Stop: claim nothing more, let in-flight deliveries finish for up to
  ``min(shutdown_grace_seconds, delivery_timeout_seconds)``, abandon the rest
  (their leases expire and recovery returns them), flush the completer,
  return.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import random
import socket
import time
from collections.abc import Iterable
from datetime import datetime

from receipts.admission import AdmissionController, AdmissionPolicy
from receipts.capacity import CapacityPolicy, ConcurrencyLimit
from receipts.completion import Completer
from receipts.db import commits_asynchronously, statement_deadline
from receipts.delivery import Deliverer
from receipts.errors import DatabaseUnavailable, QueueError
from receipts.flow import FlowPolicy, ProviderGate
from receipts.gate import GateShell
from receipts.jobqueue import WorkerQueue
from receipts.logs import get_logger, job_fields
from receipts.metrics import Metrics
from receipts.model import (
    Attempt,
    AttemptRecord,
    ClaimResult,
    FlowState,
    Outcome,
    Reason,
    Reschedule,
    Verdict,
)
from receipts.ratelimit import Choice, TokenBucket, choose
from receipts.retry import BackoffPolicy
from receipts.settings import Settings
from receipts.waker import FLEET_POLL_SECONDS, Wakeups

log = get_logger("worker")

STOP_CLAIM_SECONDS = 1.0
#: A paused pod re-reads the fleet's pause this often (one claim that claims nothing).
PAUSE_RECHECK_SECONDS = 5.0
WATCHDOG_SLACK_SECONDS = 10.0
OUTAGE_BACKOFF_FIRST_SECONDS = 0.1
#: With adaptive concurrency: seconds with no acceptance before failures make an outage.
OUTAGE_QUIET_SECONDS = 5.0
#: Backoff cap after a claim the database refused (an error in the statement).
OUTAGE_BACKOFF_MAX_SECONDS = 30.0
#: Backoff cap while the database cannot be reached: each such claim already
#: waited for the pool (its timeout, 5 s), during which the pool's reconnection
#: attempt hands it the first connection the database accepts; a short cap keeps
#: one such wait always pending, so the worker is ready within seconds of the
#: database's return, whatever the outage's length (docs/design.md §4).
UNAVAILABLE_BACKOFF_MAX_SECONDS = 1.0
#: While the queue has work and deliveries are in flight, the claim loop waits
#: up to this long (seconds) for a tenth of the slots to be free before it claims.
CLAIM_LINGER_SECONDS = 0.005
#: A job claimed ahead (the prefetch) is given back unsent after waiting this long
#: for a slot, seconds: its lease ticks meanwhile, and a slot frees within a
#: delivery's round trip while the provider answers.
PREFETCH_MAX_WAIT_SECONDS = 1.0
#: Nothing is claimed ahead when the lease leaves a job less than this long (seconds)
#: to wait for a slot (:meth:`Worker.prefetch_max_wait`): it would go back unsent.
PREFETCH_MIN_WAIT_SECONDS = 0.01
#: Weight of the newest sample in the round-trip averages the prefetch depth uses.
PREFETCH_EWMA_WEIGHT = 0.1
#: The most jobs held claimed ahead, as a share of the limit on deliveries in flight
#: (0 turns the prefetch off).
PREFETCH_MAX_SHARE = 0.5
#: Below this many deliveries ending per claim round trip (× 2), nothing is claimed
#: ahead: a slot frees too seldom for a job to wait for it in memory.
PREFETCH_MIN_AHEAD = 0.1
#: While the fleet's waker is heard, an idle pod polls this many times less often
#: (the waker wakes it on new due work; polling stays the safety net), so an idle
#: fleet's polls do not add up with its pod count (docs/design.md §4).
WAKER_POLL_FACTOR = 5.0


def admission_policy(settings: Settings) -> AdmissionPolicy:
    """The :class:`AdmissionPolicy` the settings describe."""
    return AdmissionPolicy(min_rate=settings.admission_min_rate_per_second,
                           max_rate=settings.admission_max_rate_per_second)


def capacity_policy(settings: Settings) -> CapacityPolicy:
    """The :class:`CapacityPolicy` the settings describe: the ceiling is also the slots
    (a limit above them could never be reached, so never measured)."""
    ceiling = min(settings.adaptive_concurrency_ceiling, settings.concurrency)
    return CapacityPolicy(floor=min(settings.adaptive_concurrency_floor, ceiling),
                          ceiling=ceiling)


def flow_policy(settings: Settings) -> FlowPolicy:
    """The :class:`FlowPolicy` the settings describe."""
    return FlowPolicy(
        window_seconds=settings.outage_window_seconds,
        min_jobs=settings.outage_min_jobs,
        failure_ratio=settings.outage_failure_ratio,
        outage_pause_seconds=settings.outage_pause_seconds,
        auth_pause_seconds=settings.auth_pause_seconds,
        pause_max_seconds=settings.pause_max_seconds,
        retry_after_max_seconds=settings.retry_after_max_seconds,
        # With adaptive concurrency an overloaded provider that still accepts some
        # requests is the limit's to answer, not the outage pause's.
        outage_quiet_seconds=OUTAGE_QUIET_SECONDS if settings.adaptive_concurrency else None,
    )


class Worker:
    """One worker process's delivery loop.

    Args:
        settings: validated :class:`Settings` (slots, lease, timeouts, backoff).
        queue: the :class:`~receipts.jobqueue.JobQueue` (an open pool inside), or
            anything with the same statements (:class:`~receipts.jobqueue.WorkerQueue`).
        deliverer: what delivers a job (normally :class:`receipts.delivery.HttpDeliverer`).
        metrics: the process's :class:`Metrics`.
        gate: the provider gate (defaults to one built from the settings).
    """

    def __init__(self, settings: Settings, queue: WorkerQueue, deliverer: Deliverer,
                 metrics: Metrics, *, gate: ProviderGate | None = None) -> None:
        self.settings = settings
        self.queue = queue
        self.deliverer = deliverer
        self.metrics = metrics
        self.policy = BackoffPolicy(
            base_seconds=settings.retry_base_seconds,
            cap_seconds=settings.retry_cap_seconds,
            retry_after_max_seconds=settings.retry_after_max_seconds,
        )
        self.admission = AdmissionController(admission_policy(settings)) if (
            settings.admission_control) else None
        #: Adaptive concurrency (RECEIPTS_ADAPTIVE_CONCURRENCY): the AIMD limit on
        #: deliveries in flight; None when off (the slots alone bound them). It
        #: starts at the floor; :meth:`run` moves it to the fleet's mean first.
        self.capacity = ConcurrencyLimit(capacity_policy(settings)) if (
            settings.adaptive_concurrency) else None
        #: The live pods heard through the heartbeat rows, this one included
        #: (:meth:`capacity_peers` when no waker announcement is fresh).
        self.fleet_heard = 1
        self.completer = Completer(queue, metrics, lease_seconds=settings.lease_seconds,
                                   watch_durability=commits_asynchronously(settings, "worker"),
                                   worker=socket.gethostname()[:100])
        self.gate = gate or ProviderGate(flow_policy(settings))
        #: The gate's shell: holds rejections, settles them, writes the fleet's pause.
        self.flow = GateShell(self.gate, queue, self.completer, metrics, self.policy,
                              lease_seconds=settings.lease_seconds,
                              lease_margin=settings.lease_margin,
                              delivery_seconds=settings.delivery_timeout_seconds,
                              redeliver=self._confirm)
        self._inflight: set[asyncio.Task[None]] = set()
        #: Jobs claimed ahead, oldest first, waiting for a slot (the prefetch).
        self._prefetched: collections.deque[Attempt] = collections.deque()
        #: Moving averages of a claim statement's and a delivery's round trip, seconds
        #: (0: none seen yet): the prefetch depth's inputs.
        self._claim_seconds = 0.0
        self._delivery_seconds_avg = 0.0
        #: A prefetched job waited its most for a slot: no more claiming ahead
        #: until a delivery ends (the slots are stuck; claiming and giving back
        #: again and again would only churn).
        self._prefetch_stalled = False
        self._slot_freed = asyncio.Event()
        #: Set when at least ``_claim_min`` slots are free.
        self._enough_free = asyncio.Event()
        #: The batch worth lingering for: a tenth of the slots (≥ 1, ≤ the batch cap).
        self._claim_min = max(1, min(settings.claim_batch_max, settings.concurrency // 10))
        self._backlogged = False  # the last claim came back full: the queue has work
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._db_ok = False
        self._unreachable = False  # the last claim failed for want of a connection
        self._busy_since: float | None = None
        #: Monotonic time of the last claim that returned a job (None: none yet);
        #: the heartbeat reports it (:mod:`receipts.heartbeat`).
        self.last_claim_at: float | None = None
        #: True once a stop's drain has finished: deliveries ended or abandoned
        #: and every outcome written or given up (the last ``stopped`` event).
        self.drained = False
        #: Who made an attempt, in its history: the pod (host) name.
        self.name = socket.gethostname()[:100]
        #: Record first-attempt deliveries too (the row itself tells them otherwise).
        self.record_all = settings.attempt_history == "all"
        #: A statement waiting longer than this fails /healthz (seconds).
        self.watchdog_seconds = 2 * statement_deadline(settings) + WATCHDOG_SLACK_SECONDS
        #: The most jobs one claim asked for compared with the slots free then
        #: (tests assert it never exceeds 0).
        self.max_overclaim = 0
        metrics.slots.set(settings.concurrency)
        # Read when scraped: nothing to update per delivery. A held rejection's job,
        # and a job claimed ahead, is still leased to this pod, its outcome not yet
        # written: it counts.
        metrics.inflight.set_function(
            lambda: len(self._inflight) + len(self.flow.held) + len(self._prefetched))
        self._probe_seconds = metrics.statement_duration.labels("commit_probe")
        #: The pod's LISTEN session and its part in the fleet's waker election; None
        #: when it cannot have one (behind PgBouncer, or RECEIPTS_LISTEN_NOTIFY off).
        self.wakeups = Wakeups(settings, metrics, self.wake,
                               tag=getattr(queue, "worker_tag", None),
                               free_slots=self._waker_free_slots,
                               unshared_room=self._waker_unshared_room) if (
            settings.listen_notify and not settings.pgbouncer) else None
        #: This pod's share of the fleet-wide rate limit (rate and capacity set
        #: from the waker's announcement before each use; receipts.ratelimit).
        self.bucket = TokenBucket(max(queue.rate, 1e-9), 1.0)
        #: The waker's pod's last offer before its share of the rate limit cut it,
        #: or None (_waker_free_slots).
        self._unshared_room: int | None = None
        #: receipts_delivery_duration_seconds by outcome, labelled once (labels() locks).
        self._delivery_seconds = {reason: metrics.delivery_duration.labels(reason)
                                  for reason in Reason}

    # ------------------------------------------------------------ state

    @property
    def inflight(self) -> int:
        """Deliveries in progress."""
        return len(self._inflight)

    def capacity_peers(self) -> int:
        """The pods sharing the provider, this one included (≥ 1), for the adaptive
        limit's shared increase: the waker's fresh fleet announcement (each second),
        else the live heartbeat rows that report a limit (every heartbeat)."""
        if self.wakeups is not None and (n := self.wakeups.announced_size()) is not None:
            return n
        return max(1, self.fleet_heard)

    def concurrency_limit(self) -> int | None:
        """The adaptive limit on deliveries in flight now; None when adaptation is off."""
        return None if self.capacity is None else self.capacity.allowed()

    async def join_fleet_limit(self) -> None:
        """Start the adaptive limit at the fleet's mean per-pod limit (the live
        heartbeat rows'), or leave it at the floor when none is known or the
        database does not answer (it is never started at the ceiling)."""
        capacity = self.capacity
        if capacity is None:
            return
        mean: float | None = None
        read = getattr(self.queue, "fleet_concurrency_limit", None)
        if read is not None:
            try:
                mean, count = await read()
                self.fleet_heard = count + 1  # the others, and this pod
            except QueueError as exc:
                log.debug("fleet_limit_unread", extra={"error": str(exc)})
        capacity.join(mean)
        self.metrics.concurrency_limit.set(capacity.allowed())
        self.metrics.concurrency_ceiling.set(capacity.policy.ceiling)
        log.info("concurrency_limit_started", extra={
            "limit": capacity.allowed(), "fleet_mean": None if mean is None else round(mean, 2),
            "ceiling": capacity.policy.ceiling})
        if self.settings.adaptive_concurrency_ceiling < self.settings.concurrency:
            # Slots above the ceiling can never be used: say so once, loudly.
            log.warning("concurrency_ceiling_below_slots", extra={
                "ceiling": self.settings.adaptive_concurrency_ceiling,
                "slots": self.settings.concurrency})
        if self.settings.adaptive_concurrency_floor > min(
                self.settings.concurrency, self.settings.adaptive_concurrency_ceiling):
            # The floor cannot be above what a pod may have in flight: it is lowered to
            # that (capacity_policy), so the floor the operator set does not hold.
            log.warning("concurrency_floor_above_slots", extra={
                "floor": self.settings.adaptive_concurrency_floor,
                "applied": capacity.policy.floor, "slots": self.settings.concurrency})

    def is_ready(self) -> bool:
        """True while the database answered this worker's last statement and it is not wedged."""
        return self._db_ok and self.completer.healthy and self.is_alive()

    def stalled_seconds(self) -> float:
        """How long the claim loop or the completer has waited on one statement, seconds."""
        now = time.monotonic()
        since = [t for t in (self._busy_since, self.completer.busy_since) if t is not None]
        return max((now - t for t in since), default=0.0)

    def is_alive(self) -> bool:
        """False when a statement has hung past the watchdog limit (``/healthz`` fails).

        Every statement has a client-side deadline, so this only trips when
        something below it is wedged; the liveness probe then restarts the pod.
        """
        return self.stalled_seconds() <= self.watchdog_seconds

    def wake(self) -> None:
        """Cut the current poll sleep short (a NOTIFY arrived)."""
        self._wake.set()

    def stop(self) -> None:
        """Ask :meth:`run` to stop claiming and drain (signal-handler safe)."""
        self._stop.set()
        self.flow.closing = True
        self._wake.set()
        self._slot_freed.set()

    def _db_state(self, ok: bool) -> None:
        if ok != self._db_ok:
            log.info("database_ready" if ok else "database_unavailable")
        self._db_ok = ok
        self.metrics.ready.set(1 if ok else 0)

    # ------------------------------------------------------------- loop

    async def run(self) -> None:
        """Claim and deliver until :meth:`stop`, then drain; never raises for outages.

        After :meth:`stop`, a claim statement still waiting on the database
        gets ``STOP_CLAIM_SECONDS`` before it is cancelled (whatever it may
        have committed is left to lease expiry), and the drain waits for it no
        longer than for the deliveries, so a wedged connection cannot hold the
        process past its stop budget (``Settings.stop_budget_seconds`` plus
        this second).
        """
        self.completer.start()
        await self.join_fleet_limit()
        helpers = [asyncio.create_task(self._stats_loop(), name="queue-stats")]
        if self.admission is not None:
            helpers.append(asyncio.create_task(self._admission_loop(), name="commit-probe"))
        if self.wakeups is not None:
            helpers.append(asyncio.create_task(self.wakeups.run(), name="wakeups"))
        else:
            log.info("wakeups_polling", extra={
                "reason": "pgbouncer" if self.settings.pgbouncer else "listen_notify_off",
                "poll_interval_seconds": self.settings.poll_interval_seconds})
        claiming = asyncio.create_task(self._claim_loop(), name="claim-loop")
        stopped = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({claiming, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if claiming.done() and not claiming.cancelled() and claiming.exception():
                log.error("claim_loop_crashed", exc_info=claiming.exception())
            if not claiming.done():
                await asyncio.wait({claiming}, timeout=STOP_CLAIM_SECONDS)
        finally:
            stopped.cancel()
            for task in (claiming, *helpers):
                task.cancel()
            # A cancelled statement may take the driver a few seconds to abandon
            # (it tries to cancel it in the server): wait for that alongside the
            # deliveries, within the same budget, never longer.
            await self._drain(also={claiming, *helpers})

    async def _claim_loop(self) -> None:
        backoff = OUTAGE_BACKOFF_FIRST_SECONDS
        backlog_limit = max(self.settings.concurrency, self.completer.max_batch)
        while not self._stop.is_set():
            self._send_prefetched()
            if self.capacity is not None and (hold := self.capacity.hold_seconds()) > 0:
                # The provider refused a request just now: one round trip without claims.
                await self._sleep(hold, wakeable=False)
                continue
            free = self._claim_room()
            if free <= 0:
                await self._wait_for_slot(self._prefetch_wait_left())
                continue
            if self.completer.backlog >= backlog_limit:
                await self._wait_for_writes(backlog_limit)
                continue
            if free < self._linger_min() and self._backlogged and self._inflight:
                # A claim statement costs the same CPU for 1 job as for 40: let
                # a few more slots free up (at most CLAIM_LINGER_SECONDS).
                await self._gather_slots()
                free = self._claim_room()  # a confirmation may have taken a slot meanwhile
                if free <= 0:
                    continue
            wait = await self.step(free)
            if wait is None:  # the database failed us
                await self._sleep(backoff * random.uniform(0.5, 1.0), wakeable=False)
                cap = (UNAVAILABLE_BACKOFF_MAX_SECONDS if self._unreachable
                       else OUTAGE_BACKOFF_MAX_SECONDS)
                backoff = min(backoff * 2, cap)
                continue
            backoff = OUTAGE_BACKOFF_FIRST_SECONDS
            seconds, wakeable = wait
            if seconds > 0:
                await self._sleep(seconds, wakeable=wakeable)

    def _waker_free_slots(self) -> int:
        """How many new jobs this pod could claim now, when it is the fleet's waker
        (receipts.waker wakes it first, in-process, and the other pods for the
        rest): its free slots, capped by what its throttles would let a claim
        take now — suspect pacing, admission control, its share of the rate
        limit (none while it must wait for its share) — and none while it stops
        or the fleet is paused. Nothing is taken. Counting the free slots alone
        left a throttled waker's pod first in line and new work to the stuck
        head's 150 ms: at 8 orders/s under a 20/s limit of 4 pods, pickup p99
        was 219 ms against 74 before (a new user's trial)."""
        self._unshared_room = None
        if self._stop.is_set() or self.gate.paused:
            return 0
        room = self._free_slots()
        if room > 0:
            room, _ = self.gate.suspect_allowance(room)
        if room > 0 and self.admission is not None:
            room = self.admission.available(room)
        if room > 0 and self.queue.rate > 0:
            choice = self.rate_choice()
            if choice.mode == "wait":
                return 0
            if choice.mode == "local":
                allowed = self._share_bucket(choice.share).available(room)
                if allowed < room:
                    self._unshared_room = room
                room = allowed
        return max(room, 0)

    def _waker_unshared_room(self) -> int | None:
        """What the last :meth:`_waker_free_slots` offer would have been but for
        this pod's share of the rate limit (its free slots within its other
        throttles), or None when the share did not cut it (receipts.waker, "A
        leading share")."""
        return self._unshared_room

    def _share_bucket(self, share: float) -> TokenBucket:
        """This pod's token bucket, sized to *share* (0–1) of the fleet's rate limit
        and burst as of now (receipts.ratelimit)."""
        self.bucket.resize(self.queue.rate * share, self.settings.burst * share)
        return self.bucket

    def _free_slots(self) -> int:
        """Slots free for a claim now: fewer while the gate sees unexplained rejections
        (:meth:`ProviderGate.inflight_cap`) and, with adaptive concurrency, never more
        than its limit less the deliveries in flight (min(slots, limit) - in flight);
        may be ≤ 0 (a confirmation takes a slot without a claim)."""
        inflight = len(self._inflight)
        free = self.settings.concurrency - inflight
        if self.capacity is not None:
            free = min(free, self.capacity.allowed() - inflight)
        most = self.gate.inflight_cap()
        return free if most is None else min(free, most - inflight)

    def prefetch_depth(self) -> int:
        """How many jobs to hold claimed ahead of the free slots now (≥ 0).

        The deliveries that end during one claim's round trip: ``2 × limit ×
        claim round trip ÷ delivery round trip`` (moving averages; twice, for
        their spread), rounded up (0 below ``PREFETCH_MIN_AHEAD``), at most
        ``PREFETCH_MAX_SHARE`` (half) of the limit (≥ 1) and ``claim_batch_max``,
        where the limit is ``min(slots, adaptive limit)``.
        0 unless the last claim came back full (the queue has work), when the
        lease leaves a job claimed ahead no time to wait (:meth:`prefetch_max_wait`
        below ``PREFETCH_MIN_WAIT_SECONDS``), and while the fleet is paused,
        rejections without evidence are being paced, or a prefetched job has
        waited its most since the last delivery ended: a claim then takes only
        what it can send.
        """
        if (not self._backlogged or self._prefetch_stalled or self.gate.paused
                or self.gate.inflight_cap() is not None or self._delivery_seconds_avg <= 0
                or self.prefetch_max_wait() < PREFETCH_MIN_WAIT_SECONDS):
            return 0
        limit = self.settings.concurrency
        if self.capacity is not None:
            limit = min(limit, self.capacity.allowed())
        ahead = 2 * limit * self._claim_seconds / self._delivery_seconds_avg
        # Rounded up: a pod held to one or two deliveries by the adaptive limit needs
        # one ahead as much as a large one (its slot idles for every claim). Not below
        # a tenth: a slot then frees more than ~20 claims' time apart, too long a wait.
        depth = math.ceil(ahead) if ahead >= PREFETCH_MIN_AHEAD else 0
        most = max(1, int(limit * PREFETCH_MAX_SHARE)) if PREFETCH_MAX_SHARE > 0 else 0
        return min(depth, most, self.settings.claim_batch_max)

    def _claim_room(self) -> int:
        """Jobs the next claim may take: free slots plus the prefetch's room (may be ≤ 0)."""
        return self._free_slots() + self.prefetch_depth() - len(self._prefetched)

    def prefetch_max_wait(self) -> float:
        """Seconds a job claimed ahead may wait for a slot before it goes back unsent.

        ``PREFETCH_MAX_WAIT_SECONDS``, or less when the lease leaves less room: a
        delivery must be able to run its whole timeout and leave the lease margin
        for the ack, so it starts at most ``lease - margin - delivery timeout``
        seconds after its claim was sent (the lease's start at the latest; ≥ 0: the
        settings check refuses a timeout that does not fit the lease at all). With
        the defaults (60 s lease, 10 s margin, 10 s timeout) that is 40 s, so the
        constant decides; with a 1 s lease, a 0.25 s margin and a 0.75 s timeout it
        is 0, and nothing is claimed ahead.
        """
        s = self.settings
        room = s.lease_seconds - s.lease_margin - s.delivery_timeout_seconds
        return max(0.0, min(PREFETCH_MAX_WAIT_SECONDS, room))

    def _prefetch_wait_left(self) -> float | None:
        """Seconds until the oldest prefetched job has waited its most (None: none)."""
        if not self._prefetched:
            return None
        return max(0.0, self._prefetched[0].lease_start + self.prefetch_max_wait()
                   - time.monotonic())

    def _send_prefetched(self) -> None:
        """Start prefetched jobs on the free slots; give back those that may not be sent.

        All go back (unsent, their attempts returned) while the fleet is paused
        or the worker stops; one that waited :meth:`prefetch_max_wait` goes
        back alone. None starts while the adaptive limit holds claims
        after a refusal.
        """
        queued = self._prefetched
        if not queued:
            return
        if self.gate.paused or self._stop.is_set():
            self._give_back(list(queued), "paused" if self.gate.paused else "stopping")
            queued.clear()
            return
        oldest = time.monotonic() - self.prefetch_max_wait()
        stale = []
        while queued and queued[0].lease_start <= oldest:
            stale.append(queued.popleft())
        if stale:
            self._prefetch_stalled = True
            self._give_back(stale, "waited")
        if self.capacity is not None and self.capacity.hold_seconds() > 0:
            return
        started = 0
        while queued and self._free_slots() > 0:
            self._start(queued.popleft())
            started += 1
        if started and self.capacity is not None:
            self.capacity.on_send(len(self._inflight))

    def _give_back(self, attempts: list[Attempt], why: str) -> None:
        """Return prefetched, never-sent *attempts* to ready (attempt given back, due now)."""
        for attempt in attempts:
            self.completer.reschedule(Reschedule(
                attempt, Outcome(Verdict.RETRY, Reason.INTERNAL_ERROR, detail="not sent"),
                delay_seconds=0.0, refund=True, unsent=True))
        log.info("prefetch_returned", extra={"count": len(attempts), "why": why})

    def _start(self, attempt: Attempt, *, confirming: bool = False) -> None:
        """Start *attempt*'s delivery on a slot (*confirming*: a first strike's resend)."""
        task = asyncio.create_task(self._deliver(attempt, confirming=confirming))
        self._inflight.add(task)
        task.add_done_callback(self._delivery_done)

    async def step(self, free: int) -> tuple[float, bool] | None:
        """One turn of the claim loop with *free* slots: claim, start deliveries.

        Returns how long to sleep before the next turn (seconds, and whether a
        NOTIFY may cut it short), or None when the database failed (the caller
        backs off). Never raises for database errors.
        """
        gate = self.gate
        recheck = False
        if gate.paused:
            left = gate.pause_left()
            since_read = time.monotonic() - self.flow.flow_read_at
            if left > 0 and since_read < PAUSE_RECHECK_SECONDS:
                return min(left, PAUSE_RECHECK_SECONDS - since_read), False
            if gate.probe_until is not None and gate.probe_jobs:  # our probe is still out
                return self.settings.poll_interval_seconds, False
            # Re-read the fleet's state now and then: another pod (or an operator)
            # may have ended or extended the pause. The claim claims nothing while
            # the fleet is paused; it only reports the state.
            recheck = left > 0
        probe_until: datetime | None = None
        state = FlowState()
        limit = min(free, self.settings.claim_batch_max)
        bucket: TokenBucket | None = None
        choice = self.rate_choice() if self.queue.rate > 0 and not gate.paused else None
        if choice is not None and choice.mode == "wait":
            return choice.wait_seconds, False
        if not gate.paused:
            # Rejections with no acceptance near them: pace new deliveries while the
            # evidence gathers (ProviderGate.suspect_allowance).
            limit, wait_suspect = gate.suspect_allowance(limit)
            if limit == 0:
                return wait_suspect, False
        # Admission control meters claims only while the provider is not paused.
        admission = None if gate.paused else self.admission
        if admission is not None:
            limit, wait = admission.allowance(limit)
            self.metrics.claim_rate_limit.set(admission.limit)
            if limit == 0:
                return wait, False
        if choice is not None and choice.mode == "local":
            # The pod's own share of the fleet's rate limit (receipts.ratelimit).
            bucket = self._share_bucket(choice.share)
            granted, wait = bucket.allowance(limit)
            if granted == 0:
                if admission is not None:
                    admission.refund(limit)
                return wait, False
            if admission is not None:
                admission.refund(limit - granted)
            limit = granted
        self._busy_since = time.monotonic()
        try:
            if gate.paused and not recheck:
                won = await self.queue.begin_probe(self._probe_guard_seconds())
                if won is not None:
                    probe_until, state = won
                    limit = gate.probe_size(limit)
            result = await self.claim_once(limit, probe=probe_until is not None,
                                           shared_bucket=bucket is None)
        except QueueError as exc:
            if bucket is not None:
                bucket.refund(limit)
            self._db_state(False)
            self._unreachable = isinstance(exc, DatabaseUnavailable)
            self.metrics.db_errors.labels("claim").inc()
            log.warning("claim_failed", extra={"error": str(exc)})
            return None
        finally:
            self._busy_since = None
        if probe_until is not None:
            if result.attempts:
                gate.start_probe([a.job.id for a in result.attempts], probe_until,
                                 state.pause_left_seconds or 0.0, state.pause_reason)
                log.info("provider_probe", extra={
                    **job_fields(result.attempts[0].job, "probe"),
                    "probe_jobs": len(result.attempts)})
            return 0.0, False
        if admission is not None:
            admission.refund(limit - len(result.attempts))
        if bucket is not None:
            bucket.refund(limit - len(result.attempts))
        gate.sent(len(result.attempts))
        self.flow.observe_flow(result.flow)
        if gate.paused:
            left = gate.pause_left()
            if left > 0:
                return min(left, PAUSE_RECHECK_SECONDS), False
            # Another pod's probe is out: look again soon, it may resume the fleet.
            return self.settings.poll_interval_seconds * random.uniform(0.75, 1.25), False
        self._backlogged = len(result.attempts) >= limit
        self.completer.busy = self._backlogged
        if self._backlogged:
            return 0.0, False
        tokens = result.flow.tokens
        if tokens is not None and tokens < 1 and self.queue.rate > 0:
            # Short because the fleet's bucket is empty: wait for the next token.
            return (1 - tokens) / self.queue.rate * random.uniform(1.0, 1.5), False
        return self.poll_seconds() * random.uniform(0.75, 1.25), True

    def poll_seconds(self) -> float:
        """The safety-net poll interval now: longer while the fleet's waker is heard,
        and as many times :data:`~receipts.waker.FLEET_POLL_SECONDS` as the fleet
        has pods when that is longer (its polls together stay about that often)."""
        poll = self.settings.poll_interval_seconds
        if self.wakeups is not None and self.wakeups.waker_alive():
            return max(poll * WAKER_POLL_FACTOR,
                       FLEET_POLL_SECONDS * self.wakeups.fleet_size())
        return poll

    def rate_choice(self) -> Choice:
        """Which token bucket the next claim charges under the rate limit
        (:func:`receipts.ratelimit.choose`): the shared row without a LISTEN session."""
        w = self.wakeups
        if w is None:
            return Choice("shared")
        return choose(shares=w.shares, tag=w.tag, shares_age=time.monotonic() - w.shares_at,
                      member_age=w.member_age())

    def _probe_guard_seconds(self) -> float:
        """How long other pods wait for this pod's probe before probing themselves."""
        return self.settings.delivery_timeout_seconds + self.settings.lease_margin

    async def claim_once(self, limit: int, *, probe: bool = False,
                         shared_bucket: bool = True) -> ClaimResult:
        """Claim up to *limit* jobs and start their deliveries; returns the claim's result.

        The claim starts at the waker's watermark when one is heard; under a
        rate limit it charges the shared bucket row unless not *shared_bucket*.
        At a trickle it also carries the acks waiting to be written
        (:meth:`Completer.carried_by`), unless it charges the shared bucket
        row. Raises the queue's errors (the caller backs off).
        """
        self._wake.clear()
        self.max_overclaim = max(
            self.max_overclaim, limit - (self.settings.concurrency - len(self._inflight))
            - max(0, self.prefetch_depth() - len(self._prefetched)))
        after = self.wakeups.claim_bound() if self.wakeups is not None else None
        start = time.perf_counter()
        if self.queue.rate > 0 and shared_bucket:
            # The claim that locks the fleet's shared bucket row carries no acks: it
            # must not hold that row while an acked row's lock is waited for.
            result = await self.queue.claim(limit, probe=probe, after=after, shared_bucket=True)
        else:
            # At a trickle the completer's pending acks ride on this statement.
            result = await self.completer.carried_by(
                lambda acks: self.queue.claim(limit, probe=probe, after=after,
                                              shared_bucket=shared_bucket,
                                              **({"acks": acks} if acks else {})))
        took = time.perf_counter() - start
        self.metrics.statement_duration.labels("claim").observe(took)
        self._claim_seconds = _moving(self._claim_seconds, took)
        self._db_state(True)
        self.metrics.claims.inc()
        self.metrics.claim_batch.observe(len(result.attempts))
        if result.attempts:
            self.metrics.jobs_claimed.inc(len(result.attempts))
            self.last_claim_at = time.monotonic()
        if result.flow.tokens is not None:
            self.metrics.provider_tokens.set(result.flow.tokens)
        for attempt in result.attempts:
            # Beyond the free slots: claimed ahead, sent when a slot frees.
            if self._free_slots() > 0 or probe:
                self._start(attempt)
            else:
                self._prefetched.append(attempt)
        if self.capacity is not None:
            self.capacity.on_send(len(self._inflight))
        return result

    def _delivery_done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._prefetch_stalled = False
        if self._prefetched:
            self._send_prefetched()
        self._slot_freed.set()
        # What the next claim may take, the prefetch's room included: a slot that a
        # job claimed ahead took at once still makes room for the claim.
        if self._claim_room() >= self._linger_min():
            self._enough_free.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("delivery_crashed", exc_info=task.exception())

    def _linger_min(self) -> int:
        """The batch worth lingering for: ``_claim_min``, or a tenth of the adaptive
        limit when that is smaller (≥ 1)."""
        if self.capacity is None:
            return self._claim_min
        return max(1, min(self._claim_min, self.capacity.allowed() // 10))

    async def _wait_for_slot(self, timeout: float | None = None) -> None:
        """Wait until a slot frees, or *timeout* seconds (None: no limit)."""
        self._slot_freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._slot_freed.wait(), timeout)

    async def _gather_slots(self) -> None:
        """Wait until ``_claim_min`` slots are free, at most ``CLAIM_LINGER_SECONDS``."""
        self._enough_free.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._enough_free.wait(), CLAIM_LINGER_SECONDS)

    async def _wait_for_writes(self, limit: int) -> None:
        """Wait until the completer's backlog is below *limit*, or a stop."""
        room = asyncio.ensure_future(self.completer.wait_for_room(limit))
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({room, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            room.cancel()
            stopped.cancel()

    async def _sleep(self, seconds: float, *, wakeable: bool) -> None:
        events = [self._stop.wait(), self._wake.wait()] if wakeable else [self._stop.wait()]
        waiters = [asyncio.ensure_future(e) for e in events]
        try:
            await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    # --------------------------------------------------------- delivery

    async def _deliver(self, attempt: Attempt, *, confirming: bool = False) -> None:
        job = attempt.job
        start = time.perf_counter()
        sent_at = time.monotonic()  # the flow gate's clock: held rejections compare it
        try:
            outcome = await self.deliverer.deliver(job)
        except Exception as exc:
            # A deliverer bug must not strand the job until its lease expires.
            log.exception("delivery_error", extra=job_fields(job, Reason.INTERNAL_ERROR))
            detail = f"internal error: {exc!r}"[:200]
            outcome = Outcome(Verdict.RETRY, Reason.INTERNAL_ERROR, detail=detail)
        took = time.perf_counter() - start
        self._delivery_seconds_avg = _moving(self._delivery_seconds_avg, took)
        histogram = self._delivery_seconds.get(outcome.reason)
        if histogram is None:  # a reason outside the enum (a deliverer's own string)
            histogram = self.metrics.delivery_duration.labels(outcome.reason)
        histogram.observe(took)
        if self.capacity is not None:
            self._adapt(outcome, took, sent_at)
        if self.record_all or outcome.verdict is not Verdict.DELIVERED or job.attempt > 1:
            self.completer.record(AttemptRecord.of(job, outcome, duration_seconds=took,
                                                   worker=self.name))
        await self.flow.judge(attempt, outcome, sent_at=sent_at, confirming=confirming)

    def _adapt(self, outcome: Outcome, took: float, sent_at: float) -> None:
        """Feed the adaptive limit one delivery's answer (round trip *took*, seconds)."""
        capacity = self.capacity
        assert capacity is not None
        before = capacity.allowed()
        capacity.peers = self.capacity_peers()
        signal = capacity.observe(outcome.reason, rtt_seconds=took, sent_at=sent_at,
                                  latency_sample=not outcome.replayed)
        if signal is not None:
            self.metrics.concurrency_decreases.labels(signal).inc()
        now = capacity.allowed()
        if now != before:
            self.metrics.concurrency_limit.set(now)
            if signal is not None:
                log.debug("concurrency_limit_decreased", extra={
                    "limit": now, "signal": signal, "reason": str(outcome.reason)})

    def _confirm(self, attempt: Attempt) -> None:
        """Send a first strike's job again, in its lease: the confirmation."""
        self._start(attempt, confirming=True)

    def gate_state(self) -> FlowState:
        """The gate's current view as a :class:`FlowState` (left unchanged)."""
        return self.flow.state()

    # ---------------------------------------------------------- helpers

    async def _stats_loop(self) -> None:
        """Refresh the queue gauges at most once per interval (jittered)."""
        interval = self.settings.queue_stats_interval_seconds
        while True:
            try:
                self.metrics.observe_queue(await self.queue.queue_stats())
            except QueueError as exc:
                log.debug("queue_stats_failed", extra={"error": str(exc)})
            await asyncio.sleep(interval * random.uniform(0.8, 1.2))

    async def _admission_loop(self) -> None:
        """Feed admission control one commit probe per interval (jittered), none while idle.

        A probe the database refuses three times in a row while it answers
        claims (a role that may not emit a logical-decoding message) turns
        admission control off for this process, with one warning: without a
        sample it would keep its limit forever.
        """
        admission = self.admission
        assert admission is not None
        refused = 0
        while True:
            await asyncio.sleep(admission.probe_interval() * random.uniform(0.8, 1.2))
            if admission.idle():
                continue  # nothing claimed for a while: an idle pod costs no durable commit
            try:
                seconds = await self.queue.commit_probe()
                refused = 0
                admission.observe(seconds)
                self._probe_seconds.observe(seconds)
            except QueueError as exc:
                self.metrics.db_errors.labels("commit_probe").inc()
                refused = refused + 1 if self._db_ok else 0
                if refused >= 3:
                    log.warning("admission_control_off", extra={"error": str(exc)})
                    self.admission = None
                    self.metrics.claim_rate_limit.set(0)
                    return

    async def _drain(self, also: set[asyncio.Task[None]]) -> None:
        grace = min(self.settings.shutdown_grace_seconds, self.settings.delivery_timeout_seconds)
        deliveries = set(self._inflight)
        log.info("draining", extra={"inflight": len(deliveries), "grace_seconds": grace})
        self._send_prefetched()  # the stop gives them back
        pending = deliveries | {t for t in also if not t.done()}
        if pending:
            _, left = await asyncio.wait(pending, timeout=grace)
            _cancel(left)
            abandoned = left & deliveries
            if abandoned:
                log.warning("deliveries_abandoned", extra={"count": len(abandoned)})
                await asyncio.wait(abandoned, timeout=1.0)
        if self.flow.held:  # stopping is no evidence: give the held rejections back
            self.flow.settle(final=True)
        await self.completer.close(timeout_seconds=ack_flush_seconds(self.settings))
        self.drained = True
        log.info("stopped")


def ack_flush_seconds(settings: Settings) -> float:
    """How long a stopping worker waits for its last outcome writes, seconds."""
    return max(5.0, min(settings.shutdown_grace_seconds, 30.0))


def _moving(average: float, sample: float) -> float:
    """An exponentially weighted moving average's next value (the first sample as is)."""
    if average <= 0:
        return sample
    return average + PREFETCH_EWMA_WEIGHT * (sample - average)


def _cancel(tasks: Iterable[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
