"""Per-connection rate bounds for node streams: a token bucket that answers how long to wait.

A node stream may carry at most ``rate`` units a second on average, in bursts of ``burst``; a
message over the budget is not dropped (reports are never lost) but read only after the wait, so
gRPC's flow control slows the sender down. Pure: the clock is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

REPORTS_PER_S = 2000.0      # rank reports a second per node stream (a node of 8 ranks sends ~40)
REPORTS_BURST = 20000.0     # ... a reconnect's replay of buffered reports goes at this pace after the burst
BYTES_PER_S = 8 << 20       # bytes a second per node stream (reports, log chunks)
BYTES_BURST = 32 << 20


@dataclass
class TokenBucket:
    rate: float
    burst: float
    tokens: float = -1.0   # starts full
    at: float | None = None

    def delay(self, cost: float, now: float) -> float:
        """Take ``cost`` units at time ``now``; the seconds to wait before the message may be handled
        (0.0 within the budget). The debt is taken at once, so waits add up fairly."""
        if self.at is None:
            self.tokens, self.at = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= cost
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class StreamBudget:
    """The budget of one node stream: reports and bytes."""

    def __init__(self) -> None:
        self.reports = TokenBucket(REPORTS_PER_S, REPORTS_BURST)
        self.bytes = TokenBucket(BYTES_PER_S, BYTES_BURST)
        self.waited = 0.0   # seconds this stream was held back, in all

    def delay(self, reports: int, size: int, now: float) -> float:
        wait = max(self.reports.delay(reports, now), self.bytes.delay(size, now))
        self.waited += wait
        return wait
