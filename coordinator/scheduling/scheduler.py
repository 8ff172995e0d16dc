"""The scheduler: pending jobs placed in queue order and started on their nodes.

A job pinned to an allocation (``coordinator.model.allocation``) is placed on its pool's nodes only, and no other job
on them; it neither holds back nor waits behind the general queue. A pass walks the other PENDING jobs in submission order; the first that cannot start holds the ones behind it
back for ``head_wait`` seconds unless they fit beside it (``capacity.may_pass``). A job is placed on the
free slots of READY nodes that are neither draining nor excluded for it; a restarted attempt keeps the
nodes of its previous one where it can and has its moved ranks fetch their checkpoints from a node that
holds them. Ended jobs whose ranks are not confirmed gone still hold slots and ports. The core's turn runs a pass
when the queue is marked (``coordinator.jobs.dirty``); a pass the store refused, or asked for inside another
change's transaction, leaves the mark for a later turn.
"""

from __future__ import annotations

import contextlib

from typing import Callable, Iterable

import structlog

from rankctl.coordinator.scheduling import capacity
from rankctl.coordinator.jobs.commit import Outgoing, StoreGuard
from rankctl.coordinator.jobs.dirty import Dirty
from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.fleet.nodes import NodeStatus, NodeTable
from rankctl.coordinator.scheduling.planner import assign_messages, pick_port
from rankctl.coordinator.model.records import JobRecord
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.model.stats import CoordinatorStats
from rankctl.coordinator.store.database import Store, StoreError
from rankctl.parallel.placement import NodeSlots, PlacementError

log = structlog.get_logger("rankctl.coordinator")
S = JobState
HEAD_WAIT_S = 60.0          # how long the first job that cannot start holds back the jobs behind it


def _node_span(names: list[str], shown: int = 8) -> str:
    """The nodes of a placement, at most ``shown`` of them named."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


class Scheduler:
    """Places and starts pending jobs; called from the event loop thread only.

    ``ended``: the jobs that ended for good but still hold slots (``Stops.ended``);
    ``shutting_down``: true once the coordinator is going down (nothing is started then).
    """

    def __init__(self, book: JobBook, nodes: NodeTable, store: Store, clock: Callable[[], float],
                 guard: StoreGuard, outgoing: Outgoing, stats: CoordinatorStats, dirty: Dirty, *,
                 ended: Callable[[], Iterable[JobRecord]], shutting_down: Callable[[], bool],
                 head_wait: float = HEAD_WAIT_S, general: Callable[[str], bool] = lambda pool: False,
                 gathering: Callable[[JobRecord, int], str | None] = lambda job, ready: None) -> None:
        self._book, self._nodes, self._store, self._clock = book, nodes, store, clock
        self._guard, self._outgoing, self._stats, self._dirty = guard, outgoing, stats, dirty
        self._ended, self._shutting_down = ended, shutting_down
        self.head_wait = head_wait
        self._head_since: dict[str, float] = {}          # job id -> when it first could not start
        self._passed_at = float("-inf")                  # when the last pass ran
        self._shut_out: dict[str, float] = {}            # job id -> since when only its exclusions keep it waiting
        self._prev_nodes: dict[str, list[str]] = {}      # requeued job -> its previous attempt's nodes (cache)
        # the allocations': why a job of an allocation waits for more of its workers (``coordinator.batch.holds``)
        self.gathering = gathering
        # ``pools``: whether a worker's pool is a worker pool of the general queue (ctl slurm workers)
        self.general = general

    def _placement_pool(self, pool: str) -> str:
        """The pool a node serves: its allocation's, or "" (the general queue) for a worker pool's and unpooled."""
        return "" if pool and self.general(pool) else pool

    def schedule(self) -> None:
        """Start pending jobs in queue order (see ``capacity``): the core's turn, when the queue is marked. One that
        cannot store, or is asked for inside another change's transaction, leaves the mark for a later turn."""
        if self._shutting_down() or not self._book.pending():
            return
        if self._store.in_transaction:  # never inside another change's transaction: right after it
            self._dirty.place()
            return
        try:
            with self._guard.consistent():
                self._pass()
        except StoreError as exc:
            self._dirty.retry({}, placing=True)
            log.warning("schedule.store_failed", error=str(exc))

    def due(self) -> bool:
        """Whether a pass is due with time alone: a job's exclusions are due to yield (``_yield_exclusions``), or the
        head of the queue has held the jobs behind it for ``head_wait`` since the last pass (they may pass it now:
        ``capacity.may_pass``; before, nothing but another event woke the queue, and a job that fitted waited)."""
        now = self._clock()
        if any(now - since >= self.head_wait for since in self._shut_out.values()):
            return True
        return any(self._passed_at < since + self.head_wait <= now for since in self._head_since.values())

    def free_slots(self) -> dict[str, int]:
        """READY node -> its slots not held by a job."""
        return capacity.free_slots(self._nodes.ready(), self._holding())

    def remember_nodes(self, job: JobRecord) -> None:
        """The job's attempt is over and it is queued again: its next attempt is placed against these nodes."""
        self._prev_nodes[job.id] = list(job.nodes)

    def forget(self, job_id: str) -> None:
        """The job ended: it is placed nowhere again."""
        self._prev_nodes.pop(job_id, None)
        self._shut_out.pop(job_id, None)
        self._head_since.pop(job_id, None)

    def _pass(self) -> None:
        head: JobRecord | None = None
        sessions, now = list(self._nodes), self._clock()
        self._passed_at = now
        for job in self._book.pending():
            if job.state is not S.PENDING:
                continue
            if job.pool:  # its own nodes: it neither holds back nor waits behind the general queue
                why = self._try_start(job)
                if why is not None:
                    self._book.set_waiting(job, why)
                continue
            if head is not None and not capacity.may_pass(head, sessions, now - self._head_since[head.id],
                                                          self.head_wait):
                self._book.set_waiting(job, f"queued behind {head.id}")
                continue
            why = self._try_start(job)
            if why is None:
                self._head_since.pop(job.id, None)
                continue
            self._book.set_waiting(job, why)
            self._head_since.setdefault(job.id, now)
            head = head or job

    def _holding(self) -> list[JobRecord]:
        """Jobs that hold slots and ports: the active ones, and ended ones whose ranks are not confirmed gone."""
        return self._book.active() + list(self._ended())

    def _ports_in_use(self, node: str) -> set[int]:
        return {int(j.rendezvous.rsplit(":", 1)[1]) for j in self._holding() if j.nodes[:1] == [node]}

    def _try_start(self, job: JobRecord) -> str | None:
        """Place and start ``job`` (a restart against its previous attempt's nodes); or return why it must wait.

        Draining nodes and the nodes excluded for this job are not placed; the reason names them."""
        blocked = self._nodes.blocked(job.id)
        slots = self._slots(job, blocked)
        if job.pool and (why := self.gathering(job, sum(1 for s in slots if s.free >= job.slots_per_node))):
            return why
        try:
            names, short = self._place_elastic(job, slots), ""
            self._shut_out.pop(job.id, None)
        except PlacementError as exc:
            names, short = self._yield_exclusions(job), str(exc)
        if names is None:
            if job.allocation is not None:   # (the scheduler's own reason, when it says one, in ``describe``)
                return (f"waiting for the workers of its allocation, {job.allocation.describe()}: "
                        f"{len(slots)} of {job.nodes_needed} node(s) ready")
            shown = "; ".join(f"{name} {why}" for name, why in sorted(blocked.items())[:8])
            more = f" and {len(blocked) - 8} more" if len(blocked) > 8 else ""
            return f"waiting for capacity: {short}" + (f"; not placed: {shown}{more}" if blocked else "")
        port = pick_port(self._nodes.get(names[0]).free_ports, self._ports_in_use(names[0]))
        if port is None:
            return f"waiting for a rendezvous port: node {names[0]} reported no free port that is not in use"
        self._start(job, names, port)
        return None

    def _yield_exclusions(self, job: JobRecord) -> list[str] | None:
        """The job's nodes when only its exclusions keep it from starting and they yield: at once on an allocation's
        nodes (no others will come), else after ``head_wait`` (an excluded node's peers may come back first). A job
        never waits for ever while enough READY nodes exist; the exclusions are cleared, with an event."""
        excluded = self._nodes.excluded.get(job.id)
        if not excluded:
            return None
        try:
            names = self._place_elastic(job, self._slots(job, {n: "draining" for n in self._nodes.draining}))
        except PlacementError:
            self._shut_out.pop(job.id, None)
            return None
        since = self._shut_out.setdefault(job.id, self._clock())
        if not job.pool and self._clock() - since < self.head_wait:
            return None
        del self._shut_out[job.id], self._nodes.excluded[job.id]
        with self._store.transaction(f"the exclusions of job {job.id}"):
            self._store.clear_exclusions(job_id=job.id)
            self._book.event(job, "node", f"node(s) {', '.join(sorted(excluded))} placed for this job again: without "
                                          f"them it could not be placed on the READY nodes")
        log.warning("node.exclusions_yield", job=job.id, nodes=sorted(excluded))
        return names

    def _slots(self, job: JobRecord, blocked: dict[str, str], own: Iterable[str] = ()) -> list[NodeSlots]:
        """The free slots the job may be placed on (its pool's nodes, none blocked for it); ``own``: nodes whose
        slots it holds now, counted free for its next attempt."""
        free = self.free_slots()
        for name in own:
            free[name] = free.get(name, 0) + job.slots_per_node
        return [NodeSlots(name, n) for name, n in free.items()
                if name not in blocked and self._placement_pool(self._nodes.get(name).pool) == job.pool]

    def _place_elastic(self, job: JobRecord, slots: list[NodeSlots], prev: list[str] | None = None) -> list[str]:
        """The job's nodes at its full size (``resources.nodes``), else, for an elastic job
        (``resources.min_nodes``), on as many nodes as fit down to ``min_nodes``; the full size's PlacementError
        when none fits."""
        res = job.spec.resources
        try:
            return self._place(job, slots, res.nodes, prev)
        except PlacementError as full:
            for nodes in range(res.nodes - 1, res.fewest_nodes - 1, -1):
                with contextlib.suppress(PlacementError):
                    return self._place(job, slots, nodes, prev)
            raise full from None

    def _place(self, job: JobRecord, slots: list[NodeSlots], nodes: int, prev: list[str] | None = None) -> list[str]:
        """``nodes`` nodes for the job: against ``prev`` (default: its previous attempt's), never both nodes of a
        pair kept apart for it (a link a hang pointed at) while the placement fits without the second of them."""
        prev = self._prev_attempt_nodes(job) if prev is None else prev
        apart = {b for _, b in self._nodes.apart.get(job.id, ())}
        if apart:
            try:
                return capacity.place_keeping(prev, nodes, job.slots_per_node,
                                              [s for s in slots if s.name not in apart])
            except PlacementError:
                pass  # only together: placed, and the attempt's pre-flight tests their link
        return capacity.place_keeping(prev, nodes, job.slots_per_node, slots)

    def fits_full(self, job: JobRecord) -> bool:
        """Whether a shrunk elastic job would fit at its full size now: the free slots and its own nodes'."""
        slots = self._slots(job, self._nodes.blocked(job.id), own=job.nodes)
        try:
            self._place(job, slots, job.spec.resources.nodes)
        except PlacementError:
            return False
        return True

    def in_place(self, job: JobRecord) -> tuple[list[str], int] | None:
        """Where the next attempt of a job whose attempt just failed starts at once (nodes, rendezvous port): on
        every node of the attempt still connected, whose daemon stops the old ranks before it starts the new
        (``NodeSession.replaces``), and free nodes for the rest, on a port the old attempt does not use. None:
        a node leaves the job (blocked for it, kept apart), or nothing fits now: its stop is confirmed first."""
        if job.pool or self._shutting_down():
            return None
        alive = [s for s in map(self._nodes.get, job.nodes) if s is not None and s.status is NodeStatus.READY]
        if not all(s.replaces for s in alive):
            return None
        kept = [s.name for s in alive]
        blocked = self._nodes.blocked(job.id)
        try:
            names = self._place_elastic(job, self._slots(job, blocked, own=kept), prev=job.nodes)
        except PlacementError:
            return None
        if not set(kept) <= set(names):
            return None
        port = pick_port(self._nodes.get(names[0]).free_ports, self._ports_in_use(names[0]))
        return None if port is None else (names, port)

    def restart_in_place(self, job: JobRecord, names: list[str], port: int) -> bool:
        """Queue and start the next attempt of a RESTARTING job on ``in_place``'s nodes and port at once; False
        when the store refused it (memory is the store's again: the job is RESTARTING, nothing was sent)."""
        previous = job.attempt
        self.remember_nodes(job)
        try:
            with self._guard.consistent(), self._outgoing.after_commit(), \
                    self._store.transaction(f"the next attempt of job {job.id}"):
                self._book.next_attempt(job)
                self._book.transition(job, S.PENDING, f"queued as attempt {job.attempt}, in place: each node "
                                                      f"stops attempt {previous}'s ranks before it starts its own")
                self._start(job, names, port)
        except StoreError as exc:
            if self._store.in_transaction:  # inside another change's: it fails as a whole
                raise
            log.warning("restart_in_place.store_failed", job=job.id, error=str(exc))
            return False
        return True

    def _start(self, job: JobRecord, names: list[str], port: int) -> None:
        rendezvous = f"{self._nodes.get(names[0]).record.host}:{port}"
        self._book.sized(job, len(names))   # an elastic job's attempt may run on fewer nodes
        try:
            messages = assign_messages(job, names, rendezvous, [self._nodes.get(n).peer for n in names],
                                       self._restore_sources(job, names))
        except Exception as exc:  # a stored spec that no longer lays out: fail it, keep the queue moving
            log.exception("job.assignments_failed", job=job.id)
            self._book.transition(job, S.FAILED, f"cannot build rank assignments: {exc}")
            return
        waited = self._book.waited(job)
        with self._store.transaction(f"the placement of job {job.id}"):
            self._book.placed(job, names, rendezvous)
            self._book.transition(job, S.PLACED, f"placed on {_node_span(names)}; rendezvous {job.rendezvous}")
            self._store.attempts.put(job, self._clock())
            self._book.start_ranks(job)
            self._book.transition(job, S.STARTING,
                                  f"sent {job.world_size} rank assignment(s) to {len(names)} node(s)")
        self._stats.queue_wait.observe(waited)
        self._outgoing.fan_out("assign", zip(names, messages))

    def _prev_attempt_nodes(self, job: JobRecord) -> list[str]:
        """The nodes of the job's previous attempt, which a restart places against (memory, else the store)."""
        if job.attempt < 2:
            return []
        prev = self._prev_nodes.get(job.id)
        if prev is None:  # the coordinator restarted since: the attempts table has them
            prev = self._prev_nodes[job.id] = self._store.attempts.nodes(job.id, job.attempt - 1)
        return prev

    def _restore_sources(self, job: JobRecord, names: list[str]) -> list[str]:
        """For each job node of a restarted attempt that did not run the same ranks before: the
        PeerService of a connected node holding those ranks' checkpoints (the node that ran them, even
        while it is draining, or the one that kept their copies: the next node of the previous
        attempt); "" otherwise."""
        prev = self._prev_attempt_nodes(job)
        self._prev_nodes.pop(job.id, None)
        out = [""] * len(names)
        if not prev or len(prev) != len(names):
            return out
        for k, name in enumerate(names):
            if name == prev[k]:
                continue
            for holder in (prev[k], prev[(k + 1) % len(prev)]):
                session = self._nodes.get(holder)
                if session is not None and session.status is NodeStatus.READY and session.peer:
                    out[k] = session.peer
                    break
        return out
