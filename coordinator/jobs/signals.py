"""Wake-ups for watchers: WatchJob and GetLogs --follow wait here for a job to change."""

from __future__ import annotations

import asyncio


class Signals:
    """Per-key one-shot events: ``notify(key)`` wakes everyone holding ``key``'s current event.

    Plain asyncio, no grpc; ``notify`` is synchronous so the core calls it from code on
    the event loop. A watcher takes ``arm(key)`` *before* reading the store, so a change
    that lands while it is busy still wakes it. Only keys with watchers hold an event.
    """

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def notify(self, key: str) -> None:
        event = self._events.pop(key, None)
        if event is not None:
            event.set()

    def arm(self, key: str) -> asyncio.Event:
        """The event the next ``notify(key)`` sets."""
        return self._events.setdefault(key, asyncio.Event())

    @staticmethod
    async def wait(event: asyncio.Event, timeout: float) -> bool:
        """Wait for an armed event or ``timeout`` seconds; True when notified (already, with a timeout of 0 too:
        ``wait_for`` would cancel the waiting before it looked)."""
        if event.is_set():
            return True
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
