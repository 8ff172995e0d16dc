"""Line charts as SVG text, drawn by the server (no script, no chart library in the page).

Each line is one ``<polyline>`` whose ``points`` hold one vertex per plotted point (a marker draws a dot
at every vertex); ``data-points`` on the line and on the ``<svg>`` (its first line) says how many. Both
axes have ticks at round values with short labels (``10,030``, ``1.2M``) that fit inside the viewBox, and
up to ``HOVER_POINTS`` points of each line carry a ``<title>`` (the step and the value) shown on hover.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

from rankctl.coordinator.web.html import number

W, H = 560, 236
LEFT, RIGHT, TOP, BOTTOM = 60, 28, 12, 42
TICKS = 5              # about this many ticks per axis
MIN_TICKS = 3          # ticks an axis shows at least
HOVER_POINTS = 120     # points per line with a hover title (evenly over the line, and its newest)
SUFFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
PLAIN_BELOW = 1e5      # labels below this magnitude are written out (10,030); above, with a suffix


@dataclass(frozen=True)
class Series:
    name: str                     # the line's CSS class
    points: list[tuple[int, float]]
    label: str = ""               # its legend text (default: the name)


def nice_step(span: float, ticks: int = TICKS) -> float:
    """A round distance (1, 2 or 5 times a power of ten) giving about ``ticks`` ticks over ``span``, and at
    least ``MIN_TICKS`` wherever the axis starts (``span / step`` intervals hold that many multiples)."""
    raw = span / max(1, ticks)
    exp = math.floor(math.log10(raw))
    steps = [m * 10.0 ** e for e in (exp - 1, exp, exp + 1) for m in (1, 2, 5)]
    enough = [s for s in steps if span / s >= MIN_TICKS]
    return min(enough or steps[:1], key=lambda s: abs(math.log(span / s / ticks)))


def tick_values(lo: float, hi: float, step: float) -> list[float]:
    """The multiples of ``step`` in [lo, hi]."""
    first = math.ceil(lo / step - 1e-9)
    count = math.floor(hi / step + 1e-9) - first + 1
    return [round((first + i) * step, 12) for i in range(max(0, count))]


def tick_labels(values: list[float], step: float) -> list[str]:
    """Short labels of ticks ``step`` apart, one scale for the axis: ``10,030``, ``0.25``, ``1.25M``."""
    big = max([abs(step), *map(abs, values)])
    scale, suffix = next(((s, x) for s, x in SUFFIXES if big >= PLAIN_BELOW and big >= s), (1.0, ""))
    decimals = min(6, max(0, -math.floor(math.log10(step / scale) + 1e-9)))
    texts = (f"{v / scale:,.{decimals}f}" for v in values)
    return [("0" if t.strip("-0.,") == "" else t) + suffix for t in texts]


def _bounds(lines: list[Series]) -> tuple[float, float, float, float]:
    """x from the first to the last step; y widened to round values."""
    xs = [x for s in lines for x, _ in s.points]
    ys = [y for s in lines for _, y in s.points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.05 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    step = nice_step(y1 - y0)
    return x0, x1, math.floor(y0 / step + 1e-9) * step, math.ceil(y1 / step - 1e-9) * step


def _scale(box: tuple[float, float, float, float]):  # noqa: ANN202 - (x, y) -> (px, py)
    x0, x1, y0, y1 = box
    sx, sy = (W - LEFT - RIGHT) / (x1 - x0), (H - TOP - BOTTOM) / (y1 - y0)
    return lambda x, y: (LEFT + (x - x0) * sx, H - BOTTOM - (y - y0) * sy)


def _polyline(s: Series, box: tuple[float, float, float, float], dot: str) -> str:
    at = _scale(box)
    pts = " ".join("{:.1f},{:.1f}".format(*at(x, y)) for x, y in s.points)
    return (f'<polyline class="line {escape(s.name)}" data-points="{len(s.points)}" points="{pts}" '
            f'marker-start="url(#{dot})" marker-mid="url(#{dot})" marker-end="url(#{dot})"/>')


def hover_points(points: list[tuple[int, float]], most: int = HOVER_POINTS) -> list[tuple[int, float]]:
    """At most ``most`` of ``points``, evenly spread, always with the newest."""
    if len(points) <= most:
        return list(points)
    every = -(-len(points) // (most - 1))
    return [*points[::every], points[-1]] if (len(points) - 1) % every else points[::every]


def _hits(s: Series, box: tuple[float, float, float, float], x_label: str) -> str:
    at, label = _scale(box), escape(s.label or s.name)
    return "".join('<circle class="hit" cx="{:.1f}" cy="{:.1f}" r="5">'.format(*at(x, y)) +
                   f"<title>{escape(x_label)} {x:,}: {label} {number(y)}</title></circle>"
                   for x, y in hover_points(s.points))


def _axes(box: tuple[float, float, float, float], x_label: str) -> str:
    x0, x1, y0, y1 = box
    at, ystep, xstep = _scale(box), nice_step(y1 - y0), max(1.0, nice_step(x1 - x0))
    out = [f'<line class="axis" x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}"/>',
           f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}"/>']
    ys, xs = tick_values(y0, y1, ystep), tick_values(x0, x1, xstep)
    for v, text in zip(ys, tick_labels(ys, ystep)):
        py = at(x0, v)[1]
        out.append(f'<line class="grid" x1="{LEFT}" y1="{py:.1f}" x2="{W - RIGHT}" y2="{py:.1f}"/>'
                   f'<text class="tick y" x="{LEFT - 5}" y="{py + 4:.1f}" text-anchor="end">'
                   f'{text}</text>')
    for v, text in zip(xs, tick_labels(xs, xstep)):
        px = at(v, y0)[0]
        out.append(f'<line class="axis" x1="{px:.1f}" y1="{H - BOTTOM}" x2="{px:.1f}" y2="{H - BOTTOM + 4}"/>'
                   f'<text class="tick x" x="{px:.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">'
                   f'{text}</text>')
    out.append(f'<text class="axis-name" x="{(LEFT + W - RIGHT) / 2}" y="{H - 6}" text-anchor="middle">'
               f'{escape(x_label)}</text>')
    return "".join(out)


def line_chart(svg_id: str, lines: list[Series], x_label: str = "step", empty: str = "no data yet") -> str:
    """An SVG chart of ``lines`` (the first is the main one: its count is the svg's ``data-points``)."""
    drawn, dot = [s for s in lines if s.points], escape(f"{svg_id}-dot")
    count = len(lines[0].points) if lines else 0
    head = (f'<svg id="{escape(svg_id)}" class="chart" data-points="{count}" viewBox="0 0 {W} {H}" '
            f'width="{W}" height="{H}" xmlns="http://www.w3.org/2000/svg">'
            f'<defs><marker id="{dot}" viewBox="0 0 4 4" refX="2" refY="2" markerWidth="4" markerHeight="4">'
            '<circle cx="2" cy="2" r="1.6" class="dot"/></marker></defs>')
    if not drawn:
        return f'{head}<text x="{W / 2}" y="{H / 2}" text-anchor="middle">{escape(empty)}</text></svg>'
    box = _bounds(drawn)
    legend = "".join(f'<text class="legend {escape(s.name)}" x="{W - RIGHT - 4}" y="{TOP + 12 + 14 * i}" '
                     f'text-anchor="end">{escape(s.label or s.name)} ({len(s.points)})</text>'
                     for i, s in enumerate(drawn))
    lines_svg = "".join(_polyline(s, box, dot) for s in drawn)
    hits = "".join(_hits(s, box, x_label) for s in drawn)
    return f'{head}{_axes(box, x_label)}{lines_svg}<g class="hits">{hits}</g>{legend}</svg>'
