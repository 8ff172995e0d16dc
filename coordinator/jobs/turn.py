"""The core's turn: the marks since the last one (``coordinator.jobs.dirty``) taken and acted on, in one place.

A turn stores the reports a phase change made due (``coordinator.jobs.intake``), reconciles each marked job once
(``coordinator.recovery.reconciler``; its writes in one consistent block whose node messages go once it committed:
"persist, then send") and then runs one placement pass when the queue is marked (``coordinator.scheduling.scheduler``).
What those mark (a requeued job, freed slots) is taken in a further round, a few at most; the rest waits for the next
turn. A job whose plan the store refused stays marked, with every job after it, for the tick's turn. Every operation
of the core ends with a turn; a mark made outside one asks the event loop for a turn on its next iteration.
"""

from __future__ import annotations

import structlog

from rankctl.coordinator.jobs.commit import Outgoing, StoreGuard
from rankctl.coordinator.jobs.dirty import Dirty
from rankctl.coordinator.jobs.intake import ReportIntake
from rankctl.coordinator.recovery.reconciler import JobReconciler
from rankctl.coordinator.scheduling.scheduler import Scheduler
from rankctl.coordinator.store.database import StoreError

log = structlog.get_logger("rankctl.coordinator")
TURN_ROUNDS = 4             # rounds of one turn while reconciling marks more (the rest waits for the next turn)


class Turn:
    """Runs the core's turns; the event loop thread only."""

    def __init__(self, dirty: Dirty, guard: StoreGuard, outgoing: Outgoing, intake: ReportIntake,
                 reconciler: JobReconciler, scheduler: Scheduler) -> None:
        self._dirty, self._guard, self._outgoing = dirty, guard, outgoing
        self._intake, self._reconciler, self._scheduler = intake, reconciler, scheduler
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
