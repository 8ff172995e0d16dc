"""Each job's parallel layout, built once from its stored spec (off the event loop) and kept."""

from __future__ import annotations

import asyncio
from typing import Any
from collections import OrderedDict

from rankctl.contract.jobfile import SpecError
from rankctl.contract.spec import JobSpec
from rankctl.kinds.spec import parallel_config
from rankctl.parallel.layout import LayoutError, ParallelConfig

JOBS_CACHED = 1024


def layout_of(spec: JobSpec) -> ParallelConfig | None:
    """The layout a job's spec declares (None when it does not lay out: the dashboard shows it without)."""
    try:
        return parallel_config(spec)
    except (SpecError, LayoutError, KeyError, TypeError, ValueError):
        return None


def layout_text(cfg: ParallelConfig | None) -> str:
    if cfg is None:
        return "?"
    return f"tp{cfg.tp} cp{cfg.cp} ep{cfg.ep} dp{cfg.dp} pp{cfg.pp}"


class Layouts:
    """job id -> its ParallelConfig (a job's spec never changes); the newest JOBS_CACHED kept."""

    def __init__(self, size: int = JOBS_CACHED) -> None:
        self._size = size
        self._cfg: OrderedDict[str, ParallelConfig | None] = OrderedDict()

    async def of(self, jobs: list[Any]) -> dict[str, ParallelConfig | None]:
        """The layouts of ``jobs`` (records with ``id`` and ``spec``); missing ones built on a worker thread."""
        missing = [(j.id, j.spec) for j in jobs if j.id not in self._cfg]
        if missing:
            built = await asyncio.to_thread(lambda: [(i, layout_of(s)) for i, s in missing])
            for job_id, cfg in built:
                self._cfg[job_id] = cfg
            while len(self._cfg) > self._size:
                self._cfg.popitem(last=False)
        return {j.id: self._cfg.get(j.id) for j in jobs}
