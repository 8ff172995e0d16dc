"""The rank side of the status file (``contract.rankfiles``): one flushed JSON line per record."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

from rankctl.contract.rankfiles import PHASES, status_path


class StatusWriter:
    """Appends status records for one rank; every record is one flushed line.

    With ``counters`` (``runtime.collectives``), each running record with a step also carries the
    time since the previous one split into ``compute_s`` and ``wait_s`` (waiting in collectives):
    the coordinator's stragglers by compute time.
    """

    def __init__(self, run_dir: str, rank: int, *, clock: Callable[[], float] = time.time,
                 counters: Any = None) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.rank = rank
        self.path = status_path(run_dir, rank)
        self._clock = clock
        self._file = open(self.path, "a", encoding="utf-8")
        self.counters = counters
        self._since: tuple[float, float] | None = None  # (time, wait total) at the previous step record

    def write(
        self,
        phase: str,
        *,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        error: str | None = None,
        result: dict[str, Any] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """Append one record and flush it; returns the record."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
        now = self._clock()
        record = {
            "ts": now, "rank": self.rank, "phase": phase, "step": step,
            "metrics": metrics or {}, "error": error, "result": result, **extra,
        }
        if phase == "running" and self.counters is not None:
            waited = self.counters.wait_total
            if step is not None and self._since is not None:
                wait_s = max(0.0, waited - self._since[1])
                record["wait_s"] = round(wait_s, 6)
                record["compute_s"] = round(max(0.0, now - self._since[0] - wait_s), 6)
            self._since = (now, waited)
        self._file.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        self._file.close()
