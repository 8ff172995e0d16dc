"""What the restarts and the scheduler ask of the allocations, as state of its own (``AllocationHolds``), built
before all three so that each is constructed with everything it needs (no setter after construction).

- ``hold_loss`` (``Restarts``): a node of an allocation's job was lost; its failure is held until the allocation's
  state is known (asked for at once by ``Allocations``, which fails the attempt with the answer).
- ``gathering`` (``Scheduler``): why a job of a new allocation still waits for more of its workers.

The facts: the open allocations by job, the calls to the scheduler about them (``coordinator.batch.calls``), the
losses held and since when, when each pool's first worker registered. ``Allocations`` (the request/watch/release machine) keeps them up to date. The
event loop thread only.
"""

from __future__ import annotations

from typing import Callable

from rankctl.coordinator.batch.calls import Calls
from rankctl.coordinator.model.faults import Fault
from rankctl.coordinator.model.records import JobRecord

GATHER_S = 15.0          # how long a job waits for all of a new allocation's workers (its nodes + spares) to register
                         # before it is placed on those that did (a resume finds its checkpoints on its old nodes)


class AllocationHolds:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.open: dict[str, JobRecord] = {}                  # job id -> its job, while its allocation is open
        self.calls = Calls(clock)                             # what is asked of the scheduler, and when
        self.losses: dict[str, list[Fault]] = {}              # job id -> the node losses held for an answer
        self.held_since: dict[str, float] = {}                # job id -> when its first loss was held
        self.first_worker: dict[str, float] = {}              # pool -> when its first worker registered

    @staticmethod
    def nodes_of(job: JobRecord) -> int:
        """The nodes the job's allocation asks for: the job's and its spares."""
        return job.nodes_needed + (job.allocation.request.spares if job.allocation is not None else 0)

    def hold_loss(self, job: JobRecord, loss: Fault) -> bool:
        """``Restarts``: a node of ``job`` was lost. Hold the failure until the allocation's state is known (asked
        for at once); False when there is nothing to ask (no open allocation): fail now."""
        a = job.allocation
        if a is None or job.id not in self.open or a.ended or not a.id:
            return False
        self.losses.setdefault(job.id, []).append(loss)
        self.held_since.setdefault(job.id, self._clock())
        self.calls.watch_now(job.id, a.number)
        return True

    def gathering(self, job: JobRecord, ready: int) -> str | None:
        """``Scheduler``: why ``job`` waits for more of its allocation's workers (``ready`` of them READY and free),
        or None. A new allocation's workers register within seconds of each other; placing the job on the first
        ones would move a resumed job off the nodes that hold its checkpoints."""
        a = job.allocation
        want = self.nodes_of(job)
        since = self.first_worker.get(a.pool) if a is not None else None
        if a is None or since is None or ready >= want or self._clock() - since >= GATHER_S:
            return None
        return f"waiting for the workers of its allocation, {a.describe()}: {ready} of {want} registered"
