"""Fan-outs: one decision's messages to many nodes (a restart's Cancels, a placement's Assigns), and how long
the coordinator took to hand the last of them to gRPC.

``Outgoing.fan_out`` registers the messages it queued (``begin``); each node stream's writer calls
``handed`` once gRPC took a message (it asks for the next one); when the last of a fan-out is handed, its
time from the decision and the wall-clock moment go into ``last`` by kind, for the metrics
(``rankctl_coordinator_fanout_seconds``) and ``bench/scale.py --fault``, which thereby tells the
coordinator's part of a restart from the time its (simulated) daemons take to read. A message to a stream
that closes before gRPC takes it never completes its fan-out; at most ``KEPT`` fan-outs wait, the oldest
dropped first. O(1) per message.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from rankctl.proto import rankctl_pb2 as pb

KEPT = 64   # fan-outs waiting for their last message at most


@dataclass
class Fanout:
    kind: str
    started: float                   # the coordinator's monotonic clock at the decision
    left: int = 0                    # messages not yet handed to gRPC
    total: int = 0                   # messages queued (one per node)
    messages: list[pb.CoordinatorMessage] = field(default_factory=list)   # held: their ids stay theirs


@dataclass(frozen=True)
class FanoutDone:
    seconds: float    # from the decision to the last message handed to gRPC
    ended_at: float   # unix time of that moment
    nodes: int


class Fanouts:
    def __init__(self, monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self._monotonic, self._wall = monotonic, wall
        self._by_msg: dict[int, Fanout] = {}
        self._open: OrderedDict[int, Fanout] = OrderedDict()
        self.last: dict[str, FanoutDone] = {}

    def begin(self, kind: str) -> Fanout:
        fan = Fanout(kind, self._monotonic())
        self._open[id(fan)] = fan
        while len(self._open) > KEPT:
            _, old = self._open.popitem(last=False)
            self._forget(old)
        return fan

    def sent(self, fan: Fanout, msg: pb.CoordinatorMessage) -> None:
        """``msg`` went into a node's outbox as part of ``fan`` (the same message may go to many nodes)."""
        if id(fan) not in self._open:
            return
        if id(msg) not in self._by_msg:
            self._by_msg[id(msg)] = fan
            fan.messages.append(msg)
        fan.left += 1
        fan.total += 1

    def handed(self, msg: pb.CoordinatorMessage) -> None:
        """A node stream's writer handed ``msg`` to gRPC."""
        fan = self._by_msg.get(id(msg))
        if fan is None:
            return
        fan.left -= 1
        if fan.left <= 0:
            self.last[fan.kind] = FanoutDone(self._monotonic() - fan.started, self._wall(), fan.total)
            self._open.pop(id(fan), None)
            self._forget(fan)

    def _forget(self, fan: Fanout) -> None:
        for msg in fan.messages:
            self._by_msg.pop(id(msg), None)
