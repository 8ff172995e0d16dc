"""The core's turn: the marks since the last one (``coordinator.jobs.dirty``) taken and acted on, in one place.

A turn stores the reports a phase change made due (``coordinator.jobs.intake``), fails the attempts of the jobs of
each node found LOST (``Restarts.node_lost``: one transaction a node, its messages after it), reconciles each marked
job once (``coordinator.recovery.reconciler``: its writes in one consistent block whose node messages go once it
committed, "persist, then send") and then runs one placement pass when the queue is marked
(``coordinator.scheduling.scheduler``). What those mark (a requeued job, freed slots) is taken in a further round, a
few at most; the rest waits for the next turn. A job whose plan the store refused is set aside, with every job after
it, for the tick's turn (``Dirty.resume``). Every operation of the core ends with a turn; a mark made outside one
asks the event loop for a turn on its next iteration.
"""

from __future__ import annotations

import structlog

from rankctl.coordinator.fleet.nodes import NodeStatus, NodeTable
from rankctl.coordinator.jobs.commit import Outgoing, StoreGuard
from rankctl.coordinator.jobs.dirty import Dirty
from rankctl.coordinator.jobs.intake import ReportIntake
from rankctl.coordinator.recovery.reconciler import JobReconciler
from rankctl.coordinator.recovery.restarts import Restarts
from rankctl.coordinator.scheduling.scheduler import Scheduler
from rankctl.coordinator.store.database import Store, StoreError

log = structlog.get_logger("rankctl.coordinator")
TURN_ROUNDS = 4             # rounds of one turn while reconciling marks more (the rest waits for the next turn)


class Turn:
    """Runs the core's turns; the event loop thread only."""

    def __init__(self, dirty: Dirty, store: Store, guard: StoreGuard, outgoing: Outgoing, intake: ReportIntake,
                 nodes: NodeTable, restarts: Restarts, reconciler: JobReconciler, scheduler: Scheduler) -> None:
        self._dirty, self._store, self._guard, self._outgoing = dirty, store, guard, outgoing
        self._intake, self._nodes, self._restarts = intake, nodes, restarts
        self._reconciler, self._scheduler = reconciler, scheduler
        self._running = False

    def run(self) -> None:
        """One turn (module docstring); a turn asked for inside one (a worker pool's drain) is that one's."""
        if self._running:
            return
        self._running = True
        try:
            for _ in range(TURN_ROUNDS):
                if not self._round():
                    return
        finally:
            self._running = False

    def _round(self) -> bool:
        """One round; False when nothing was marked or the store refused."""
        dirty = self._dirty
        if dirty.reports:   # reports that change a phase came: stored first
            dirty.reports = False
            try:
                self._intake.flush()
            except Exception:  # noqa: BLE001 - as the server's group-commit loop: logged, the next flush retries
                log.exception("reports.flush_failed")
        if not self._lost_nodes():
            return False
        if not dirty:
            return False
        jobs, placing = dirty.take()
        marked = list(jobs.items())
        for k, (job_id, timed) in enumerate(marked):
            try:
                with self._guard.consistent(), self._outgoing.after_commit():
                    self._reconciler.reconcile(job_id, timed)
            except StoreError as exc:   # memory is back to the store's: this job and the rest, later
                dirty.retry(dict(marked[k:]), placing)
                log.warning("job.reconcile_store_failed", job=job_id, error=str(exc))
                return False
        if placing or dirty.placing:
            dirty.placing = False
            self._scheduler.schedule()
        return True

    def _lost_nodes(self) -> bool:
        """Fail the attempts of the jobs of each node marked LOST (one still LOST: one that came back meanwhile had
        its jobs reconciled as it registered); False when the store refused (the rest waits for a later turn)."""
        names = self._dirty.take_lost()
        for k, name in enumerate(names):
            session = self._nodes.get(name)
            if session is None or session.status is not NodeStatus.LOST:
                continue
            try:   # what the loss decides is one transaction, and its messages go once it committed
                with self._guard.consistent(), self._outgoing.after_commit():
                    with self._store.transaction(f"the loss of node {name}"):
                        self._restarts.node_lost(name, session.detail)
            except StoreError as exc:
                self._dirty.retry_lost(names[k:])
                log.warning("node.lost_store_failed", node=name, error=str(exc))
                return False
        return True
