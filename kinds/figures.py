"""A kind's per-step figures, described once: how the coordinator folds each over the ranks, and how every view
shows it (``JobKind.figures``: name -> ``Figure``, or just its ``Fold``).

The views iterate over these descriptions and name no figure themselves: the dashboard's figures and charts
(``coordinator.web.jobview``, ``coordinator.web.series``) and the Prometheus gauges (``coordinator.web.metrics``).
A new kind gets its gauges and charts by describing its figures, without a change to the coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

Fold = Literal["first", "min", "max"]      # how a step's figure is folded over the ranks that report it


@dataclass(frozen=True)
class Figure:
    """One figure: ``fold`` (``first`` a value every reporting rank agrees on, such as a loss; ``min``/``max``
    the slowest or largest rank's); ``label`` as the dashboard shows it (its name when empty) and ``unit``;
    ``chart``: the dashboard chart it is drawn on, ``line`` its line there (figures naming one chart share it,
    the first one named is its main line); ``metric``: its Prometheus gauge (labelled by job), with ``help``;
    ``sparse``: reported on some steps only (a validation loss): its gauge and figure keep its latest value."""

    fold: Fold
    label: str = ""
    unit: str = ""
    chart: str = ""
    line: str = ""
    metric: str = ""
    help: str = ""
    sparse: bool = False


def figure(value: Fold | Figure) -> Figure:
    return value if isinstance(value, Figure) else Figure(value)


def folds_of(figures: Mapping[str, Fold | Figure]) -> dict[str, Fold]:
    """name -> how it is folded (what ``coordinator.diagnosis.progress`` folds)."""
    return {name: figure(value).fold for name, value in figures.items()}


def described(figures: Mapping[str, Fold | Figure]) -> dict[str, Figure]:
    return {name: figure(value) for name, value in figures.items()}


def charts_of(figures: Mapping[str, Fold | Figure]) -> dict[str, list[tuple[str, Figure]]]:
    """chart -> its (figure name, figure) lines, in the order the kind names them."""
    out: dict[str, list[tuple[str, Figure]]] = {}
    for name, f in described(figures).items():
        if f.chart:
            out.setdefault(f.chart, []).append((name, f))
    return out
