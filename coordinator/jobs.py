"""The job book: jobs in submission order, their rank statuses and events, kept in the store.

Every change goes through here so that state, event and store stay consistent: a
transition checks the state machine, updates the job row, appends an event and wakes
the job's watchers. Callers group several changes in ``store.transaction()``.
"""

from __future__ import annotations

from typing import Callable

import structlog

from rankctl.coordinator.errors import AmbiguousJob, JobNotFound
from rankctl.coordinator.records import EventRecord, JobRecord, RankRecord
from rankctl.coordinator.signals import Signals
from rankctl.coordinator.states import JobState, is_active, is_terminal, transition
from rankctl.coordinator.store import Store

log = structlog.get_logger("rankctl.coordinator")


class JobBook:
    """Jobs by id (insertion = submission order), rank statuses and per-job event numbering."""

    def __init__(self, store: Store, clock: Callable[[], float], signals: Signals) -> None:
        self.store, self.clock, self.signals = store, clock, signals
        self.jobs: dict[str, JobRecord] = {j.id: j for j in store.load_jobs()}
        self._ranks: dict[str, dict[int, RankRecord]] = {j: store.ranks(j) for j in self.jobs}
        self._seq: dict[str, int] = store.last_event_seqs()

    # -- lookup --------------------------------------------------------------
    def get(self, id_or_name: str) -> JobRecord:
        job = self.jobs.get(id_or_name)
        if job is not None:
            return job
        named = [j for j in self.jobs.values() if j.name == id_or_name]
        if len(named) == 1:
            return named[0]
        if named:
            raise AmbiguousJob(f"{len(named)} jobs are named {id_or_name!r}: {', '.join(j.id for j in named)}; "
                               "give the job id")
        raise JobNotFound(f"no job {id_or_name!r}")

    def list(self, limit: int = 0) -> list[JobRecord]:
        """Jobs in submission order; ``limit`` > 0 keeps the most recent."""
        jobs = list(self.jobs.values())
        return jobs[-limit:] if limit > 0 else jobs

    def pending(self) -> list[JobRecord]:
        return [j for j in self.jobs.values() if j.state is JobState.PENDING]

    def active(self) -> list[JobRecord]:
        return [j for j in self.jobs.values() if is_active(j.state)]

    def ranks(self, job_id: str) -> dict[int, RankRecord]:
        return self._ranks.setdefault(job_id, {})

    # -- changes -------------------------------------------------------------
    def add(self, job: JobRecord) -> None:
        with self.store.transaction():
            self.store.insert_job(job)
            self.jobs[job.id] = job
            self.event(job, "transition", f"submitted: {job.reason}")
        log.info("job.submitted", job=job.id, world_size=job.world_size)

    def event(self, job: JobRecord, kind: str, message: str, rank: RankRecord | None = None) -> EventRecord:
        seq = self._seq.get(job.id, 0) + 1
        ev = EventRecord(job.id, seq, self.clock(), job.state, kind, message, rank)
        self.store.append_event(ev)
        self._seq[job.id] = seq
        self.signals.notify(job.id)
        return ev

    def transition(self, job: JobRecord, dst: JobState, reason: str) -> None:
        """Move ``job`` to ``dst`` (raises IllegalTransition), store it and write an event."""
        transition(job.state, dst, reason)
        with self.store.transaction():
            job.state, job.reason = dst, reason
            if is_terminal(dst):
                job.finished_at = self.clock()
            self.store.update_job(job)
            if is_terminal(dst) and job.nodes:
                self.store.finish_attempt(job)
            self.event(job, "transition", reason)
        log.info("job.transition", job=job.id, state=dst.value, reason=reason)

    def set_waiting(self, job: JobRecord, reason: str) -> None:
        """Update a pending job's reason, with an event, only when it changes."""
        if job.reason == reason:
            return
        with self.store.transaction():
            job.reason = reason
            self.store.update_job(job)
            self.event(job, "waiting", reason)

    def save(self, job: JobRecord) -> None:
        self.store.update_job(job)

    def start_ranks(self, job: JobRecord) -> None:
        """Fresh ``pending`` statuses for every rank of a just-placed job."""
        s = job.slots_per_node
        ranks = {r: RankRecord(r, job.nodes[r // s], updated_at=self.clock()) for r in range(job.world_size)}
        with self.store.transaction():
            self.store.clear_ranks(job.id)
            for r in ranks.values():
                self.store.put_rank(job.id, r)
        self._ranks[job.id] = ranks

    def put_rank(self, job: JobRecord, r: RankRecord) -> None:
        self.store.put_rank(job.id, r)
        self.ranks(job.id)[r.rank] = r
