"""Attempt stops: an ended attempt's slots and ports stay taken until its ranks are confirmed gone.

A rank is gone once it reported its exit, or once its node is lost or came back without the attempt
(a lost node's ranks die with its launcher). ``Stops`` keeps one ``Stop`` per job whose ended attempt
(restarting, failed, cancelled) is not confirmed gone yet: the restart decision reads how many ranks are
left and since when, the scheduler counts ended jobs still stopping as holding their slots, and GetJob
says how many ranks are not yet confirmed gone. ``STOP_TIMEOUT_S`` bounds the wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.fleet.nodes import NodeStatus, NodeTable
from rankctl.coordinator.model.records import JobRecord
from rankctl.coordinator.model.states import JobState, is_terminal
from rankctl.parallel.placement import ranks_of_node

STOP_TIMEOUT_S = 120.0   # ranks not confirmed gone by then: a restart fails, an ended job's slots are freed


@dataclass
class Stop:
    """An ended attempt whose ranks are not all confirmed gone: its slots and ports stay taken."""

    attempt: int
    since: float
    gone: set[int] = field(default_factory=set)  # job node indexes whose ranks count as gone (lost, or back without it)


class Stops:
    """The stops under way, by job id; called from the event loop thread only."""

    def __init__(self, book: JobBook, nodes: NodeTable, clock: Callable[[], float]) -> None:
        self._book, self._nodes, self._clock = book, nodes, clock
        self._stops: dict[str, Stop] = {}

    def __bool__(self) -> bool:
        return bool(self._stops)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._stops

    def job_ids(self) -> list[str]:
        return list(self._stops)

    def begin(self, job: JobRecord) -> Stop:
        """Start waiting for the ranks of the job's current attempt to be gone (kept if already waiting)."""
        stop = self._stops.get(job.id)
        if stop is None or stop.attempt != job.attempt:
            gone = {k for k, name in enumerate(job.nodes)
                    if (s := self._nodes.get(name)) is None or s.status is NodeStatus.LOST}
            stop = self._stops[job.id] = Stop(job.attempt, self._clock(), gone)
        return stop

    def forget(self, job_id: str) -> None:
        self._stops.pop(job_id, None)

    def left(self, job: JobRecord) -> int:
        """Ranks of the stopping attempt not confirmed gone: not exited, on a node not counted gone.

        Constant time in the job's size: the exits are counted (``JobProgress.exited``); only the ranks
        of the nodes counted gone (lost, or back without the attempt) are looked at.
        """
        stop = self._stops.get(job.id)
        left = job.world_size - self._book.progress(job).exited
        if left and stop is not None and stop.gone:
            ranks, spn = self._book.ranks(job.id), job.slots_per_node
            for k in stop.gone:
                left -= sum(1 for r in ranks_of_node(k, spn) if (rec := ranks.get(r)) is None or not rec.exited)
        return max(0, left)

    def stopping_ranks(self, job_id: str) -> int:
        """Ranks of the job's ended attempt not yet confirmed gone (0: none, or nothing is stopping)."""
        job = self._book.jobs.get(job_id)
        if job is None or job.id not in self._stops or self._stops[job.id].attempt != job.attempt:
            return 0
        return self.left(job)

    def ended(self) -> list[JobRecord]:
        """Jobs that ended for good whose ranks are not confirmed gone: they still hold slots and ports."""
        jobs = []
        for job_id in self._stops:
            job = self._book.jobs.get(job_id)
            if job is not None and is_terminal(job.state):
                jobs.append(job)
        return jobs

    def node_gone(self, name: str) -> list[JobRecord]:
        """``name`` is lost (or came back without its ranks): its ranks count as gone in every stop; the jobs of
        those stops."""
        jobs = []
        for job, k, _ in self._on_node(name):
            self._stops[job.id].gone.add(k)
            jobs.append(job)
        return jobs

    def node_back(self, name: str, listed: Iterable[tuple[str, int]]) -> list[JobRecord]:
        """Node ``name`` registered listing (job, attempt) pairs: a stopping attempt it does not list counts
        as gone there; the RESTARTING jobs it still runs are returned (to be told again to stop)."""
        listed = set(listed)
        still = []
        for job, k, stop in self._on_node(name):
            if (job.id, job.attempt) not in listed:
                stop.gone.add(k)
            elif job.state is JobState.RESTARTING:
                still.append(job)
        return still

    def _on_node(self, name: str) -> Iterable[tuple[JobRecord, int, Stop]]:
        """(job, job node index of ``name``, stop) of each stop whose attempt ran on ``name``."""
        for job_id, stop in list(self._stops.items()):
            job = self._book.jobs.get(job_id)
            k = job.node_index().get(name) if job is not None and job.attempt == stop.attempt else None
            if k is not None:
                yield job, k, stop

    def free_if_gone(self, job: JobRecord, *, quiet: bool = False) -> bool:
        """An ended job's stop: forget it once its ranks are gone or STOP_TIMEOUT_S passed (an event says so
        unless ``quiet``); True when its slots are free now."""
        stop = self._stops.get(job.id)
        if stop is None:
            return False
        left = self.left(job) if stop.attempt == job.attempt else 0
        waited = self._clock() - stop.since
        if left and waited <= STOP_TIMEOUT_S:
            return False
        del self._stops[job.id]
        if not quiet:
            self._book.event(job, "stop", (
                f"attempt {stop.attempt}: {left} rank(s) on connected nodes never reported their exit within "
                f"{STOP_TIMEOUT_S:g} s; their slots are reused" if left else
                f"attempt {stop.attempt}: every rank confirmed gone after {waited:.1f} s; its slots are free"))
        return True
