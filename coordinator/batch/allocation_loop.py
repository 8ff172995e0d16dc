"""The server's side of allocations: the ``Allocator`` calls ``Allocations.due()`` asks for, each on a worker
thread (``sbatch`` and ``squeue`` block for as long as the scheduler takes), their answers brought back to the
core on the event loop thread."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable, Sequence

import structlog

from rankctl.coordinator.model.allocation import AllocationRefused, Allocator
from rankctl.coordinator.batch.allocations import Allocations
from rankctl.coordinator.batch.calls import Work
from rankctl.coordinator.batch.pools import WorkerPools
from rankctl.coordinator.store.database import StoreError

log = structlog.get_logger("rankctl.coordinator")
PERIOD_S = 1.0
Archive = Callable[[str], Awaitable[object]]


async def allocation_loop(sources: Sequence[Allocations | WorkerPools], allocator: Allocator,
                          archive: Archive | None = None, period: float = PERIOD_S) -> None:
    """Every ``period`` seconds, start the calls that are due (jobs' allocations, worker pools); runs until
    cancelled. Each answer goes back to the source that asked. ``archive(job_id)`` keeps an ended job's rank logs
    before its workers are released (the core's)."""
    calls: set[asyncio.Task] = set()
    try:
        while True:
            await asyncio.sleep(period)
            for source in sources:
                try:
                    due = source.due() if source else []
                except StoreError as exc:
                    log.warning("allocation.store_failed", error=str(exc))
                    continue
                except Exception:  # a defect must not end the loop: every allocation would stop being watched
                    log.exception("allocation.due_failed")
                    continue
                for work in due:
                    task = asyncio.create_task(_call(source, allocator, work, archive))
                    calls.add(task)
                    task.add_done_callback(calls.discard)
    finally:
        for task in list(calls):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _call(allocations: Allocations | WorkerPools, allocator: Allocator, work: Work,
                archive: Archive | None) -> None:
    try:
        if work.action == "archive":
            try:
                if archive is not None:
                    await archive(work.job_id)
            finally:   # the workers are released even when the logs could not be kept
                allocations.archived(work)
        elif work.action == "request":
            try:
                allocation_id, output = await asyncio.to_thread(allocator.request, work.ask)
            except AllocationRefused as exc:
                allocations.refused(work, str(exc))
                return
            allocations.requested(work, allocation_id, output)
        elif work.action == "watch":
            allocations.seen(work, await asyncio.to_thread(allocator.state, work.allocation))
        else:
            await asyncio.to_thread(allocator.release, work.allocation)
            allocations.released(work)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the scheduler did not answer, or the store refused: tried again later
        allocations.failed_call(work, f"{type(exc).__name__}: {exc}")
