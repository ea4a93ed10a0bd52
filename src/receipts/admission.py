"""Admission control for the checkout database: an AIMD limit on the claim rate.

The queue lives in the orders database, so a drain at full speed competes
with checkout for CPU, locks and WAL flushes (docs/design.md §11; the bench
measured checkout p99 at 1.96× idle with 32 slots and 4.9× with 500). Each
worker therefore adapts how fast it claims to how fast the database answers
its own claim and ack statements, the way TCP congestion control adapts to
round-trip time:

* every claim or ack statement gives a latency sample, normalised for its
  size (``latency / (1 + rows / ROWS_SCALE)``, since a statement of 100 rows
  costs more than one of 1 on an idle server);
* the *baseline* is the lowest normalised latency seen, allowed to drift up
  by ``BASELINE_DRIFT_PER_SECOND`` so it follows a database that has really
  become slower (more data, a bigger machine's neighbour);
* the samples are smoothed (an exponentially weighted moving average,
  weight ``SMOOTHING``): one slow commit or a busy event loop is jitter, not
  congestion;
* a smoothed latency above ``tolerance × baseline`` plus ``NOISE_FLOOR_SECONDS``
  is congestion: the limit is multiplied by ``decrease``, at most once per
  ``DECREASE_SPACING_SECONDS`` (one decision per round of statements, not one
  per sample of the same round). The floor is absolute because on an idle
  server the baseline is well under a millisecond while an ordinary commit
  (fsync) and the worker's own event loop add milliseconds: a drain that
  only meets that jitter keeps its rate, a database that really slows down
  (tens of milliseconds) is backed off from;
* otherwise the limit grows additively by ``increase_per_second × elapsed``;
* the limit stays within [``min_rate``, ``max_rate``] jobs/s: the floor
  means a backlog always drains, however busy the database.

The limit is enforced with a local token bucket (capacity
``BURST_SECONDS`` of the limit, at least one claim batch), and exposed as
``receipts_claim_rate_limit``. Pure: no I/O; tests pass their own clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

#: Rows that double a statement's expected latency (claim of 100 ≈ 6× claim of 1 here).
ROWS_SCALE = 20.0
#: How fast the baseline may rise without a lower sample (per second, relative).
BASELINE_DRIFT_PER_SECOND = 0.01
#: Smoothed latency below this many seconds above the baseline is never congestion.
NOISE_FLOOR_SECONDS = 0.008
#: Weight of a new sample in the moving average.
SMOOTHING = 0.1
#: One multiplicative decrease per this many seconds at most.
DECREASE_SPACING_SECONDS = 0.2
#: The local bucket holds this many seconds of the current limit.
BURST_SECONDS = 0.1


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """AIMD parameters.

    Attributes:
        min_rate: the floor of the claim rate, jobs/s (a backlog always drains).
        max_rate: the ceiling, jobs/s (and the starting limit).
        tolerance: a sample above tolerance × baseline is congestion.
        decrease: the multiplicative decrease factor (0–1).
        increase_per_second: additive increase, jobs/s per second of no congestion.
    """

    min_rate: float = 50.0
    max_rate: float = 20_000.0
    tolerance: float = 3.0
    decrease: float = 0.7
    increase_per_second: float = 200.0


class AdmissionController:
    """The claim-rate limit of one worker (see the module doc).

    Args:
        policy: the AIMD parameters.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, policy: AdmissionPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        now = clock()
        self.limit = policy.max_rate
        self.baseline: float | None = None
        self.smoothed: float | None = None
        self._baseline_at = now
        self._last_sample = now
        self._last_decrease = -1e9
        self._tokens = float("inf")  # a full bucket (clamped to capacity on first use)
        self._tokens_at = now
        self.decreases = 0

    def observe(self, seconds: float, rows: int) -> None:
        """Feed one statement's latency (*seconds*) for *rows* rows."""
        now = self._clock()
        sample = max(seconds, 1e-6) / (1 + max(rows, 0) / ROWS_SCALE)
        if self.baseline is None or sample < self.baseline:
            self.baseline, self._baseline_at = sample, now
        else:
            drift = (now - self._baseline_at) * BASELINE_DRIFT_PER_SECOND
            self.baseline *= 1 + min(drift, 1.0)
            self._baseline_at = now
        self.smoothed = sample if self.smoothed is None else (
            self.smoothed + SMOOTHING * (sample - self.smoothed))
        p = self.policy
        congested = self.smoothed > self.baseline * p.tolerance + NOISE_FLOOR_SECONDS
        if congested:
            if now - self._last_decrease >= DECREASE_SPACING_SECONDS:
                self.limit = max(p.min_rate, self.limit * p.decrease)
                self._last_decrease = now
                self.decreases += 1
        else:
            self.limit = min(p.max_rate,
                             self.limit + p.increase_per_second * (now - self._last_sample))
        self._last_sample = now

    def allowance(self, want: int) -> tuple[int, float]:
        """How many of *want* jobs may be claimed now, and else how long to wait (seconds).

        Returns ``(n, 0.0)`` with 1 ≤ n ≤ *want* when tokens are there
        (they are taken), or ``(0, seconds)`` until the next token.
        """
        now = self._clock()
        capacity = max(self.limit * BURST_SECONDS, float(want), 1.0)
        self._tokens = min(capacity, self._tokens + (now - self._tokens_at) * self.limit)
        self._tokens_at = now
        n = min(want, int(self._tokens))
        if n >= 1:
            self._tokens -= n
            return n, 0.0
        return 0, (1.0 - self._tokens) / self.limit

    def refund(self, unused: int) -> None:
        """Give back tokens for jobs a claim asked for but did not get."""
        if unused > 0:
            self._tokens += unused
