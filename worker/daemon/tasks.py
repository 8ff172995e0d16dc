"""Coroutines a daemon runs beside its loops (checkpoint pushes, stack dumps, cleanups), each kept
referenced until it ends, so that none is collected half-way and a stopping daemon can end them all."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run ``coro`` beside the caller; it is forgotten once done."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel(self) -> None:
        """End every one still running, and wait until they have."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
