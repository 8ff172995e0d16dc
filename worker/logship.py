"""A rank's log lines on their way to the coordinator, within limits.

Each line is cut at ``MAX_LINE_BYTES`` (marked) and each rank ships at most ``LINES_PER_S``
lines a second, with a burst of ``BURST`` (a token bucket); the excess is dropped and one
marker line per read says how many. The rank's full log stays in its file on the node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from rankctl.worker.status import FileTailer

MAX_LINE_BYTES = 4096
LINES_PER_S = 1000.0
BURST = 2000
MAX_READ_BYTES = 4 << 20  # per rank per poll


@dataclass
class LineBudget:
    """A token bucket of lines: ``rate`` a second, at most ``burst`` saved up."""

    rate: float = LINES_PER_S
    burst: float = BURST
    clock: Callable[[], float] = time.monotonic
    tokens: float = field(init=False)
    last: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens, self.last = float(self.burst), self.clock()

    def take(self, wanted: int) -> int:
        """How many of ``wanted`` lines may go now."""
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.last) * self.rate)
        self.last = now
        n = min(wanted, int(self.tokens))
        self.tokens -= n
        return n


@dataclass
class RankLog:
    """One rank's log file, read for shipping: lines cut, rate limited, drops counted."""

    path: str
    node: str
    budget: LineBudget = field(default_factory=LineBudget)
    tailer: FileTailer = field(init=False)

    def __post_init__(self) -> None:
        self.tailer = FileTailer(self.path, max_line=MAX_LINE_BYTES, max_read=MAX_READ_BYTES)

    def read(self) -> list[str]:
        """The lines to ship now, with a marker line if some were dropped."""
        lines = self.tailer.read_lines()
        n = self.budget.take(len(lines))
        if n == len(lines):
            return lines
        dropped = len(lines) - n
        return lines[:n] + [f"[rankctl: {dropped} lines dropped (over {self.budget.rate:g} lines/s); "
                            f"the full log is {self.path} on node {self.node}]"]

    def drained(self) -> bool:
        return self.tailer.at_end()
