"""Rank reports from node sessions: ownership, ordering, per-job counters and group commits.

A mixin of ``core.Coordinator`` (it uses the core's book, node table, store and ``_advance_once``);
kept apart so that each module has one job. Called from the event loop thread only.

Reports are queued as they arrive (``rank_reports``: one call per ReportBatch) and applied in
one store transaction per ``flush`` (the server calls it every ``FLUSH_S``): a group commit. A batch
with a phase change, exit or error is flushed on the event loop's next turn instead, together with
whatever else came in that turn, so that a job's state never waits for the commit period.
What a node learns is stored (``Ack``, and ``Registered.last_seq`` after a reconnect) is only
ever what a committed transaction holds. When the store refuses the commit, memory goes back
to what the store holds (``_consistent``), the batch is held, in order, and retried (backing off
``RETRY_S``); a node whose held reports pass ``MAX_HELD`` is asked to reconnect, and replays.

Per report the work is constant in the job's size: the rank's record and the job's
``JobProgress`` counters change in memory; the store gets a row only when the rank's phase,
exit or error changes, and one job-level ``step`` event when the slowest rank finishes a step.
"""

from __future__ import annotations

import asyncio
from typing import Iterable, Sequence

import structlog

from rankctl.coordinator.convert import update_seconds
from rankctl.coordinator.nodes import NodeSession, NodeStatus
from rankctl.coordinator.progress import SLOW_EVENTS, JobProgress, SlowRank
from rankctl.coordinator.records import JobRecord, RankRecord, RankUpdate
from rankctl.coordinator.store import StoreError
from rankctl.parallel.placement import node_of_rank
from rankctl.proto import rankctl_pb2 as pb

log = structlog.get_logger("rankctl.coordinator")
FLUSH_S = 0.05                # group commit period
RETRY_S = 1.0                 # while the store refuses, retry this often
MAX_INBOX = 200_000           # reports queued between two flushes before one is forced
MAX_HELD = 1_000_000          # reports held while the store refuses, before nodes are asked to replay
ACK_EVERY_S = 30.0            # at most one Ack per node this often (the buffer it trims is coalesced anyway)
ROUTINE_EVENTS_MAX_WORLD = 256  # above this, routine per-rank phase changes get no event of their own


def _changes_phase(update: RankUpdate | pb.RankReport) -> bool:
    """More than a running rank's next step: a phase (a rank enters running at step 0), an exit, an error,
    a result or a process state. Over-approximates; only when the report is stored depends on it."""
    st = update.status
    return st.exited or st.phase != "running" or not st.step or bool(st.error) or bool(update.result_json)


class ReportsMixin:
    """Applies what nodes report; see ``core`` for the threading and consistency contract."""

    # -- intake ---------------------------------------------------------------------------
    def rank_reports(self, session: NodeSession, updates: Sequence[RankUpdate | pb.RankReport]) -> int:
        """Queue one node's reports for the next group commit; the number queued (0: stale stream).

        ``updates`` are ``RankUpdate``s or the wire's ``RankReport``s themselves (same field names,
        ``status`` with a ``RankRecord``'s): the hot path reads them in place, copying nothing.
        """
        if not self.nodes.is_current(session) or not updates:
            return 0
        session.last_heartbeat = session.record.last_seen = self.clock()  # a report shows the node is alive
        self._inbox.append((session, updates))
        self._queued += len(updates)
        if self._queued >= MAX_INBOX:
            self.flush()
        elif not self._flush_due and any(map(_changes_phase, updates)):
            self._flush_soon()
        return len(updates)

    def _flush_soon(self) -> None:
        """A phase change, exit or error came: store it on the event loop's next turn, with every report
        that came in the same turn (one transaction a turn, never one a rank); step reports alone wait for
        the ``FLUSH_S`` group commit."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test driving the core by hand): the next flush() stores it
            return
        self._flush_due = True
        loop.call_soon(self._due_flush)

    def _due_flush(self) -> None:
        self._flush_due = False
        try:
            if self._inbox:
                self.flush()
        except Exception:  # as the server's group-commit loop: logged, and the next flush retries
            log.exception("reports.flush_failed")

    def rank_report(self, session: NodeSession, update: RankUpdate) -> bool:
        """Apply one report now (the legacy one-report message); False when dropped as a replay or stale."""
        if not self.nodes.is_current(session) or (update.seq and update.seq <= session.record.last_seq):
            if self.nodes.is_current(session):
                session.last_heartbeat = session.record.last_seen = self.clock()
            return False
        self.rank_reports(session, [update])
        self.flush()
        return True

    # -- group commit ---------------------------------------------------------------------
    def flush(self, *, force: bool = False) -> bool:
        """Apply and store every queued report in one transaction; False when the store refused."""
        if not self._inbox and not self._held:
            return True
        if self._held and not force and self.clock() - self._refused_at < RETRY_S:
            self._hold_inbox()
            return False
        batch = self._held + self._inbox
        self._held, self._inbox, self._queued = [], [], 0
        touched: dict[str, JobRecord] = {}
        seqs: dict[str, tuple[NodeSession, int]] = {}
        applied = 0
        try:
            with self._consistent(), self._outgoing_after_commit():
                with self.store.transaction("rank reports"):
                    for session, updates in batch:
                        if self.nodes.is_current(session):
                            applied += self._apply_updates(session, updates, touched)
                        if session.record.last_seq:
                            seqs[session.name] = (session, session.record.last_seq)
                    for name, (session, seq) in seqs.items():
                        self.store.set_node_seq(name, seq)
                    for job in touched.values():
                        self._advance_once(job)
        except StoreError as exc:
            self._refused_at = self.clock()
            self._held = [(s, u) for s, u in batch if self.nodes.is_current(s)]
            self._check_held()
            log.warning("reports.store_failed", held=sum(len(u) for _, u in self._held), error=str(exc))
            return False
        self.stats.rank_reports += applied
        self._ack(seqs.values())
        if self._reschedule:  # a job finished inside the transaction: its slots are free now
            self.schedule()
        return True

    def _hold_inbox(self) -> None:
        self._held.extend(self._inbox)
        self._inbox, self._queued = [], 0
        self._check_held()

    def _check_held(self) -> None:
        """Too much held: drop it and ask its nodes to reconnect and replay (they still have every report)."""
        if sum(len(u) for _, u in self._held) <= MAX_HELD:
            return
        for session in {s.name: s for s, _ in self._held}.values():
            self._resync_node(session)
        log.warning("reports.hold_full", nodes=len({s.name for s, _ in self._held}))
        self._held = []

    @property
    def held_reports(self) -> int:
        """Reports received but not yet stored (the store refused them)."""
        return sum(len(u) for _, u in self._held)

    def _ack(self, stored: Iterable[tuple[NodeSession, int]]) -> None:
        now = self.clock()
        for session, seq in stored:
            if now - session.acked_at >= ACK_EVERY_S and self.nodes.is_current(session):
                session.acked_at = now
                self.nodes.send(session.name, pb.CoordinatorMessage(ack=pb.Ack(last_seq=seq)))

    def _resync_node(self, session: NodeSession) -> None:
        """Close the stream without losing the node: it reconnects and replays what the store lacks."""
        session.status, session.detail = NodeStatus.DISCONNECTED, "asked to reconnect and replay its reports"
        session.since = self.clock()
        self._close_stream(session)

    # -- one report -----------------------------------------------------------------------
    def _owner_of(self, job: JobRecord, rank: int) -> str | None:
        return job.nodes[node_of_rank(rank, job.slots_per_node)] if 0 <= rank < job.world_size and job.nodes else None

    def _apply_updates(self, session: NodeSession, updates: Sequence[RankUpdate | pb.RankReport],
                       touched: dict[str, JobRecord]) -> int:
        """Apply one node's reports in order; how many applied. The job, its counters and the node's rank
        range are looked up once per run of reports for the same job (the hot path reads the wire objects)."""
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
                job = self.book.jobs.get(update.job_id)
                k = job.node_index().get(name) if job is not None and update.attempt == job.attempt else None
                if k is None:
                    self._reject(session, update, job)
                    job = None
                    continue
                lo, hi = k * job.slots_per_node, (k + 1) * job.slots_per_node
                ranks, progress = self.book.ranks(job.id), self.book.progress(job)
                progress.bind(job)  # its pipeline stages and nodes, for stragglers by compute time (once)
            if not lo <= update.status.rank < hi:
                self._reject(session, update, job)
                continue
            applied += 1
            if self._apply_rank(job, ranks, progress, name, update):
                touched[job.id] = job
        return applied

    def _reject(self, session: NodeSession, update: RankUpdate, job: JobRecord | None) -> None:
        """Count (and log, sparingly) a report for a rank this node does not run in this attempt."""
        if job is not None and update.attempt == job.attempt:
            self.rejected_reports[session.name] += 1
            n = self.rejected_reports[session.name]
            if n == 1 or n % 1000 == 0:
                log.warning("report.not_owner", node=session.name, job=job.id, rank=update.status.rank,
                            owner=self._owner_of(job, update.status.rank), rejected=n)
        else:  # an older attempt's or a forgotten job's report: normal after a restart or a cancel
            log.debug("report.ignored", node=session.name, job=update.job_id, attempt=update.attempt)

    def _apply_rank(self, job: JobRecord, ranks: dict[int, RankRecord], progress: JobProgress, node: str,
                    update: RankUpdate | pb.RankReport) -> bool:
        """Fold one report into the rank's record and the job's counters; True when the job may advance."""
        st = update.status
        old = ranks.get(st.rank)
        if old is not None and not update.result_json and (st.phase or old.phase) == old.phase \
                and st.exited == old.exited and st.exit_code == old.exit_code and st.error in ("", old.error):
            # the common case, a running rank's next step: in memory only, no row, no event
            metrics = st.metrics_json
            if metrics and metrics != "{}":
                old.metrics_json = metrics
            updated = update_seconds(st)
            if updated:
                old.updated_at = updated
            if st.process != old.process:  # the daemon saw the process stop or go on (memory only)
                old.process = st.process
            if st.collectives or st.stack:  # hang evidence: counters that stopped moving (memory only)
                old.collectives, old.stack = st.collectives, st.stack
            progress.reports += 1
            step = st.step
            if step and step != old.step:
                progress.advanced_at = self.clock()
                progress.step_figures(step, st)
                before, old.step = old.step, step
                self._stepped(job, progress, progress.moved_step(st.rank, before, step))
            return False
        phase = st.phase or (old.phase if old else "pending")
        step = st.step or (old.step if old else 0)
        # an exit report carries no step or metrics: keep the last ones the rank reported
        metrics = st.metrics_json if st.metrics_json not in ("", "{}") or old is None else old.metrics_json
        error = st.error or (old.error if old else "")
        new = RankRecord(rank=st.rank, node=node, phase=phase, step=step, metrics_json=metrics, error=error,
                         exit_code=st.exit_code, exited=st.exited, updated_at=update_seconds(st) or self.clock(),
                         result_json=update.result_json or (old.result_json if old else ""), process=st.process)
        progress.advanced_at = self.clock()
        if step != (old.step if old else 0):
            progress.step_figures(step, st)
        self._stepped(job, progress, progress.moved(old, new))
        self.book.put_rank(job, new)
        if new.exited or new.phase == "failed" or new.error != (old.error if old else "") or \
                job.world_size <= ROUTINE_EVENTS_MAX_WORLD:
            self.book.event(job, "rank", f"rank {new.rank} {'exited' if new.exited else new.phase}", new)
        return True

    def _stepped(self, job: JobRecord, progress: JobProgress, step: int | None) -> None:
        """One job-level event when the slowest rank finished a step (once per step, restarts included);
        a ``straggler`` event for each rank flagged or unflagged by its compute time then."""
        if step is None:
            return
        changes = progress.slow_changes()
        if changes:
            self._straggler_events(job, step, changes)
        if step <= progress.emitted_step:
            return
        progress.emitted_step = step
        m = progress.metrics
        loss = f", loss {m['loss']:.4g}" if isinstance(m.get("loss"), float) else ""
        self.book.event(job, "step", f"step {step}{loss}", step=step, metrics=m)

    def _straggler_events(self, job: JobRecord, step: int, changes: list[tuple[SlowRank, bool]]) -> None:
        """One event per rank flagged or unflagged (at most ``SLOW_EVENTS``, then one counting the rest)."""
        for fig, flagged in changes[:SLOW_EVENTS]:
            what = "is a straggler" if flagged else "is no longer a straggler"
            self.book.event(job, "straggler", f"rank {fig.rank} on {fig.node or '-'} {what} (compute): "
                            f"{fig.compute_s:.3f} s vs median {fig.median_s:.3f} s of its peers",
                            step=step, metrics={**fig.as_dict(), "slow": flagged})
        rest = changes[SLOW_EVENTS:]
        if rest:
            up = sum(flagged for _, flagged in rest)
            self.book.event(job, "straggler", f"{up} more rank(s) flagged and {len(rest) - up} unflagged as "
                            f"stragglers (compute); `ctl status` shows the worst", step=step)
