"""Drain checkpoints: a RUNNING job on a drained node is asked for a checkpoint before it moves off it; so is
a RUNNING elastic job on fewer nodes than its full size before it grows back (``ask_grow``).

When the job's kind saves a checkpoint at a step the daemon asks for (``JobKind.drain_checkpoint``),
each of its nodes is sent ``CheckpointNow`` for a step a little ahead of its fastest rank
(``drain_step``); ``due_for`` says whether a job may move now: every rank saved that checkpoint (the ranks agree on
its step, that one or a later one: ``contract.files.rankfiles.SAVED_ON_REQUEST``, a step figure), or
``DRAIN_WAIT_S`` passed. Moving a job is a restart without the node (``coordinator.recovery.restarts``): this
module only asks and waits.

Step numbers (one convention, in every message and in ``resumed_from``): steps count from 1; "the checkpoint at
step S" holds the state after step S; a run that resumes from it reports ``resumed_from: S`` and trains step S + 1
next. The ranks keep training until the attempt stops, so a newer checkpoint (a periodic one, or the one a rank
that saw the request late saved) may exist by then: the next attempt takes the newest every rank holds, S or later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import structlog

from rankctl.contract.files.rankfiles import SAVED_ON_REQUEST
from rankctl.coordinator.api import convert
from rankctl.coordinator.jobs.commit import Outgoing
from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.diagnosis.progress import JobProgress
from rankctl.coordinator.model.records import JobRecord
from rankctl.coordinator.model.states import JobState
from rankctl.kinds import registry

log = structlog.get_logger("rankctl.coordinator")
DRAIN_WAIT_S = 60.0      # how long a drain waits for the checkpoint before the job moves anyway
DRAIN_LEAD_STEPS = 2     # the drain checkpoint is at least this many steps ahead of the fastest rank ...
DRAIN_LEAD_S = 0.5       # ... and about this far ahead in step time (the request must reach every rank first)
DRAIN_MAX_LEAD = 10      # ... but never more steps ahead than this
RESUMES = "the next attempt resumes from step {step} or a newer checkpoint every rank holds"   # the convention above


@dataclass
class DrainWait:
    """A RUNNING job asked for a checkpoint at ``step`` before it moves off the drained ``nodes``."""

    attempt: int
    step: int
    since: float
    nodes: list[str]
    grow: bool = False    # no node leaves: an elastic job on fewer nodes goes back to its full size


def drain_step(progress: JobProgress) -> int:
    """The step a drained job checkpoints at: past its fastest rank by the lead (in steps and in step time)."""
    lead = DRAIN_LEAD_STEPS
    dt = progress.metrics.get("step_time_max")
    if isinstance(dt, (int, float)) and dt > 0:
        lead = max(lead, min(DRAIN_MAX_LEAD, math.ceil(DRAIN_LEAD_S / dt)))
    return progress.max_step + lead


def saves_on_request(kind: str) -> bool:
    """Whether a running job of ``kind`` saves a checkpoint at a step the daemon asks for (a drain waits)."""
    known = registry.kinds().get(kind)
    return known is not None and known.drain_checkpoint


class Drains:
    """The drain checkpoints jobs were asked for, by job id; called from the event loop thread only."""

    def __init__(self, book: JobBook, clock: Callable[[], float], outgoing: Outgoing) -> None:
        self._book, self._clock, self._outgoing = book, clock, outgoing
        self._waits: dict[str, DrainWait] = {}

    def forget(self, job_id: str) -> None:
        """The job ended or restarted: its wait is over."""
        self._waits.pop(job_id, None)

    def also_leaving(self, job: JobRecord, name: str) -> bool:
        """Whether the job already waits for its drain checkpoint (this attempt's); ``name`` joins the nodes
        it then leaves."""
        wait = self._waits.get(job.id)
        if wait is None or wait.attempt != job.attempt:
            return False
        if name not in wait.nodes:
            wait.nodes.append(name)
        return True

    def ask(self, job: JobRecord, name: str) -> None:
        """Ask every node of the job for a checkpoint before it moves off the drained node ``name``."""
        step = drain_step(self._book.progress(job))
        self._book.set_waiting(job, f"node {name} is draining: every rank saves a checkpoint at step {step}, "
                                    f"then the job restarts without it; {RESUMES.format(step=step)} "
                                    f"(at most {DRAIN_WAIT_S:g} s)")
        self._waits[job.id] = DrainWait(job.attempt, step, self._clock(), [name])
        self._outgoing.to_nodes(job.nodes, convert.checkpoint_message(job.id, job.attempt, step))
        log.info("job.drain_checkpoint", job=job.id, node=name, step=step)

    def ask_grow(self, job: JobRecord, nodes: int) -> None:
        """Ask every node of a shrunk elastic job for a checkpoint before it restarts on ``nodes`` (its full size)."""
        step = drain_step(self._book.progress(job))
        self._book.set_waiting(job, f"nodes are free again: every rank saves a checkpoint at step {step}, then the "
                                    f"job restarts on {nodes} nodes, its full size; {RESUMES.format(step=step)} "
                                    f"(at most {DRAIN_WAIT_S:g} s)")
        self._waits[job.id] = DrainWait(job.attempt, step, self._clock(), [], grow=True)
        self._outgoing.to_nodes(job.nodes, convert.checkpoint_message(job.id, job.attempt, step))
        log.info("job.grow_checkpoint", job=job.id, step=step, nodes=nodes)

    def waiting(self, job: JobRecord) -> bool:
        """Whether the job's attempt waits for a checkpoint before it moves (a drain or a growth)."""
        wait = self._waits.get(job.id)
        return wait is not None and wait.attempt == job.attempt

    def resend(self, name: str) -> None:
        """A node (re)connected: the checkpoint requests of drains still waiting on its jobs."""
        for job_id, wait in self._waits.items():
            job = self._book.jobs.get(job_id)
            if job is not None and job.attempt == wait.attempt and job.runs_on(name):
                self._outgoing.send(name, convert.checkpoint_message(job.id, job.attempt, wait.step))

    def due_for(self, job: JobRecord) -> tuple[DrainWait, str] | None:
        """(its wait, why now) when the RUNNING job moves now: every rank passed the checkpoint step, or it waited
        DRAIN_WAIT_S. A wait of an earlier attempt is dropped."""
        wait = self._waits.get(job.id)
        if wait is None:
            return None
        if job.state is not JobState.RUNNING or job.attempt != wait.attempt:
            del self._waits[job.id]
            return None
        progress = self._book.progress(job)
        at, saved = progress.min_step, progress.latest.get(SAVED_ON_REQUEST)
        if SAVED_ON_REQUEST not in progress.folds:   # a kind that does not say which step it saved: passing it
            saved = wait.step if at >= wait.step else None
        if isinstance(saved, (int, float)) and saved >= wait.step:   # the step is complete: every rank saved it
            return wait, f"every rank passed step {saved:.0f} (its checkpoint; {RESUMES.format(step=int(saved))})"
        if self._clock() - wait.since > DRAIN_WAIT_S:
            return wait, (f"no checkpoint at step {wait.step} within {DRAIN_WAIT_S:g} s (slowest rank at step {at}): "
                          f"the job resumes from the newest checkpoint every rank holds")
        return None

    def undrained(self, name: str) -> None:
        """``ctl undrain`` while a job waits for its drain checkpoint: it stays where it is."""
        for job_id, wait in list(self._waits.items()):
            if name in wait.nodes:
                wait.nodes.remove(name)
                if not wait.nodes:
                    del self._waits[job_id]
                    job = self._book.jobs[job_id]
                    if job.state is JobState.RUNNING:
                        self._book.set_waiting(job, f"node {name} no longer draining: the job stays on its nodes")
