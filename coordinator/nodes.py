"""Live node sessions: which daemons are connected, their outboxes, ports and heartbeats.

An *outbox* is a callable taking one ``CoordinatorMessage``; the NodeService servicer
passes ``queue.put_nowait`` of the stream's asyncio.Queue, tests pass ``list.append``.
Messages for a node that is not connected are dropped (it learns the truth when it
registers again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterator

from rankctl.coordinator.records import NodeHello, NodeRecord
from rankctl.proto import rankctl_pb2 as pb

Outbox = Callable[[pb.CoordinatorMessage], None]


class NodeStatus(str, Enum):
    READY = "READY"                # connected, heartbeating
    LOST = "LOST"                  # stream broke or heartbeats stopped
    DISCONNECTED = "DISCONNECTED"  # known from the store, not connected since the coordinator started


@dataclass(eq=False)
class NodeSession:
    """One node's runtime state; a new object (a new stream) on every Register."""

    record: NodeRecord
    status: NodeStatus
    outbox: Outbox | None = None
    free_ports: tuple[int, ...] = ()
    last_heartbeat: float = 0.0
    detail: str = ""               # why LOST / since when DISCONNECTED
    unverified: set[tuple[str, int]] = field(default_factory=set)  # (job, attempt) not listed on Register
    acked_at: float = 0.0          # when the last Ack was sent
    peer_port: int = 0             # its PeerService port (checkpoint replication); 0: none

    @property
    def peer(self) -> str:
        """``host:port`` of its PeerService, or "" when it has none."""
        return f"{self.record.host}:{self.peer_port}" if self.peer_port else ""
    owes_failures: bool = False    # LOST, but failing its jobs could not be stored yet
    since: float = 0.0             # when it became DISCONNECTED (0: since the coordinator started)

    @property
    def name(self) -> str:
        return self.record.name


@dataclass
class NodeTable:
    """Every known node by name; the current session of each."""

    sessions: dict[str, NodeSession] = field(default_factory=dict)
    _names: list[str] | None = field(default=None, repr=False)  # sorted names, rebuilt when a name is added

    @classmethod
    def from_records(cls, records: list[NodeRecord]) -> "NodeTable":
        return cls({r.name: NodeSession(r, NodeStatus.DISCONNECTED, detail="waiting to reconnect") for r in records})

    def get(self, name: str) -> NodeSession | None:
        return self.sessions.get(name)

    def __iter__(self) -> Iterator[NodeSession]:
        """Sessions in name order (the order placement uses)."""
        if self._names is None or len(self._names) != len(self.sessions):
            self._names = sorted(self.sessions)
        sessions = self.sessions
        return (sessions[n] for n in self._names)

    def ready(self) -> list[NodeSession]:
        return [s for s in self if s.status is NodeStatus.READY]

    def record_for(self, hello: NodeHello, now: float) -> NodeRecord:
        """The record a session for ``hello`` would have; a new daemon session restarts report numbering."""
        old = self.sessions.get(hello.name)
        last_seq = old.record.last_seq if old is not None and old.record.session == hello.session else 0
        return NodeRecord(hello.name, hello.address, hello.slots, dict(hello.hardware), hello.session, last_seq, now)

    def connect(self, record: NodeRecord, hello: NodeHello, outbox: Outbox, now: float) -> NodeSession:
        """Open a new session (``record`` from ``record_for``, already stored)."""
        session = NodeSession(record, NodeStatus.READY, outbox, tuple(hello.free_ports), now,
                              peer_port=hello.peer_port)
        self.sessions[hello.name] = session
        return session

    def is_current(self, session: NodeSession) -> bool:
        return self.sessions.get(session.name) is session

    def send(self, name: str, msg: pb.CoordinatorMessage) -> bool:
        """Put ``msg`` in the node's outbox if it is connected; False when dropped."""
        s = self.sessions.get(name)
        if s is None or s.status is not NodeStatus.READY or s.outbox is None:
            return False
        s.outbox(msg)
        return True
