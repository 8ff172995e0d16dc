"""The counters the coordinator keeps for its metrics, apart from the metrics that read them.

The core's collaborators count here as things happen (O(1) each); ``coordinator.web.metrics`` reads the
counters at scrape time. Neither imports the other's module: both import this one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rankctl.coordinator.model.histogram import Histogram

QUEUE_WAIT_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)
RESTART_CAUSES = ("failure", "drain", "grow")


@dataclass
class CoordinatorStats:
    """What the core counts for its metrics (since the process started, as Prometheus counters are)."""

    rank_reports: int = 0                                    # applied and stored
    restarts: Counter = field(default_factory=Counter)       # cause ("failure" | "drain" | "grow") -> attempts
    queue_wait: Histogram = field(default_factory=lambda: Histogram(QUEUE_WAIT_BUCKETS))
