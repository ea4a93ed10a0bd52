"""The fleet-wide provider rate limit, kept per pod: a local token bucket at the pod's share.

``RECEIPTS_PROVIDER_RATE_LIMIT_PER_SECOND`` (jobs/s for the whole fleet) and
``RECEIPTS_PROVIDER_BURST`` (the fleet's bucket capacity, jobs) keep their
meaning. A shared bucket row charged by every claim (``claim_limited``) is a
fleet-wide mutex on the claim path, and while any snapshot is held its row
versions pile up (docs/design.md, "A fleet-wide rate limit").
Instead each pod runs a token bucket of its own at

    rate × share,  capacity burst × share,

where its share is its weight (its slots) over the weights of the live pods.
The live pods are the holders of a per-pod advisory lock on their LISTEN
sessions (``member_lock``; a pod killed with ``kill -9`` loses it with its
connection), which the elected waker reads once per heartbeat
(``fleet_members``) and announces with every pod's share on the fleet
channel (:mod:`receipts.waker`). Nothing is written per claim, and nothing
to a shared row at all.

Which bucket a claim charges (:func:`choose`):

* the pod's own share was announced within :data:`SHARE_FRESH_SECONDS`: the
  local bucket;
* the pod is new in the fleet (its LISTEN session began less than
  :data:`JOIN_WAIT_SECONDS` ago) and not yet announced: it waits, so that it
  never claims beside the others' full shares;
* otherwise (no waker heard: behind PgBouncer, ``RECEIPTS_LISTEN_NOTIFY``
  off, an older waker that announces no shares): the shared bucket row, as
  before.

A ``Retry-After`` or an outage still pauses the whole fleet at once: every
claim reads ``receipt_flow``'s pause, written only when a pause is set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: Shares announced this long ago (seconds) are still used: longer than a
#: waker's failover (its silence, then an election), so that a new waker's
#: first announcement arrives before the pods fall back to the shared row.
SHARE_FRESH_SECONDS = 10.0
#: A pod whose LISTEN session is this young (seconds) waits for its share
#: rather than charging the shared row: the waker announces every second.
JOIN_WAIT_SECONDS = 3.0
#: While the bucket is empty, a claim waits for this many seconds' worth of
#: tokens (at least one, at most the free slots): one claim per few jobs, not
#: one per job.
CLAIM_TOKENS_SECONDS = 0.05


class TokenBucket:
    """A local token bucket: *rate* tokens/s, at most *capacity* tokens (≥ 1).

    Starts empty, so a pod that joins (or restarts) does not add a burst on
    top of the others'. :meth:`resize` changes rate and capacity when the
    pod's share changes (the tokens held are kept, up to the new capacity).

    Args:
        rate: tokens per second (> 0).
        capacity: the most tokens held (jobs; raised to 1).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, rate: float, capacity: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.rate = max(float(rate), 1e-9)
        self.capacity = max(float(capacity), 1.0)
        self.tokens = 0.0
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._at) * self.rate)
        self._at = now

    def resize(self, rate: float, capacity: float) -> None:
        """New *rate* (tokens/s) and *capacity* (tokens), from now on."""
        self._refill()
        self.rate = max(float(rate), 1e-9)
        self.capacity = max(float(capacity), 1.0)
        self.tokens = min(self.tokens, self.capacity)

    def allowance(self, want: int) -> tuple[int, float]:
        """Take up to *want* tokens: ``(n, 0.0)`` with 1 ≤ n ≤ *want*, or ``(0, seconds)``
        to wait until a claim's worth (:data:`CLAIM_TOKENS_SECONDS`, ≥ 1 token) is there."""
        self._refill()
        if want < 1:
            return 0, 0.0
        if self.tokens >= 1.0:
            n = min(want, int(self.tokens))
            self.tokens -= n
            return n, 0.0
        need = max(1.0, min(float(want), self.rate * CLAIM_TOKENS_SECONDS, self.capacity))
        return 0, (need - self.tokens) / self.rate

    def available(self, want: int) -> int:
        """What :meth:`allowance` would grant *want* now, without taking it (0 when
        it would wait)."""
        self._refill()
        return min(want, int(self.tokens)) if want >= 1 and self.tokens >= 1.0 else 0

    def refund(self, unused: int) -> None:
        """Give back tokens for jobs a claim asked for but did not get."""
        if unused > 0:
            self.tokens = min(self.capacity, self.tokens + unused)


@dataclass(frozen=True, slots=True)
class Choice:
    """Which bucket the next claim charges (see :func:`choose`).

    ``mode`` is ``"local"`` (with ``share``, 0 < share ≤ 1), ``"wait"`` (for
    ``wait_seconds``) or ``"shared"`` (the ``receipt_flow`` row).
    """

    mode: str
    share: float = 0.0
    wait_seconds: float = 0.0


def choose(*, shares: Mapping[str, float] | None, tag: str | None, shares_age: float,
           member_age: float | None) -> Choice:
    """The bucket for the next claim under a rate limit (module doc).

    Args:
        shares: the last announced shares (pod tag → share of the limit), or None.
        tag: this pod's tag (None: it cannot be a member).
        shares_age: seconds since *shares* were announced.
        member_age: seconds since this pod's LISTEN session took its member
            lock, or since the pod started while it has not taken one yet
            (None: it can hold none).
    """
    if tag is not None and shares is not None and shares_age < SHARE_FRESH_SECONDS:
        share = shares.get(tag)
        if share is not None and share > 0:
            return Choice("local", share=min(float(share), 1.0))
    if member_age is not None and member_age < JOIN_WAIT_SECONDS:
        return Choice("wait", wait_seconds=0.1)
    return Choice("shared")


def shares_of(members: Mapping[str, int | None],
              lead: tuple[str, float] | None = None) -> dict[str, float]:
    """Each live pod's share of the fleet's rate limit, by its weight (its slots).

    *members*: pod tag → slots (None: not reported yet, weighed as the mean of
    the others, or 1). *lead*: ``(tag, share)``, a pod that gets *share* of
    the limit when that is more than its weight's (the waker's pod at a calm
    rate: :data:`receipts.waker.LEAD_MAX_SHARE`, "A leading share" in
    docs/design.md); the others split the rest by weight. A lead is ignored
    when its pod is the only member or not one, and clamped to [0, 1).
    Shares add up to 1; an empty fleet has none.
    """
    known = [s for s in members.values() if s is not None and s > 0]
    default = sum(known) / len(known) if known else 1.0
    weights = {tag: float(s) if s is not None and s > 0 else default
               for tag, s in members.items()}
    total = sum(weights.values())
    if total <= 0:
        return {}
    shares = {tag: w / total for tag, w in weights.items()}
    if lead is not None and lead[0] in shares and len(shares) > 1:
        tag, share = lead[0], min(max(float(lead[1]), 0.0), 0.999)
        if share > shares[tag]:
            rest = total - weights[tag]
            shares = {t: (share if t == tag else (1.0 - share) * w / rest)
                      for t, w in weights.items()}
    return {tag: round(v, 6) for tag, v in shares.items()}
