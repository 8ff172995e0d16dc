"""Rank reports and log batches from node sessions: ownership, ordering, and holding what the store refused.

A mixin of ``core.Coordinator`` (it uses the core's book, node table, store and ``_advance``);
kept apart so that each module has one job. Called from the event loop thread only.
"""

from __future__ import annotations

import structlog

from rankctl.coordinator.nodes import NodeSession, NodeStatus
from rankctl.coordinator.progress import changed
from rankctl.coordinator.records import JobRecord, RankRecord, RankUpdate
from rankctl.coordinator.store import StoreError
from rankctl.parallel.placement import node_of_rank

log = structlog.get_logger("rankctl.coordinator")
MAX_UNSTORED_REPORTS = 100_000  # reports held per node while the store refuses writes
MAX_LOG_LINE = 4096             # characters of a log line stored
MAX_LOG_BATCH = 1000            # lines of one LogLines message stored


class ReportsMixin:
    """Applies what nodes report; see ``core`` for the threading and consistency contract."""

    def rank_report(self, session: NodeSession, update: RankUpdate) -> bool:
        """Apply one rank report; False when dropped (a replay already seen, or a stale stream).

        A report the store refuses is held, in order, with every later one of the session,
        until tick can store them (the node is not told: it would replay them anyway after
        a reconnect, since its last stored report number is what the store holds).
        """
        if not self.nodes.is_current(session):
            return False
        rec = session.record
        session.last_heartbeat = rec.last_seen = self.clock()  # a report shows the node is alive
        if update.seq and update.seq <= rec.last_seq:
            return False
        if session.unstored:
            self._hold(session, update)
            return True
        try:
            self._store_report(session, update)
        except StoreError as exc:
            log.warning("report.store_failed", node=rec.name, error=str(exc))
            self._hold(session, update)
        return True

    def _hold(self, session: NodeSession, update: RankUpdate) -> None:
        if len(session.unstored) >= MAX_UNSTORED_REPORTS:  # the daemon still has them: make it replay
            log.warning("report.hold_full", node=session.name, held=len(session.unstored))
            session.unstored.clear()
            self._resync_node(session)
            return
        session.unstored.append(update)

    def _resync_node(self, session: NodeSession) -> None:
        """Close the stream without losing the node: it reconnects and replays what the store lacks."""
        session.status, session.detail = NodeStatus.DISCONNECTED, "asked to reconnect and replay its reports"
        session.since = self.clock()
        if session.outbox is not None:
            session.outbox(None)
            session.outbox = None

    def _flush_unstored(self, session: NodeSession) -> None:
        while session.unstored:
            try:
                self._store_report(session, session.unstored[0])
            except StoreError as exc:
                log.warning("report.flush_failed", node=session.name, held=len(session.unstored), error=str(exc))
                return
            session.unstored.popleft()

    def _owner_of(self, job: JobRecord, rank: int) -> str | None:
        return job.nodes[node_of_rank(rank, job.slots_per_node)] if 0 <= rank < job.world_size and job.nodes else None

    def _store_report(self, session: NodeSession, update: RankUpdate) -> None:
        """Store one report (raises StoreError, memory unchanged); then move its job along."""
        rec, job = session.record, self.book.jobs.get(update.job_id)
        rank = update.status.rank
        owned = (job is not None and update.attempt == job.attempt and self._owner_of(job, rank) == session.name)
        with self._consistent():
            with self.store.transaction(f"a report of node {rec.name}"):
                if update.seq:
                    self.store.set_node_seq(rec.name, update.seq)
                if owned:
                    self._apply_rank(job, session.name, update)
            if update.seq:
                rec.last_seq = update.seq
        if not owned:
            self._reject(session, update, job)
            return
        self._advance(job)

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

    def _apply_rank(self, job: JobRecord, node: str, update: RankUpdate) -> None:
        old = self.book.ranks(job.id).get(update.status.rank)
        st = update.status
        # an exit report carries no step or metrics: keep the last ones the rank reported
        keep_metrics = st.metrics_json in ("", "{}") and old is not None
        new = RankRecord(
            rank=st.rank, node=node, phase=st.phase or (old.phase if old else "pending"),
            step=st.step or (old.step if old else 0),
            metrics_json=old.metrics_json if keep_metrics else st.metrics_json,
            error=st.error or (old.error if old else ""), exit_code=st.exit_code, exited=st.exited,
            updated_at=st.updated_at or self.clock(),
            result_json=update.result_json or (old.result_json if old else ""),
        )
        self.book.put_rank(job, new)
        if changed(old, new):
            self.book.event(job, "rank", f"rank {new.rank} {'exited' if new.exited else new.phase}", new)

    def append_logs(self, session: NodeSession, job_id: str, attempt: int, rank: int, lines: list[str]) -> None:
        """Store a batch of a rank's log lines (bounded tail) and wake log followers.

        Lines of a rank this node does not run are counted and dropped; lines the store
        refuses are dropped with a warning (the rank's full log stays in its file on the node).
        """
        job = self.book.jobs.get(job_id)
        if not lines or job is None or not self.nodes.is_current(session):
            return
        if attempt != job.attempt or self._owner_of(job, rank) != session.name:
            self.rejected_reports[session.name] += 1
            return
        lines = [ln if len(ln) <= MAX_LOG_LINE else ln[:MAX_LOG_LINE] + " [rankctl: line cut]"
                 for ln in lines[:MAX_LOG_BATCH]]  # daemons cut first; a stream that does not is cut here
        try:
            self.store.append_logs(job_id, attempt, rank, lines)
        except StoreError as exc:
            log.warning("logs.store_failed", node=session.name, job=job_id, rank=rank, lines=len(lines),
                        error=str(exc))
            return
        self.signals.notify(job_id)
