"""Retry timing: pure functions, no I/O (docs/design.md §3).

Exponential backoff with *full jitter* (a uniform draw between 0 and the
capped exponential), so that jobs failed together by one provider outage do
not come back together. A provider's ``Retry-After`` is a floor, clamped to a
maximum so that a hostile or broken value cannot park a job for a year.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

#: The defaults of :class:`BackoffPolicy`, seconds; ``Settings`` takes its
#: ``RECEIPTS_RETRY_*`` defaults from these, so the two cannot drift. Base 10 s:
#: with outages pausing the fleet instead of burning attempts, the backoff only
#: rides out one job's own trouble, and five attempts span at most
#: 10 + 20 + 40 + 80 = 150 s (docs/design.md, "Retry defaults").
BASE_SECONDS = 10.0
CAP_SECONDS = 900.0
RETRY_AFTER_MAX_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """Backoff parameters, all in seconds (defaults: the module's constants, which
    ``RECEIPTS_RETRY_BASE_SECONDS``, ``_CAP_SECONDS`` and ``_AFTER_MAX_SECONDS`` share).

    Attributes:
        base_seconds: the ceiling of the first retry's draw.
        cap_seconds: the largest ceiling any retry draws under.
        retry_after_max_seconds: a ``Retry-After`` above this is clamped to it.
    """

    base_seconds: float = BASE_SECONDS
    cap_seconds: float = CAP_SECONDS
    retry_after_max_seconds: float = RETRY_AFTER_MAX_SECONDS

    def ceiling(self, attempt: int) -> float:
        """``min(cap, base × 2^(attempt−1))`` for a 1-based *attempt* (≥1)."""
        exponent = min(max(attempt, 1) - 1, 62)
        return min(self.cap_seconds, self.base_seconds * (2.0**exponent))

    def delay(
        self,
        attempt: int,
        *,
        retry_after_seconds: float | None = None,
        rng: random.Random | None = None,
    ) -> float:
        """Seconds to wait before the next attempt after failed *attempt*.

        Full jitter: ``U(0, ceiling(attempt))``. When the provider asked for
        *retry_after_seconds* (already parsed; None or negative means absent),
        the result is at least that, and never more than
        ``retry_after_max_seconds``.
        """
        draw = (rng or random).uniform(0.0, self.ceiling(attempt))
        if retry_after_seconds is not None and retry_after_seconds >= 0:
            floor = min(retry_after_seconds, self.retry_after_max_seconds)
            return max(draw, floor)
        return draw


def parse_retry_after(value: str | None, *, date_header: str | None = None) -> float | None:
    """Parse a ``Retry-After`` header into seconds from now, or None.

    Accepts delta-seconds (``"120"``) and an HTTP-date. A date is measured
    against the response's own ``Date`` header when given (the provider's
    clock, not ours), else against this machine's clock. Negative, empty or
    malformed values return None (treated as absent; the normal backoff
    applies). The caller clamps large values (see :class:`BackoffPolicy`).
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text.isascii() and text.isdigit():
        return float(int(text[:12]))
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    now = datetime.now(UTC)
    if date_header:
        with contextlib.suppress(TypeError, ValueError, IndexError):
            now = parsedate_to_datetime(date_header) or now
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    seconds = (when - now).total_seconds()
    return seconds if seconds >= 0 else None
