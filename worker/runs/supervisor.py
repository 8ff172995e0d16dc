"""The daemon's warm launcher (``worker.runs.launcher_client``), kept running: its events go to a listener in
order; when it dies, every rank it had forked died with it (``PR_SET_PDEATHSIG``), the listener hears so,
and a new launcher starts, with backoff. ``LauncherLost`` ends the daemon when none will start, or when
launchers keep dying soon after their start, so that its own supervisor restarts the process."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Protocol

from rankctl.contract.assignment import RankAssignment
from rankctl.worker.runs.launcher_client import LauncherError
from rankctl.worker.daemon.metrics import DaemonStats
from rankctl.worker.uplink.reporting import how_launcher_ended

REAP_S = 2.0  # a dead launcher's exit status is waited for this long


class LauncherLost(RuntimeError):
    """The launcher died and no new one would start: the daemon must exit (non-zero)."""


class LauncherListener(Protocol):
    async def on_event(self, ev: dict[str, Any]) -> None: ...
    async def launcher_died(self, why: str) -> None: ...


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    restarts: int     # tries to start a new launcher before giving up
    backoff: float    # seconds before the second try; doubles each time
    stable_s: float   # a launcher that dies sooner than this after its start counts towards giving up


class LauncherSupervisor:
    """``launcher`` is a started launcher; ``start()`` starts a replacement (closed here when it dies in
    turn); ``on_change`` hears when ``alive`` changed; ``stopping`` set: the launcher's end is no death."""

    def __init__(self, launcher: Any, *, start: Callable[[], Awaitable[Any]], policy: RestartPolicy, node: str,
                 listener: LauncherListener, on_change: Callable[[], Awaitable[None]], stopping: asyncio.Event,
                 stats: DaemonStats, log: Any) -> None:
        self.launcher = launcher
        self._start = start
        self._policy = policy
        self._node = node
        self._listener = listener
        self._on_change = on_change
        self._stopping = stopping
        self._stats = stats
        self._log = log
        self._own: Any = None  # a replacement this supervisor started
        self._up = asyncio.Event()
        self._up.set()

    @property
    def alive(self) -> bool:
        return self._up.is_set()

    @property
    def hardware(self) -> dict[str, Any]:
        return getattr(self.launcher, "hardware", None) or {}

    async def launch(self, assignments: Iterable[RankAssignment], **kw: Any) -> None:
        """Hand ranks to the launcher once one runs; LauncherError: it just died (its death reports them)."""
        await self._up.wait()
        await self.launcher.launch(assignments, **kw)

    async def kill(self, job_id: str, attempt: int | None = None) -> None:
        """End the job's ranks here (of one ``attempt``; None: of every one); LauncherError: no launcher, so none
        of its ranks is left."""
        await self.launcher.kill(job_id, **({} if attempt is None else {"attempt": attempt}))

    async def run(self) -> None:
        """Launcher events in order, forever; when the launcher dies, tell the listener and start another."""
        quick_deaths = 0  # in a row, each within stable_s of its start: a crash loop
        while True:
            started = time.monotonic()
            async for ev in self.launcher.events():
                await self._listener.on_event(ev)
            if self._stopping.is_set():
                return
            await self._died()
            quick_deaths = quick_deaths + 1 if time.monotonic() - started < self._policy.stable_s else 0
            if quick_deaths > self._policy.restarts:
                raise LauncherLost(f"the launcher died {quick_deaths} times in a row, each within "
                                   f"{self._policy.stable_s:g} s of its start")
            if quick_deaths > 1:
                await asyncio.sleep(self._policy.backoff * 2 ** (quick_deaths - 2))
            await self._restart()

    async def close(self) -> None:
        """Close the replacement launcher this supervisor started, if any (the first one is its owner's)."""
        if self._own is not None:
            await self._own.close()

    async def _died(self) -> None:
        self._up.clear()
        await self._on_change()
        proc = getattr(self.launcher, "proc", None)
        if proc is not None:  # its exit status, once reaped
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), REAP_S)
        ended = how_launcher_ended(self.launcher)
        await self._listener.launcher_died(f"the launcher on node {self._node} died ({ended}); "
                                           "every rank it had forked was killed with it")

    async def _restart(self) -> None:
        delay, error = self._policy.backoff, ""
        for attempt in range(1, self._policy.restarts + 1):
            try:
                launcher = await self._start()
            except (LauncherError, OSError) as exc:
                error = str(exc)
                self._log.warning("launcher did not start", attempt=attempt, error=error, retry_in=delay)
                await asyncio.sleep(delay)
                delay *= 2
                continue
            await self.close()  # the dead replacement: reap it
            self.launcher = self._own = launcher
            self._stats.launcher_restarts += 1
            self._up.set()
            await self._on_change()
            self._log.info("launcher restarted", pid=launcher.pid, attempt=attempt)
            return
        raise LauncherLost(f"the launcher died and did not restart after {self._policy.restarts} tries: {error}")
