"""Restarts in place on this node: an Assign of a newer attempt of a job while an older attempt of it has live
ranks here (the coordinator restarted the job without waiting for their stop: ``Register.replaces``).

The older runs say nothing more to the coordinator, which has moved on; their ranks are signalled (SIGTERM,
the stopped ones continued, SIGKILL after the launcher's grace) and the new ranks start once the old are gone,
or ``WAIT_S`` passed. The wait runs beside the session's message loop, one chain per job (a later Assign of the
job waits for an earlier one), so that a Cancel meanwhile is heard: an attempt cancelled before its start never
starts, and its ranks are reported exited, which is what the coordinator's stop waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections import OrderedDict
from typing import Any, Awaitable, Callable

from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.runs.assign import claimed_ranks
from rankctl.worker.runs.launcher_client import LauncherError
from rankctl.worker.uplink.outbox import Outbox
from rankctl.worker.uplink.reporting import exit_status
from rankctl.worker.runs.runs import Runs
from rankctl.worker.runs.runstate import RunState

WAIT_S = 15.0      # an older attempt's ranks get this long to go before the newer one starts anyway
REMEMBERED = 1024  # jobs whose cancelled attempts a node remembers
POLL_S = 0.02      # (the launcher SIGKILLs them 10 s after its SIGTERM)


class InPlace:
    """``admit``: starts an Assign's ranks (``worker.runs.assign.Admission.admit``); ``kill(job, attempt)``: the
    launcher's (``LauncherSupervisor.kill``)."""

    def __init__(self, *, node: str, runs: Runs, kill: Callable[[str, int], Awaitable[None]],
                 admit: Callable[[pb.Assign], Awaitable[None]], outbox: Outbox, log: Any) -> None:
        self._node, self._runs, self._kill, self._admit, self._outbox, self._log = node, runs, kill, admit, outbox, log
        # job -> its newest Assign waiting for an older attempt, and the task that starts it
        self._chains: dict[str, tuple[pb.Assign, asyncio.Task]] = {}
        self._cancelled: OrderedDict[str, int] = OrderedDict()   # job -> newest attempt cancelled here (1 << 30: all)

    def assign(self, msg: pb.Assign) -> bool:
        """Take the Assign if an older attempt of its job is live here or another of its Assigns waits; False:
        nothing to wait for (the caller admits it at once)."""
        older = self._runs.supersede(msg.job_id, msg.attempt)
        before = self._chains.get(msg.job_id)
        if not older and before is None:
            return False
        self._chains[msg.job_id] = (msg, asyncio.ensure_future(self._chain(msg, older, before and before[1])))
        return True

    def waiting(self) -> list[pb.RunningJob]:
        """The attempts assigned here whose ranks wait for an older attempt's to go, as a registration names the
        attempts it runs (a reconnect meanwhile must not read as the node back without them)."""
        return [pb.RunningJob(job_id=job_id, attempt=msg.attempt, ranks=claimed_ranks(msg))
                for job_id, (msg, _) in self._chains.items() if not self.cancelled(job_id, msg.attempt)]

    def cancel(self, msg: pb.Cancel) -> None:
        """A Cancel came: an Assign of the job for ``msg.attempt`` or an older one never starts here, whether it
        waits here now or comes later (a relayed Assign can come after a Cancel: ``worker.uplink.relay``)."""
        attempt = max(msg.attempt or 1 << 30, self._cancelled.pop(msg.job_id, 0))
        self._cancelled[msg.job_id] = attempt
        while len(self._cancelled) > REMEMBERED:
            self._cancelled.popitem(last=False)

    def cancelled(self, job_id: str, attempt: int) -> bool:
        """A Cancel here named this attempt of the job (or a newer one, or every one)."""
        newest = self._cancelled.get(job_id)
        return newest is not None and attempt <= newest

    async def close(self) -> None:
        tasks = [task for _, task in self._chains.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _chain(self, msg: pb.Assign, older: list[RunState], before: asyncio.Task | None) -> None:
        try:
            if before is not None:
                with contextlib.suppress(Exception):
                    await before
            await self._stop(msg, older)
            if self.cancelled(msg.job_id, msg.attempt):
                self.never_started(msg)
            else:
                await self._admit(msg)
        finally:
            if self._chains.get(msg.job_id, (None, None))[1] is asyncio.current_task():
                del self._chains[msg.job_id]

    async def _stop(self, msg: pb.Assign, older: list[RunState]) -> None:
        if not older:
            return
        self._log.info("restart in place: stopping the older attempt", job=msg.job_id, attempt=msg.attempt,
                       older=[r.attempt for r in older])
        try:
            for run in older:
                await self._kill(msg.job_id, run.attempt)
        except LauncherError:
            return  # no launcher, so none of its ranks is left
        self._runs.continue_stopped(msg.job_id)
        loop = asyncio.get_running_loop()
        end = loop.time() + WAIT_S
        while any(r.alive for r in older) and loop.time() < end:
            await asyncio.sleep(POLL_S)
        left = sum(len(r.alive) for r in older)
        if left:
            self._log.warning("older attempt not gone; starting the new one", job=msg.job_id, ranks_left=left)

    def never_started(self, msg: pb.Assign) -> None:
        """The attempt was cancelled while its ranks waited for the older ones: each reported exited."""
        self._log.info("cancelled before its ranks started", job=msg.job_id, attempt=msg.attempt)
        note = f"rankctl: attempt {msg.attempt} was cancelled before its ranks started on node {self._node}"
        for rank in claimed_ranks(msg):
            self._outbox.report(msg.job_id, msg.attempt, exit_status(rank, self._node, -signal.SIGTERM, note))
