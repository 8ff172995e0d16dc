"""What changed since the core's last turn: the jobs to reconcile, and whether the queue needs a placement pass.

Every change that can move a job on marks it here and decides nothing: a commit of rank reports marks the jobs it
touched, a node found LOST itself (its jobs' attempts fail in the turn), a node's return the stops under way, an
ended attempt or a freed slot the queue. The core's turn (``Coordinator.turn``) takes the marks, reconciles each job
once from its level state (``coordinator.recovery.reconciler``) and runs one placement pass
(``coordinator.scheduling.scheduler``). The tick
marks every job whose state changes with time alone (a hang, a failure held for its cause, a stop or a drain out of
time, an elastic job whose nodes came free: ``timed``). A mark a refused write left is set aside (``retry``,
``retry_lost``) and back among the marks only at the tick (``resume``): the turns of other operations (a heartbeat,
a group commit) never retry a refused write, so a failing store is tried once a tick, not once a message. A mark
made outside any core operation (an allocation's poll, a worker pool's change, a report that changes a phase and so
is stored at once) asks the event loop for a turn soon (``wake``). This replaces the owed-work memories each
collaborator kept.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Iterable

import structlog

log = structlog.get_logger("rankctl.coordinator")


class Dirty:
    """The marks of one coordinator; the event loop thread only. ``turn``: the core's turn, run on the event loop's
    next iteration after the first mark (none when no loop runs: a test driving the core by hand turns it)."""

    def __init__(self, turn: Callable[[], None] = lambda: None) -> None:
        self._jobs: dict[str, bool] = {}   # job id -> whether the time-dependent checks are due (a tick's mark)
        self.placing = False               # a placement pass is due
        self.reports = False               # reports that change a phase wait for a group commit: due in this turn
        self._lost: dict[str, None] = {}   # nodes found LOST whose jobs the turn fails (in the order found)
        # marks a refused write left, set aside until the tick (``resume``)
        self._later_jobs: dict[str, bool] = {}
        self._later_placing = False
        self._later_lost: dict[str, None] = {}
        self._turn, self._woken = turn, False
        self._due: dict[str, float] = {}   # job id -> when a timed look at it is asked for (``later``)

    def _wake(self) -> None:
        if self._woken:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._woken = True
        loop.call_soon(self._woken_turn)

    def _woken_turn(self) -> None:
        self._woken = False
        if not self:
            return
        try:
            self._turn()
        except Exception:  # noqa: BLE001 - as the server's loops: logged, and the tick's turn retries
            log.exception("job.turn_failed")

    def __bool__(self) -> bool:
        return bool(self._jobs) or self.placing or self.reports or bool(self._lost)

    def job(self, job_id: str, *, timed: bool = False) -> None:
        """The job's level state changed (``timed``: time alone may have moved it on)."""
        if not self:
            self._wake()
        _mark(self._jobs, job_id, timed)

    def later(self, job_id: str, delay: float) -> None:
        """Mark the job again in ``delay`` seconds (a judgement that time alone changes, due before the tick:
        a stop held long enough, a hang's limit); one call per job at a time, the soonest kept."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        at = loop.time() + delay
        if self._due.get(job_id, float("inf")) <= at:
            return
        self._due[job_id] = at
        loop.call_at(at, self._look_again, job_id, at)

    def _look_again(self, job_id: str, at: float) -> None:
        if self._due.get(job_id) == at:
            del self._due[job_id]
            self.job(job_id)

    def jobs(self, job_ids: Iterable[str], *, timed: bool = False) -> None:
        for job_id in job_ids:
            self.job(job_id, timed=timed)

    def place(self) -> None:
        """Pending jobs may start now (a job was queued, slots or nodes came free)."""
        if not self:
            self._wake()
        self.placing = True

    def node_lost(self, name: str) -> None:
        """The node was found LOST: the turn fails the attempts of its jobs (``Restarts.node_lost``)."""
        if not self:
            self._wake()
        self._lost[name] = None

    def take_lost(self) -> list[str]:
        """The lost nodes marked so far, cleared."""
        lost, self._lost = list(self._lost), {}
        return lost

    def retry_lost(self, names: list[str]) -> None:
        """Lost nodes whose jobs a refused write left as they were: set aside for the tick (``resume``)."""
        self._later_lost.update(dict.fromkeys(names))

    def commit_reports(self) -> None:
        """A phase change, exit or error came: the queued reports are stored in the next turn (``intake``)."""
        if not self:
            self._wake()
        self.reports = True

    def take(self) -> tuple[dict[str, bool], bool]:
        """The marks so far (job id -> timed, placement due), cleared."""
        jobs, placing = self._jobs, self.placing
        self._jobs, self.placing = {}, False
        return jobs, placing

    def retry(self, jobs: dict[str, bool], placing: bool = False) -> None:
        """Marks a refused write left: set aside for the tick (``resume``), without asking for a turn."""
        for job_id, timed in jobs.items():
            _mark(self._later_jobs, job_id, timed)
        self._later_placing = self._later_placing or placing

    def resume(self) -> None:
        """The tick: the marks refused writes left are marks again (lost nodes first, in the order found)."""
        self._lost = {**self._later_lost, **self._lost}
        for job_id, timed in self._later_jobs.items():
            _mark(self._jobs, job_id, timed)
        self.placing = self.placing or self._later_placing
        self._later_jobs, self._later_placing, self._later_lost = {}, False, {}


def _mark(marks: dict[str, bool], job_id: str, timed: bool) -> None:
    """Mark ``job_id`` in ``marks``; a tick's mark (``timed``) stays one."""
    marks[job_id] = timed or marks.get(job_id, False)
