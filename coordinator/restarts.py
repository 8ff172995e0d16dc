"""Automatic restarts: a failed or drained attempt is stopped, confirmed gone, and the job runs again.

A mixin of ``core.Coordinator`` (it uses the core's book, node table, store and ``_finish``).
When an attempt fails (a rank exits non-zero, a node is lost, a node comes back without the
job) and the job has restarts left (``restart.max_restarts``), the job moves to RESTARTING
with the reason and every node of the attempt is told to stop it. The next attempt is
queued (PENDING, ``attempt + 1``) only once every rank of the old one is confirmed gone: it
reported its exit, or its node is lost or came back without it (a lost node's ranks die with
its launcher). No slot or port is reused before that. The placement then keeps the nodes of
the previous attempt where they can still run (warm launchers, their own checkpoints) and puts
a spare where one cannot, so a lost node is replaced by a spare. Each attempt's end, reason,
cause (``failure`` or ``drain``) and the node a failure is attributed to are stored in the
``attempts`` table; a job out of restarts fails with every attempt's reason.

The same confirmation holds for an attempt that ended for good (cancelled, failed): its slots
and ports stay taken until its ranks are gone or ``STOP_TIMEOUT_S`` passed (``Stop``), and
GetJob says how many ranks are not yet confirmed gone.

Draining (``ctl drain NODE``): the node takes no new work. A RUNNING ``train`` job on it is
asked for a checkpoint a little ahead of its fastest rank (``CheckpointNow`` to each of its
nodes); once every rank has passed that step, or after ``DRAIN_WAIT_S``, the attempt ends and
the job restarts without the node, resuming from the checkpoint (the replacement fetches the
drained node's shards from the drained node itself, which is still connected). Other jobs
move at once. A drain restart is no failure: it does not count against ``max_restarts``.

A node to which two consecutive attempts' failures of one job are attributed (the node of the
lowest failed rank, or the lost node) is not placed for that job again until ``ctl undrain``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import structlog

from rankctl.coordinator import convert
from rankctl.contract.spec import DEFAULT_HANG_TIMEOUT_S
from rankctl.coordinator.nodes import NodeStatus
from rankctl.coordinator.progress import JobProgress
from rankctl.coordinator.records import JobRecord
from rankctl.coordinator.states import JobState, is_terminal
from rankctl.kinds import registry
from rankctl.parallel.placement import ranks_of_node

log = structlog.get_logger("rankctl.coordinator")
S = JobState
STOP_TIMEOUT_S = 120.0   # an attempt whose ranks are not confirmed gone by then: a restart fails, an end frees its slots
REASONS_SHOWN = 400      # characters of each attempt's reason in a final failure
DRAIN_WAIT_S = 60.0      # how long a drain waits for the checkpoint before the job moves anyway
DRAIN_LEAD_STEPS = 2     # the drain checkpoint is at least this many steps ahead of the fastest rank ...
DRAIN_LEAD_S = 0.5       # ... and about this far ahead in step time (the request must reach every rank first)
DRAIN_MAX_LEAD = 10      # ... but never more steps ahead than this


@dataclass
class Stop:
    """An ended attempt whose ranks are not all confirmed gone: its slots and ports stay taken."""

    attempt: int
    since: float
    gone: set[int] = field(default_factory=set)  # job node indexes whose ranks count as gone (lost, or back without it)


@dataclass
class DrainWait:
    """A RUNNING train job asked for a checkpoint at ``step`` before it moves off the drained ``nodes``."""

    attempt: int
    step: int
    since: float
    nodes: list[str]


def drain_step(progress: JobProgress) -> int:
    """The step a drained job checkpoints at: past its fastest rank by the lead (in steps and in step time)."""
    lead = DRAIN_LEAD_STEPS
    dt = progress.metrics.get("step_time_max")
    if isinstance(dt, (int, float)) and dt > 0:
        lead = max(lead, min(DRAIN_MAX_LEAD, math.ceil(DRAIN_LEAD_S / dt)))
    return progress.max_step + lead


def _saves_on_request(kind: str) -> bool:
    """Whether a running job of ``kind`` saves a checkpoint at a step the daemon asks for (a drain waits)."""
    known = registry.kinds().get(kind)
    return known is not None and known.drain_checkpoint


class RestartsMixin:
    """See the module docstring; called from the event loop thread, inside the core's consistency blocks."""

    # -- failures ---------------------------------------------------------------------------
    def _fail_attempt(self, job: JobRecord, reason: str, *, node: str = "") -> None:
        """The current attempt failed (``node``: the node it is attributed to, "" when none): restart the job
        if it may, else fail it with every attempt's reason. Drain restarts do not count as restarts."""
        if job.state is S.RESTARTING:  # already stopping: a node lost or back without it only helps confirm
            self._maybe_requeue(job)
            return
        max_restarts = int((job.spec.get("restart") or {}).get("max_restarts", 0))
        drained = self.store.drained_attempts(job.id) if job.attempt > 1 else 0
        if job.attempt - 1 - drained < max_restarts:
            self._begin_restart(job, f"attempt {job.attempt} failed: {reason}", reason, blamed=node)
            return
        if max_restarts == 0:
            self._finish(job, S.FAILED, reason)
            return
        earlier = [a for a in self.store.attempts(job.id) if a["attempt"] < job.attempt]
        history = "; ".join(f"attempt {a['attempt']}: {a['reason'][:REASONS_SHOWN]}" for a in earlier)
        self._finish(job, S.FAILED, f"attempt {job.attempt} failed and no restart is left "
                                    f"(max_restarts={max_restarts}): {reason}; earlier: {history}")

    def _begin_restart(self, job: JobRecord, headline: str, reason: str, *, cause: str = "failure",
                       blamed: str = "") -> None:
        """End the attempt (``reason`` stored with it), tell its nodes to stop it, queue the next once it is gone."""
        with self.store.transaction(f"the restart of job {job.id}"):
            self.book.transition(job, S.RESTARTING, f"{headline}; stopping its ranks")
            self.store.end_attempt(job.id, job.attempt, self.clock(), S.RESTARTING.value, reason, cause)
            if blamed:
                self.store.blame_attempt(job.id, job.attempt, blamed)
                self._exclude_if_repeated(job, blamed)
        self.stats.restarts[cause] += 1
        self._drains.pop(job.id, None)
        self._begin_stop(job)
        cancel = convert.cancel_message(job.id, job.attempt, headline)
        for name in dict.fromkeys(job.nodes):
            self._send(name, cancel)
        log.warning("job.restarting", job=job.id, attempt=job.attempt, reason=reason, cause=cause)
        self._maybe_requeue(job)

    def _exclude_if_repeated(self, job: JobRecord, node: str) -> None:
        """The previous attempt's failure was attributed to ``node`` too: do not place the job there again."""
        if job.attempt < 2 or self.store.attempt_blamed(job.id, job.attempt - 1) != node:
            return
        why = f"its ranks failed in attempts {job.attempt - 1} and {job.attempt}"
        self.store.add_exclusion(job.id, node, why, self.clock())
        self.nodes.excluded.setdefault(job.id, {})[node] = why
        self.book.event(job, "node", f"node {node} is not placed for this job again: {why} "
                                     f"(`ctl undrain {node}` clears this)")
        log.warning("node.excluded", node=node, job=job.id, reason=why)

    # -- stopping an attempt ----------------------------------------------------------------
    def _begin_stop(self, job: JobRecord) -> Stop:
        """Start waiting for the ranks of the job's current attempt to be gone (kept if already waiting)."""
        stop = self._stops.get(job.id)
        if stop is None or stop.attempt != job.attempt:
            gone = {k for k, name in enumerate(job.nodes)
                    if (s := self.nodes.get(name)) is None or s.status is NodeStatus.LOST}
            stop = self._stops[job.id] = Stop(job.attempt, self.clock(), gone)
        return stop

    def _unconfirmed(self, job: JobRecord) -> int:
        """Ranks of the stopping attempt not confirmed gone: not exited, on a node not counted gone.

        Constant time in the job's size: the exits are counted (``JobProgress.exited``); only the ranks
        of the nodes counted gone (lost, or back without the attempt) are looked at.
        """
        stop = self._stops.get(job.id)
        left = job.world_size - self.book.progress(job).exited
        if left and stop is not None and stop.gone:
            ranks, spn = self.book.ranks(job.id), job.slots_per_node
            for k in stop.gone:
                left -= sum(1 for r in ranks_of_node(k, spn) if (rec := ranks.get(r)) is None or not rec.exited)
        return max(0, left)

    def stopping_ranks(self, job_id: str) -> int:
        """Ranks of the job's ended attempt not yet confirmed gone (0: none, or nothing is stopping)."""
        job = self.book.jobs.get(job_id)
        if job is None or job.id not in self._stops or self._stops[job.id].attempt != job.attempt:
            return 0
        return self._unconfirmed(job)

    def _node_gone(self, name: str) -> None:
        """``name`` is lost (or came back without its ranks): its ranks count as gone in every stop."""
        for job_id, stop in self._stops.items():
            job = self.book.jobs.get(job_id)
            k = job.node_index().get(name) if job is not None and job.attempt == stop.attempt else None
            if k is not None:
                stop.gone.add(k)

    def _maybe_requeue(self, job: JobRecord) -> None:
        """Queue the next attempt once every rank of the stopping one is confirmed gone."""
        if job.state is not S.RESTARTING:
            return
        stop = self._begin_stop(job)
        left = self._unconfirmed(job)
        if left:
            if self.clock() - stop.since > STOP_TIMEOUT_S:
                self._stops.pop(job.id, None)
                self._finish(job, S.FAILED, f"attempt {job.attempt} did not stop: {left} rank(s) on connected "
                                            f"nodes never reported their exit within {STOP_TIMEOUT_S:g} s",
                             stop=False)
            return
        previous = job.attempt
        self._prev_nodes[job.id] = list(job.nodes)
        with self.store.transaction(f"the next attempt of job {job.id}"):
            job.attempt, job.nodes, job.rendezvous = previous + 1, [], ""
            self.book.transition(job, S.PENDING, f"attempt {previous}'s ranks are gone; queued as attempt "
                                                 f"{job.attempt}")
        self._stops.pop(job.id, None)
        self.schedule()

    def _check_stop(self, job: JobRecord, *, quiet: bool = False) -> None:
        """An ended job's stop: free its slots once its ranks are gone or STOP_TIMEOUT_S passed (an event says so)."""
        stop = self._stops.get(job.id)
        if stop is None:
            return
        left = self._unconfirmed(job) if stop.attempt == job.attempt else 0
        waited = self.clock() - stop.since
        if left and waited <= STOP_TIMEOUT_S:
            return
        del self._stops[job.id]
        if not quiet:
            self.book.event(job, "stop", (
                f"attempt {stop.attempt}: {left} rank(s) on connected nodes never reported their exit within "
                f"{STOP_TIMEOUT_S:g} s; their slots are reused" if left else
                f"attempt {stop.attempt}: every rank confirmed gone after {waited:.1f} s; its slots are free"))
        self.schedule()

    def _check_stops(self) -> None:
        """From tick (and when a node is lost or comes back): stops whose confirmation came or is overdue."""
        for job_id in list(self._stops):
            job = self.book.jobs.get(job_id)
            if job is not None and job.state is S.RESTARTING:
                self._maybe_requeue(job)
            elif job is not None and is_terminal(job.state):
                self._check_stop(job)
            else:
                self._stops.pop(job_id, None)

    # -- placement of a restarted attempt ---------------------------------------------------
    def _prev_attempt_nodes(self, job: JobRecord) -> list[str]:
        """The nodes of the job's previous attempt, which a restart places against (memory, else the store)."""
        if job.attempt < 2:
            return []
        prev = self._prev_nodes.get(job.id)
        if prev is None:  # the coordinator restarted since: the attempts table has them
            prev = self._prev_nodes[job.id] = self.store.attempt_nodes(job.id, job.attempt - 1)
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
                session = self.nodes.get(holder)
                if session is not None and session.status is NodeStatus.READY and session.peer:
                    out[k] = session.peer
                    break
        return out

    # -- draining ---------------------------------------------------------------------------
    def _drain_jobs(self, name: str) -> list[JobRecord]:
        """Move every active job off the draining node ``name``; the jobs concerned (only that node's)."""
        moved = []
        for job in self.book.active():
            if not job.runs_on(name):
                continue
            moved.append(job)
            wait = self._drains.get(job.id)
            if job.state is S.RESTARTING:
                continue  # its next attempt is placed without the node
            if wait is not None and wait.attempt == job.attempt:
                if name not in wait.nodes:
                    wait.nodes.append(name)
            elif job.state is S.RUNNING and _saves_on_request(job.kind):
                self._ask_checkpoint(job, name)
            else:
                self._drain_restart(job, [name], f"the job was {job.state.value.lower()}: moved at once")
        return moved

    def _ask_checkpoint(self, job: JobRecord, name: str) -> None:
        step = drain_step(self.book.progress(job))
        self.book.set_waiting(job, f"node {name} is draining: every rank saves a checkpoint at step {step}, then "
                                   f"the job restarts without it (at most {DRAIN_WAIT_S:g} s)")
        self._drains[job.id] = DrainWait(job.attempt, step, self.clock(), [name])
        msg = convert.checkpoint_message(job.id, job.attempt, step)
        for node in dict.fromkeys(job.nodes):
            self._send(node, msg)
        log.info("job.drain_checkpoint", job=job.id, node=name, step=step)

    def _resend_checkpoints(self, name: str) -> None:
        """A node (re)connected: the checkpoint requests of drains still waiting on its jobs."""
        for job_id, wait in self._drains.items():
            job = self.book.jobs.get(job_id)
            if job is not None and job.attempt == wait.attempt and job.runs_on(name):
                self._send(name, convert.checkpoint_message(job.id, job.attempt, wait.step))

    def _check_drains(self) -> None:
        """From tick: drained jobs whose ranks all passed the checkpoint step, or waited DRAIN_WAIT_S, move."""
        now = self.clock()
        for job_id, wait in list(self._drains.items()):
            job = self.book.jobs.get(job_id)
            if job is None or job.state is not S.RUNNING or job.attempt != wait.attempt:
                self._drains.pop(job_id, None)  # it ended, failed or restarted meanwhile
                continue
            at = self.book.progress(job).min_step
            if at >= wait.step:
                self._drain_restart(job, wait.nodes, f"every rank passed step {wait.step} (its checkpoint)")
            elif now - wait.since > DRAIN_WAIT_S:
                self._drain_restart(job, wait.nodes, f"no checkpoint at step {wait.step} within {DRAIN_WAIT_S:g} s "
                                                     f"(slowest rank at step {at}): the job resumes from the newest "
                                                     "checkpoint every rank holds")

    def _drain_restart(self, job: JobRecord, nodes: list[str], detail: str) -> None:
        """End the attempt because ``nodes`` are drained (no failure: it does not use a restart)."""
        why = "; ".join(f"node {n} drained" + (f" ({r})" if (r := self.nodes.draining.get(n)) else "")
                        for n in nodes)
        self._begin_restart(job, f"attempt {job.attempt} ended: {why}; {detail}", f"{why}; {detail}", cause="drain")

    def _stop_draining(self, name: str) -> None:
        """``ctl undrain`` while a job waits for its drain checkpoint: it stays where it is."""
        for job_id, wait in list(self._drains.items()):
            if name in wait.nodes:
                wait.nodes.remove(name)
                if not wait.nodes:
                    del self._drains[job_id]
                    job = self.book.jobs[job_id]
                    if job.state is S.RUNNING:
                        self.book.set_waiting(job, f"node {name} no longer draining: the job stays on its nodes")

    # -- hangs ------------------------------------------------------------------------------
    def _check_hangs(self, loop_lag: float) -> None:
        """From tick: a RUNNING job that has reported steps and none of whose ranks changed step or phase
        for ``restart.hang_timeout`` seconds is hung; its attempt fails (and restarts if it may) naming what is known. Time the
        coordinator's own loop was stalled does not count."""
        now = self.clock()
        for job in self.book.active():
            if job.state is not S.RUNNING:
                continue
            progress = self.book.progress(job)
            if loop_lag > 0:
                progress.advanced_at += loop_lag
            timeout = float((job.spec.get("restart") or {}).get("hang_timeout", DEFAULT_HANG_TIMEOUT_S))
            idle = now - progress.advanced_at
            # armed once a rank reported a step: a script that never reports one cannot be told from a hang
            if progress.advanced_at and progress.max_step > 0 and idle > timeout:
                self._fail_attempt(job, self._hang_reason(job, idle, timeout))

    def _hang_reason(self, job: JobRecord, idle: float, timeout: float) -> str:
        """Who the hang waits for (``coordinator.hangs``): stopped or spinning ranks, the groups waiting and
        the members that never entered their operation, from the evidence the daemons sent; else the slowest ranks."""
        from rankctl.coordinator.hangs import hang_reason

        return hang_reason(self.book.ranks(job.id), self.book.progress(job).summary(), idle, timeout)

