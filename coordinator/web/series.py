"""A job's step figures for the dashboard: read incrementally from its stored ``step`` events, bounded.

``StepSeries`` folds step events in order (``add``) and keeps every point until there are more than
``cap``; then it keeps every 2nd, 4th ... (evenly over the step events, the stride doubling), so its
memory and the points plotted stay under ``cap`` whatever the job's length. ``SeriesCache`` holds one
series per job (the most recently viewed ones) and reads only the events after the last one it saw,
a bounded number per request: a long history is caught up over a few polls. Call it from the event loop.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from rankctl.kinds import registry
from rankctl.kinds.figures import described

MAX_POINTS = 2000      # points kept (and plotted) per line
READ_CHUNK = 1000      # events read from the store at once
CHUNKS_PER_READ = 5    # ... and at most this many chunks per request
JOBS_CACHED = 64       # series kept in memory (most recently viewed jobs)
NOTES_KEPT = 20        # the newest events that are neither steps nor rank phases (transitions, nodes, stragglers)

Point = tuple[int, float]  # (step, value)


def _finite(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


@dataclass
class Line:
    """One evenly thinned line: every ``stride``-th point by arrival, and always the newest."""

    cap: int = MAX_POINTS
    seen: int = 0
    stride: int = 1
    kept: list[Point] = field(default_factory=list)
    last: Point | None = None

    def add(self, point: Point) -> None:
        if self.seen % self.stride == 0:
            self.kept.append(point)
            if len(self.kept) > self.cap - 1:  # room for the newest point beside them
                self.kept = self.kept[::2]
                self.stride *= 2
        self.seen += 1
        self.last = point

    def points(self) -> list[Point]:
        """What is plotted: every point (``seen`` <= cap), else the thinned ones and the newest."""
        if self.last is None or (self.kept and self.kept[-1] is self.last):
            return list(self.kept)
        return [*self.kept, self.last]


@dataclass
class StepSeries:
    """The charted figures of a job by step (``charted``: figure names drawn on some kind's chart,
    ``kinds.figures``), a line each; ``seq`` is the last event read."""

    charted: frozenset[str] = frozenset()
    seq: int = 0
    step_events: int = 0
    lines: dict[str, Line] = field(default_factory=dict)
    latest: dict[str, Any] = field(default_factory=dict)  # the newest step event's metrics and step
    notes: deque = field(default_factory=lambda: deque(maxlen=NOTES_KEPT))  # (ts, kind, message)

    def add(self, ev: Any) -> None:
        """One stored event (an ``EventRecord``), in order."""
        self.seq = ev.seq
        if ev.kind != "step":
            if ev.kind != "rank":
                self.notes.append((ev.ts, ev.kind, ev.message))
            return
        metrics = ev.metrics or {}
        self.step_events += 1
        self.latest = {"step": ev.step, **metrics}
        for name in self.charted:
            value = _finite(metrics.get(name))
            if value is not None:
                self.lines.setdefault(name, Line()).add((ev.step, value))


@dataclass(frozen=True)
class Snapshot:
    """A series as it was at one moment: plain lists, safe to render on another thread."""

    step_events: int
    seen: dict[str, int]              # figure -> its points seen
    lines: dict[str, list[Point]]     # figure -> its points plotted
    latest: dict[str, Any]
    notes: list[tuple[float, str, str]]

    def line(self, name: str) -> list[Point]:
        return self.lines.get(name, [])


def snapshot(s: StepSeries) -> Snapshot:
    return Snapshot(s.step_events, {k: v.seen for k, v in s.lines.items()},
                    {k: v.points() for k, v in s.lines.items()}, dict(s.latest), list(s.notes))


def charted_figures() -> frozenset[str]:
    """Every figure a registered kind draws on a chart."""
    return frozenset(name for kind in registry.kinds().values() for name, f in described(kind.figures).items()
                     if f.chart)


class SeriesCache:
    """``get(job_id)``: the job's series, brought up to date from ``events(job_id, after_seq, limit)``."""

    def __init__(self, events: Callable[[str, int, int], list], jobs: int = JOBS_CACHED) -> None:
        self._events, self._jobs = events, jobs
        self._series: OrderedDict[str, StepSeries] = OrderedDict()

    def get(self, job_id: str) -> StepSeries:
        series = self._series.pop(job_id, None) or StepSeries(charted_figures())
        self._series[job_id] = series
        while len(self._series) > self._jobs:
            self._series.popitem(last=False)
        for _ in range(CHUNKS_PER_READ):
            chunk = self._events(job_id, series.seq, READ_CHUNK)
            for ev in chunk:
                series.add(ev)
            if len(chunk) < READ_CHUNK:
                break
        return series
