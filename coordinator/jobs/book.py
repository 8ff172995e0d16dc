"""The job book: jobs in submission order, their rank statuses, counters and events, kept in the store.

Every change goes through here so that state, event and store stay consistent: a
transition checks the state machine, updates the job row, appends an event and wakes
the job's watchers. Callers group several changes in ``store.transaction()``. When a
write fails (``StoreError``), the caller runs ``resync()``: memory goes back to what the
store holds, in place, so that references held elsewhere stay valid.

Rank records exist only for ranks that reported (a rank never heard of is ``pending``); they
are loaded for active jobs at start and on demand for finished ones. Each job's ``JobProgress``
(counters over its ranks) is rebuilt from them. Active and pending jobs are indexed, so the
scheduler and the failure detector never walk the whole history.
"""

from __future__ import annotations

import builtins

import bisect
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import structlog

from rankctl.contract.names import shown as shown_value
from rankctl.coordinator.model.allocation import Allocation
from rankctl.coordinator.model.errors import AmbiguousJob, JobNotFound
from rankctl.coordinator.diagnosis.pace import Learned
from rankctl.coordinator.diagnosis.progress import JobProgress
from rankctl.coordinator.model.records import EventRecord, JobRecord, RankRecord
from rankctl.coordinator.jobs.signals import Signals
from rankctl.coordinator.model.states import JobState, is_active, is_terminal, transition
from rankctl.coordinator.store.database import Store
from rankctl.parallel.placement import node_of_rank

log = structlog.get_logger("rankctl.coordinator")
REASON_MAX = 2000      # characters of a reason kept (rank errors can be long)
AMBIGUOUS_SHOWN = 5    # job ids listed in an ambiguous-name error
MAX_PAGE = 1000        # jobs in one ListJobs page
FINISHED_CACHED = 16   # finished jobs whose ranks and counters stay in memory after a read


def _cap(reason: str) -> str:
    return reason if len(reason) <= REASON_MAX else reason[:REASON_MAX - 1] + "…"


class JobBook:
    """Jobs by id (insertion = submission order), rank statuses and per-job event numbering."""

    def __init__(self, store: Store, clock: Callable[[], float], signals: Signals) -> None:
        self.store, self.clock, self.signals = store, clock, signals
        self.jobs: dict[str, JobRecord] = {j.id: j for j in store.load_jobs()}
        self.learned: dict[str, Learned] = {}   # job id -> what its attempts taught the hang judgement
        self._load()

    def _load(self) -> None:
        self._seq: dict[str, int] = self.store.last_event_seqs()
        self._rows: dict[tuple[str, int], RankRecord] | None = None   # rank rows deferred (``rank_rows``)
        self._ranks: dict[str, dict[int, RankRecord]] = {}
        self._progress: dict[str, JobProgress] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # finished jobs cached, oldest first
        self._index()
        for job in self._active.values():
            self._ranks[job.id] = self.store.ranks(job.id)
            self._progress[job.id] = self._rebuild(job)

    def _index(self) -> None:
        """Jobs in submission order, with their seqnos (ascending) for paging by bisection; active and pending."""
        self._order: builtins.list[JobRecord] = list(self.jobs.values())
        self._seqnos: builtins.list[int] = [j.seqno for j in self._order]
        self._active: dict[str, JobRecord] = {j.id: j for j in self._order if is_active(j.state)}
        self._pending: dict[str, JobRecord] = {j.id: j for j in self._order if j.state is JobState.PENDING}
        known = getattr(self, "queued_at", {})  # kept across a resync; after a restart, since submission
        self.queued_at: dict[str, float] = {j.id: known.get(j.id, j.created_at) for j in self._pending.values()}

    def _rebuild(self, job: JobRecord) -> JobProgress:
        progress = JobProgress.taught(job.world_size, self.learned.setdefault(job.id, Learned()))
        for r in self._ranks.get(job.id, {}).values():
            progress.moved(None, r)
        progress.emitted_step = self.store.last_step(job.id) if job.nodes else 0
        progress.advance(self.clock())   # the hang judgement's clock starts now, never from zero
        return progress

    def resync(self) -> None:
        """Bring memory back to the store after a failed write: jobs updated in place, ranks, event numbers."""
        stored = {j.id: j for j in self.store.load_jobs()}
        for job_id in [j for j in self.jobs if j not in stored]:
            del self.jobs[job_id]  # added in memory, never committed
        before = {j.id: (j.attempt, self._ranks.get(j.id, {})) for j in self._active.values()}
        for job_id, fresh in stored.items():
            job = self.jobs.setdefault(job_id, fresh)
            if job is not fresh:
                job.__dict__.update(fresh.__dict__)
        self._load()
        self._keep_steps(before)
        for job_id in self.jobs:
            self.signals.notify(job_id)
        log.warning("store.resynced", jobs=len(self.jobs))

    def _keep_steps(self, before: dict[str, tuple[int, dict[int, RankRecord]]]) -> None:
        """After a resync: a rank whose stored row says what memory said (phase, exit, error) keeps what only memory
        held (its step, metrics, hang evidence); one whose change the store refused keeps the step it had reached.
        A refused write does not show a running job back at step 0 while the disk stays full."""
        for job_id, (attempt, old) in before.items():
            job, ranks = self.jobs.get(job_id), self._ranks.get(job_id)
            if job is None or ranks is None or job.attempt != attempt or not old:
                continue
            for rank, row in ranks.items():
                mem = old.get(rank)
                if mem is None:
                    continue
                if (mem.phase, mem.exited, mem.exit_code, mem.error) == (row.phase, row.exited, row.exit_code, row.error):
                    ranks[rank] = mem
                elif mem.step > row.step:   # a change the store refused (held, retried): the step it had reached stays
                    row.step, row.metrics_json = mem.step, mem.metrics_json
            self._progress[job_id] = self._rebuild(job)
            self._progress[job_id].refeed(ranks.values(), self.clock())

    # -- lookup --------------------------------------------------------------
    def get(self, id_or_name: str) -> JobRecord:
        job = self.jobs.get(id_or_name)
        if job is not None:
            return job
        named = [j for j in self.jobs.values() if j.name == id_or_name]
        if len(named) == 1:
            return named[0]
        shown = shown_value(id_or_name)
        if named:
            ids = ", ".join(j.id for j in named[-AMBIGUOUS_SHOWN:][::-1])
            more = f" and {len(named) - AMBIGUOUS_SHOWN} older" if len(named) > AMBIGUOUS_SHOWN else ""
            raise AmbiguousJob(f"{len(named)} jobs are named {shown}: {ids}{more}; give the job id")
        raise JobNotFound(f"no job {shown}")

    def list(self, limit: int = 0) -> builtins.list[JobRecord]:
        """Jobs in submission order; ``limit`` > 0 keeps the most recent."""
        jobs = list(self.jobs.values())
        return jobs[-limit:] if limit > 0 else jobs

    def page(self, size: int, before: int = 0, states: Iterable[JobState] = ()) -> tuple[builtins.list[JobRecord], int]:
        """Up to ``size`` jobs, newest first, submitted before seqno ``before`` (0: from the newest),
        in one of ``states`` (all when empty); and the cursor of the next page (0: no more)."""
        wanted, out = frozenset(states), builtins.list[JobRecord]()
        i = bisect.bisect_left(self._seqnos, before) if before > 0 else len(self._order)
        while i > 0 and len(out) < size:
            i -= 1
            if not wanted or self._order[i].state in wanted:
                out.append(self._order[i])
        more = i > 0 and len(out) == size
        return out, (out[-1].seqno if more else 0)

    def pending(self) -> builtins.list[JobRecord]:
        """PENDING jobs in submission order."""
        return sorted(self._pending.values(), key=lambda j: j.seqno) if len(self._pending) > 1 \
            else list(self._pending.values())

    def waited(self, job: JobRecord) -> float:
        """Seconds a PENDING job has been queued (this attempt; since submission after a coordinator restart)."""
        return max(0.0, self.clock() - self.queued_at.get(job.id, job.created_at))

    def active(self) -> builtins.list[JobRecord]:
        return list(self._active.values())

    def ranks(self, job_id: str) -> dict[int, RankRecord]:
        """rank -> record of the ranks that reported (a finished job's are read from the store)."""
        ranks = self._ranks.get(job_id)
        if ranks is None:
            ranks = self._ranks[job_id] = self.store.ranks(job_id) if job_id in self.jobs else {}
            self._cache_finished(job_id)
        return ranks

    def progress(self, job: JobRecord) -> JobProgress:
        """The job's counters (rebuilt from its stored ranks for a finished job)."""
        progress = self._progress.get(job.id)
        if progress is None:
            self.ranks(job.id)
            progress = self._progress[job.id] = self._rebuild(job)
            self._cache_finished(job.id)
        return progress

    def _cache_finished(self, job_id: str) -> None:
        if job_id in self._active:
            return
        self._finished[job_id] = None
        self._finished.move_to_end(job_id)
        while len(self._finished) > FINISHED_CACHED:
            old, _ = self._finished.popitem(last=False)
            if old not in self._active:
                self._ranks.pop(old, None)
                self._progress.pop(old, None)

    # -- changes -------------------------------------------------------------
    def add(self, job: JobRecord) -> None:
        """Store a new job and its first event; memory changes only once both are committed."""
        ev = EventRecord(job.id, 1, self.clock(), job.state, "transition", _cap(f"submitted: {job.reason}"))
        with self.store.transaction("the new job"):
            job.seqno = self.store.insert_job(job)
            self.store.append_event(ev)
        self.jobs[job.id] = job
        self._order.append(job)
        self._seqnos.append(job.seqno)
        self._state_changed(job)
        self._seq[job.id] = ev.seq
        self.signals.notify(job.id)
        log.info("job.submitted", job=job.id, world_size=job.world_size)

    def _state_changed(self, job: JobRecord) -> None:
        """Keep the active and pending indexes in step with ``job.state``."""
        if is_active(job.state):
            self._active[job.id] = job
            self._finished.pop(job.id, None)
        else:
            self._active.pop(job.id, None)
        if job.state is JobState.PENDING:
            self._pending[job.id] = job
            self.queued_at.setdefault(job.id, self.clock())
        else:
            self._pending.pop(job.id, None)
            self.queued_at.pop(job.id, None)

    def event(self, job: JobRecord, kind: str, message: str, rank: RankRecord | None = None, *,
              step: int = 0, metrics: dict[str, Any] | None = None, ranks: int = 0) -> EventRecord:
        seq = self._seq.get(job.id, 0) + 1
        ev = EventRecord(job.id, seq, self.clock(), job.state, kind, _cap(message), rank, step, metrics, ranks)
        self.store.append_event(ev)
        self._seq[job.id] = seq
        self.signals.notify(job.id)
        return ev

    def transition(self, job: JobRecord, dst: JobState, reason: str) -> None:
        """Move ``job`` to ``dst`` (raises IllegalTransition), store it and write an event."""
        transition(job.state, dst, reason)
        reason = _cap(reason)
        with self.store.transaction(f"job {job.id} moving to {dst.value}"):
            job.state, job.reason = dst, reason
            if is_terminal(dst):
                job.finished_at = self.clock()
            self._state_changed(job)
            self.store.update_job(job)
            if is_terminal(dst) and job.nodes:
                self.store.attempts.finish(job)
            self.event(job, "transition", reason)
        if is_terminal(dst):
            self._cache_finished(job.id)
        log.info("job.transition", job=job.id, state=dst.value, reason=reason)

    # -- the one writer of a JobRecord's fields (tests/unit/repo/test_import_rules.py); the caller's transaction stores
    def next_attempt(self, job: JobRecord) -> None:
        job.attempt, job.nodes, job.rendezvous = job.attempt + 1, [], ""

    def placed(self, job: JobRecord, names: builtins.list[str], rendezvous: str) -> None:
        job.world_size, job.nodes, job.rendezvous = len(names) * job.slots_per_node, names, rendezvous

    def sized(self, job: JobRecord, nodes: int) -> None:   # an elastic job's attempt may run on fewer nodes
        job.world_size = nodes * job.slots_per_node

    def set_result(self, job: JobRecord, result: Any) -> None:
        job.result = result
        self.save(job)

    def pin(self, job: JobRecord, allocation: Allocation, reason: str | None = None) -> None:
        job.allocation, job.reason = allocation, job.reason if reason is None else reason

    def set_waiting(self, job: JobRecord, reason: str) -> None:
        """Update a pending job's reason, with an event, only when it changes."""
        reason = _cap(reason)
        if job.reason == reason:
            return
        with self.store.transaction():
            job.reason = reason
            self.store.update_job(job)
            self.event(job, "waiting", reason)

    def save(self, job: JobRecord) -> None:
        self.store.update_job(job)

    def start_ranks(self, job: JobRecord) -> None:
        """A just-placed attempt: no rank has reported yet (every rank reads as ``pending``)."""
        self.store.clear_ranks(job.id)
        self._ranks[job.id] = {}
        self._progress[job.id] = JobProgress.taught(job.world_size, self.learned.setdefault(job.id, Learned()))

    def put_rank(self, job: JobRecord, r: RankRecord) -> None:
        """Store a rank's record (a phase change, an exit or an error) and keep it in memory; inside
        ``rank_rows`` the row waits for the block's end."""
        if self._rows is not None:
            self._rows[(job.id, r.rank)] = r
        else:
            self.store.put_rank(job.id, r)
        self.ranks(job.id)[r.rank] = r

    def ranks_gone(self, job: JobRecord, node: str, why: str) -> None:
        """The ranks of ``node`` in the job's attempt that never reported an exit are recorded exited (code -1,
        ``why``; failed): their node is gone and will not say (``put_exit``). O(slots)."""
        ranks, progress, now = self.ranks(job.id), self.progress(job), self.clock()
        for rank in job.ranks_on(node):
            old = ranks.get(rank)
            if old is not None and old.exited:
                continue
            new = RankRecord(rank=rank, node=node, phase="exited", step=old.step if old else 0, exited=True,
                             exit_code=-1, error=why, updated_at=now,
                             metrics_json=old.metrics_json if old else "")
            progress.moved(old, new)
            self.put_exit(job, new)

    def put_exit(self, job: JobRecord, r: RankRecord) -> None:
        """A rank's exit: ``put_rank``, but in memory only while the job is RESTARTING (the next attempt's placement
        clears its rows: ``start_ranks``)."""
        if job.state is JobState.RESTARTING:
            self.ranks(job.id)[r.rank] = r
        else:
            self.put_rank(job, r)

    def put_ranks(self, job: JobRecord, records: builtins.list[RankRecord]) -> None:
        """``put_rank`` of each of ``records`` (a node's ranks starting alike: ``ReportApplier._start_range``)."""
        ranks, rows, job_id = self.ranks(job.id), self._rows, job.id
        for r in records:
            ranks[r.rank] = r
            if rows is not None:
                rows[(job_id, r.rank)] = r
        if rows is None:
            self.store.put_ranks((job_id, r) for r in records)

    @contextmanager
    def rank_rows(self) -> Iterator[None]:
        """Collect the rank rows ``put_rank`` writes in the block and store them at its end in one statement
        (the newest per rank): a group commit's reports cost one ``executemany``, not a statement a rank.
        Call inside the store transaction that holds the rest of the commit."""
        self._rows = {}
        try:
            yield
            if self._rows:
                self.store.put_ranks(((job_id, r) for (job_id, _), r in self._rows.items()))
        finally:
            self._rows = None

    def rank_page(self, job: JobRecord, offset: int, limit: int) -> builtins.list[RankRecord]:
        """Ranks ``offset`` .. ``offset + limit - 1`` (clipped to the world); unheard ones as ``pending``."""
        ranks, s = self.ranks(job.id), job.slots_per_node
        out = []
        for r in range(max(0, offset), min(job.world_size, offset + max(0, limit))):
            rec = ranks.get(r)
            if rec is None:
                node = job.nodes[node_of_rank(r, s)] if job.nodes else ""
                rec = RankRecord(r, node)
            out.append(rec)
        return out
