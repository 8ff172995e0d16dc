"""One job reconciled from its level state: the view ``reconcile`` reads, built once, and its plan carried out.

The core's turn (``Coordinator.turn``) calls ``JobReconciler.reconcile`` once for each job marked dirty
(``coordinator.jobs.dirty``): after a commit of rank reports, a node's loss or return, a cancel, a drain, an
allocation's change, a refused write, and on every tick for each active or stopping job. It reads the job's record,
counters, drain and stop, and asks ``coordinator.recovery.reconcile`` what follows:

- an ended job whose ranks are not all confirmed gone frees its slots once they are (``stops``); a RESTARTING one
  queues its next attempt (or fails) once its stop allows;
- the attempt's pre-flight, once: nodes it found bad are excluded and the attempt fails naming them;
- the failed rank most likely the cause (killed by a signal, else failed with its own error, else the lowest) fails
  the attempt; one whose error only says a peer failed waits ``ATTRIBUTION_S`` (from when it was first seen) for
  that peer's report, so that the reason and the node blamed are the cause's, not a consequence's;
- a RUNNING job none of whose ranks changed step or phase for long enough is hung (seconds on the job's own pace
  when its ranks wait for a peer, ``coordinator.diagnosis.pace``; at most ``restart.hang_timeout``); the reason
  names whom it waits for (``coordinator.diagnosis.hangs``);
- a drain whose checkpoint is complete (or out of time) moves the job off the drained nodes; a shrunk elastic job
  whose full size fits again asks for a checkpoint, then restarts at its full size (checked on the tick's marks
  only: a placement trial costs O(nodes));
- every rank running makes it RUNNING, every rank exited 0 aggregates the result and makes it SUCCEEDED.

The plan's writes are one transaction, and its node messages go once it committed (the turn holds them: "persist,
then send"). Nothing is owed: a plan the store refused leaves the job marked (memory back to the store's), and a later
turn reads the level state again.
"""

from __future__ import annotations

from typing import Callable

import structlog

from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.jobs.results import aggregate, parse_rank_results
from rankctl.coordinator.model.faults import Cause, Fault, rank_fault
from rankctl.coordinator.model.records import JobRecord
from rankctl.coordinator.model.states import JobState, is_active, is_terminal
from rankctl.coordinator.recovery.drains import Drains, saves_on_request
from rankctl.coordinator.diagnosis.deadlock import blocked
from rankctl.coordinator.diagnosis.hangs import hang_reason, waiting_line
from rankctl.coordinator.diagnosis.pace import DEADLOCK, LINK
from rankctl.coordinator.diagnosis.progress import JobProgress
from rankctl.coordinator.recovery.reconcile import (
    ATTRIBUTION_S, Continue, EndAttempt, Hold, Nothing, Plan, Running, Succeed, reconcile,
)
from rankctl.coordinator.recovery.restart_decision import Wait
from rankctl.coordinator.recovery.restarts import Restarts
from rankctl.coordinator.scheduling.scheduler import Scheduler
from rankctl.coordinator.scheduling.stops import Stops
from rankctl.coordinator.store.database import Store

__all__ = ["ATTRIBUTION_S", "JobReconciler"]
log = structlog.get_logger("rankctl.coordinator")
S = JobState


class JobReconciler:
    """Reconciles one job at a time; called from the event loop thread, inside the core's consistent blocks."""

    def __init__(self, book: JobBook, store: Store, clock: Callable[[], float], restarts: Restarts, stops: Stops,
                 drains: Drains, scheduler: Scheduler, later: Callable[[str, float], None] = lambda job, s: None
                 ) -> None:
        self._book, self._store, self._clock, self._later = book, store, clock, later
        self._restarts, self._stops, self._drains, self._scheduler = restarts, stops, drains, scheduler

    def timed(self) -> list[str]:
        """The jobs time alone may move on (the tick marks them): the active ones and the ended ones stopping."""
        return [job.id for job in self._book.active()] + self._stops.job_ids()

    def discount(self, loop_lag: float) -> None:
        """The coordinator's own loop stood still ``loop_lag`` seconds: that time does not count towards a hang."""
        for job in self._book.active():
            if job.state is S.RUNNING:
                progress = self._book.progress(job)
                if progress.advanced_at is not None:
                    progress.advanced_at += loop_lag
                progress.pace.discount(loop_lag)

    def reconcile(self, job_id: str, timed: bool = False) -> None:
        """What follows for the job now, carried out (``timed``: also what time alone decides: growth)."""
        job = self._book.jobs.get(job_id)
        if job is None:
            self._stops.forget(job_id)
            return
        if is_terminal(job.state):
            if job_id in self._stops:   # an ended attempt: an exit or the time may complete its stop
                self._restarts.free_when_gone(job)
            return
        if job.state is S.RESTARTING:   # its stop: requeue, wait, or give up
            plan: Plan = reconcile(self._restarts.view(job))
            if not (isinstance(plan, Continue) and isinstance(plan.decision, Wait)):
                with self._store.transaction(f"the stop of job {job.id}"):
                    self._restarts.apply(job, plan)
            return
        if job_id in self._stops:   # a stop of an earlier attempt: over (the job was queued again)
            self._stops.forget(job_id)
        if not is_active(job.state):   # queued: the placement pass's
            return
        progress = self._book.progress(job)
        pre = progress.preflight
        if pre is not None and not pre.handled:
            if pre.exclude:
                with self._store.transaction(f"the pre-flight of job {job.id}"):
                    self._preflight_failed(job, pre.exclude)
                pre.handled = True
                return
            self._restarts.together_again(job)
            pre.handled = True
        links: list[tuple[str, str]] = []
        plan = self._plan(job, progress, links, timed)
        if isinstance(plan, (Nothing, Hold)):
            return   # (held for its cause: a killed peer's report, or a lost node's held failure)
        with self._store.transaction(f"the {type(plan).__name__.lower()} plan of job {job.id}"):   # one, then send
            self._carry_out(job, progress, plan, links)

    def _plan(self, job: JobRecord, progress: JobProgress, links: list[tuple[str, str]], timed: bool) -> Plan:
        """The job's whole view, built once (reads only), and ``reconcile``'s plan for it."""
        bad = progress.likely_cause()
        if bad is not None and progress.failing_since is None:
            progress.failing_since = self._clock()
        running = job.state is S.RUNNING
        drain = self._drains.due_for(job) if running else None
        grow_fits = timed and running and job.world_size < job.spec.world_size and not self._drains.waiting(job) \
            and self._scheduler.fits_full(job)
        return reconcile(self._restarts.view(
            job, failed=rank_fault(bad) if bad is not None else None, failed_since=progress.failing_since,
            loss_held=self._restarts.loss_held(job), hang=self._hang(job, links) if running else None,
            drain_due=(tuple(drain[0].nodes), drain[1]) if drain is not None and drain[0].nodes else None,
            grow_due=drain[1] if drain is not None and not drain[0].nodes else None,
            grow_fits=grow_fits, saves_on_request=grow_fits and saves_on_request(job.kind),
            all_running=progress.all_running(), all_succeeded=progress.all_succeeded()))

    def _carry_out(self, job: JobRecord, progress: JobProgress, plan: Plan, links: list[tuple[str, str]]) -> None:
        """The plan's writes (inside the caller's one transaction) and messages (sent once it committed)."""
        match plan:
            case Running():
                self._book.transition(job, S.RUNNING, f"all {job.world_size} ranks running")
                progress.advance(self._clock())
                if progress.all_succeeded():   # every rank ran and exited 0 between two turns
                    self._succeed(job)
            case Succeed():
                self._succeed(job)
            case EndAttempt(fault) if fault.cause is Cause.HANG:
                for a, b in links:   # the hang pointed at links between nodes: kept apart next time
                    self._restarts.keep_apart(job, a, b)
                self._restarts.apply(job, plan)
            case _:
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

    def _hang(self, job: JobRecord, links: list[tuple[str, str]]) -> Fault | None:
        """The RUNNING job's hang, if it is hung (``coordinator.diagnosis.pace``: certain evidence at once, uncertain
        at the bound); the ranks it points at are named in an event first, as soon as every live rank is still and
        some wait. The links it points at go on ``links``; the ranks, on the job's counters (the dashboard)."""
        progress = self._book.progress(job)
        pace, now = progress.pace, self._clock()
        timeout, live = job.spec.restart.hang_timeout, job.world_size - progress.exited
        if pace.spared is None:
            pace.spared = self._restarts.uncertain_hang_steps(job)
        ranks = self._book.ranks(job.id)
        if pace.still(live) and pace.analysed != pace.generation:
            pace.analysed = pace.generation
            pace.blocked = blocked(ranks, [min(pace.waiting)]) if pace.all_waiting(live) else ""
        verdict = pace.judge(now, timeout, live, progress.min_step)
        if verdict is None:
            wait = pace.nameable(now) if pace.still(live) else None
            if wait == 0.0:
                self._name(job, progress, ranks, timeout, now)
            elif wait is not None:
                self._later(job.id, wait)
            due = pace.due(now, timeout, live)
            if due is not None:
                self._later(job.id, due)   # judged again then, not at the next tick
            return None
        quiet = pace.quiet_for(now)
        progress.hang = []
        reason = hang_reason(ranks, progress.summary(), quiet, verdict.rule, links, progress.hang)
        return Fault(cause=Cause.HANG, reason=reason, step=progress.min_step, detail=verdict.kind)

    def _name(self, job: JobRecord, progress: JobProgress, ranks: dict, timeout: float, now: float) -> None:
        """An event naming whom the waiting ranks wait for, where it is and when it is acted on (once per state of
        the evidence); the ranks it points at outline the dashboard's grid."""
        pace = progress.pace
        pace.named, pace.named_at = pace.generation, now
        named: list[int] = []
        text = waiting_line(ranks, named)
        if not named:
            return
        if pace.stopped:
            when = "acted on about a second after the stop unless it goes on"
        elif pace.blocked in (DEADLOCK, LINK):
            when = "acted on at once if it holds" if pace.blocked == DEADLOCK or pace.lossy else \
                f"acted on after {pace.learned.bound(pace.pause_kind(), timeout):g} s still"
        elif pace.spared and progress.min_step in pace.spared:
            when = "not acted on: an earlier attempt was ended at this step for the same uncertain reason, so it is " \
                   "taken for work (`ctl cancel` ends it)"
        else:
            when = f"acted on only if still so {pace.learned.bound(pace.pause_kind(), timeout):g} s after the job " \
                   f"last moved (restart.hang_timeout, or a pause it survived)"
        if f"{text}; {when}" == pace.stall:
            return
        progress.hang, pace.stall = named, f"{text}; {when}"
        with self._store.transaction(f"the stall of job {job.id}"):
            self._book.event(job, "stall", pace.stall)
