"""Relayed fan-outs (a relay tree, as Slurm's ``TreeWidth``): a big job's Assigns go to one head daemon a group.

An Assign fan-out to more than ``width`` nodes is cut into groups of ``width + 1`` consecutive job nodes: a head
and the ``width`` nodes it forwards to. The first node of a group whose daemon relays (``Register.relays``) gets
one ``Relay`` holding the group's messages (its own among them), each signed with its node's session key
(``contract.relaymac``: a head cannot forge, alter or replay another node's) and numbered; it hands each to its node's PeerService (``worker.uplink.relay``) and answers ``RelayDone``
naming those it could not reach. The coordinator sends a node its message itself when the head names it, when the
head's stream ends before its answer, or when no answer came within ``WAIT_S`` - unless the message is no longer
current (``current``: its attempt ended meanwhile). A node with no PeerService, or not connected, goes direct; a
group with no relaying daemon goes direct. So 8,192 nodes take 127 writes of the coordinator's instead of 8,192.

Up: each relayed item names the head's PeerService (``report_via``, signed with it); the node sends its report
batches there (``PeerService.Forward``), each signed with its key and numbered, and the head carries its group's
batches in one ``RelayedBatches`` message. ``up`` checks each (a node of this coordinator, connected, the MAC
under its key, a number above the last) before its reports go where the node's own batches go. When a head's
stream ends, every node whose batches it carried is told to send again on its own stream what is not stored
(``Ack.resend``) and to report there from then on; a node whose Forward fails does so by itself.

O(1) per message; the bundles waiting for their answer are bounded by ``KEPT`` (the oldest sent direct first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

import structlog

from google.protobuf.message import DecodeError

from rankctl.contract.relaymac import DOWN, UP, relay_mac, relay_mac_ok
from rankctl.coordinator.fleet.nodes import NodeSession, NodeStatus, NodeTable
from rankctl.proto import rankctl_pb2 as pb

log = structlog.get_logger("rankctl.coordinator")

WIDTH = 64       # nodes a head forwards to (its group: it and they); 0: never relay
WAIT_S = 5.0     # a head's RelayDone comes within this, or its nodes are sent theirs direct
KEPT = 4096      # bundles waiting for their RelayDone at most
RELAYED_KINDS = frozenset({"assign"})   # fan-outs that go through heads
Message = tuple[str, pb.CoordinatorMessage]


@dataclass
class Bundle:
    id: int
    head: str
    messages: dict[str, pb.CoordinatorMessage]   # node -> its message, sent direct if the relay fails
    deadline: float = 0.0


class Relays:
    """``send(node, msg)`` puts a message in a node's outbox now; ``current(msg)``: still worth sending direct."""

    def __init__(self, nodes: NodeTable, send: Callable[[str, pb.CoordinatorMessage], None], *,
                 current: Callable[[pb.CoordinatorMessage], bool] = lambda msg: True,
                 clock: Callable[[], float] = time.monotonic, width: int = WIDTH) -> None:
        self._nodes, self._send, self.current, self._clock, self.width = nodes, send, current, clock, width
        self._next = 0
        self._planned: dict[int, Bundle] = {}             # id(Relay message) -> its bundle, until handed out
        self._armed: OrderedDict[int, Bundle] = OrderedDict()   # bundle id -> bundle, oldest first
        self._by_head: dict[str, set[int]] = {}           # head -> its armed bundles' ids
        self._via: dict[str, str] = {}                    # node -> the head that carried its last batch
        self._carried: dict[str, set[str]] = {}           # head -> the nodes in _via under it
        self.carried = 0   # report batches heads carried up
        self.relayed = 0   # messages heads delivered
        self.direct = 0    # messages sent direct because their relay failed
        self.bundles = 0   # Relays sent

    # -- out -----------------------------------------------------------------------------------
    def plan(self, kind: str, messages: Iterable[Message]) -> list[Message]:
        """What to put in the outboxes for one fan-out: the messages as they are, or one Relay a group."""
        items = list(messages)
        if kind not in RELAYED_KINDS or self.width < 1 or len(items) <= self.width:
            return items
        out: list[Message] = []
        size = self.width + 1
        for start in range(0, len(items), size):
            out.extend(self._group(items[start:start + size]))
        return out

    def _group(self, group: list[Message]) -> list[Message]:
        sessions, ready = self._nodes.sessions, NodeStatus.READY
        head = next((n for n, _ in group
                     if (s := sessions.get(n)) is not None and s.relays and s.status is ready), None)
        if head is None:
            return group
        self._next += 1
        relay, kept, direct = pb.Relay(bundle=self._next), {}, []
        via = sessions[head].peer   # where the group's nodes send their report batches ("": their own streams)
        for name, msg in group:
            s = sessions.get(name)
            if s is None or s.status is not ready or (name != head and not s.peer) or name in kept:
                direct.append((name, msg))
                continue
            s.relay_seq += 1
            payload, up = msg.SerializeToString(), via if name != head else ""
            relay.items.add(node=name, peer=s.peer, seq=s.relay_seq, message=payload, report_via=up,
                            mac=relay_mac(s.relay_key, DOWN, name, s.relay_seq, payload, up.encode()))
            kept[name] = msg
        if len(kept) < 2:   # the head alone: a relay saves nothing
            return group
        wrapper = pb.CoordinatorMessage(relay=relay)
        self._planned[id(wrapper)] = Bundle(relay.bundle, head, kept)
        while len(self._planned) > KEPT:   # planned and never handed out (the change did not commit)
            self._planned.pop(next(iter(self._planned)))
        return direct + [(head, wrapper)]

    def handed(self, msg: pb.CoordinatorMessage, ok: bool) -> None:
        """``msg`` went to its node's outbox (``ok``) or could not (the node not connected): a Relay waits for its
        answer from now on, or its messages go direct at once."""
        bundle = self._planned.pop(id(msg), None)
        if bundle is None:
            return
        self.bundles += 1
        if not ok:
            self._fall_back(bundle, "its head is not connected")
            return
        bundle.deadline = self._clock() + WAIT_S
        self._armed[bundle.id] = bundle
        self._by_head.setdefault(bundle.head, set()).add(bundle.id)
        while len(self._armed) > KEPT:
            self._fall_back(self._disarm(next(iter(self._armed))), "too many relays wait for their answer")

    def dropped(self, msg: pb.CoordinatorMessage) -> None:
        """``msg`` will not be sent (the change that decided it did not commit)."""
        self._planned.pop(id(msg), None)

    # -- back ----------------------------------------------------------------------------------
    def done(self, head: str, msg: pb.RelayDone) -> None:
        """A head's answer: the nodes it named failed get theirs direct."""
        bundle = self._armed.get(msg.bundle)
        if bundle is None or bundle.head != head:   # late (sent direct already) or not this head's
            return
        self._disarm(bundle.id)
        failed = [n for n in msg.failed[:len(bundle.messages)] if n in bundle.messages]
        self.relayed += len(bundle.messages) - len(failed)
        if failed:
            log.warning("relay.failed", head=head, nodes=len(failed), first=failed[0][:64], error=msg.error[:200])
            self._fall_back(Bundle(bundle.id, head, {n: bundle.messages[n] for n in failed}), "")

    def head_lost(self, head: str) -> None:
        """The head's stream ended: its bundles' nodes get theirs direct, and the nodes whose batches it carried
        send again on their own streams what is not stored."""
        for bundle_id in sorted(self._by_head.get(head, ())):
            self._fall_back(self._disarm(bundle_id), f"head {head} lost")
        carried = self._carried.pop(head, set())
        for node in sorted(carried):
            self._via.pop(node, None)
            s = self._nodes.sessions.get(node)
            if s is not None:
                self._send(node, pb.CoordinatorMessage(ack=pb.Ack(last_seq=s.record.last_seq, resend=True)))
        if carried:
            log.warning("relay.resend", head=head, nodes=len(carried))

    def up(self, head: str, nb: pb.NodeBatch) -> tuple[NodeSession, pb.ReportBatch] | None:
        """One node's batch a head carried: its session and reports, or None when it does not hold (its node
        unknown or not connected, the MAC not under its key, its number not above the last one, not a batch)."""
        s = self._nodes.sessions.get(nb.node)
        if s is None or s.status is not NodeStatus.READY or nb.seq <= s.relay_up_seq or \
                not relay_mac_ok(s.relay_key, UP, nb.node, nb.seq, nb.mac, nb.batch):
            return None
        try:
            batch = pb.ReportBatch.FromString(nb.batch)
        except DecodeError:
            return None
        s.relay_up_seq = nb.seq
        self.carried += 1
        if self._via.get(nb.node) != head:
            self.reported_direct(nb.node)
            self._via[nb.node] = head
            self._carried.setdefault(head, set()).add(nb.node)
        return s, batch

    def reported_direct(self, node: str) -> None:
        """The node sent a batch on its own stream: no head carries its reports now."""
        head = self._via.pop(node, None)
        if head is not None:
            nodes = self._carried.get(head)
            if nodes is not None:
                nodes.discard(node)
                if not nodes:
                    del self._carried[head]

    def due(self) -> None:
        """Bundles whose head did not answer within ``WAIT_S``: their nodes get theirs direct."""
        now = self._clock()
        while self._armed and (bundle := next(iter(self._armed.values()))).deadline <= now:
            self._fall_back(self._disarm(bundle.id), f"head {bundle.head} did not answer within {WAIT_S:g} s")

    def _disarm(self, bundle_id: int) -> Bundle:
        bundle = self._armed.pop(bundle_id)
        ids = self._by_head.get(bundle.head)
        if ids is not None:
            ids.discard(bundle_id)
            if not ids:
                del self._by_head[bundle.head]
        return bundle

    def _fall_back(self, bundle: Bundle, why: str) -> None:
        sent = 0
        for name, msg in bundle.messages.items():
            if self.current(msg):
                self._send(name, msg)
                sent += 1
        self.direct += sent
        if why:
            log.warning("relay.direct", head=bundle.head, nodes=sent, reason=why)
