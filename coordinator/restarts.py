"""Automatic restarts: a failed attempt is stopped, confirmed gone, and the job runs again.

A mixin of ``core.Coordinator`` (it uses the core's book, node table, store and ``_finish``).
When an attempt fails (a rank exits non-zero, a node is lost, a node comes back without the
job) and the job has restarts left (``restart.max_restarts``), the job moves to RESTARTING
with the reason and every node of the attempt is told to stop it. The next attempt is
queued (PENDING, ``attempt + 1``) only once every rank of the old one is confirmed gone: it
reported its exit, or its node is not connected (a lost node's ranks die with its
launcher). No slot or port is reused before that. The placement then takes READY nodes with
free slots, so a lost node is replaced by a spare; the healthy nodes keep their warm
launchers. Each attempt's end and reason are stored in the ``attempts`` table; a job out of
restarts fails with every attempt's reason.
"""

from __future__ import annotations

import structlog

from rankctl.coordinator import convert
from rankctl.contract.spec import DEFAULT_HANG_TIMEOUT_S
from rankctl.coordinator.nodes import NodeStatus
from rankctl.coordinator.progress import rank_span
from rankctl.coordinator.records import JobRecord
from rankctl.coordinator.states import JobState
from rankctl.parallel.placement import ranks_of_node

log = structlog.get_logger("rankctl.coordinator")
S = JobState
STOP_TIMEOUT_S = 120.0   # an attempt whose ranks are not confirmed gone by then fails the job
REASONS_SHOWN = 400      # characters of each attempt's reason in a final failure


class RestartsMixin:
    """See the module docstring; called from the event loop thread, inside the core's consistency blocks."""

    def _fail_attempt(self, job: JobRecord, reason: str) -> None:
        """The current attempt failed: restart the job if it may, else fail it with every attempt's reason."""
        max_restarts = int((job.spec.get("restart") or {}).get("max_restarts", 0))
        if job.attempt - 1 < max_restarts:
            self._begin_restart(job, reason)
            return
        if max_restarts == 0:
            self._finish(job, S.FAILED, reason)
            return
        earlier = [a for a in self.store.attempts(job.id) if a["attempt"] < job.attempt]
        history = "; ".join(f"attempt {a['attempt']}: {a['reason'][:REASONS_SHOWN]}" for a in earlier)
        self._finish(job, S.FAILED, f"attempt {job.attempt} failed and no restart is left "
                                    f"(max_restarts={max_restarts}): {reason}; earlier: {history}")

    def _begin_restart(self, job: JobRecord, reason: str) -> None:
        with self.store.transaction(f"the restart of job {job.id}"):
            self.book.transition(job, S.RESTARTING, f"attempt {job.attempt} failed: {reason}; stopping its ranks")
            self.store.end_attempt(job.id, job.attempt, self.clock(), S.RESTARTING.value, reason)
        self._restart_since[job.id] = self.clock()
        msg_reason = f"attempt {job.attempt} failed: {reason}"
        cancel = convert.cancel_message(job.id, job.attempt, msg_reason)
        for name in dict.fromkeys(job.nodes):
            self._send(name, cancel)
        log.warning("job.restarting", job=job.id, attempt=job.attempt, reason=reason)
        self._maybe_requeue(job)

    def _unconfirmed(self, job: JobRecord) -> int:
        """Ranks of the stopping attempt on a connected node that have not reported their exit."""
        ranks, left = self.book.ranks(job.id), 0
        for k, name in enumerate(job.nodes):
            session = self.nodes.get(name)
            if session is None or session.status is not NodeStatus.READY:
                continue  # not connected: its ranks died with its launcher, or it is asked to reconnect
            left += sum(1 for r in ranks_of_node(k, job.slots_per_node)
                        if (rec := ranks.get(r)) is None or not rec.exited)
        return left

    def _maybe_requeue(self, job: JobRecord) -> None:
        """Queue the next attempt once every rank of the stopping one is confirmed gone."""
        if job.state is not S.RESTARTING:
            return
        left = self._unconfirmed(job)
        if left:
            if self.clock() - self._restart_since.get(job.id, self.clock()) > STOP_TIMEOUT_S:
                self._finish(job, S.FAILED, f"attempt {job.attempt} did not stop: {left} rank(s) on connected "
                                            f"nodes never reported their exit within {STOP_TIMEOUT_S:g} s")
            return
        previous = job.attempt
        self._prev_nodes[job.id] = list(job.nodes)
        with self.store.transaction(f"the next attempt of job {job.id}"):
            job.attempt, job.nodes, job.rendezvous = previous + 1, [], ""
            self.book.transition(job, S.PENDING, f"attempt {previous}'s ranks are gone; queued as attempt "
                                                 f"{job.attempt}")
        self._restart_since.pop(job.id, None)
        self.schedule()

    def _check_restarts(self) -> None:
        """From tick: restarts whose confirmation is overdue."""
        for job_id in list(self._restart_since):
            job = self.book.jobs.get(job_id)
            if job is None or job.state is not S.RESTARTING:
                self._restart_since.pop(job_id, None)
            else:
                self._maybe_requeue(job)

    def _restore_sources(self, job: JobRecord, names: list[str]) -> list[str]:
        """For each job node of a restarted attempt that did not run the same ranks before: the
        PeerService of a connected node holding those ranks' checkpoints (the node that ran them, or
        the one that kept their copies: the next node of the previous attempt); "" otherwise."""
        prev = self._prev_nodes.pop(job.id, None)
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
        """What is known of a hang: stopped processes first (the daemons watch them), then the slowest ranks."""
        ranks = self.book.ranks(job.id)
        summary = self.book.progress(job).summary()
        parts = [f"hang: no rank advanced for {idle:.0f} s (restart.hang_timeout={timeout:g})"]
        stopped = sorted((r.rank, r.node) for r in ranks.values() if r.process == "stopped" and not r.exited)
        if stopped:
            nodes = ", ".join(sorted({n for _, n in stopped}))
            parts.append(f"{rank_span([r for r, _ in stopped])} stopped (SIGSTOP or a debugger) on {nodes}")
        if summary.stragglers:
            parts.append(f"slowest step {summary.min_step} held by {rank_span(summary.stragglers)}"
                         f"{' (and more)' if len(summary.stragglers) >= 16 else ''}")
        else:
            parts.append(f"every rank at step {summary.min_step}")
        return "; ".join(parts)

