"""A fixed-bucket histogram kept by the core (O(log buckets) per observation) and exposed by the metrics; a run's step
times as its summary shows them."""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass, field


def exponential_bounds(low: float, high: float, per_doubling: int) -> tuple[float, ...]:
    """Bucket bounds from ``low`` until one reaches ``high``, ``per_doubling`` of them per factor 2 (each
    2**(1/per_doubling) times the one before; 3 significant digits), so that every bucket is as wide
    relative to its values: a quantile read from them is off by at most half a bucket's ratio."""
    if not 0 < low < high or per_doubling < 1:
        raise ValueError(f"exponential_bounds: need 0 < low < high and per_doubling >= 1, "
                         f"not low={low!r}, high={high!r}, per_doubling={per_doubling!r}")
    n = math.ceil(per_doubling * math.log2(high / low))
    return tuple(float(f"{low * 2 ** (k / per_doubling):.3g}") for k in range(n + 1))


@dataclass
class Histogram:
    """Fixed buckets, counted per bucket (the last one: above every bound); Prometheus wants them cumulative."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float, n: int = 1) -> None:
        """``n`` observations of ``value``."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n   # le: a value equal to a bound is in it
        self.total += value * n

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts):
            running += n
            out.append((bound, running))
        return out

    @property
    def count(self) -> int:
        return sum(self.counts)


RECENT_TIMES = 4096   # step durations a run's median is taken over, at most (the newest)


@dataclass
class RunTimes:
    """A run's step durations: the exact fastest and slowest, and the median of the newest ``RECENT_TIMES`` (taken on
    read, cached until the next one): what a run's summary shows, not only its last step's."""

    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_TIMES))
    low: float | None = None
    high: float | None = None
    _median: tuple[int, float] | None = None
    seen: int = 0

    def observe(self, dt: float) -> None:
        self.recent.append(dt)
        self.low = dt if self.low is None or dt < self.low else self.low
        self.high = dt if self.high is None or dt > self.high else self.high
        self.seen += 1

    def figures(self) -> dict[str, float]:
        """``step_time_median``, ``step_time_run_min``, ``step_time_run_max`` (none before a step is timed)."""
        if self.low is None or self.high is None:
            return {}
        if self._median is None or self._median[0] != self.seen:
            self._median = (self.seen, statistics.median(self.recent))
        return {"step_time_median": self._median[1], "step_time_run_min": self.low, "step_time_run_max": self.high}
