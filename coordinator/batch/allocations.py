"""The jobs pinned to allocations, kept by the core: what to ask the scheduler, what it said, what ends.

The server's ``AllocationLoop`` asks ``due()`` about once a second for the calls an ``Allocator`` must make
(request, watch, release) and brings the answers back (``requested``, ``refused``, ``seen``, ``released``), all on
the event loop thread. Rules:

- A job's allocation is asked for as soon as the job is stored; its workers register with its pool and the
  scheduler places the job on them only (``Scheduler``).
- The job ends (any state): its ranks' logs are kept by the coordinator (``logarchive``, bounded in time), then
  the workers of its pool are told to exit (``Release``), so the scheduler's job completes; one still alive
  ``calls.RELEASE_GRACE_S`` later is released by the adapter (``scancel``).
- The allocation ends first (``scancel``, its time limit, preemption): the attempt fails naming the allocation
  and its state (``Restarts.fail_attempt``); a job that may restart is queued again and gets a new allocation
  (a new pool, ``number`` + 1) once the old one has ended, then resumes from its newest checkpoint.
- The scheduler refuses the request: the job fails with its words.
- A worker that registers with a pool no active job owns is told to exit at once.
- A node of an allocation's job is lost: the allocation's state is asked for at once and the attempt fails
  only with the answer (``coordinator.batch.holds``): the whole allocation ended (its reason names it), or only
  that node was lost (the job restarts on a spare of the allocation, as anywhere).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import structlog

from rankctl.coordinator.model.allocation import (NOT_SUBMITTED, REQUESTING, UNAVAILABLE, Allocation, AllocationRequest,
                                            Ask, Seen, pool_name)
from rankctl.coordinator.batch.calls import WATCH_S, Work
from rankctl.coordinator.batch.holds import GATHER_S, AllocationHolds
from rankctl.coordinator.jobs.commit import StoreGuard
from rankctl.coordinator.jobs.dirty import Dirty
from rankctl.coordinator.model.faults import Cause, Fault
from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.fleet.nodes import NodeSession, NodeTable
from rankctl.coordinator.model.records import JobRecord
from rankctl.coordinator.recovery.restarts import Restarts
from rankctl.coordinator.model.states import JobState, is_terminal
from rankctl.coordinator.store.database import Store
from rankctl.proto import rankctl_pb2 as pb

log = structlog.get_logger("rankctl.coordinator")
S = JobState
LOSS_GRACE_S = 3.0       # how long a lost node's failure waits for the scheduler to say the allocation ended
                         # (scancel and a time limit end the workers before the scheduler's state changes)


def release_message(reason: str) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(release=pb.Release(reason=reason))


class Allocations:
    """The open allocations by job, and their pools; the event loop thread only."""

    def __init__(self, book: JobBook, nodes: NodeTable, store: Store, clock: Callable[[], float],
                 guard: StoreGuard, restarts: Restarts, dirty: Dirty, holds: AllocationHolds,
                 dial: tuple[str, bool] = ("", False)) -> None:
        self._book, self._nodes, self._store, self._clock = book, nodes, store, clock
        self._guard, self._restarts, self._dirty, self.holds = guard, restarts, dirty, holds
        self.address, self.tls = dial   # where the workers dial this coordinator; mutual TLS: workers need an identity
        holds.open.update({j.id: j for j in book.jobs.values() if j.allocation is not None and not _finished(j)})
        self._open, self._calls = holds.open, holds.calls           # (the holds' facts, kept up to date here)
        self._losses, self._held_since, self._first_worker = holds.losses, holds.held_since, holds.first_worker
        self._pools: dict[str, str] = {j.allocation.pool: j.id for j in self._open.values()}  # pool -> its job
        self._archived: set[str] = set()                         # ended jobs whose rank logs were kept

    def __bool__(self) -> bool:
        return bool(self._open)

    # -- submit ----------------------------------------------------------------------------
    def attach(self, job: JobRecord, request: AllocationRequest) -> None:
        """A new job's first allocation (stored with the job)."""
        self._book.pin(job, Allocation(request=request, pool=pool_name(job.id, 1), attempt=job.attempt),
                       f"waiting for its allocation: asking {request.scheduler} for {self.nodes_of(job)} node(s)")

    def added(self, job: JobRecord) -> None:
        if job.allocation is not None:
            self._open[job.id] = job
            self._pools[job.allocation.pool] = job.id

    def problems(self, request: AllocationRequest) -> list[str]:
        """The request's broken rules, and a missing worker identity when this coordinator serves TLS."""
        why = request.tls_problem(self.tls)
        return request.problems() + ([why] if why else [])

    nodes_of = staticmethod(AllocationHolds.nodes_of)

    # -- what the loop asks ---------------------------------------------------------------------
    def due(self) -> list[Work]:
        """The calls to make now (``coordinator.batch.calls``); each is in flight until its answer comes back."""
        now, out = self._clock(), []
        for job in list(self._open.values()):
            a = job.allocation
            if is_terminal(job.state) and not a.released:
                if self._archive_due(job):   # its ranks' logs first: node-local state dirs go with the nodes
                    if (work := self._calls.start(Work("archive", job.id, a))) is not None:
                        out.append(work)
                else:
                    self._release_workers(job, f"job {job.id} is {job.state.value}")
            if job.state is S.PENDING and a.pool in self._first_worker \
                    and GATHER_S <= now - self._first_worker[a.pool] < GATHER_S + 2:
                self._dirty.place()   # its gathering time is over: placed on the workers that came
            if a.state == REQUESTING and not a.id and is_terminal(job.state):
                self._set(job, replace(a, state=NOT_SUBMITTED))
                continue
            if a.ended:
                self._ended(job)
                continue
            work = self._calls.next(job.id, a, lambda: Ask(job.id, job.name, a, self.nodes_of(job),
                                                          job.slots_per_node, self.address, tls=self.tls))
            if work is not None:
                out.append(work)
        return out

    # -- answers ---------------------------------------------------------------------------------
    def _answered(self, work: Work) -> JobRecord | None:
        """The call is no longer in flight; its job, unless it moved on to another allocation or ended for good."""
        self._calls.answered(work)
        return self._current(work)

    def requested(self, work: Work, allocation_id: str, output: str) -> None:
        if (job := self._answered(work)) is None:
            return
        a = job.allocation
        with self._guard.consistent():
            self._set(job, replace(a, id=allocation_id, output=output, state="PENDING", detail=""))
            self._book.event(job, "allocation", f"asked {a.request.scheduler} for {self.nodes_of(job)} node(s): "
                                                f"job {allocation_id}, batch output {output}")
        log.info("allocation.requested", job=job.id, pool=a.pool, id=allocation_id)

    def refused(self, work: Work, words: str) -> None:
        if (job := self._answered(work)) is None:
            return
        a = job.allocation
        with self._guard.consistent():
            self._set(job, replace(a, state=UNAVAILABLE, detail=words))
            if not is_terminal(job.state):
                self._restarts.finish(job, S.FAILED, f"{a.request.scheduler} refused its allocation: {words}")
        self._forget(job)

    def seen(self, work: Work, seen: Seen) -> None:
        self._calls.seen(work)
        if (job := self._answered(work)) is None:
            return
        a = job.allocation
        if (seen.state, list(seen.nodes), seen.detail) != (a.state, a.nodes, a.detail):
            with self._guard.consistent():
                self._set(job, replace(a, state=seen.state, nodes=list(seen.nodes) or a.nodes, detail=seen.detail))
                if job.allocation.ended:
                    self._losses.pop(job.id, None)   # the allocation's end is the reason, not its nodes'
                    self._held_since.pop(job.id, None)
                    self._ended(job)
            self._dirty.place()   # a pending job's reason shows what the scheduler now says (its pending reason)
        if job.id in self._losses and not job.allocation.ended \
                and self._clock() - self._held_since.get(job.id, 0.0) < LOSS_GRACE_S:
            self._calls.watch_now(job.id, work.allocation.number)   # it may still end: ask again at the next due
            return
        self._fail_held(job)

    def _fail_held(self, job: JobRecord) -> None:
        """The allocation lives on: the held node losses fail the attempt as they would elsewhere (a spare)."""
        held = self._losses.pop(job.id, [])
        self._held_since.pop(job.id, None)
        with self._guard.consistent():
            for loss in held:
                if is_terminal(job.state) or job.state is S.RESTARTING:
                    break   # the first one ended the attempt
                if job.runs_on(loss.node):
                    self._restarts.fail_attempt(job, loss)

    def _archive_due(self, job: JobRecord) -> bool:
        return bool(job.nodes) and job.id not in self._archived and not job.allocation.ended

    def archived(self, work: Work) -> None:
        """The job's rank logs are kept (``logarchive``): its workers may go."""
        self._answered(work)
        self._archived.add(work.job_id)

    def released(self, work: Work) -> None:
        self._answered(work)
        self._calls.released(work)

    def failed_call(self, work: Work, error: str) -> None:
        """A call that could not be made (the scheduler did not answer): tried again at the next ``due``."""
        self._calls.failed(work)
        log.warning("allocation.call_failed", job=work.job_id, action=work.action, error=error)
        job = self._answered(work)
        if job is not None and work.action == "watch":
            self._fail_held(job)   # the scheduler did not answer: a lost node is a lost node
        elif job is not None and work.action == "request" and not is_terminal(job.state):
            detail = f"{error[:300]}; asked again every {WATCH_S:g} s"
            if detail != job.allocation.detail:   # why it is not asked yet, in the job's reason (``describe``)
                with self._guard.consistent():
                    self._set(job, replace(job.allocation, detail=detail))
                self._dirty.place()

    # -- nodes ------------------------------------------------------------------------------------
    def registered(self, session: NodeSession) -> None:
        """A worker of a pool no active job owns is told to exit."""
        if not session.pool:
            return
        self._first_worker.setdefault(session.pool, self._clock())
        owner = self._open.get(self._pools.get(session.pool, ""))
        if owner is None or is_terminal(owner.state) or owner.allocation.released:
            why = f"no active job owns pool {session.pool}" if owner is None else f"job {owner.id} has ended"
            self._nodes.send(session.name, release_message(why))

    # -- internals -----------------------------------------------------------------------------------
    def _current(self, work: Work) -> JobRecord | None:
        job = self._open.get(work.job_id)
        return job if job is not None and job.allocation.number == work.allocation.number else None

    def _set(self, job: JobRecord, allocation: Allocation) -> None:
        with self._store.transaction(f"the allocation of job {job.id}"):
            self._book.pin(job, allocation)
            self._store.update_job(job)

    def _release_workers(self, job: JobRecord, why: str) -> None:
        a = job.allocation
        with self._guard.consistent():
            self._set(job, replace(a, released=True))
        self._calls.told_to_exit(job.id, a.number)
        for session in self._nodes:
            if session.pool == a.pool:
                self._nodes.send(session.name, release_message(why))
        log.info("allocation.released", job=job.id, pool=a.pool, id=a.id, reason=why)

    def _ended(self, job: JobRecord) -> None:
        """The allocation ended: forget it when the job has ended too; else fail the attempt (it may restart), or
        ask for a new allocation when the job was queued again after the old one ended."""
        a = job.allocation
        if is_terminal(job.state):
            self._forget(job)
            return
        words = f"its allocation ended: {a.describe()}" + (f", {a.detail}" if a.detail and a.detail != "None" else "")
        with self._guard.consistent():
            if job.state is S.PENDING and job.attempt > a.attempt:   # queued again after the old one ended
                self._renew(job)
            elif job.state is S.PENDING:
                self._restarts.finish(job, S.FAILED, f"{words} before the job started")
            elif job.state is not S.RESTARTING:
                self._restarts.fail_attempt(job, Fault(cause=Cause.OTHER, reason=words))

    def _renew(self, job: JobRecord) -> None:
        old = job.allocation
        self._calls.forget(job.id, old.number)
        fresh = Allocation(request=old.request, pool=pool_name(job.id, old.number + 1), number=old.number + 1,
                           attempt=job.attempt)
        self._set(job, fresh)
        self._pools.pop(old.pool, None)
        self._pools[fresh.pool] = job.id
        self._book.set_waiting(job, f"waiting for a new allocation (the last one ended: {old.describe()})")
        self._book.event(job, "allocation", f"allocation {old.number} ended ({old.describe()}); asking for a new one")
        log.warning("allocation.renewed", job=job.id, old=old.id, pool=fresh.pool)

    def _forget(self, job: JobRecord) -> None:
        self._open.pop(job.id, None)
        self._archived.discard(job.id)
        self._pools.pop(job.allocation.pool, None)
        self._calls.forget(job.id, job.allocation.number)


def _finished(job: JobRecord) -> bool:
    return is_terminal(job.state) and job.allocation.ended
