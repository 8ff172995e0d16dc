"""Rank reports folded into the job book: ownership, order, per-job counters, step and straggler events.

``ReportApplier.apply`` takes one node's reports of one group commit, in order, inside its transaction
(``coordinator.jobs.intake`` queues and commits them). A report is applied only for a rank the sending node
runs in the job's current attempt (others are counted per node and dropped) and only once (its ``seq``).
Per report the work is constant in the job's size: the rank's record and the job's ``JobProgress``
counters change in memory; the store gets a row only when the rank's phase, exit or error changes, and
one job-level ``step`` event when the slowest rank finishes a step (with ``straggler`` events for the
ranks flagged or unflagged by their compute time, ``coordinator.diagnosis.skew``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Callable, ContextManager, Sequence

import structlog

from rankctl.contract.preflight import line as preflight_line
from rankctl.contract.files.rankstatus import NOTICE_CHARS
from rankctl.coordinator.model import rankbounds as bounds
from rankctl.coordinator.api.convert import update_seconds
from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.fleet.nodes import NodeSession
from rankctl.coordinator.diagnosis.hangs import stop_line
from rankctl.coordinator.diagnosis.preflight import parse as parse_preflight
from rankctl.coordinator.diagnosis.progress import JobProgress, rank_span, stopped_on_request
from rankctl.coordinator.model.records import JobRecord, RankRecord, RankUpdate
from rankctl.coordinator.diagnosis.skew import SLOW_EVENTS, SlowRank
from rankctl.coordinator.model.states import LIVE
from rankctl.parallel.placement import node_of_rank
from rankctl.proto import rankctl_pb2 as pb

log = structlog.get_logger("rankctl.coordinator")
ROUTINE_EVENTS_MAX_WORLD = 256  # above this, routine per-rank phase changes get no event of their own
Report = RankUpdate | pb.RankReport


def _starts_up(update: pb.RankReport) -> bool:
    """A live rank's plain start-up phase: no step, exit, error, result or anything the record keeps apart."""
    st = update.status
    return not (st.step or st.exited or st.error or update.result_json or st.notice or st.preflight
                or st.collectives or st.stack or st.phase == "failed") and st.phase in bounds.KNOWN_PHASES \
        and len(st.metrics_json) <= bounds.METRICS_CHARS and len(st.process) <= bounds.PROCESS_CHARS


class ReportApplier:
    """Applies what nodes report to the book; ``rejected`` counts, per node, reports for ranks it does not run."""

    def __init__(self, book: JobBook, clock: Callable[[], float]) -> None:
        self._book, self._clock = book, clock
        self.rejected: Counter[str] = Counter()

    def rank_rows(self) -> ContextManager[None]:
        """Around the ``apply`` calls of one group commit: their rank rows are stored together at its end."""
        return self._book.rank_rows()

    def apply(self, session: NodeSession, updates: Sequence[Report], touched: dict[str, JobRecord]) -> int:
        """Apply one node's reports in order; how many applied (jobs that may advance go into ``touched``).
        The job, its counters and the node's rank range are looked up once per run of reports for the same
        job (the hot path reads the wire objects in place)."""
        rec, name = session.record, session.name
        applied = 0
        job: JobRecord | None = None
        lo = hi = 0
        ranks: dict[int, RankRecord] = {}
        progress: JobProgress | None = None
        for update in updates:
            seq = update.seq
            if seq:
                if seq <= rec.last_seq:
                    continue  # a replay already applied
                rec.last_seq = seq
            if job is None or update.job_id != job.id or update.attempt != job.attempt:
                job = self._book.jobs.get(update.job_id)
                k = job.node_index().get(name) if job is not None and update.attempt == job.attempt else None
                if k is None:
                    self._reject(name, update, job)
                    job = None
                    continue
                lo, hi = k * job.slots_per_node, (k + 1) * job.slots_per_node
                ranks, progress = self._book.ranks(job.id), self._book.progress(job)
                progress.bind(job)  # its pipeline stages and nodes, for stragglers by compute time (once)
            first = update.status.rank
            count = getattr(update.status, "ranks", 0)   # a wire report may stand for several ranks
            if not lo <= first < hi or count > hi - first:
                self._reject(name, update, job)
                continue
            if count > 1:
                applied += count
                if self._apply_range(job, ranks, progress, name, update, first, count):
                    touched[job.id] = job
                continue
            applied += 1
            if self._apply_rank(job, ranks, progress, name, update, first):
                touched[job.id] = job
        return applied

    def _apply_range(self, job: JobRecord, ranks: dict[int, RankRecord], progress: JobProgress, node: str,
                     update: Report, first: int, count: int) -> bool:
        """A report that stands for ranks ``first .. first + count - 1`` (``worker.uplink.reportfold``): each rank
        folded as if it had reported alone, with one event for the lot; True when the job may advance."""
        if _starts_up(update) and not any(rank in ranks for rank in range(first, first + count)):
            self._start_range(job, progress, node, update, first, count)
            return True
        changed = False
        events: list[RankRecord] = []
        for rank in range(first, first + count):
            if self._apply_rank(job, ranks, progress, node, update, rank, events):
                changed = True
        if events:  # one event for the lot: the range's first rank and how many (a watcher updates them all)
            new = replace(events[-1], rank=first)
            what = "exited" if new.exited else new.phase
            self._book.event(job, "rank", f"{rank_span(list(range(first, first + count)))} {what}", new,
                             ranks=count)
        return changed

    def _start_range(self, job: JobRecord, progress: JobProgress, node: str, update: pb.RankReport, first: int,
                     count: int) -> None:
        """A start-up phase of ranks none of which reported in this attempt (a node's ranks at the start of every
        attempt): what ``_apply_rank`` does for each, in one pass (at 65,536 ranks a restart is 8,192 of these)."""
        st = update.status
        phase, process, metrics, code = st.phase or "pending", st.process, st.metrics_json, st.exit_code
        updated = update_seconds(st) or self._clock()
        records = [RankRecord(rank=rank, node=node, phase=phase, metrics_json=metrics, exit_code=code,
                              updated_at=updated, process=process) for rank in range(first, first + count)]
        self._book.put_ranks(job, records)
        if process:
            for rank in range(first, first + count):
                progress.pace.process(rank, process, self._clock())
        new = records[0]
        progress.advance(self._clock())
        progress.started(count, phase)
        if job.world_size <= ROUTINE_EVENTS_MAX_WORLD:
            self._book.event(job, "rank", f"{rank_span(list(range(first, first + count)))} {phase}", new,
                             ranks=count)

    def _reject(self, node: str, update: Report, job: JobRecord | None) -> None:
        """Count (and log, sparingly) a report for a rank this node does not run in this attempt. An older
        attempt's or a forgotten job's report is normal after a restart or a cancel: dropped without a word (after
        a restart in place at 65,536 ranks, thousands arrive at once)."""
        if job is None or update.attempt != job.attempt:
            return
        self.rejected[node] += 1
        n = self.rejected[node]
        if n == 1 or n % 1000 == 0:
            rank = update.status.rank
            owner = job.nodes[node_of_rank(rank, job.slots_per_node)] \
                if 0 <= rank < job.world_size and job.nodes else None
            log.warning("report.not_owner", node=node, job=job.id, rank=rank, owner=owner, rejected=n)

    def _apply_rank(self, job: JobRecord, ranks: dict[int, RankRecord], progress: JobProgress, node: str,
                    update: Report, rank: int, events: list[RankRecord] | None = None) -> bool:
        """Fold one report into rank ``rank``'s record and the job's counters; True when the job may advance.
        ``events``: where a rank event due goes instead of the record (a report for several ranks writes one)."""
        st = update.status
        old = ranks.get(rank)
        notice = getattr(st, "notice", "")   # a wire report's (in-process RankRecords carry none)
        if notice:  # the rank asked for this on the job's record (a damaged checkpoint step passed over)
            self._book.event(job, "notice", f"rank {rank}: {notice[:NOTICE_CHARS]}")
        judged = False   # rank 0's pre-flight outcome came: the job advances on it now (a node to exclude ends the
        if getattr(st, "preflight", "") and rank == 0 and progress.preflight is None \
                and len(st.preflight) <= bounds.PREFLIGHT_CHARS:   # attempt at once)
            self._preflight(job, progress, st.preflight)
            judged = progress.preflight is not None
        if old is not None and not update.result_json and (st.phase or old.phase) == old.phase \
                and st.exited == old.exited and st.exit_code == old.exit_code and st.error in ("", old.error):
            self._next_step(job, progress, old, st)
            return judged
        phase = bounds.phase(st.phase) or (old.phase if old else "pending")
        step = st.step or (old.step if old else 0)
        # an exit report carries no step or metrics: keep the last ones the rank reported
        metrics = bounds.metrics(st.metrics_json) if st.metrics_json not in ("", "{}") or old is None \
            else old.metrics_json
        error = bounds.error(st.error) or (old.error if old else "")
        result = bounds.result(update.result_json) or (old.result_json if old else "")
        new = RankRecord(rank=rank, node=node, phase=phase, step=step, metrics_json=metrics, error=error,
                         exit_code=st.exit_code, exited=st.exited, updated_at=update_seconds(st) or self._clock(),
                         result_json=result, process=bounds.process(st.process))
        progress.advance(self._clock())
        if new.exited:
            progress.pace.gone(new.rank)
        elif new.process != (old.process if old else ""):
            progress.pace.process(new.rank, new.process, self._clock())
        if step != (old.step if old else 0):
            progress.step_figures(step, st, rank)
        stopped = job.state not in LIVE and stopped_on_request(new)   # a cancel's, not a failure
        self._stepped(job, progress, progress.moved(old, new, stopped))
        if new.exited:
            self._book.put_exit(job, new)
        else:
            self._book.put_rank(job, new)
        if job.world_size <= ROUTINE_EVENTS_MAX_WORLD or (
                (new.exited or new.phase == "failed" or new.error != (old.error if old else ""))
                and not (new.exited and job.state not in LIVE)):
            # a large attempt's exits once it ended (its end is already on the record; "stopped: ..." errors
            # included) get no event each: 65,528 of them cost the coordinator ~10 s at 65,536 ranks
            if events is not None:
                events.append(new)
            else:
                self._book.event(job, "rank", f"rank {new.rank} {'exited' if new.exited else new.phase}", new)
        return True

    def _preflight(self, job: JobRecord, progress: JobProgress, text: str) -> None:
        """Rank 0's pre-flight outcome: its figures for ``ctl status`` and an event; what it means for the job
        (nodes excluded, pairs that may go together again) waits in ``progress.preflight`` for the advance
        (``JobReconciler.reconcile``)."""
        found = parse_preflight(text, list(job.nodes))
        if found is None:
            return
        progress.preflight = found
        excluded = "; ".join(f"node {job.nodes[i]}: {why}" for i, why in found.exclude)
        self._book.event(job, "preflight", f"pre-flight: {preflight_line(found.figures, found.note)}"
                                           f"{f'; excludes {excluded}' if excluded else ''}")

    def _next_step(self, job: JobRecord, progress: JobProgress, old: RankRecord, st: RankRecord | pb.RankStatus
                   ) -> None:
        """The common case, a running rank's next step: in memory only, no row, no event."""
        metrics = st.metrics_json
        if metrics and metrics != "{}":
            old.metrics_json = bounds.metrics(metrics)
        updated = update_seconds(st)
        if updated:
            old.updated_at = updated
        if st.process != old.process:  # the daemon saw the process stop or go on (memory only)
            old.process = bounds.process(st.process)
            progress.pace.process(old.rank, old.process, self._clock())
        if st.collectives or st.stack:  # hang evidence: counters that stopped moving (memory only)
            old.collectives, old.stack = bounds.collectives(st.collectives), bounds.stack(st.stack)
            progress.pace.evidence(old.rank, old.collectives, old.stack, self._clock())
        if old.process and progress.pace.announce(old.rank, self._clock()):   # named at once, before any judgement
            self._book.event(job, "stopped", stop_line(old), old)
        progress.reports += 1
        step = st.step
        if step and step != old.step:
            progress.advance(self._clock())
            progress.step_figures(step, st, old.rank)
            before, old.step = old.step, step
            self._stepped(job, progress, progress.moved_step(old.rank, before, step))

    def _stepped(self, job: JobRecord, progress: JobProgress, step: int | None) -> None:
        """One job-level event when the slowest rank finished a step (once per step, restarts included);
        a ``straggler`` event for each rank flagged or unflagged by its compute time then."""
        if step is None:
            return
        progress.pace.step_completed(step, self._clock())
        changes = progress.slow_changes()
        if changes:
            self._straggler_events(job, progress, step, changes)
        if step <= progress.emitted_step:
            return
        progress.emitted_step = step
        m = progress.metrics
        loss = f", loss {m['loss']:.4g}" if isinstance(m.get("loss"), float) else ""
        self._book.event(job, "step", f"step {step}{loss}", step=step, metrics=m)

    def _straggler_events(self, job: JobRecord, progress: JobProgress, step: int,
                          changes: list[tuple[SlowRank, bool]]) -> None:
        """One event when a rank is first flagged and one when it is then unflagged, at most, per attempt (a rank that
        flaps on a loaded machine said so twenty times in one run: ``ctl status`` keeps showing the current ones);
        at most ``SLOW_EVENTS``, then one counting the rest."""
        told = progress.straggler_told
        news = []
        for fig, flagged in changes:
            if told.get(fig.rank, 0) == (0 if flagged else 1):
                told[fig.rank] = 1 if flagged else 2
                news.append((fig, flagged))
        changes = news
        for fig, flagged in changes[:SLOW_EVENTS]:
            what = "is a straggler" if flagged else "is no longer a straggler"
            self._book.event(job, "straggler", f"rank {fig.rank} on {fig.node or '-'} {what} (compute): "
                             f"{fig.compute_s:.3f} s vs median {fig.median_s:.3f} s of its peers",
                             step=step, metrics={**fig.as_dict(), "slow": flagged})
        rest = changes[SLOW_EVENTS:]
        if rest:
            up = sum(flagged for _, flagged in rest)
            self._book.event(job, "straggler", f"{up} more rank(s) flagged and {len(rest) - up} unflagged as "
                             f"stragglers (compute); `ctl status` shows the worst", step=step)
