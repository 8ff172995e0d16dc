"""Report intake: rank reports queued as they arrive and stored in one transaction per group commit.

``accept`` queues one ReportBatch; ``flush`` applies everything queued (``coordinator.jobs.reports``) and
stores it in one transaction: a group commit, every ``FLUSH_S`` from the server's loop. A batch with a
phase change, exit or error is flushed on the event loop's next turn instead, together with whatever
else came in that turn, so that a job's state never waits for the commit period. What a node learns is
stored (``Ack``, and ``Registered.last_seq`` after a reconnect) is only ever what a committed transaction
holds; Acks go out at their own pace (``coordinator.fleet.acks``). When the store refuses the commit, memory goes
back to what the store holds, the batch is held, in order, and retried (backing off ``RETRY_S``); a node
whose held reports pass ``MAX_HELD`` is asked to reconnect, and replays.
"""

from __future__ import annotations

from typing import Callable, Sequence

import structlog

from rankctl.coordinator.fleet.acks import AckPacer
from rankctl.coordinator.jobs.commit import Outgoing, StoreGuard
from rankctl.coordinator.jobs.dirty import Dirty
from rankctl.coordinator.fleet.nodes import NodeSession, NodeTable
from rankctl.coordinator.model.records import JobRecord
from rankctl.coordinator.jobs.reports import Report, ReportApplier
from rankctl.coordinator.model.stats import CoordinatorStats
from rankctl.coordinator.store.database import Store, StoreError

log = structlog.get_logger("rankctl.coordinator")
FLUSH_S = 0.05                # group commit period
RETRY_S = 1.0                 # while the store refuses, retry this often
MAX_INBOX = 200_000           # reports queued between two flushes before one is forced
MAX_HELD = 1_000_000          # reports held while the store refuses, before nodes are asked to replay
MAX_DROPPED = 3               # nodes' reports left out of one group commit (a bug) before the rest is held instead
Queued = tuple[NodeSession, Sequence[Report]]


def _changes_phase(update: Report) -> bool:
    """More than a running rank's next step: a phase (a rank enters running at step 0), an exit, an error,
    a result or a process state. Over-approximates; only when the report is stored depends on it."""
    st = update.status
    return st.exited or st.phase != "running" or not st.step or bool(st.error) or bool(update.result_json)


class ReportIntake:
    """The inbox and the group commit; called from the event loop thread only.

    The jobs a committed report touched are marked (``dirty``): the core's turn reconciles them.
    ``resync``: closes a node's stream so that it reconnects and replays.
    """

    def __init__(self, nodes: NodeTable, store: Store, clock: Callable[[], float], guard: StoreGuard,
                 outgoing: Outgoing, applier: ReportApplier, stats: CoordinatorStats, *,
                 dirty: Dirty, resync: Callable[[NodeSession], None]) -> None:
        self._nodes, self._store, self._clock, self._guard = nodes, store, clock, guard
        self._outgoing, self._applier, self._stats = outgoing, applier, stats
        self._dirty, self._resync = dirty, resync
        self._inbox: list[Queued] = []                   # queued for the next flush
        self._held: list[Queued] = []                    # the same, refused by the store: retried
        self._queued = 0
        self._refused_at = 0.0
        self.acks = AckPacer(nodes, clock)               # what nodes learn is stored (``coordinator.fleet.acks``)

    @property
    def held(self) -> int:
        """Reports received but not yet stored (the store refused them)."""
        return sum(len(u) for _, u in self._held)

    def pending(self) -> bool:
        """Whether a flush has reports to store or Acks to send."""
        return bool(self._inbox or self._held or len(self.acks))

    def accept(self, session: NodeSession, updates: Sequence[Report]) -> int:
        """Queue one node's reports for the next group commit; the number queued (0: stale stream).

        ``updates`` are ``RankUpdate``s or the wire's ``RankReport``s themselves (same field names,
        ``status`` with a ``RankRecord``'s): the hot path reads them in place, copying nothing.
        """
        if not self._nodes.is_current(session) or not updates:
            return 0
        session.last_heartbeat = session.record.last_seen = self._clock()  # a report shows the node is alive
        self._inbox.append((session, updates))
        self._queued += len(updates)
        if self._queued >= MAX_INBOX:
            self.flush()
        elif not self._dirty.reports and any(map(_changes_phase, updates)):
            # stored in the core's next turn (the event loop's next), with every report that came in the same
            # turn: one transaction a turn, never one a rank; step reports alone wait for the FLUSH_S group commit
            self._dirty.commit_reports()
        return len(updates)

    def flush(self, *, force: bool = False) -> bool:
        """Apply and store every queued report in one transaction; False when the store refused. Acks due go out
        at their pace (``coordinator.fleet.acks``) on every call."""
        if not self._inbox and not self._held:
            self.acks.send()
            return True
        if self._held and not force and self._clock() - self._refused_at < RETRY_S:
            self._hold_inbox()
            return False
        batch = self._held + self._inbox
        self._held, self._inbox, self._queued = [], [], 0
        try:
            applied, seqs = self._commit(batch)
        except StoreError as exc:
            self._refuse(batch, exc)
            return False
        except Exception:  # noqa: BLE001 - a bug on one node's reports must not lose everyone's
            log.exception("reports.commit_failed", nodes=len(batch))
            self._guard.resync()
            applied, seqs = self._commit_each(batch)
        self._stats.rank_reports += applied
        self.acks.due(seqs)
        return True

    def _commit(self, batch: list[Queued]) -> tuple[int, list[tuple[NodeSession, int]]]:
        """Apply ``batch`` in one transaction and mark the jobs it touched; (reports applied, each node's last
        stored report number)."""
        touched: dict[str, JobRecord] = {}
        seqs: dict[str, tuple[NodeSession, int]] = {}
        applied = 0
        with self._guard.consistent(), self._outgoing.after_commit():
            with self._store.transaction("rank reports"):
                with self._applier.rank_rows():   # the rows in one statement, before any job advances
                    for session, updates in batch:
                        if self._nodes.is_current(session):
                            applied += self._applier.apply(session, updates, touched)
                        if session.record.last_seq:
                            seqs[session.name] = (session, session.record.last_seq)
                self._store.set_node_seqs((name, seq) for name, (_, seq) in seqs.items())   # one statement
        self._dirty.jobs(touched)
        return applied, list(seqs.values())

    def _refuse(self, batch: list[Queued], exc: StoreError) -> None:
        """The store refused: the batch is held, in order, and retried."""
        self._hold(batch)
        log.warning("reports.store_failed", held=self.held, error=str(exc))

    def _hold(self, batch: list[Queued]) -> None:
        """Hold ``batch`` (its current streams' reports, in order, before anything held already) for the retry
        ``RETRY_S`` from now."""
        self._refused_at = self._clock()
        self._held = [(s, u) for s, u in batch if self._nodes.is_current(s)] + self._held
        self._check_held()

    def _commit_each(self, batch: list[Queued]) -> tuple[int, list[tuple[NodeSession, int]]]:
        """A group commit raised (not the store: a bug): each node's reports in a transaction of their own, so
        that only those that raise are left out (logged; the node's stored report number stays where it was, and
        its later reports' Ack covers them). The rest is stored as the group commit would have."""
        applied, seqs, failed = 0, [], 0
        for k, item in enumerate(batch):
            try:
                done, stored = self._commit([item])
            except StoreError as exc:
                self._refuse(batch[k:], exc)
                break
            except Exception:  # noqa: BLE001
                log.exception("reports.dropped", node=item[0].name, reports=len(item[1]))
                self._guard.resync()
                failed += 1
                if failed >= MAX_DROPPED and k + 1 < len(batch):   # not one node's reports: held and retried, as a
                    self._hold(batch[k + 1:])                       # store refusal, so a resync a node never runs
                    break                                           # for thousands of them at once
                continue
            applied += done
            seqs += stored
        return applied, seqs

    def _hold_inbox(self) -> None:
        self._held.extend(self._inbox)
        self._inbox, self._queued = [], 0
        self._check_held()

    def _check_held(self) -> None:
        """Too much held: drop it and ask its nodes to reconnect and replay (they still have every report)."""
        if self.held <= MAX_HELD:
            return
        for session in {s.name: s for s, _ in self._held}.values():
            self._resync(session)
        log.warning("reports.hold_full", nodes=len({s.name for s, _ in self._held}))
        self._held = []
