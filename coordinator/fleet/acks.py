"""Acks, paced: what each node learns is stored, at most once per ``ACK_EVERY_S`` a node and at a bounded rate for
the fleet.

An Ack trims the daemon's report buffer (which is coalesced anyway), so it is never urgent. The group commit
(``coordinator.jobs.intake``) hands ``due`` each stored node's newest stored report number; a node not acked for
``ACK_EVERY_S`` joins a FIFO, and ``send`` hands Acks from it to the node streams at ``rate`` a second (a token
bucket of ``ACK_BURST``): enough for every node of the fleet twice per ``ACK_EVERY_S``. Before this, a restart at
65,536 ranks, whose reports come from every node at once, sent 8,192 Acks among its Assigns and first steps, one
more message a node on the coordinator's loop and the daemons' in the seconds the job waits; now at most
``ACK_BURST`` + ``rate`` a second of them. An Ack carries the newest number stored when it is sent. O(1) a node.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from rankctl.coordinator.fleet.nodes import NodeSession, NodeTable
from rankctl.proto import rankctl_pb2 as pb

ACK_EVERY_S = 30.0     # at most one Ack per node this often
ACK_RATE_MIN = 200.0   # Acks a second to the fleet at least (more for a fleet larger than ACK_EVERY_S * this / 2)
ACK_BURST = 256        # Acks sent at once after a quiet spell


class AckPacer:
    def __init__(self, nodes: NodeTable, clock: Callable[[], float]) -> None:
        self._nodes, self._clock = nodes, clock
        self._due: deque[NodeSession] = deque()
        self._tokens, self._at = float(ACK_BURST), clock()

    def __len__(self) -> int:
        return len(self._due)

    def rate(self) -> float:
        """Acks a second: every node of the fleet twice per ``ACK_EVERY_S``, at least ``ACK_RATE_MIN``."""
        return max(ACK_RATE_MIN, 2 * len(self._nodes.sessions) / ACK_EVERY_S)

    def due(self, stored: Iterable[tuple[NodeSession, int]]) -> None:
        """Nodes whose reports up to the number given are stored (a committed transaction holds them)."""
        now = self._clock()
        for session, seq in stored:
            session.ack_seq = seq
            if not session.ack_queued and now - session.acked_at >= ACK_EVERY_S:
                session.ack_queued = True
                self._due.append(session)
        self.send()

    def send(self) -> int:
        """Hand the Acks the rate allows now to their node streams, oldest due first; how many."""
        due = self._due
        if not due:
            return 0
        now = self._clock()
        self._tokens = min(float(ACK_BURST), self._tokens + max(0.0, now - self._at) * self.rate())
        self._at = now
        sent = 0
        while due and self._tokens >= 1:
            session = due.popleft()
            session.ack_queued = False
            if not self._nodes.is_current(session):
                continue   # a newer stream: its Registered told it what is stored
            session.acked_at = now
            self._tokens -= 1
            sent += 1
            self._nodes.send(session.name, pb.CoordinatorMessage(ack=pb.Ack(last_seq=session.ack_seq)))
        return sent
