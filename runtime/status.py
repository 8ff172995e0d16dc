"""The rank side of the status file (``contract.rankfiles``): one flushed JSON line per record."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

from rankctl.contract.rankfiles import PHASES, status_path


class StatusWriter:
    """Appends status records for one rank; every record is one flushed line."""

    def __init__(self, run_dir: str, rank: int, *, clock: Callable[[], float] = time.time) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.rank = rank
        self.path = status_path(run_dir, rank)
        self._clock = clock
        self._file = open(self.path, "a", encoding="utf-8")

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
        record = {
            "ts": self._clock(), "rank": self.rank, "phase": phase, "step": step,
            "metrics": metrics or {}, "error": error, "result": result, **extra,
        }
        self._file.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        self._file.close()
