"""Worker pools: workers on one allocation that join the general queue (``ctl slurm workers``).

A pool asks the scheduler for ``nodes`` nodes with one ``ctl worker`` each, registered with the pool's id; unlike
a job's allocation (``coordinator.batch.allocations``) its nodes are *general*: any job submitted with ``ctl submit``
may be placed there (``Scheduler.general``). It ends in one of three ways:

- ``ctl slurm release ID``: the pool is RELEASING. Its nodes are drained (``ctl drain``: each job on them takes
  a drain checkpoint and moves off, as on any drained node); once no job holds a slot on them the workers are
  told to exit (``Release``), so the Slurm job completes; one still there ``RELEASE_GRACE_S`` later is
  released by the adapter (``scancel``).
- The scheduler ends the allocation first (its time limit, ``scancel``, preemption): the workers are gone, their
  jobs restart elsewhere as after any lost node, and the pool is ENDED with the scheduler's words.
- The scheduler refuses the request: ENDED with its words.

The server's ``AllocationLoop`` drives pools as it drives jobs' allocations: ``due()`` names the calls to make, the
answers come back on the event loop thread. Pools are stored (``worker_pools``) and survive a restart.
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import structlog

from rankctl.coordinator.model.allocation import (NOT_SUBMITTED, REQUESTING, UNAVAILABLE, Allocation, AllocationRequest,
                                            Ask, Seen)
from rankctl.coordinator.batch.allocations import release_message
from rankctl.coordinator.batch.calls import Calls, Work
from rankctl.coordinator.api.convert import allocation_to_pb, stamp
from rankctl.coordinator.model.errors import InvalidRequest, PoolNotFound
from rankctl.coordinator.fleet.nodes import NodeNotFound, NodeSession, NodeTable
from rankctl.coordinator.jobs.commit import StoreGuard
from rankctl.coordinator.recovery.restarts import Restarts
from rankctl.coordinator.store.database import Store
from rankctl.proto import rankctl_pb2 as pb

log = structlog.get_logger("rankctl.coordinator")
ACTIVE, RELEASING, ENDED = "ACTIVE", "RELEASING", "ENDED"
MAX_NODES, MAX_SLOTS = 4096, 1024
ENDED_SHOWN = 50   # ended pools a listing shows besides the open ones


@dataclass(kw_only=True)
class PoolRecord:
    id: str
    nodes: int
    slots: int
    allocation: Allocation
    state: str = ACTIVE
    reason: str = ""
    created_at: float = 0.0
    requested_by: str = ""
    drained: list[str] = field(default_factory=list)   # nodes its release drained (undrained when it ends)
    released_for: str = ""          # why it was released ("pool X released: REASON"; "" while not released)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["allocation"] = self.allocation.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PoolRecord":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        known["allocation"] = Allocation.from_dict(d.get("allocation") or {})
        return cls(**known)


def pool_to_pb(p: PoolRecord) -> pb.WorkerPool:
    msg = pb.WorkerPool(id=p.id, allocation=allocation_to_pb(p.allocation), nodes=p.nodes, slots=p.slots,
                        state=p.state, reason=p.reason, requested_by=p.requested_by)
    stamp(msg.create_time, p.created_at)
    return msg


class PoolRecords:
    """The worker pools known (stored) and the open ones, loaded first: the scheduler asks which queue a worker
    serves (``general``) before the pools themselves are built; ``WorkerPools`` keeps them up to date."""

    def __init__(self, store: Store) -> None:
        self.all: dict[str, PoolRecord] = {p.id: p for p in map(PoolRecord.from_dict, store.load_pools())}
        self.open = {p.id: p for p in self.all.values() if p.state != ENDED}

    def general(self, pool: str) -> bool:
        """``Scheduler``: whether a worker of ``pool`` belongs to the general queue."""
        return pool in self.open


class WorkerPools:
    """The pools by id; the event loop thread only. A released pool's nodes are drained, and undrained when it ends,
    through ``restarts`` (as ``ctl drain``); ``free_slots`` is the scheduler's (READY node -> its slots no job
    holds)."""

    def __init__(self, records: PoolRecords, nodes: NodeTable, store: Store, clock: Callable[[], float],
                 guard: StoreGuard, restarts: Restarts, free_slots: Callable[[], dict[str, int]],
                 dial: tuple[str, bool] = ("", False)) -> None:
        self._nodes, self._store, self._clock = nodes, store, clock
        self._guard, self._restarts, self._free_slots = guard, restarts, free_slots
        self.address, self.tls = dial   # where the workers dial, and whether it serves TLS
        self._all, self._open = records.all, records.open
        self._calls = Calls(clock)   # what is asked of the scheduler, and when (``coordinator.batch.calls``)

    def __bool__(self) -> bool:
        return bool(self._open)

    def general(self, pool: str) -> bool:
        """Whether a worker of ``pool`` belongs to the general queue (``PoolRecords.general``)."""
        return pool in self._open

    # -- requests -------------------------------------------------------------------------
    def start(self, request: AllocationRequest, nodes: int, slots: int, requested_by: str = "") -> PoolRecord:
        problems = request.problems()
        if (why := request.tls_problem(self.tls)) is not None:
            problems.append(why)
        if not 1 <= nodes <= MAX_NODES:
            problems.append(f"--nodes (got {nodes}): must be between 1 and {MAX_NODES}")
        if not 1 <= slots <= MAX_SLOTS:
            problems.append(f"--slots (got {slots}): must be between 1 and {MAX_SLOTS}")
        if problems:
            raise InvalidRequest("; ".join(problems))
        pool_id = self._new_id()
        pool = PoolRecord(id=pool_id, nodes=nodes, slots=slots, created_at=self._clock(), requested_by=requested_by,
                          allocation=Allocation(request=replace(request, spares=0), pool=pool_id),
                          reason=f"asking {request.scheduler} for {nodes} node(s)")
        self._save(pool)
        self._all[pool.id] = self._open[pool.id] = pool
        log.info("pool.started", pool=pool.id, nodes=nodes, slots=slots)
        return pool

    def release(self, pool_id: str, reason: str = "") -> PoolRecord:
        """Drain the pool's nodes; its workers are told to exit once no job holds a slot there."""
        pool = self.get(pool_id)
        if pool.state != ACTIVE:
            return pool
        pool.released_for = f"pool {pool.id} released" + (f": {reason}" if reason else "")
        pool.state, pool.reason = RELEASING, pool.released_for + "; draining its nodes"
        for session in self._members(pool):
            self._drain_member(pool, session.name)
        self._save(pool)
        log.warning("pool.releasing", pool=pool.id, nodes=len(pool.drained))
        return pool

    def get(self, pool_id: str) -> PoolRecord:
        pool = self._all.get(pool_id)
        if pool is None:
            raise PoolNotFound(f"no worker pool has id {pool_id!r} (ctl slurm pools lists them)")
        return pool

    def listing(self) -> list[PoolRecord]:
        ended = [p for p in self._all.values() if p.state == ENDED][-ENDED_SHOWN:]
        return sorted([*self._open.values(), *ended], key=lambda p: p.created_at)

    def registered(self, session: NodeSession) -> bool:
        """A worker registered: True when its pool is one of these (a RELEASING pool's newcomer is drained too)."""
        pool = self._open.get(session.pool)
        if pool is None:
            return False
        if pool.state == RELEASING:
            self._drain_member(pool, session.name)
            self._save(pool)
        return True

    # -- what the loop asks ---------------------------------------------------------------------
    def due(self) -> list[Work]:
        out = []
        for pool in list(self._open.values()):
            a = pool.allocation
            unasked = a.state == REQUESTING and not a.id
            if unasked and pool.state == RELEASING:
                self._end(pool, NOT_SUBMITTED, "released before the scheduler was asked")
                continue
            if a.ended:
                self._end(pool, a.state, f"its allocation ended: {a.describe()}")
                continue
            if not unasked and pool.state == RELEASING and not a.released and self._idle(pool):
                self._let_go(pool)
                continue
            work = self._calls.next(pool.id, a, lambda: Ask(pool.id, "workers", a, pool.nodes, pool.slots,
                                                           self.address, tls=self.tls, general=True))
            if work is not None:
                out.append(work)
        return out

    # -- answers (as ``Allocations``') ----------------------------------------------------------------
    def requested(self, work: Work, allocation_id: str, output: str) -> None:
        if (pool := self._answered(work)) is None:
            return
        pool.allocation = replace(pool.allocation, id=allocation_id, output=output, state="PENDING")
        if pool.state == ACTIVE:
            pool.reason = f"{pool.allocation.describe()}, batch output {output}"
        self._save(pool)
        log.info("pool.requested", pool=pool.id, id=allocation_id)

    def refused(self, work: Work, words: str) -> None:
        if (pool := self._answered(work)) is not None:
            pool.allocation = replace(pool.allocation, state=UNAVAILABLE, detail=words)
            self._end(pool, UNAVAILABLE, f"{pool.allocation.request.scheduler} refused its allocation: {words}")

    def seen(self, work: Work, seen: Seen) -> None:
        self._calls.seen(work)
        if (pool := self._answered(work)) is None:
            return
        a = pool.allocation
        if (seen.state, list(seen.nodes), seen.detail) != (a.state, a.nodes, a.detail):
            pool.allocation = replace(a, state=seen.state, nodes=list(seen.nodes) or a.nodes, detail=seen.detail)
            if pool.state == ACTIVE:
                pool.reason = pool.allocation.describe()
            self._save(pool)

    def released(self, work: Work) -> None:
        self._answered(work)
        self._calls.released(work)

    def failed_call(self, work: Work, error: str) -> None:
        self._calls.failed(work)
        log.warning("pool.call_failed", pool=work.job_id, action=work.action, error=error)
        self._answered(work)

    # -- internals -----------------------------------------------------------------------------------
    def _answered(self, work: Work) -> PoolRecord | None:
        self._calls.answered(work)
        return self._open.get(work.job_id)

    def _members(self, pool: PoolRecord) -> list[NodeSession]:
        return [s for s in self._nodes if s.pool == pool.id]

    def _idle(self, pool: PoolRecord) -> bool:
        """No job holds a slot on the pool's nodes (one no longer READY holds none)."""
        free = self._free_slots()
        return all(free[s.name] >= s.record.slots for s in self._members(pool) if s.name in free)

    def _drain_member(self, pool: PoolRecord, name: str) -> None:
        if name not in pool.drained:
            pool.drained.append(name)
            with contextlib.suppress(NodeNotFound), self._guard.consistent():   # it left meanwhile: nothing to move
                self._restarts.drain(name, pool.released_for)

    def _let_go(self, pool: PoolRecord) -> None:
        """No job holds a slot on the pool's nodes any more: its workers are told to exit."""
        pool.allocation = replace(pool.allocation, released=True)
        pool.reason = pool.released_for + "; its workers were told to exit"
        self._save(pool)
        self._calls.told_to_exit(pool.id, pool.allocation.number)
        for session in self._members(pool):
            self._nodes.send(session.name, release_message(f"worker pool {pool.id} is released"))
        log.info("pool.released", pool=pool.id, id=pool.allocation.id)

    def _end(self, pool: PoolRecord, state: str, why: str) -> None:
        if state != pool.allocation.state:
            pool.allocation = replace(pool.allocation, state=state)
        pool.state = ENDED
        pool.reason = f"{pool.released_for}; {why}" if pool.released_for else why
        for name in pool.drained:   # a later pool may give a worker the same node name
            with self._guard.consistent():
                self._restarts.undrain_node(name)
        self._save(pool)
        self._open.pop(pool.id, None)
        self._calls.forget(pool.id, pool.allocation.number)
        log.warning("pool.ended", pool=pool.id, reason=pool.reason)

    def _save(self, pool: PoolRecord) -> None:
        with self._store.transaction(f"worker pool {pool.id}"):
            self._store.save_pool(pool.id, pool.created_at, pool.to_dict())

    def _new_id(self) -> str:
        while (pool_id := f"workers-{secrets.token_hex(3)}") in self._all:
            pass
        return pool_id
