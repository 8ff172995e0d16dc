"""Multi-rank test helpers: ranks forked from the test process over a FileStore world.

The test process is fork-safe because ``conftest.py`` keeps torch single-threaded and runs
in-process gRPC modules last.
"""

from __future__ import annotations

import gc
import os
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


def fork_ranks(world: int, fn: Callable[..., None], *args: object) -> list[int]:
    """Run ``fn(rank, world, *args)`` in ``world`` forked processes; their exit codes. The parent's objects are
    frozen out of the collector's sight first: a child's garbage collection never walks what it inherited (a
    child crashed collecting while building its model, on CI, after the pytest process had held other state)."""
    gc.collect()
    gc.freeze()
    pids = []
    for rank in range(world):
        if (pid := os.fork()) == 0:
            code = 0
            try:
                torch.set_num_threads(1)
                fn(rank, world, *args)
            except BaseException:  # noqa: BLE001 - report and exit nonzero, never return to pytest
                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)
    try:
        return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    finally:
        gc.unfreeze()


class CachedGroups:
    """``new_group`` that reuses the communicator of a member list built for an earlier case."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def __call__(self, ranks: list[int], **kwargs: Any) -> dist.ProcessGroup:
        key = tuple(ranks)
        if key not in self.cache:
            self.cache[key] = dist.new_group(ranks, **kwargs)
        return self.cache[key]


def run_cases(rank: int, world: int, store_path: str, cases: list, run_case: Callable[..., None]) -> None:
    """One gloo world for several cases: ``run_case(rank, case, new_group)`` for each."""
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    new_group = CachedGroups()
    for case in cases:
        run_case(rank, case, new_group)
    dist.destroy_process_group()
