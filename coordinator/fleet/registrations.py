"""Registrations gathered for a moment and opened together: one store write for a storm of them.

After a coordinator restart or a failover every daemon registers again within seconds; on a replicated store
each store write is an etcd round trip, so registering them one by one would hold thousands of them in line.
``RegistrationBatch.register`` waits at most ``WINDOW_S`` for others, then the core opens them all with one
store transaction (``Coordinator.register_many``). A caller that went away meanwhile (its stream cancelled) is
left out, or disconnected again if its session was opened.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from rankctl.coordinator.model.records import NodeHello

WINDOW_S = 0.02
MAX_BATCH = 1024


class RegistrationBatch:
    """``core()``: the coordinator core now (it changes when a standby takes over)."""

    def __init__(self, core: Callable[[], Any], window_s: float = WINDOW_S) -> None:
        self._core, self.window_s = core, window_s
        self._pending: list[tuple[NodeHello, Callable, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None

    async def register(self, hello: NodeHello, outbox: Callable) -> Any:
        """The node's session once its batch is opened; raises what refused it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._pending.append((hello, outbox, future))
        if len(self._pending) >= MAX_BATCH:
            self._open()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._open)
        return await future

    def _open(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch = [p for p in self._pending if not p[2].done()]  # a cancelled caller is left out
        self._pending = []
        if not batch:
            return
        core = self._core()
        try:
            results = core.register_many([(hello, outbox) for hello, outbox, _ in batch])
        except Exception as exc:  # noqa: BLE001 - every caller hears it
            results = [exc] * len(batch)
        for (_, _, future), result in zip(batch, results):
            if future.cancelled():
                if not isinstance(result, Exception):
                    core.disconnect(result, "stream closed")
            elif isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
