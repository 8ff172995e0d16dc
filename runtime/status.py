"""The rank side of the status file: each ``RankStatusRecord`` (``contract.files.rankstatus``) one flushed line."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

from rankctl.contract.files.rankfiles import open_own, status_path
from rankctl.contract.files.rankstatus import PHASES, RankStatusRecord


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
        self._file = open(open_own(self.path, os.O_WRONLY | os.O_APPEND, keep=True), "a", encoding="utf-8")
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
        traceback: Sequence[str] = (),
        notice: str | None = None,
        preflight: str | None = None,
    ) -> RankStatusRecord:
        """Append one record and flush it; returns the record."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
        now = self._clock()
        wait_s = compute_s = None
        if phase == "running" and self.counters is not None:
            waited = self.counters.wait_total
            if step is not None and self._since is not None:
                waited_s = max(0.0, waited - self._since[1])
                wait_s, compute_s = round(waited_s, 6), round(max(0.0, now - self._since[0] - waited_s), 6)
            self._since = (now, waited)
        record = RankStatusRecord(rank=self.rank, phase=phase, ts=now, step=step, metrics=dict(metrics or {}),
                                  error=error, result=result, traceback=tuple(traceback), wait_s=wait_s,
                                  compute_s=compute_s, notice=notice, preflight=preflight)
        self._file.write(record.to_line() + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        self._file.close()
