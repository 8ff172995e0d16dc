"""The read model: a job and a node as every reader shows them, built in one place.

gRPC (``GetJob``, ``WatchJob``'s batches, ``ListNodes``, ``DrainNode``), the dashboard (a job's live fragment, the
nodes page) and ``/metrics`` (slots) read ``Shown`` instead of reaching into the job book, the node table, the stops
and the store each in its own way. A ``JobShown`` is read at one moment (its record a copy: a render on a worker
thread sees one state) and bounded: one page of ranks, the newest ``ATTEMPTS_SHOWN`` attempts, a summary of constant
size. A ``NodeShown`` carries what a node row says: its session, free slots, drain reason, the jobs it runs and the
ones it is excluded from. ``JobGauges`` are a job's figures as ``/metrics`` shows them (``job_gauges``: phases,
steps, stragglers, the step-time histogram and the figures the job's kind describes, ``kinds.figures``). Plain data:
no grpc, no protobuf (the servicers convert).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from rankctl.coordinator.diagnosis.progress import JobProgress, JobSummary
from rankctl.coordinator.fleet.nodes import NodeSession, NodeTable
from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.model.records import JobRecord, RankRecord
from rankctl.coordinator.scheduling.capacity import jobs_by_node
from rankctl.coordinator.scheduling.stops import Stops
from rankctl.coordinator.store.database import Store
from rankctl.kinds import registry
from rankctl.kinds.figures import described

ATTEMPTS_SHOWN = 20   # attempts shown with a job (the newest)


def stopping_reason(reason: str, stopping: int) -> str:
    """The job's reason, plus how many ranks of its ended attempt are not yet confirmed gone."""
    return f"{reason}; stopping: {stopping} rank(s) not yet confirmed gone" if stopping else reason


@dataclass(frozen=True)
class JobShown:
    """One job as shown: its record (a copy), summary, reason with its stop, newest attempts and one page of ranks."""

    job: JobRecord
    summary: JobSummary
    stopping: int                 # ranks of the ended attempt not yet confirmed gone
    reason: str                   # the job's reason, with ``stopping`` said
    attempts: list[dict]          # the newest ATTEMPTS_SHOWN stored attempts, oldest first (empty: not asked for)
    ranks: list[RankRecord]       # ranks ``rank_offset`` .. of the current attempt (empty: not asked for)
    rank_offset: int = 0


@dataclass(frozen=True)
class NodeShown:
    """One node as shown: its session, free slots (0 unless READY), drain, jobs, exclusions, rejected reports."""

    session: NodeSession
    free: int
    draining: str | None          # its drain reason ("": none given); None: not draining
    jobs: list[str]               # the active jobs with ranks on it
    excluded_for: list[str]       # the jobs it is never placed for again (``ctl undrain`` clears them)
    rejected: int                 # reports it sent for ranks it does not run

    @property
    def name(self) -> str:
        return self.session.name


@dataclass(frozen=True)
class JobGauges:
    """A job's figures as ``/metrics`` shows them, O(1) in its size (``job_gauges``)."""

    job: JobRecord
    phases: dict[str, int]               # ranks by phase (this attempt)
    min_step: int                        # the slowest rank's step: every rank finished it
    max_step: int                        # the fastest rank's step
    stragglers: int                      # ranks flagged by their compute time
    lagging: int                         # ranks still at the slowest step while others are ahead
    step_buckets: list[tuple[str, float]]   # the completed steps' durations (cumulative buckets; empty: none yet)
    step_total: float                    # their sum
    step_time: dict[str, float]          # "min", "mean", "max" of the last completed step's time across its ranks
    figures: dict[str, float]            # Prometheus gauge name -> value: each figure the job's kind describes


def job_gauges(job: JobRecord, p: JobProgress) -> JobGauges:
    """The job's gauges from its counters: a figure's value is the last completed step's, a sparse one's its
    latest (not every step has it)."""
    acc, kind = p.last_step, registry.kinds().get(job.kind)
    figures = {}
    for name, f in described(kind.figures).items() if kind is not None else ():
        value = p.latest.get(name) if f.sparse else acc.figures.get(name) if acc is not None else None
        if f.metric and value is not None:
            figures[f.metric] = value
    times = {} if acc is None else {stat: v for stat, v in (("min", acc.time_min), ("mean", acc.time_mean),
                                                            ("max", acc.time_max)) if v is not None}
    return JobGauges(
        job=job, phases=dict(p.phases), min_step=p.min_step, max_step=p.max_step,
        stragglers=len(p.skew.slow) if p.skew is not None else 0,
        lagging=len(p.at_step.get(p.min_step, ())) if p.max_step > p.min_step else 0,
        step_buckets=p.step_times.buckets() if p.step_times.count else [], step_total=p.step_times.total,
        step_time=times, figures=figures)


class Shown:
    """Builds the views; the event loop thread only (a view, once built, may go to any thread)."""

    def __init__(self, book: JobBook, nodes: NodeTable, stops: Stops, store: Store,
                 free_slots: Callable[[], dict[str, int]], rejected: Counter[str]) -> None:
        self._book, self._nodes, self._stops, self._store = book, nodes, stops, store
        self._free_slots, self._rejected = free_slots, rejected

    def job(self, id_or_name: str, rank_offset: int = 0, rank_limit: int = 0, *, attempts: bool = True) -> JobShown:
        """The job (by id or unique name: JobNotFound / AmbiguousJob) with ranks ``rank_offset`` .. (``rank_limit``
        of them; 0: none) and, unless not ``attempts``, its newest attempts."""
        job = self._book.get(id_or_name)
        stopping = self._stops.stopping_ranks(job.id)
        return JobShown(
            job=dataclasses.replace(job), summary=self._book.progress(job).summary(), stopping=stopping,
            reason=stopping_reason(job.reason, stopping),
            attempts=self._store.attempts.listed(job.id, ATTEMPTS_SHOWN) if attempts else [],
            ranks=self._book.rank_page(job, rank_offset, rank_limit) if rank_limit > 0 else [],
            rank_offset=rank_offset)

    def nodes(self) -> list[NodeShown]:
        """Every known node."""
        return self._shown(list(self._nodes))

    def slots(self) -> tuple[int, int]:
        """The READY nodes' rank slots: (all of them, those no job holds); no per-node view built."""
        return sum(s.record.slots for s in self._nodes.ready()), sum(self._free_slots().values())

    def node(self, name: str) -> NodeShown:
        """One node; NodeNotFound when no node has that name."""
        return self._shown([self._nodes.known(name)])[0]

    def _shown(self, sessions: list[NodeSession]) -> list[NodeShown]:
        free, draining = self._free_slots(), self._nodes.draining
        excluded, jobs = self._nodes.exclusions_by_node(), jobs_by_node(self._book.active())
        return [NodeShown(s, free.get(s.name, 0), draining.get(s.name), jobs.get(s.name, []),
                          excluded.get(s.name, []), self._rejected[s.name]) for s in sessions]
