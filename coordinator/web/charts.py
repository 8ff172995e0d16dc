"""Line charts as SVG text, drawn by the server (no script, no chart library in the page).

Each line is one ``<polyline>`` whose ``points`` hold one vertex per plotted point (a marker draws a dot
at every vertex); ``data-points`` on the line and on the ``<svg>`` (its first line) says how many.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

W, H = 560, 220
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 12, 28


@dataclass(frozen=True)
class Series:
    name: str                     # the line's CSS class
    points: list[tuple[int, float]]
    label: str = ""               # its legend text (default: the name)


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _bounds(lines: list[Series]) -> tuple[float, float, float, float]:
    xs = [x for s in lines for x, _ in s.points]
    ys = [y for s in lines for _, y in s.points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.05 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    return x0, x1, y0, y1


def _polyline(s: Series, box: tuple[float, float, float, float], dot: str) -> str:
    x0, x1, y0, y1 = box
    sx, sy = (W - LEFT - RIGHT) / (x1 - x0), (H - TOP - BOTTOM) / (y1 - y0)
    pts = " ".join(f"{LEFT + (x - x0) * sx:.1f},{H - BOTTOM - (y - y0) * sy:.1f}" for x, y in s.points)
    return (f'<polyline class="line {escape(s.name)}" data-points="{len(s.points)}" points="{pts}" '
            f'marker-start="url(#{dot})" marker-mid="url(#{dot})" marker-end="url(#{dot})"/>')


def _axes(box: tuple[float, float, float, float], x_label: str) -> str:
    x0, x1, y0, y1 = box
    return (f'<line class="axis" x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}"/>'
            f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}"/>'
            f'<text x="{LEFT - 4}" y="{TOP + 8}" text-anchor="end">{_fmt(y1)}</text>'
            f'<text x="{LEFT - 4}" y="{H - BOTTOM}" text-anchor="end">{_fmt(y0)}</text>'
            f'<text x="{LEFT}" y="{H - 8}">{escape(x_label)} {x0:g}</text>'
            f'<text x="{W - RIGHT}" y="{H - 8}" text-anchor="end">{x1:g}</text>')


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
                     f'text-anchor="end">{escape(s.label or s.name)} ({len(s.points)})</text>' for i, s in enumerate(drawn))
    return head + _axes(box, x_label) + "".join(_polyline(s, box, dot) for s in drawn) + legend + "</svg>"
