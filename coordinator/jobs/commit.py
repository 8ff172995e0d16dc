"""All or nothing: what one change of the coordinator does with its memory and with the nodes.

``StoreGuard.consistent()``: when the store refuses a write (``StoreError``: disk full, I/O error), memory
goes back to what the store holds (the job book, the nodes' stored report numbers, drains and
exclusions) and the error goes on to the caller. ``Outgoing``: node messages decided inside a change
are held and sent only once it completes (its transaction committed); outside one they go at once.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import structlog

from rankctl.coordinator.scheduling.fanout import Fanout, Fanouts
from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.fleet.nodes import NodeTable
from rankctl.coordinator.scheduling.relay import WIDTH as RELAY_WIDTH, Relays
from rankctl.coordinator.model.states import is_terminal
from rankctl.coordinator.store.database import Store, StoreError
from rankctl.proto import rankctl_pb2 as pb

log = structlog.get_logger("rankctl.coordinator")


class StoreGuard:
    """Undoes the memory changes of a block whose writes did not all commit (the store is the truth)."""

    def __init__(self, store: Store, book: JobBook, nodes: NodeTable) -> None:
        self._store, self._book, self._nodes = store, book, nodes

    @contextmanager
    def consistent(self) -> Iterator[None]:
        try:
            yield
        except StoreError:
            if not self._store.in_transaction:  # else the outermost block, once rolled back, resyncs
                try:
                    self.resync()
                except Exception:  # noqa: BLE001 - the store itself gone (a leader stepping down closes it):
                    log.warning("store.resync_failed", exc_info=True)   # the refusal is what the caller must hear
            raise

    def resync(self) -> None:
        """Memory back to what the store holds (after a block that raised and rolled back)."""
        store, nodes = self._store, self._nodes
        self._book.resync()
        stored = {r.name: r.last_seq for r in store.load_nodes()}
        for session in nodes:
            session.record.last_seq = stored.get(session.name, 0)
        nodes.draining, nodes.excluded = store.load_drains(), store.load_exclusions()

    def rewound(self) -> None:
        """Writes committed here were refused by a replicated store after the fact (``coordinator.ha.replicator``):
        memory back to what it holds, and each connected node sends its reports after the newest stored again."""
        self.resync()
        for session in self._nodes:
            session.ack_seq = session.record.last_seq
            self._nodes.send(session.name, pb.CoordinatorMessage(ack=pb.Ack(last_seq=session.record.last_seq,
                                                                            resend=True)))


class Outgoing:
    """Messages to nodes; inside ``after_commit()`` they wait until the block completes. A big fan-out of Assigns
    goes through relay heads (``relays``)."""

    def __init__(self, nodes: NodeTable, fanouts: Fanouts, book: JobBook, relay_width: int = RELAY_WIDTH) -> None:
        self._nodes, self.fanouts = nodes, fanouts
        self._held: list[tuple[str, pb.CoordinatorMessage, Fanout | None]] | None = None

        def current(msg: pb.CoordinatorMessage) -> bool:   # an Assign of an attempt still under way
            job = book.jobs.get(msg.assign.job_id)
            return job is not None and job.attempt == msg.assign.attempt and not is_terminal(job.state)
        self.relays = Relays(nodes, lambda name, msg: self._send_now(name, msg, None), current=current,
                             width=relay_width)

    @contextmanager
    def after_commit(self) -> Iterator[None]:
        """Hold node messages decided inside the block; send them only if it completes (it committed)."""
        outer = self._held is None
        if outer:
            self._held = []
        try:
            yield
        except BaseException:
            if outer:
                for _, msg, _ in self._held:
                    self.relays.dropped(msg)
                self._held = None
            raise
        if outer:
            held, self._held = self._held, None
            for name, msg, fan in held:
                self._send_now(name, msg, fan)

    def send(self, name: str, msg: pb.CoordinatorMessage, fan: Fanout | None = None) -> None:
        if self._held is not None:
            self._held.append((name, msg, fan))
        else:
            self._send_now(name, msg, fan)

    def _send_now(self, name: str, msg: pb.CoordinatorMessage, fan: Fanout | None) -> None:
        ok = self._nodes.send(name, msg)
        if ok and fan is not None:
            self.fanouts.sent(fan, msg)
        if fan is not None:
            self.relays.handed(msg, ok)

    def to_nodes(self, names: list[str], msg: pb.CoordinatorMessage, kind: str = "") -> None:
        """``msg`` to each of ``names`` once (a job's nodes, in order); ``kind``: timed as a fan-out of it."""
        fan = self.fanouts.begin(kind) if kind else None
        for name in dict.fromkeys(names):
            self.send(name, msg, fan)

    def fan_out(self, kind: str, messages: Iterable[tuple[str, pb.CoordinatorMessage]]) -> None:
        """One message to each node, timed as one fan-out of ``kind`` (``coordinator.scheduling.fanout``)."""
        fan = self.fanouts.begin(kind)
        for name, msg in self.relays.plan(kind, messages):
            self.send(name, msg, fan)
