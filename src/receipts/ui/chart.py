"""The queue-depth chart: ready, running and failed jobs over the last hour, as inline SVG.

Drawn on the server from the samples the page's :class:`~receipts.ui.monitor.Monitor`
keeps in memory, so it needs no script, no library and no weaker CSP (SVG
presentation attributes are not styles). Each series is a polyline; a gap of
more than :data:`GAP_FACTOR` sampling intervals breaks the line rather than
drawing a slope through time nobody measured. Series differ by colour *and*
dash pattern, and the figure has a text summary for screen readers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from markupsafe import Markup, escape

WIDTH, HEIGHT = 640, 180
LEFT, RIGHT, TOP, BOTTOM = 48, 12, 12, 26
#: A pause between two samples longer than this many intervals breaks the line.
GAP_FACTOR = 3.0
#: (attribute name on a sample, label, colour, dash pattern)
SERIES = (("ready", "ready", "#1f5fbf", ""),
          ("running", "running", "#2e7d32", "6 3"),
          ("failed", "failed", "#b3261e", "2 3"))


@dataclass(frozen=True, slots=True)
class Sample:
    """The queue at one moment (database time): rows by state."""

    at: datetime
    ready: int
    running: int
    failed: int


def nice_ceiling(value: float) -> int:
    """The smallest of 1, 2, 5 × 10ⁿ at or above *value* (at least 1): the y axis top."""
    if value <= 1:
        return 1
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * power >= value:
            return int(step * power)
    return int(10 * power)  # pragma: no cover


def depth_chart(samples: Sequence[Sample], now: datetime, *, window_seconds: float = 3600.0,
                interval_seconds: float = 5.0) -> Markup:
    """The SVG figure of *samples* over the *window_seconds* up to *now*.

    *interval_seconds* is the sampling interval (for gap detection). Returns
    markup ready for a template; every text in it is escaped.
    """
    shown = [s for s in samples if (now - s.at).total_seconds() <= window_seconds]
    top = nice_ceiling(max([max(s.ready, s.running, s.failed) for s in shown] or [0]))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(at: datetime) -> float:
        age = (now - at).total_seconds()
        return LEFT + plot_w * (1 - age / window_seconds)

    def y(value: int) -> float:
        return TOP + plot_h * (1 - value / top)

    parts = [
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" '
        'stroke="#5b6672" stroke-width="1"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT + plot_w}" y2="{TOP}" '
        'stroke="#d8dde3" stroke-width="1"/>',
        f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end" font-size="11" '
        f'fill="#3d4650">{top:,}</text>',
        f'<text x="{LEFT - 6}" y="{TOP + plot_h + 4}" text-anchor="end" font-size="11" '
        'fill="#3d4650">0</text>',
    ]
    minutes = round(window_seconds / 60)
    for fraction, label in ((0.0, f"−{minutes} min"), (0.5, f"−{minutes // 2} min"),
                            (1.0, "now")):
        anchor = "start" if fraction == 0 else "end" if fraction == 1 else "middle"
        parts.append(f'<text x="{LEFT + plot_w * fraction:.1f}" y="{HEIGHT - 6}" '
                     f'text-anchor="{anchor}" font-size="11" fill="#3d4650">{label}</text>')
    gap = interval_seconds * GAP_FACTOR
    for attribute, _, colour, dash in SERIES:
        runs: list[list[str]] = []
        previous: datetime | None = None
        for sample in shown:
            if previous is None or (sample.at - previous).total_seconds() > gap:
                runs.append([])
            runs[-1].append(f"{x(sample.at):.1f},{y(getattr(sample, attribute)):.1f}")
            previous = sample.at
        for run in runs:
            if len(run) == 1:  # one point: a dot, so a lone sample still shows
                cx, cy = run[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{colour}"/>')
            else:
                dashes = f' stroke-dasharray="{dash}"' if dash else ""
                parts.append(f'<polyline points="{" ".join(run)}" fill="none" '
                             f'stroke="{colour}" stroke-width="2"{dashes}/>')
    summary = describe(shown, window_seconds)
    return Markup(
        f'<svg class="depth" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-labelledby="depth-title">'
        f'<title id="depth-title">{escape(summary)}</title>{"".join(parts)}</svg>')


def describe(samples: Sequence[Sample], window_seconds: float) -> str:
    """One sentence for screen readers: each series' first, last and highest value."""
    if not samples:
        return "Queue depth: no samples yet."
    minutes = round(window_seconds / 60)
    first = samples[0]
    if (samples[-1].at - first.at).total_seconds() < window_seconds * 0.9:
        since = f"since {first.at:%H:%M} UTC"
    else:
        since = f"over the last {minutes} minutes"
    pieces = []
    for attribute, label, _, _ in SERIES:
        values = [getattr(s, attribute) for s in samples]
        pieces.append(f"{label} {values[0]:,} to {values[-1]:,} (highest {max(values):,})")
    return f"Queue depth {since}: " + "; ".join(pieces) + "."


def legend() -> Markup:
    """The chart's legend as HTML: each series' colour swatch (an inline SVG line) and name."""
    items = []
    for _, label, colour, dash in SERIES:
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        items.append(f'<li><svg width="24" height="8" aria-hidden="true"><line x1="0" y1="4" '
                     f'x2="24" y2="4" stroke="{colour}" stroke-width="2"{dashes}/></svg>'
                     f'{label}</li>')
    return Markup(f'<ul class="legend">{"".join(items)}</ul>')
