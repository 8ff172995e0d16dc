"""Job advancement: an active job moves on from its ranks' counters, or fails when it hangs.

After each group commit of rank reports, an active job's ``JobProgress`` decides: the failed rank most likely
the cause (killed by a signal, else failed with its own error, else the lowest) fails the attempt (``restarts``);
one whose error only says a peer failed waits up to ``ATTRIBUTION_S`` for that peer's report, so that the reason
and the node blamed are the cause's, not a consequence's; every rank running makes it RUNNING, every rank exited 0
aggregates the result and makes it SUCCEEDED. A RUNNING job none of whose ranks changed step or phase
for long enough is hung (``check_hangs``: seconds on the job's own pace when its ranks wait for a peer,
``coordinator.diagnosis.pace``; at most ``restart.hang_timeout``); the reason names whom it waits for
(``coordinator.diagnosis.hangs``). An advance the store refused is owed and retried by ``settle``.
"""

from __future__ import annotations

from typing import Callable

import structlog

from rankctl.coordinator.jobs.commit import StoreGuard
from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.model.faults import Cause, Fault, rank_fault
from rankctl.coordinator.model.records import JobRecord
from rankctl.coordinator.recovery.reconcile import ATTRIBUTION_S, Hold, Running, Succeed, reconcile
from rankctl.coordinator.recovery.restarts import Restarts
from rankctl.coordinator.jobs.results import aggregate, parse_rank_results
from rankctl.coordinator.model.states import JobState, is_active
from rankctl.coordinator.scheduling.stops import Stops
from rankctl.coordinator.store.database import Store, StoreError

log = structlog.get_logger("rankctl.coordinator")
S = JobState


class Advancer:
    """Moves active jobs along; called from the event loop thread only."""

    def __init__(self, book: JobBook, store: Store, clock: Callable[[], float], guard: StoreGuard,
                 restarts: Restarts, stops: Stops) -> None:
        self._book, self._store, self._clock, self._guard = book, store, clock, guard
        self._restarts, self._stops = restarts, stops
        self._owed: set[str] = set()                     # jobs whose advance failed to store: retried by settle
        self._held: dict[str, float] = {}                # job -> when a failure that names a peer's was first held

    def advance(self, job: JobRecord) -> None:
        """Move an active job along from its rank statuses (owed to ``settle`` when the store refuses)."""
        if not is_active(job.state) and job.id not in self._stops:
            return
        try:
            with self._guard.consistent():
                self.advance_once(job)
        except StoreError as exc:
            self._owed.add(job.id)
            log.warning("job.advance_store_failed", job=job.id, error=str(exc))

    def check_held(self) -> None:
        """Fail the attempts whose peer-failure reports waited ``ATTRIBUTION_S`` for a cause in vain (on the tick)."""
        for job_id in list(self._held):
            job = self._book.jobs.get(job_id)
            if job is None or not is_active(job.state) or job.state is S.RESTARTING:
                self._held.pop(job_id, None)
            elif self._clock() - self._held[job_id] >= ATTRIBUTION_S:
                self.advance_once(job)

    def settle(self) -> None:
        """Retry the advances the store refused."""
        for job_id in sorted(self._owed):
            self._owed.discard(job_id)
            self.advance(self._book.jobs[job_id])

    def advance_once(self, job: JobRecord) -> None:
        """Move the job along from its counters (constant time; a result reads every rank once)."""
        if not is_active(job.state):
            if job.id in self._stops:  # an ended attempt: an exit may complete its stop
                self._restarts.free_when_gone(job)
            return
        if job.state is S.RESTARTING:
            self._restarts.requeue_when_stopped(job)
            return
        progress = self._book.progress(job)
        if progress.preflight is not None and not progress.preflight.handled:
            progress.preflight.handled = True
            if progress.preflight.exclude:
                self._preflight_failed(job, progress.preflight.exclude)
                return
            self._restarts.together_again(job)
        bad = progress.likely_cause()
        since = self._held.setdefault(job.id, self._clock()) if bad is not None else None
        plan = reconcile(self._restarts.view(
            job, failed=rank_fault(bad) if bad is not None else None, failed_since=since,
            loss_held=self._restarts.loss_held(job), all_running=progress.all_running(),
            all_succeeded=progress.all_succeeded()))
        match plan:
            case Hold():
                return   # held for its cause: a killed peer's report, or a lost node's held failure (``check_held``)
            case Running():
                self._book.transition(job, S.RUNNING, f"all {job.world_size} ranks running")
                progress.advanced_at = self._clock()
                if progress.all_succeeded():   # every rank ran and exited 0 between two advances
                    self._succeed(job)
            case Succeed():
                self._succeed(job)
            case _:
                self._held.pop(job.id, None)
                self._restarts.apply(job, plan)

    def _preflight_failed(self, job: JobRecord, exclude: list[tuple[int, str]]) -> None:
        """The attempt's pre-flight found nodes to leave out: each is excluded for this job, and the attempt
        fails naming them (the restart places the job without them)."""
        named = [(job.nodes[i], why) for i, why in exclude if i < len(job.nodes)]
        for node, why in named:
            self._restarts.exclude(job, node, f"the pre-flight of attempt {job.attempt}: {why}")
        reason = "pre-flight: " + "; ".join(f"node {node}: {why}; it is excluded from this job" for node, why in named)
        self._restarts.fail_attempt(job, Fault(cause=Cause.OTHER, reason=reason, node=named[0][0] if named else ""))

    def _succeed(self, job: JobRecord) -> None:
        ranks = self._book.ranks(job.id)
        results = parse_rank_results({r: rec.result_json for r, rec in ranks.items()})
        with self._store.transaction(f"the result of job {job.id}"):
            self._book.set_result(job, aggregate(job.kind, results))
            self._book.event(job, "result", f"result from {len(results)} rank(s)")
        ended = job.result.get("ended") if isinstance(job.result, dict) else None   # the kind's word on the end
        self._restarts.finish(job, S.SUCCEEDED, f"all {job.world_size} ranks exited 0"
                                                + (f"; {str(ended)[:300]}" if ended else ""))

    def check_hangs(self, loop_lag: float) -> None:
        """A RUNNING job that has reported steps and none of whose ranks changed step or phase for long
        enough is hung (``coordinator.diagnosis.pace``: seconds when its ranks wait for a peer, else
        ``restart.hang_timeout``); its attempt fails (and restarts if it may) naming what is known. Time the
        coordinator's own loop was stalled (``loop_lag``) does not count."""
        now = self._clock()
        for job in self._book.active():
            if job.state is not S.RUNNING:
                continue
            progress = self._book.progress(job)
            if loop_lag > 0:
                progress.advanced_at += loop_lag
            timeout = job.spec.restart.hang_timeout
            idle = now - progress.advanced_at
            # armed once a rank reported a step: a script that never reports one cannot be told from a hang
            live = job.world_size - progress.exited
            if progress.advanced_at and progress.max_step > 0 and progress.pace.hung(idle, timeout, live):
                links: list[tuple[str, str]] = []
                reason = self._hang_reason(job, idle, progress.pace.rule(timeout), links, progress.hang)
                for a, b in links:
                    self._restarts.keep_apart(job, a, b)
                hang = Fault(cause=Cause.HANG, reason=reason, step=progress.min_step)
                self._restarts.apply(job, reconcile(self._restarts.view(job, hang=hang)))

    def _hang_reason(self, job: JobRecord, idle: float, rule: str, links: list[tuple[str, str]],
                     named: list[int]) -> str:
        """Who the hang waits for (``coordinator.diagnosis.hangs``): stopped or spinning ranks, the groups waiting and
        the members that never entered their operation, from the evidence the daemons sent; else the slowest
        ranks. The ranks it points at go on ``named`` (the dashboard outlines them)."""
        from rankctl.coordinator.diagnosis.hangs import hang_reason

        return hang_reason(self._book.ranks(job.id), self._book.progress(job).summary(), idle, rule, links, named)
