"""Ends of attempts: a failed attempt restarts or fails the job, a drained node's jobs move, a job finishes.

A failed attempt (a rank exits non-zero, a node is lost or comes back without it, a hang) goes to the pure
``restart_decision.decide``. A restart moves the job to RESTARTING with the reason. Where every node of the
attempt still connected stays in the next one and its daemon stops an older attempt's ranks before it starts a
newer Assign's (``Register.replaces``), the next attempt is queued and placed at once on those nodes and free
ones for the lost (``Scheduler.in_place``): a restart in place, on a new rendezvous port, with no stop to wait
for. Otherwise it tells every node of the attempt to stop it and queues the next attempt (PENDING,
``attempt + 1``) only once every rank of the old one is confirmed gone (``stops``); no slot or port is
reused before that. Each attempt's end,
reason, cause (``failure`` or ``drain``) and the node a failure is attributed to are stored in the
``attempts`` table. A node two consecutive failed attempts of a job are attributed to (only a node's own
fault is: ``faults.Fault.blames_node``) is not placed for that job again until ``ctl undrain``; a full disk
excludes it at once. A drained node's jobs restart without it, after their drain
checkpoint where their kind saves one (``drains``); a drain is no failure.
"""

from __future__ import annotations

from typing import Any, Callable

import structlog

from rankctl.coordinator.api import convert
from rankctl.coordinator.jobs.commit import Outgoing
from rankctl.coordinator.recovery.drains import Drains, saves_on_request
from rankctl.coordinator.model.faults import Cause, Fault, Failed, reattributed
from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.fleet.nodes import NodeTable
from rankctl.coordinator.diagnosis.pace import UNCERTAIN
from rankctl.coordinator.diagnosis.progress import rank_span
from rankctl.coordinator.model.records import JobRecord
from rankctl.coordinator.jobs.dirty import Dirty
from rankctl.coordinator.recovery.reconcile import (
    AskCheckpoint, Continue, EndAttempt, Grow, JobView, MoveOff, Plan, reconcile,
)
from rankctl.coordinator.recovery.restart_decision import (
    AttemptFacts, Decision, Fail, Requeue, Restart, StopFacts, Wait,
)
from rankctl.coordinator.scheduling.scheduler import Scheduler
from rankctl.coordinator.model.states import LIVE, JobState
from rankctl.coordinator.model.stats import CoordinatorStats
from rankctl.coordinator.scheduling.stops import Stops
from rankctl.coordinator.store.database import Store

log = structlog.get_logger("rankctl.coordinator")
S = JobState


def _gone(ranks: list[int]) -> str:
    return f"{rank_span(ranks)} {'is' if len(ranks) == 1 else 'are'} gone"


def max_restarts(job: JobRecord) -> int:
    return job.spec.restart.max_restarts


class Restarts:
    """Carries out what ends an attempt; called from the event loop thread, inside the core's consistent blocks."""

    def __init__(self, book: JobBook, nodes: NodeTable, store: Store, clock: Callable[[], float],
                 outgoing: Outgoing, stops: Stops, drains: Drains, scheduler: Scheduler,
                 stats: CoordinatorStats, dirty: Dirty,
                 hold_loss: Callable[[JobRecord, Fault], bool] = lambda job, loss: False) -> None:
        self._book, self._nodes, self._store, self._clock = book, nodes, store, clock
        self._outgoing, self._stops, self._drains, self._scheduler = outgoing, stops, drains, scheduler
        self._stats, self._dirty = stats, dirty
        # the allocations' say over a lost node of an allocation's job (True: they fail the attempt themselves, once
        # they know whether the whole allocation ended: ``coordinator.batch.holds``)
        self.hold_loss = hold_loss
        self._failed: dict[str, Failed] = {}   # job -> its last failure
        self._losing: dict[str, dict[str, str]] = {}   # job -> its lost nodes whose failure ``hold_loss`` holds


    # -- failures ---------------------------------------------------------------------------
    def fail_attempt(self, job: JobRecord, fault: Fault) -> None:
        """The current attempt failed with ``fault``: what follows is ``reconcile``'s (restart the job if it may,
        else fail it with every attempt's reason; one that fails the same way as the attempt before it, as stored,
        ends the job). A RESTARTING job only re-checks its stop."""
        slot = {Cause.NODE_LOST: "lost", Cause.NODE_BACK: "lost", Cause.HANG: "hang"}.get(fault.cause, "failed")
        self.apply(job, reconcile(self.view(job, **{slot: (fault,) if slot == "lost" else fault})))

    def view(self, job: JobRecord, **facts: Any) -> JobView:
        """The job's level state for ``reconcile``: its attempt, restart budget and stored attempts, the fault its
        previous attempt failed with (stored: it survives a failover), its stop, the time; plus ``facts``."""
        stop = None
        if job.state is S.RESTARTING:
            begun = self._stops.begin(job)
            stop = StopFacts(begun.since, self._stops.left(job))
        # the stored attempts only when a failure is at hand (the common advance has none: no store read)
        failing = job.state is not S.RESTARTING and any(facts.get(k) for k in ("lost", "failed", "hang"))
        attempts = [AttemptFacts(a["attempt"], a["reason"], a["cause"]) for a in self._store.attempts.listed(job.id)] \
            if failing else []
        previous = Fault.from_json(self._store.attempts.fault(job.id, job.attempt - 1)) \
            if failing and job.attempt > 1 else None
        return JobView(state=job.state, attempt=job.attempt, max_restarts=max_restarts(job), attempts=attempts,
                       previous=previous, stop=stop, now=self._clock(), **facts)

    def apply(self, job: JobRecord, plan: Plan) -> None:
        """Carry out ``reconcile``'s plan for the attempt's end or the job's growth; the rest (Running, Succeed, Hold,
        Nothing) is the caller's."""
        match plan:
            case EndAttempt(fault, decision):
                if job.state is not S.RESTARTING:
                    step = fault.step if fault.repeatable else None
                    self._failed[job.id] = Failed(job.attempt, fault, step, self._clock(), tuple(job.nodes))
                self._carry_out(job, decision, fault=fault)
            case MoveOff(nodes, why):
                self.drain_restart(job, list(nodes), why)
            case Grow(why):
                self._begin_restart(job, f"attempt {job.attempt} ended to grow back to {job.nodes_needed} nodes"
                                         + (f": {why}" if why else ""), "nodes free again" + (f"; {why}" if why else ""),
                                    cause="grow")
            case AskCheckpoint():
                self._drains.ask_grow(job, job.nodes_needed)
            case Continue(decision):
                self._carry_out(job, decision)

    def uncertain_hang_steps(self, job: JobRecord) -> set[int]:
        """The steps at which an earlier attempt of the job was ended for an uncertain hang (its stored faults: they
        survive a failover); the hang judgement does not end another attempt for that at those steps."""
        faults = (Fault.from_json(self._store.attempts.fault(job.id, a)) for a in range(1, job.attempt))
        return {f.step for f in faults if f is not None and f.cause is Cause.HANG and f.detail == UNCERTAIN
                and f.step is not None}

    def loss_held(self, job: JobRecord) -> bool:
        """A node of the job's attempt is lost and its failure held (``hold_loss``): its victims' errors wait."""
        return job.id in self._losing

    def requeue_when_stopped(self, job: JobRecord) -> None:
        """Queue a RESTARTING job's next attempt once every rank of the stopping one is confirmed gone."""
        if job.state is S.RESTARTING:
            self.apply(job, reconcile(self.view(job)))

    def _carry_out(self, job: JobRecord, decision: Decision, *, fault: Fault | None = None) -> None:
        match decision:
            case Restart(headline, reason):
                self._begin_restart(job, headline, reason, fault=fault)
            case Requeue():
                self._requeue(job)
            case Fail(reason, abandon):
                if abandon:
                    self._stops.forget(job.id)
                if fault is not None:   # kept with the last attempt too: clients read the job's exit code from it
                    self._store.attempts.store_fault(job.id, job.attempt, fault.to_json())
                self.finish(job, S.FAILED, reason, stop=not abandon)
            case Wait():
                pass

    def _begin_restart(self, job: JobRecord, headline: str, reason: str, *, cause: str = "failure",
                       fault: Fault | None = None) -> None:
        """End the attempt (``reason`` stored with it), tell its nodes to stop it, queue the next once it is gone.
        Only a node's own fault is blamed on it (``Fault.blames_node``); a full disk excludes it at once."""
        with self._store.transaction(f"the restart of job {job.id}"):
            self._book.transition(job, S.RESTARTING, f"{headline}; stopping its ranks")
            self._lost_ranks_gone(job)
            self._store.attempts.end(job.id, job.attempt, self._clock(), S.RESTARTING.value, reason, cause)
            if fault is not None:
                self._store.attempts.store_fault(job.id, job.attempt, fault.to_json())
            if fault is not None and fault.blames_node:
                self._store.attempts.blame(job.id, job.attempt, fault.node)
                if fault.moves_off_node:
                    self.exclude(job, fault.node, f"attempt {job.attempt}: {fault.reason}")
                else:
                    self._exclude_if_repeated(job, fault.node)
        self._stats.restarts[cause] += 1
        self._drains.forget(job.id)
        log.warning("job.restarting", job=job.id, attempt=job.attempt, reason=reason, cause=cause)
        placed = self._scheduler.in_place(job)
        if placed is not None and self._scheduler.restart_in_place(job, *placed):
            return  # its nodes stop the old ranks as they start the new: no stop to confirm first
        self._stops.begin(job)
        self._outgoing.to_nodes(job.nodes, convert.cancel_message(job.id, job.attempt, headline), kind="cancel")
        self.requeue_when_stopped(job)

    def _exclude_if_repeated(self, job: JobRecord, node: str) -> None:
        """The previous attempt's failure was attributed to ``node`` too: do not place the job there again."""
        if job.attempt < 2 or self._store.attempts.blamed(job.id, job.attempt - 1) != node:
            return
        self.exclude(job, node, f"its ranks failed in attempts {job.attempt - 1} and {job.attempt}")

    def keep_apart(self, job: JobRecord, a: str, b: str) -> None:
        """A hang pointed at the link between nodes ``a`` and ``b``: the job's next attempts are not placed on
        both while other nodes fit, until a pre-flight of an attempt on both passes (``scheduler``)."""
        self._nodes.apart.setdefault(job.id, set()).add((a, b))
        self._book.event(job, "node", f"nodes {a} and {b} are not placed together for this job while other nodes "
                                      f"fit, until a pre-flight between them passes: their link may be cut")

    def together_again(self, job: JobRecord) -> None:
        """The attempt's pre-flight passed: pairs kept apart for the job that it runs on both of may meet again."""
        apart = self._nodes.apart.get(job.id)
        met = {(a, b) for a, b in apart or () if a in job.nodes and b in job.nodes}
        if met:
            apart -= met
            self._book.event(job, "node", "the pre-flight passed between " + ", ".join(f"{a} and {b}" for a, b in
                                                                                       sorted(met)))

    def exclude(self, job: JobRecord, node: str, why: str) -> None:
        """Never place ``job`` on ``node`` again (stored; ``ctl undrain NODE`` clears it)."""
        with self._store.transaction(f"an exclusion of node {node} for job {job.id}"):
            self._store.add_exclusion(job.id, node, why, self._clock())
            self._book.event(job, "node", f"node {node} is not placed for this job again: {why} "
                                          f"(`ctl undrain {node}` clears this)")
        self._nodes.excluded.setdefault(job.id, {})[node] = why
        log.warning("node.excluded", node=node, job=job.id, reason=why)

    def _requeue(self, job: JobRecord) -> None:
        previous = job.attempt
        self._scheduler.remember_nodes(job)
        with self._store.transaction(f"the next attempt of job {job.id}"):
            self._book.next_attempt(job)
            self._book.transition(job, S.PENDING, f"attempt {previous}'s ranks are gone; queued as attempt "
                                                  f"{job.attempt}")
        self._stops.forget(job.id)
        self._dirty.place()

    # -- ends -------------------------------------------------------------------------------
    def finish(self, job: JobRecord, state: JobState, reason: str, *, stop: bool = True) -> None:
        """Move to a terminal state; FAILED/CANCELLED tell every node of the job to stop it, and its slots
        wait until its ranks are confirmed gone (``stop``; False: they are free at once)."""
        self._book.transition(job, state, reason)
        self._lost_ranks_gone(job)
        self._drains.forget(job.id)
        self._failed.pop(job.id, None)
        self._nodes.apart.pop(job.id, None)
        self._scheduler.forget(job.id)
        if job.id in self._nodes.excluded:  # an ended job is placed nowhere again
            self._store.clear_exclusions(job_id=job.id)
            del self._nodes.excluded[job.id]
        if state is not S.SUCCEEDED:
            self._outgoing.to_nodes(job.nodes, convert.cancel_message(job.id, job.attempt, reason))
        if stop and state is not S.SUCCEEDED and job.nodes:
            self._stops.begin(job)
            self.free_when_gone(job, quiet=True)  # nothing left to confirm: free now, without an event
        else:
            self._stops.forget(job.id)
        self._dirty.place()

    def free_when_gone(self, job: JobRecord, *, quiet: bool = False) -> None:
        """An ended job's stop: its slots are free once its ranks are gone (or the stop timed out)."""
        if self._stops.free_if_gone(job, quiet=quiet):
            self._dirty.place()

    # -- nodes that go away -----------------------------------------------------------------
    def node_lost(self, name: str, detail: str) -> None:
        """Every active job with ranks on the lost node ``name`` fails its attempt (a drained one moves); then the
        node's ranks that never said they exited, of those jobs and of ended attempts still stopping, are recorded
        gone with it (a failed job showed them running for ever)."""
        stopping = self._stops.node_gone(name)
        earlier = [(job, self._failed.get(job.id)) for job in self._book.active()]   # O(active jobs)
        touched = [job for job in self._book.active() if job.runs_on(name)]
        for job in touched:
            if job.state is S.RESTARTING:
                continue  # a restart's stop is checked below: the node's ranks there are gone too
            loss = Fault(cause=Cause.NODE_LOST, reason=f"node {name} lost ({detail}); {_gone(job.ranks_on(name))}",
                         node=name)
            if name in self._nodes.draining:  # drained, then taken away: still no failure
                why = f"then lost ({detail}); {_gone(job.ranks_on(name))}"
                self.apply(job, reconcile(self.view(job, draining_lost=((name,), why), lost=(loss,))))
            elif job.pool and self.hold_loss(job, loss):
                self._losing.setdefault(job.id, {})[name] = detail
            else:
                self.apply(job, reconcile(self.view(job, lost=(loss,))))
        for job, last in earlier:   # a victim's error that failed an attempt just before: the loss is why
            self._reattribute(job, last, name, detail)
        for job in {j.id: j for j in touched + stopping}.values():
            if job.state not in LIVE:   # (a held loss waits for its allocation)
                self._book.ranks_gone(job, name, f"gone with node {name} (lost: {detail})")
        self._dirty.jobs(self._stops.job_ids())   # their stops may be complete now

    def node_back_without(self, job: JobRecord, name: str, missing: list[int]) -> None:
        """Node ``name`` reconnected without the job, and ``missing`` of its ranks there never exited."""
        self.fail_attempt(job, Fault(cause=Cause.NODE_BACK, node=name,
                                     reason=f"node {name} reconnected without this job; {_gone(missing)}"))

    def drain(self, name: str, reason: str) -> list[JobRecord]:
        """The node takes no new work (stored; NodeNotFound for a node never known) and every active job on it moves
        off it; the jobs concerned. Draining again only updates the reason."""
        self._nodes.known(name)
        if self._nodes.draining.get(name) != reason:
            with self._store.transaction(f"the drain of node {name}"):
                self._store.set_drain(name, reason, self._clock())
                self._nodes.draining[name] = reason
        moved = self.drain_node(name)
        log.warning("node.draining", node=name, reason=reason, jobs=len(moved))
        return moved

    def undrain_node(self, name: str) -> list[str]:
        """The node takes work again (stored), for the jobs it was excluded from too; their ids."""
        cleared = self._nodes.exclusions_by_node().get(name, [])
        with self._store.transaction(f"the undrain of node {name}"):
            self._store.clear_drain(name)
            self._store.clear_exclusions(node=name)
            self._nodes.draining.pop(name, None)
            for job_id in cleared:
                names = self._nodes.excluded[job_id]
                names.pop(name, None)
                if not names:
                    del self._nodes.excluded[job_id]
                self._book.event(self._book.jobs[job_id], "node", f"node {name} may run this job again (undrained)")
            self._drains.undrained(name)
        log.info("node.undrained", node=name, cleared=len(cleared))
        self._dirty.place()
        return cleared

    def drain_node(self, name: str) -> list[JobRecord]:
        """Move every active job off the draining node ``name``; the jobs concerned (only that node's)."""
        moved = []
        for job in self._book.active():
            if not job.runs_on(name):
                continue
            moved.append(job)
            if job.state is S.RESTARTING or self._drains.also_leaving(job, name):
                continue  # its next attempt is placed without the node / it leaves after its checkpoint
            if job.state is S.RUNNING and saves_on_request(job.kind):
                self._drains.ask(job, name)
            else:
                self.drain_restart(job, [name], f"the job was {job.state.value.lower()}: moved at once")
        return moved

    def _lost_ranks_gone(self, job: JobRecord) -> None:
        """The attempt ended while a node's loss was held: that node's ranks are gone with it (not ``running``)."""
        for name, detail in self._losing.pop(job.id, {}).items():
            self._book.ranks_gone(job, name, f"gone with node {name} (lost: {detail})")

    def _reattribute(self, job: JobRecord, last: Failed | None, name: str, detail: str) -> None:
        """Node ``name`` was lost: where the job's ``last`` failed attempt ended on its victim's error, that
        attempt's stored reason and blame become the loss (``faults.reattributed``)."""
        session = self._nodes.get(name)
        loss = reattributed(last, name, detail, session.last_heartbeat if session else 0.0)
        if last is None or loss is None or (job.attempt == last.attempt and job.state is not S.RESTARTING):
            return
        with self._store.transaction(f"the reason of attempt {last.attempt} of job {job.id}"):
            self._store.attempts.end(job.id, last.attempt, last.at, S.RESTARTING.value, loss.reason)
            self._store.attempts.blame(job.id, last.attempt, name)
            self._store.attempts.store_fault(job.id, last.attempt, loss.to_json())
            self._book.event(job, "node", f"attempt {last.attempt} failed with node {name}'s loss; "
                                          f"{last.fault.reason} followed from it")
        if self._failed.get(job.id) is last:
            self._failed[job.id] = Failed(last.attempt, loss, None, last.at, last.nodes)

    def drain_restart(self, job: JobRecord, nodes: list[str], detail: str) -> None:
        """End the attempt because ``nodes`` are drained (no failure: it does not use a restart)."""
        why = "; ".join(f"node {n} drained" + (f" ({r})" if (r := self._nodes.draining.get(n)) else "")
                        for n in nodes)
        self._begin_restart(job, f"attempt {job.attempt} ended: {why}; {detail}", f"{why}; {detail}", cause="drain")
