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
    #: A sample kept once a minute (``receipt_ui_samples``), read back after a restart.
    coarse: bool = False


def axis_margin(label: str, font_px: float = 11.0) -> int:
    """The left margin (SVG units) that fits the y axis' widest *label* (``1,000,000``)
    at *font_px*: about 0.62 em a character, plus room for the tick."""
    return max(LEFT, int(len(label) * font_px * 0.62) + 12)


def _nice(value: float) -> float:
    """The smallest of 1, 2, 5 × 10ⁿ (n any integer) at or above *value* (> 0)."""
    power = 10 ** math.floor(math.log10(value))
    return float(next(step * power for step in (1, 2, 5, 10) if step * power >= value))


def nice_ceiling(value: float) -> int:
    """The smallest of 1, 2, 5 × 10ⁿ at or above *value* (at least 1): the y axis top."""
    return 1 if value <= 1 else int(_nice(value))


def depth_chart(samples: Sequence[Sample], now: datetime, *, window_seconds: float = 3600.0,
                interval_seconds: float = 5.0) -> Markup:
    """The SVG figure of *samples* over the *window_seconds* up to *now*.

    *interval_seconds* is the sampling interval (for gap detection). Returns
    markup ready for a template; every text in it is escaped.
    """
    shown = [s for s in samples if (now - s.at).total_seconds() <= window_seconds]
    top = nice_ceiling(max([max(s.ready, s.running, s.failed) for s in shown] or [0]))
    left = axis_margin(f"{top:,}")
    plot_w, plot_h = WIDTH - left - RIGHT, HEIGHT - TOP - BOTTOM

    def x(at: datetime) -> float:
        age = (now - at).total_seconds()
        return left + plot_w * (1 - age / window_seconds)

    def y(value: int) -> float:
        return TOP + plot_h * (1 - value / top)

    parts = [
        f'<line x1="{left}" y1="{TOP + plot_h}" x2="{left + plot_w}" y2="{TOP + plot_h}" '
        'stroke="#5b6672" stroke-width="1"/>',
        f'<line x1="{left}" y1="{TOP}" x2="{left + plot_w}" y2="{TOP}" '
        'stroke="#d8dde3" stroke-width="1"/>',
        f'<text x="{left - 6}" y="{TOP + 4}" text-anchor="end" font-size="11" '
        f'fill="#3d4650">{top:,}</text>',
        f'<text x="{left - 6}" y="{TOP + plot_h + 4}" text-anchor="end" font-size="11" '
        'fill="#3d4650">0</text>',
    ]
    minutes = round(window_seconds / 60)
    for fraction, label in ((0.0, f"−{minutes} min"), (0.5, f"−{minutes // 2} min"),
                            (1.0, "now")):
        anchor = "start" if fraction == 0 else "end" if fraction == 1 else "middle"
        parts.append(f'<text x="{left + plot_w * fraction:.1f}" y="{HEIGHT - 6}" '
                     f'text-anchor="{anchor}" font-size="11" fill="#3d4650">{label}</text>')
    for attribute, _, colour, dash in SERIES:
        runs: list[list[str]] = []
        previous: Sample | None = None
        for sample in shown:
            # Kept samples are a minute apart: their gap is measured in minutes.
            step = 60.0 if previous is not None and previous.coarse else interval_seconds
            if previous is None or (sample.at - previous.at).total_seconds() > (
                    step * GAP_FACTOR):
                runs.append([])
            runs[-1].append(f"{x(sample.at):.1f},{y(getattr(sample, attribute)):.1f}")
            previous = sample
        for run in runs:
            if len(run) == 1:  # one point: a dot, so a lone sample still shows
                cx, cy = run[0].split(",")
                parts.append(f'<circle class="s-{attribute}" cx="{cx}" cy="{cy}" r="2" '
                             f'fill="{colour}"/>')
            else:
                dashes = f' stroke-dasharray="{dash}"' if dash else ""
                parts.append(f'<polyline class="s-{attribute}" points="{" ".join(run)}" '
                             f'fill="none" stroke="{colour}" stroke-width="2"{dashes}/>')
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
        items.append(f'<li><svg width="24" height="8" aria-hidden="true"><line '
                     f'class="s-{label}" x1="0" y1="4" x2="24" y2="4" stroke="{colour}" '
                     f'stroke-width="2"{dashes}/></svg>{label}</li>')
    return Markup(f'<ul class="legend">{"".join(items)}</ul>')


#: The throughput and latency charts: narrower than the depth chart, so that at 390 px
#: (about 360 px of content) their 12-unit text is still about 11 px high.
RATE_WIDTH, RATE_HEIGHT = 400, 130
RATE_TOP, RATE_BOTTOM, RATE_RIGHT = 14, 24, 8
LATENCY_SERIES = (("p50", "median", "#1f5fbf", ""), ("p95", "95th percentile", "#b3261e", "5 3"))


def _axis_text(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:g} s"
    return f"{int(value):,}"


def _nice_seconds(value: float) -> float:
    """The y axis top of attempt times: 1, 2, 5 × 10ⁿ seconds at or above *value*."""
    return 1.0 if value <= 0 else _nice(value)


def _frame(top_label: str, left: int, title_id: str, title: str, cls: str) -> list[str]:
    plot_w = RATE_WIDTH - left - RATE_RIGHT
    plot_h = RATE_HEIGHT - RATE_TOP - RATE_BOTTOM
    parts = [
        f'<svg class="rate {cls}" viewBox="0 0 {RATE_WIDTH} {RATE_HEIGHT}" role="img" '
        f'aria-labelledby="{title_id}"><title id="{title_id}">{escape(title)}</title>',
        f'<line x1="{left}" y1="{RATE_TOP + plot_h}" x2="{left + plot_w}" '
        f'y2="{RATE_TOP + plot_h}" stroke="#5b6672" stroke-width="1"/>',
        f'<line x1="{left}" y1="{RATE_TOP}" x2="{left + plot_w}" y2="{RATE_TOP}" '
        'stroke="#d8dde3" stroke-width="1"/>',
        f'<text x="{left - 4}" y="{RATE_TOP + 4}" text-anchor="end" font-size="12" '
        f'fill="#3d4650">{escape(top_label)}</text>',
        f'<text x="{left - 4}" y="{RATE_TOP + plot_h + 4}" text-anchor="end" font-size="12" '
        'fill="#3d4650">0</text>',
    ]
    for fraction, label in ((0.0, "−60 min"), (1.0, "now")):
        anchor = "start" if fraction == 0 else "end"
        parts.append(f'<text x="{left + plot_w * fraction:.1f}" y="{RATE_HEIGHT - 6}" '
                     f'text-anchor="{anchor}" font-size="12" fill="#3d4650">{label}</text>')
    return parts


def throughput_chart(minutes: Sequence[dict[str, object]], now: datetime) -> Markup:
    """Deliveries per minute over the hour up to *now*, as SVG bars (one a minute).

    *minutes*: dicts with ``minute`` (datetime) and ``delivered`` (int), as
    :class:`receipts.ui.monitor.Rates` holds them. Every text is escaped.
    """
    shown = [m for m in minutes if 0 <= (now - m["minute"]).total_seconds() < 3600]  # type: ignore[operator]
    peak = max([int(m["delivered"]) for m in shown] or [0])  # type: ignore[call-overload]
    top = nice_ceiling(peak)
    label = f"{top:,}"
    left = max(30, int(len(label) * 12 * 0.62) + 8)
    plot_w = RATE_WIDTH - left - RATE_RIGHT
    plot_h = RATE_HEIGHT - RATE_TOP - RATE_BOTTOM
    total = sum(int(m["delivered"]) for m in shown)  # type: ignore[call-overload]
    title = (f"Deliveries per minute, last hour: {total:,} in all, at most {peak:,} in one "
             "minute." if shown else "Deliveries per minute: no attempt recorded in the last "
             "hour.")
    parts = _frame(label, left, "rate-title", title, "throughput")
    bar = plot_w / 60
    for m in shown:
        age = (now - m["minute"]).total_seconds()  # type: ignore[operator]
        x = left + plot_w * (1 - (age + 60) / 3600)
        h = plot_h * int(m["delivered"]) / top  # type: ignore[call-overload]
        parts.append(f'<rect class="s-delivered" x="{max(left, x):.1f}" '
                     f'y="{RATE_TOP + plot_h - h:.1f}" width="{max(1.0, bar - 1):.1f}" '
                     f'height="{h:.1f}" fill="#2e7d32"/>')
    parts.append("</svg>")
    return Markup("".join(parts))


def latency_chart(minutes: Sequence[dict[str, object]], now: datetime) -> Markup:
    """The median and 95th percentile attempt time per minute over the hour up to *now*."""
    shown = [m for m in minutes if 0 <= (now - m["minute"]).total_seconds() < 3600  # type: ignore[operator]
             and m.get("p95") is not None]
    top = _nice_seconds(max([float(m["p95"]) for m in shown] or [0.0]))  # type: ignore[arg-type]
    label = _axis_text(top, "s")
    left = max(30, int(len(label) * 12 * 0.62) + 8)
    plot_w = RATE_WIDTH - left - RATE_RIGHT
    plot_h = RATE_HEIGHT - RATE_TOP - RATE_BOTTOM
    if shown:
        worst = max(float(m["p95"]) for m in shown)  # type: ignore[arg-type]
        title = (f"Attempt time per minute, last hour: 95th percentile at most "
                 f"{_axis_text(worst, 's')}.")
    else:
        title = "Attempt time: no attempt recorded in the last hour."
    parts = _frame(label, left, "latency-title", title, "latency")
    for key, _, colour, dash in LATENCY_SERIES:
        points = []
        for m in shown:
            age = (now - m["minute"]).total_seconds() - 30  # type: ignore[operator]
            x = left + plot_w * (1 - age / 3600)
            y = RATE_TOP + plot_h * (1 - min(1.0, float(m[key]) / top))  # type: ignore[arg-type]
            points.append(f"{min(x, left + plot_w):.1f},{y:.1f}")
        if len(points) == 1:
            cx, cy = points[0].split(",")
            parts.append(f'<circle class="s-{key}" cx="{cx}" cy="{cy}" r="2.5" '
                         f'fill="{colour}"/>')
        elif points:
            dashes = f' stroke-dasharray="{dash}"' if dash else ""
            parts.append(f'<polyline class="s-{key}" points="{" ".join(points)}" fill="none" '
                         f'stroke="{colour}" stroke-width="2"{dashes}/>')
    parts.append("</svg>")
    return Markup("".join(parts))


def latency_legend() -> Markup:
    """The latency chart's legend (colour and dash of each percentile)."""
    items = []
    for key, label, colour, dash in LATENCY_SERIES:
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        items.append(f'<li><svg width="24" height="8" aria-hidden="true"><line class="s-{key}" '
                     f'x1="0" y1="4" x2="24" y2="4" stroke="{colour}" stroke-width="2"'
                     f'{dashes}/></svg>{label}</li>')
    return Markup(f'<ul class="legend">{"".join(items)}</ul>')
