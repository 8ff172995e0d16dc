"""A fixed-bucket histogram kept by the core (O(log buckets) per observation) and exposed by the metrics."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class Histogram:
    """Fixed buckets, counted per bucket (the last one: above every bound); Prometheus wants them cumulative."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1   # le: a value equal to a bound is in it
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts):
            running += n
            out.append((bound, running))
        return out

    @property
    def count(self) -> int:
        return sum(self.counts)
