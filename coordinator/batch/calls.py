"""The request/watch/release machine of an allocation: which call to make to a batch scheduler, and when.

The allocations of jobs (``coordinator.batch.allocations``) and the worker pools (``coordinator.batch.pools``) own
allocations for different ends; what they ask the scheduler is the same, and this is the one place that says it. An
allocation without an id is requested (asked again ``WATCH_S`` after a call that could not be made); once it has one
it is watched every ``WATCH_S`` (at once after ``watch_now``: a node of it was lost); its workers told to exit, it is
released ``RELEASE_GRACE_S`` later if it has not ended by itself. Each call is in flight until its answer comes back
(``answered``), and never made twice at once. Keys are (owner, allocation number): a job's renewed allocation is
another one. The event loop thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rankctl.coordinator.model.allocation import REQUESTING, Allocation, Ask

WATCH_S = 5.0            # how often an allocation's state is asked for
RELEASE_GRACE_S = 30.0   # how long an ended owner's workers have to exit before the allocation is released


@dataclass(frozen=True)
class Work:
    """One call to make: an ``Allocator``'s ``request`` (``ask``), ``watch`` or ``release``, or ``archive`` (an ended
    job's rank logs, before its workers are released). ``job_id``: the owner (a job, or a worker pool)."""

    action: str
    job_id: str
    allocation: Allocation
    ask: Ask | None = None


class Calls:
    """The calls in flight and the timers of every allocation of one owner kind."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._in_flight: set[tuple[str, int, str]] = set()
        self._watched: dict[tuple[str, int], float] = {}       # when last asked about (or a call failed)
        self._released_at: dict[tuple[str, int], float] = {}   # when its workers were told to exit (inf: released)

    def next(self, owner: str, a: Allocation, ask: Callable[[], Ask]) -> Work | None:
        """The call to make now about ``owner``'s allocation ``a`` (None: none due, or it is in flight)."""
        now, key = self._clock(), (owner, a.number)
        if a.state == REQUESTING and not a.id:
            if key in self._watched and now - self._watched[key] < WATCH_S:
                return None   # the last request could not be made (``failed``): again every WATCH_S
            work = Work("request", owner, a, ask())
        elif a.released and now - self._released_at.get(key, now) >= RELEASE_GRACE_S:
            work = Work("release", owner, a)
        elif a.id and now - self._watched.get(key, 0.0) >= WATCH_S:
            work = Work("watch", owner, a)
        else:
            return None
        return self.start(work)

    def start(self, work: Work) -> Work | None:
        """``work``, now in flight; None when the same call already is."""
        flight = (work.job_id, work.allocation.number, work.action)
        if flight in self._in_flight:
            return None
        self._in_flight.add(flight)
        return work

    def answered(self, work: Work) -> None:
        self._in_flight.discard((work.job_id, work.allocation.number, work.action))

    def seen(self, work: Work) -> None:
        """A watch answered (or a call could not be made): the next watch is ``WATCH_S`` from now."""
        self._watched[(work.job_id, work.allocation.number)] = self._clock()

    failed = seen

    def watch_now(self, owner: str, number: int) -> None:
        """Ask about the allocation at the next ``next`` (a node of it was lost: did the whole allocation end?)."""
        self._watched[(owner, number)] = 0.0

    def told_to_exit(self, owner: str, number: int) -> None:
        """The allocation's workers were told to exit: released ``RELEASE_GRACE_S`` from now unless it ends first."""
        self._released_at[(owner, number)] = self._clock()

    def released(self, work: Work) -> None:
        """Released once; the next watch (at once) sees it end."""
        key = (work.job_id, work.allocation.number)
        self._released_at[key] = float("inf")
        self._watched.pop(key, None)

    def forget(self, owner: str, number: int) -> None:
        for d in (self._watched, self._released_at):
            d.pop((owner, number), None)
