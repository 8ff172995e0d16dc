"""Live node sessions: which daemons are connected, their outboxes, ports and heartbeats.

An *outbox* is a callable taking one ``CoordinatorMessage``; the NodeService servicer
passes ``queue.put_nowait`` of the stream's asyncio.Queue, tests pass ``list.append``.
Messages for a node that is not connected are dropped (it learns the truth when it
registers again).

Beside the sessions the table holds what operators and failures decided about nodes (kept in
the store too): the nodes being drained (``ctl drain``: no new work, their jobs move off them)
and, per job, the nodes it is not placed on again (its ranks there failed twice in a row).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterator

from rankctl.contract.names import shown
from rankctl.coordinator.model.errors import CoordinatorError
from rankctl.coordinator.model.records import NodeHello, NodeRecord
from rankctl.coordinator.store.durability import AT_ONCE, Durability
from rankctl.proto import rankctl_pb2 as pb

Outbox = Callable[[pb.CoordinatorMessage], None]


class NodeNotFound(CoordinatorError):
    """No node has this name (NOT_FOUND)."""


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
    beat: float = 0.0              # the heartbeat interval this session's daemon was last asked for
    was_beat: float = 0.0          # the one before, until its next heartbeat (it was sleeping that long when told)
    detail: str = ""               # why LOST / since when DISCONNECTED
    unverified: set[tuple[str, int]] = field(default_factory=set)  # (job, attempt) not listed on Register
    acked_at: float = 0.0          # when the last Ack was sent
    ack_seq: int = 0               # its newest report number stored (the next Ack's; ``coordinator.fleet.acks``)
    ack_queued: bool = False       # waiting for its Ack in the pacer's queue
    peer_port: int = 0             # its PeerService port (checkpoint replication); 0: none
    usage: pb.NodeUsage | None = None  # the newest usage its heartbeats carried (None: none yet)
    pool: str = ""                 # the allocation it was started for ("": the general pool; from its Register)
    replaces: bool = False         # its daemon stops an older attempt's ranks before a newer Assign's start
    relays: bool = False           # its daemon heads a relay tree's group when asked (``coordinator.scheduling.relay``)
    data_roots: tuple[str, ...] = ()  # where its jobs may create files (``Register.data_roots``; (): not told)
    relay_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))  # signs Relayed items for it
    relay_seq: int = 0             # the last Relayed item's number for it
    relay_up_seq: int = 0          # the last number of its batches a relay head carried

    @property
    def peer(self) -> str:
        """``host:port`` of its PeerService, or "" when it has none."""
        return f"{self.record.host}:{self.peer_port}" if self.peer_port else ""
    since: float = 0.0             # when it became DISCONNECTED (0: since the coordinator started)

    @property
    def name(self) -> str:
        return self.record.name


@dataclass
class NodeTable:
    """Every known node by name; the current session of each."""

    sessions: dict[str, NodeSession] = field(default_factory=dict)
    _names: list[str] | None = field(default=None, repr=False)  # sorted names, rebuilt when a name is added
    draining: dict[str, str] = field(default_factory=dict)             # node -> why (ctl drain)
    excluded: dict[str, dict[str, str]] = field(default_factory=dict)  # job id -> node -> why not placed for it
    # job id -> node pairs whose link a hang pointed at: not placed together for it while others fit, until a
    # pre-flight of an attempt on both passes (memory only)
    apart: dict[str, set[tuple[str, str]]] = field(default_factory=dict)
    # when what is committed is stored (a replicated store's leader stores behind the loop): a message goes
    # once everything committed before it is stored, in order ("persist, then send")
    durability: Durability = field(default=AT_ONCE, repr=False)

    @classmethod
    def from_records(cls, records: list[NodeRecord], draining: dict[str, str] | None = None,
                     excluded: dict[str, dict[str, str]] | None = None, *,
                     durability: Durability = AT_ONCE) -> "NodeTable":
        sessions = {r.name: NodeSession(r, NodeStatus.DISCONNECTED, detail="waiting to reconnect") for r in records}
        return cls(sessions, draining=dict(draining or {}), excluded=dict(excluded or {}), durability=durability)

    def get(self, name: str) -> NodeSession | None:
        return self.sessions.get(name)

    def known(self, name: str) -> NodeSession:
        """The node's session; NodeNotFound naming the value when no node has that name."""
        session = self.sessions.get(name)
        if session is None:
            raise NodeNotFound(f"no node {shown(name)} is known to this coordinator (`ctl nodes` lists them)")
        return session

    def blocked(self, job_id: str) -> dict[str, str]:
        """Nodes a job is not placed on now, with why: every draining node and the job's exclusions."""
        out = {name: "draining" for name in self.draining}
        for name, why in self.excluded.get(job_id, {}).items():
            out.setdefault(name, f"excluded for this job: {why}")
        return out

    def exclusions_by_node(self) -> dict[str, list[str]]:
        """node -> the jobs it is not placed for again (one pass over the exclusions)."""
        out: dict[str, list[str]] = {}
        for job_id, names in self.excluded.items():
            for name in names:
                out.setdefault(name, []).append(job_id)
        return out

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
                              peer_port=hello.peer_port, pool=hello.pool, replaces=hello.replaces,
                              relays=hello.relays, data_roots=hello.data_roots)
        self.sessions[hello.name] = session
        return session

    def is_current(self, session: NodeSession) -> bool:
        return self.sessions.get(session.name) is session

    def close_all(self) -> None:
        """Close every node's stream (a coordinator that stops leading): the daemons go to the new leader."""
        for s in self.sessions.values():
            if s.outbox is not None:
                s.outbox(None)

    def send(self, name: str, msg: pb.CoordinatorMessage) -> bool:
        """Put ``msg`` in the node's outbox if it is connected, once what was committed before it is stored;
        False when dropped (a message held for the store goes to the session current then, if any)."""
        s = self.sessions.get(name)
        if s is None or s.status is not NodeStatus.READY or s.outbox is None:
            return False
        if self.durability.pending():
            self.durability.after(lambda: self._put(s, msg))
        else:
            s.outbox(msg)
        return True

    def _put(self, s: NodeSession, msg: pb.CoordinatorMessage) -> None:
        if self.sessions.get(s.name) is s and s.status is NodeStatus.READY and s.outbox is not None:
            s.outbox(msg)
