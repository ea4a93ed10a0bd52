"""Admission control for the checkout database: an AIMD limit on the claim rate.

The queue lives in the orders database, so a drain competes with checkout
(docs/design.md §11). What a drain costs checkout is mostly time waiting for
the WAL flush: the bench split a checkout transaction (insert order, enqueue,
commit) during a full drain and found the insert and the enqueue about as
fast as on an idle server while the commit took much longer (docs/design.md
§11 has the figures). So each
worker steers its claim rate by the latency of exactly that, a small durable
commit, the way delay-based TCP congestion control (Vegas, BBR) steers a
sending rate by round-trip time:

* The worker runs a *commit probe* (``JobQueue.commit_probe``: one
  transactional logical-decoding message of a few bytes, committed with
  ``synchronous_commit = on``; no table, no lock) every
  ``PROBE_INTERVAL_SECONDS`` while it claims, every
  ``IDLE_PROBE_INTERVAL_SECONDS`` otherwise, none once it has claimed nothing
  for ``IDLE_AFTER_SECONDS``, and feeds the latency to
  :meth:`AdmissionController.observe`. The worker's own claims and acks do
  not wait for a flush (``RECEIPTS_SYNCHRONOUS_COMMIT=off``), so their
  latency would not show what checkout feels.
* Samples are judged per *window* of ``WINDOW_SAMPLES`` by their median.
* A window in which this worker claimed at most ``QUIET_RATE_FACTOR ×
  min_rate`` jobs/s is *quiet*: its median is what a commit costs without
  this worker's drain. The *baseline* is the lowest median of the last
  ``BASELINE_WINDOWS`` quiet windows. A worker that drains without a quiet
  window for ``QUIET_EVERY_SECONDS`` (or has no baseline yet) makes one: the
  limit drops to ``min_rate`` for one window, about 1 s in 30, so a drain
  can never teach itself that its own load is normal. A trickle of work
  below the quiet rate never pays for one. A quiet window is never a reason
  to cut: once a worker is throttled to the quiet rate, commits that stay
  slow are someone else's doing, become the baseline, and the worker climbs
  back for as long as its own load adds less than the tolerance.
* A busy window whose median exceeds ``tolerance × baseline +
  NOISE_FLOOR_SECONDS`` is congestion: the limit becomes ``decrease ×`` the
  rate the window actually used (a limit far above what is used would not
  bind). Otherwise it grows by ``increase_per_second`` per second of the
  window, but never past twice the rate used, so an idle or slot-bound
  worker does not bank a limit it has never tried.
* The limit starts at ``max_rate`` (a drain runs at full speed until a
  window shows congestion) and stays within [``min_rate``, ``max_rate``]
  jobs/s: the floor means a backlog always drains.

The limit is enforced with a local token bucket (:meth:`allowance`) and
exposed as ``receipts_claim_rate_limit``. Pure: no I/O; tests pass their own
clock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: Commit probes per second while the worker claims, and while it does not.
PROBE_INTERVAL_SECONDS = 0.2
IDLE_PROBE_INTERVAL_SECONDS = 1.0
#: A worker that has claimed no job for this long is idle and sends no commit
#: probe at all: each probe is a durable commit, and an idle fleet's cost to
#: the database must not grow with its pod count (docs/design.md §11).
IDLE_AFTER_SECONDS = 10.0
#: Samples judged together (their median).
WINDOW_SAMPLES = 5
#: A window claiming at most this many × min_rate jobs/s is quiet.
QUIET_RATE_FACTOR = 4.0
#: A draining worker makes a quiet window at least this often, seconds.
QUIET_EVERY_SECONDS = 30.0
#: The baseline is the lowest median of this many recent quiet windows.
BASELINE_WINDOWS = 3
#: A median within this many seconds of tolerance × baseline is never congestion.
NOISE_FLOOR_SECONDS = 0.0002
#: The local bucket holds this many seconds of the current limit.
BURST_SECONDS = 0.1


#: The claim-rate floor and ceiling defaults, jobs/s per worker; ``Settings`` takes
#: ``RECEIPTS_ADMISSION_MIN/MAX_RATE_PER_SECOND``'s defaults from these.
MIN_RATE_PER_SECOND = 50.0
MAX_RATE_PER_SECOND = 20_000.0


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """AIMD parameters.

    Attributes:
        min_rate: the floor of the claim rate, jobs/s (a backlog always
            drains); also the rate of a quiet window.
        max_rate: the ceiling and starting limit, jobs/s.
        tolerance: a busy window's median commit latency above tolerance ×
            baseline (+ ``NOISE_FLOOR_SECONDS``) is congestion.
        decrease: the multiplicative decrease factor (0–1).
        increase_per_second: additive increase, jobs/s per second without congestion.
    """

    min_rate: float = MIN_RATE_PER_SECOND
    max_rate: float = MAX_RATE_PER_SECOND
    tolerance: float = 1.5
    decrease: float = 0.75
    increase_per_second: float = 500.0


class AdmissionController:
    """The claim-rate limit of one worker (see the module doc).

    Read by the worker and tests: :attr:`limit` (jobs/s now), ``baseline``
    (seconds; None until the first quiet window), ``decreases`` (congested
    windows so far), ``quiet_windows_forced``.

    Args:
        policy: the AIMD parameters.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, policy: AdmissionPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        now = clock()
        self._target = policy.max_rate  # the AIMD limit outside a forced quiet window
        self._forcing_quiet = False
        self._quiet: deque[float] = deque(maxlen=BASELINE_WINDOWS)
        self._last_quiet = now
        self._samples: list[float] = []
        self._window_start = now
        self._claimed = 0  # jobs claimed in this window
        self._last_claim = -1e9  # when a claim last returned jobs
        self._granted = 0  # tokens the last allowance took
        self._tokens = 1.0
        self._tokens_at = now
        self.baseline: float | None = None
        self.decreases = 0
        self.quiet_windows_forced = 0

    @property
    def limit(self) -> float:
        """The claim rate in force now, jobs/s."""
        return self.policy.min_rate if self._forcing_quiet else self._target

    def idle(self) -> bool:
        """True when no claim has returned a job for ``IDLE_AFTER_SECONDS`` (no probes then)."""
        return self._clock() - self._last_claim >= IDLE_AFTER_SECONDS

    def probe_interval(self) -> float:
        """Seconds until the next commit probe: short while claiming, long when idle."""
        busy = self._clock() - self._last_claim < 1.0
        return PROBE_INTERVAL_SECONDS if busy else IDLE_PROBE_INTERVAL_SECONDS

    def observe(self, seconds: float) -> None:
        """Feed one commit probe's latency, *seconds*; every ``WINDOW_SAMPLES`` ends a window."""
        self._samples.append(seconds)
        if len(self._samples) >= WINDOW_SAMPLES:
            self._judge()

    def _judge(self) -> None:
        now = self._clock()
        samples = sorted(self._samples)
        median = samples[len(samples) // 2]
        elapsed = max(now - self._window_start, 1e-3)
        used = self._claimed / elapsed
        self._samples.clear()
        self._claimed = 0
        self._window_start = now
        p = self.policy
        forced, self._forcing_quiet = self._forcing_quiet, False
        quiet = forced or used <= QUIET_RATE_FACTOR * p.min_rate
        if quiet:
            self._quiet.append(median)
            self.baseline = min(self._quiet)
            self._last_quiet = now
        if forced:
            return  # the limit resumes where it was
        if self.baseline is None or now - self._last_quiet >= QUIET_EVERY_SECONDS:
            # Busy with no recent measure of a commit without us: make one next.
            self._forcing_quiet = True
            self.quiet_windows_forced += 1
        if self.baseline is None:
            return
        # A quiet window is never cut: slow commits then are not this worker's doing.
        if not quiet and median > self.baseline * p.tolerance + NOISE_FLOOR_SECONDS:
            self._target = max(p.min_rate, min(self._target, used) * p.decrease)
            self.decreases += 1
            return
        ceiling = max(2 * used, p.min_rate)
        if self._target < ceiling:
            grown = self._target + p.increase_per_second * elapsed
            self._target = min(p.max_rate, grown, ceiling)

    def allowance(self, want: int) -> tuple[int, float]:
        """How many of *want* jobs may be claimed now, and else how long to wait (seconds).

        Returns ``(n, 0.0)`` with 1 ≤ n ≤ *want* when tokens are there
        (they are taken), or ``(0, seconds)`` until there are enough. While
        the limit binds, a claim waits for a whole batch — *want*, or
        ``BURST_SECONDS`` of the limit when that is fewer — instead of
        taking jobs one token at a time: a commit costs the database about
        as much for one row as for thirty, so a throttled drain that claimed
        job by job would load it with more commits, not fewer.
        """
        now = self._clock()
        limit = self.limit
        self._tokens, batch = self._refilled(want, now)
        self._tokens_at = now
        if self._tokens >= batch:
            n = min(want, int(self._tokens))
            self._tokens -= n
            self._claimed += n
            self._granted = n
            return n, 0.0
        return 0, (batch - self._tokens) / limit

    def available(self, want: int) -> int:
        """What :meth:`allowance` would grant *want* now, without taking it (0 when
        it would wait)."""
        tokens, batch = self._refilled(want, self._clock())
        return min(want, int(tokens)) if want >= 1 and tokens >= batch else 0

    def _refilled(self, want: int, now: float) -> tuple[float, int]:
        """The tokens there would be at *now* (monotonic seconds), and the batch a
        claim of *want* waits for while the limit binds."""
        limit = self.limit
        capacity = max(limit * BURST_SECONDS, float(want), 1.0)
        tokens = min(capacity, self._tokens + (now - self._tokens_at) * limit)
        return tokens, max(1, min(want, int(limit * BURST_SECONDS)))

    def refund(self, unused: int) -> None:
        """Give back tokens for jobs the last claim asked for but did not get."""
        if unused > 0:
            self._tokens += unused
            self._claimed -= unused
        if self._granted > unused:  # it claimed something: the worker is busy
            self._last_claim = self._clock()
        self._granted = 0
