"""Adaptive concurrency: a per-pod AIMD limit on deliveries in flight (pure, no I/O).

The fleet autoscales on queue depth; the provider's capacity is what really
bounds delivery. This module finds that capacity from the provider's own
answers and keeps a pod's concurrent requests within its share of it.

The rule (:class:`ConcurrencyLimit`), per answer:

* **Overload** (429, 5xx, a timeout, a connection lost or refused): multiply
  the limit by ``backoff`` (0.85 by default; ``lone_backoff``, 0.9, for a pod
  alone on the provider) at once, but only for an answer
  to a request *sent after* the last decrease, so one episode of overload
  (all the requests already in flight when it began) costs one decrease: no
  more than one per round trip.
* **Latency**: answers are grouped in windows of about one round trip's
  worth (as many answers as the limit, at least ``min_window``). A window
  whose mean round-trip time is above ``slow_factor`` × the baseline (the
  lowest window mean seen, drifting up slowly so a provider that got slower
  for good is not held against it forever) is a decrease too, with the same
  once-per-round-trip guard: a provider queueing requests says so by
  slowing down before it starts refusing them.
* **Increase**: a window with no overload, a mean within ``calm_factor`` ×
  the baseline, and the limit actually reached (the pod was held by the
  limit, not by its backlog) adds to the limit. Until the pod's first
  decrease (the search for the capacity, TCP's slow start) a window is one
  round trip's answers (as many as the limit, at least ``SEARCH_MIN_WINDOW``)
  and each adds half the limit (at least 1): × 1.5 per round trip, from the
  floor to 32 in about nine round trips. One added per window of at least
  ``min_window`` answers took a pod from 1 to 32 in about fifteen seconds
  at 100 ms, a third of a 40-s bench run (bench/README.md). After it,
  it adds ``increase`` ÷ the pods sharing the provider
  (:attr:`ConcurrencyLimit.peers`, from the waker's fleet announcement or
  the heartbeat rows): the *fleet* then grows by about ``increase`` per
  window, whatever its size, instead of by one per pod. Each step past the
  capacity costs about one refused request, so with N pods each adding one,
  the refused share grew with N (1.6 % at 4 pods and 3 % at 8 against a
  capacity of 16, measured); shared, it is about
  ``increase / (min_window × (1 - backoff) × capacity)`` at any N.
* **A pod alone** (``peers`` = 1) decreases by ``lone_backoff`` (0.9) and
  adds ``increase × (1 - lone_backoff) ÷ (1 - backoff)`` (a third) per window.
  The multiplicative decrease is there for fairness among pods (below); a
  lone pod has nobody to be fair to, and what it loses is its sawtooth, about
  ``(1 - backoff) ÷ 2`` of the capacity. The smaller step keeps the refused
  share the same (the formula above), while the sawtooth's loss falls from
  7.5 % to 5 % (HighSpeed TCP, RFC 3649, likewise shrinks the decrease where
  no competing flow needs the room). Measured with one pod against a capacity
  of 16 at 50 ms: 0.88 → 0.90–0.91 of what C allows, 0.6 % refused before and
  after (bench/README.md).

The limit stays within [``floor``, ``ceiling``]; the worker claims no more
than ``min(slots, limit) - in flight``. An overload answer that leaves the
pod at its floor also stops its claims for one round trip (the baseline;
:meth:`ConcurrencyLimit.hold_seconds`): a refused request frees its slot at
once, and a pod that cannot shrink would refill it at once, again and again,
into a provider that is full (TCP's retransmission timer plays that part
when the window cannot shrink). Above the floor the decrease itself leaves
more requests in flight than the new limit, so the pod claims nothing until
enough have come back, and a hold would only idle it: with a hold after
every refusal, one pod lost about one round trip of deliveries per cycle.

Why AIMD rather than a gradient or Vegas limiter alone: pods do not talk to
each other about the provider. Additive increase with multiplicative
decrease is the rule under which independent senders sharing one
bottleneck, each seeing only its own answers, converge to equal shares of
it and stay near its capacity (Chiu and Jain's argument behind TCP
congestion control): every decrease shrinks the larger shares by more,
every increase grows all shares alike. So the fleet needs no shared row
written per claim or per delivery: each pod only reports its limit in its
heartbeat (for the autoscaler and the fleet mean a new pod starts from),
never on the hot path. The latency guard borrows the gradient limiters'
signal so that a provider that slows down rather than refuses is backed
off from too; 429/503 answers and timeouts remain the primary signal.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from receipts.model import Reason

#: Default floor of the limit (deliveries in flight per pod).
FLOOR = 1
#: Default ceiling of the limit (deliveries in flight per pod; the slots cap it too).
CEILING = 64

#: Bounds of the pause in claims after an overload answer (one baseline round trip), s.
HOLD_MIN_SECONDS, HOLD_MAX_SECONDS = 0.01, 5.0
#: The signals of a decrease (``receipts_concurrency_limit_decreases_total{signal}``).
OVERLOAD, LATENCY = "overload", "latency"
#: While a pod searches for the capacity: the fewest answers in a window (one round
#: trip's worth otherwise), and the share of the limit each calm window adds.
SEARCH_MIN_WINDOW, SEARCH_GROWTH = 4, 0.5
#: Answers that say the provider is overloaded: the limit shrinks.
OVERLOAD_REASONS = frozenset({Reason.RATE_LIMITED, Reason.PROVIDER_5XX, Reason.TIMEOUT,
                              Reason.CONNECTION_LOST, Reason.CONNECT_ERROR})
#: Answers whose round trip is a latency sample: new work done at the provider's pace.
#: Not a rejection nor a 409 (a provider that validates first answers them at once),
#: and not a replayed success (:attr:`Outcome.replayed`: a stored answer, at once):
#: a window of those set the baseline far below a delivery's real round trip, and
#: every later window read as slow (a new user's trial: the limit fell to 1 after a
#: crash's redeliveries were answered from the provider's idempotency store).
ANSWERED_REASONS = frozenset({Reason.DELIVERED})


@dataclass(frozen=True, slots=True)
class CapacityPolicy:
    """The AIMD limiter's constants.

    Attributes:
        floor: the lowest limit (≥ 1), deliveries in flight.
        ceiling: the highest limit (≥ floor), deliveries in flight.
        backoff: the factor of a multiplicative decrease, in (0, 1). A fleet held
            at the capacity runs between ``backoff`` × and 1 × it, so one pod's
            mean is about (1 + backoff) ÷ 2 of it: 0.85 keeps that above 0.9.
        lone_backoff: the factor for a pod alone on the provider (``peers`` = 1),
            in [backoff, 1); its increase shrinks by ``(1 - lone_backoff) ÷
            (1 - backoff)`` so that it refuses no more often.
        increase: the fleet's additive increase per window of calm answers once
            the capacity has been found (each pod adds this ÷ the pods), in (0, 1].
        slow_factor: a window whose mean round trip exceeds this × the baseline
            is a decrease (> calm_factor).
        calm_factor: a window may increase the limit only when its mean round
            trip is within this × the baseline (≥ 1).
        min_window: the fewest answers in a window (≥ 1).
        baseline_drift: how much the baseline round trip may rise per second (a
            fraction; 0.005: × 2 in about 2.3 minutes), so a provider that got
            slower for good is re-learnt, but a fleet that loads the provider
            for minutes does not make its own queueing the new normal.
    """

    floor: int = FLOOR
    ceiling: int = CEILING
    backoff: float = 0.85
    increase: float = 0.5
    slow_factor: float = 2.0
    calm_factor: float = 1.25
    min_window: int = 32
    baseline_drift: float = 0.005
    lone_backoff: float = 0.9

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError("need 1 <= floor <= ceiling")
        if not 0 < self.backoff < 1:
            raise ValueError("backoff must be in (0, 1)")
        if not self.backoff <= self.lone_backoff < 1:
            raise ValueError("lone_backoff must be in [backoff, 1)")
        if not 0 < self.increase <= 1:
            raise ValueError("increase must be in (0, 1]")
        if not 1 <= self.calm_factor < self.slow_factor:
            raise ValueError("need 1 <= calm_factor < slow_factor")
        if self.min_window < 1 or self.baseline_drift < 0:
            raise ValueError("min_window must be >= 1 and baseline_drift >= 0")


def starting_limit(policy: CapacityPolicy, fleet_mean: float | None) -> float:
    """Where a new pod's limit starts: the fleet's mean per-pod limit (read from the
    live heartbeat rows) within [floor, ceiling], or the floor when none is known.

    A pod that starts at the ceiling beside a fleet held at the provider's
    capacity would send a burst of overload; starting at the mean joins the
    fleet at its current share.
    """
    if fleet_mean is None or not math.isfinite(fleet_mean):
        return float(policy.floor)
    return float(min(policy.ceiling, max(policy.floor, fleet_mean)))


class ConcurrencyLimit:
    """One pod's AIMD limit on deliveries in flight (see the module doc).

    Args:
        policy: the constants.
        initial: the starting limit (:func:`starting_limit`); clamped to
            [floor, ceiling]. None: the floor.
        clock: monotonic seconds (tests pass their own).

    Attributes:
        peers: the pods sharing the provider, this one included (≥ 1); the
            worker keeps it current. It divides the increase after the first
            decrease.
        searching: True until the first decrease (the limit then grows by half
            per round trip); a pod that joins at the fleet's mean (:meth:`join`)
            does not search.

    Not thread-safe: one event loop feeds it.
    """

    def __init__(self, policy: CapacityPolicy, *, initial: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.limit = starting_limit(policy, initial)
        self._clock = clock
        #: Monotonic time of the last decrease: answers to requests sent before it
        #: are part of the episode it already answered.
        self.decreased_at = -math.inf
        #: The lowest mean round trip of a block of ``min_window`` answers seen (drifting
        #: up), seconds; None: none yet.
        self.baseline: float | None = None
        self._baseline_at = clock()
        self.decreases = 0
        self.increases = 0
        self.peers = 1
        self.searching = True
        #: Monotonic time until which the pod claims nothing (after an overload answer).
        self.hold_until = -math.inf
        self._block_count, self._block_sum = 0, 0.0
        self._reset_window()

    def _reset_window(self) -> None:
        self._count = 0
        self._rtt_sum = 0.0
        self._peak = 0
        self._first_sent = math.inf

    def join(self, fleet_mean: float | None) -> None:
        """Start at the fleet's mean per-pod limit (:func:`starting_limit`); a pod
        that joins a fleet with a known mean has its share already, so it does
        not search (its increases are shared from the start)."""
        self.limit = starting_limit(self.policy, fleet_mean)
        self.searching = fleet_mean is None or not math.isfinite(fleet_mean)

    def allowed(self) -> int:
        """Deliveries this pod may have in flight now (the limit, rounded down; ≥ 1)."""
        return max(1, int(self.limit))

    def hold_seconds(self) -> float:
        """Seconds the pod must still wait before claiming (0 when it may claim now)."""
        return max(0.0, self.hold_until - self._clock())

    def on_send(self, inflight: int) -> None:
        """Note *inflight* deliveries (after starting some): the window saw this load."""
        self._peak = max(self._peak, inflight)

    def observe(self, reason: Reason | str, *, rtt_seconds: float,
                sent_at: float, latency_sample: bool = True) -> str | None:
        """Feed one finished delivery: its *reason*, round trip (seconds) and the
        monotonic time it was sent. Other reasons (auth, internal errors,
        rejections) say nothing about load and are ignored, and so is a success
        that is no *latency_sample* (a replayed answer).

        Returns the signal of a decrease it caused (``overload`` or ``latency``),
        else None (also when the limit was already at its floor).
        """
        if reason in OVERLOAD_REASONS:
            signal = None
            if sent_at >= self.decreased_at and self._decrease():
                signal = OVERLOAD
            if self.limit < self.policy.floor + 1:  # at the floor: it cannot shrink
                rtt = self.baseline if self.baseline is not None else rtt_seconds
                if not math.isfinite(rtt):
                    rtt = HOLD_MAX_SECONDS
                self.hold_until = max(self.hold_until, self._clock() + min(
                    HOLD_MAX_SECONDS, max(HOLD_MIN_SECONDS, rtt)))
            return signal
        if (reason not in ANSWERED_REASONS or not latency_sample
                or not math.isfinite(rtt_seconds) or rtt_seconds < 0):
            return None
        self._block_count += 1
        self._block_sum += rtt_seconds
        if self._block_count >= self.policy.min_window:
            # The baseline learns from blocks of min_window answers, whatever the
            # windows' size: the search's small windows would let a few quick answers
            # set it.
            self._learn_baseline(self._block_sum / self._block_count)
            self._block_count, self._block_sum = 0, 0.0
        self._count += 1
        self._rtt_sum += rtt_seconds
        self._first_sent = min(self._first_sent, sent_at)
        least = SEARCH_MIN_WINDOW if self.searching else self.policy.min_window
        if self._count >= max(least, self.allowed()):
            return self._close_window()
        return None

    def _learn_baseline(self, mean: float) -> None:
        """Lower the baseline to a block's *mean* round trip, or let it drift up."""
        base = self.baseline
        if base is None or mean < base:
            self.baseline = mean
        else:
            elapsed = max(0.0, self._clock() - self._baseline_at)
            self.baseline = min(mean, base * (1 + self.policy.baseline_drift) ** elapsed)
        self._baseline_at = self._clock()

    def _close_window(self) -> str | None:
        p = self.policy
        mean = self._rtt_sum / self._count
        base = self.baseline
        if base is not None and mean > p.slow_factor * base:
            if self._first_sent >= self.decreased_at and self._decrease():
                return LATENCY
        elif ((base is None or mean <= p.calm_factor * base) and self._peak >= self.allowed()
              and self.limit < p.ceiling):
            if self.searching:
                step = max(1.0, SEARCH_GROWTH * self.limit)
            elif self.peers <= 1:
                step = p.increase * (1 - p.lone_backoff) / (1 - p.backoff)
            else:
                step = p.increase / self.peers
            self.limit = min(float(p.ceiling), self.limit + step)
            self.increases += 1
        self._reset_window()
        return None

    def _decrease(self) -> bool:
        """Multiply the limit by the backoff (not below the floor) and open a new
        episode; True when the limit went down (at the floor it cannot, and that
        is no decrease to count)."""
        p = self.policy
        before = self.limit
        backoff = p.lone_backoff if self.peers <= 1 else p.backoff
        self.limit = max(float(p.floor), self.limit * backoff)
        self.decreased_at = self._clock()
        self.searching = False
        self._reset_window()
        if self.limit < before:
            self.decreases += 1
            return True
        return False
