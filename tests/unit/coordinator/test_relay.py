"""Relay trees, pure: the coordinator's grouping and fall-backs (``coordinator.scheduling.relay``) and what a node takes
(``worker.uplink.relay``). No processes; the end-to-end path runs in tests/e2e/test_e2e_restart.py (``--relay-width 1``)."""

from __future__ import annotations

import asyncio

import pytest

from rankctl.contract.relaymac import DOWN, UP, relay_mac
from rankctl.coordinator.fleet.nodes import NodeSession, NodeStatus, NodeTable
from rankctl.coordinator.model.records import NodeRecord
from rankctl.coordinator.scheduling.relay import WAIT_S, Relays
from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.uplink.relay import RelayInbox, RelayRefused, Uplink, forward


def assign(job: str = "j-000001", attempt: int = 2, first: int = 0) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(assign=pb.Assign(job_id=job, attempt=attempt, first_rank=first, rank_count=2))


class World:
    def __init__(self, n: int, relays: bool = True, peers: bool = True, width: int = 2) -> None:
        self.now = 100.0
        self.nodes = NodeTable()
        self.sent: list[tuple[str, pb.CoordinatorMessage]] = []
        for k in range(n):
            name = f"n{k}"
            s = NodeSession(NodeRecord(name, "127.0.0.1", 2), NodeStatus.READY, outbox=lambda m: None,
                            peer_port=9000 + k if peers else 0, relays=relays)
            self.nodes.sessions[name] = s
        self.live = True
        self.relays = Relays(self.nodes, lambda name, msg: self.sent.append((name, msg)),
                             current=lambda msg: self.live, clock=lambda: self.now, width=width)
        self.messages = [(f"n{k}", assign(first=2 * k)) for k in range(n)]

    def plan(self) -> list[tuple[str, pb.CoordinatorMessage]]:
        out = self.relays.plan("assign", self.messages)
        for _, msg in out:
            self.relays.handed(msg, True)
        return out


def test_a_big_fan_out_goes_to_one_head_a_group_each_item_signed_with_its_nodes_key() -> None:
    w = World(7, width=2)
    out = w.plan()
    assert [name for name, _ in out] == ["n0", "n3", "n6"]
    relays = [msg.relay for _, msg in out if msg.WhichOneof("body") == "relay"]
    assert [[i.node for i in r.items] for r in relays] == [["n0", "n1", "n2"], ["n3", "n4", "n5"]]
    assert out[-1][1].WhichOneof("body") == "assign"   # a group of one: direct
    item = relays[0].items[1]
    s = w.nodes.sessions["n1"]
    assert item.peer == "127.0.0.1:9001" and item.seq == s.relay_seq == 1
    assert item.report_via == "127.0.0.1:9000" and relays[0].items[0].report_via == ""   # the head reports itself
    assert item.mac == relay_mac(s.relay_key, DOWN, "n1", 1, item.message, b"127.0.0.1:9000")
    assert pb.CoordinatorMessage.FromString(item.message) == w.messages[1][1]
    assert w.relays.plan("assign", w.messages[:2]) == w.messages[:2]   # no more nodes than the width: direct
    assert w.relays.plan("cancel", w.messages) == w.messages            # only Assigns are relayed


def test_groups_without_a_relaying_daemon_or_peers_go_direct() -> None:
    assert World(6, relays=False).relays.plan("assign", World(6).messages) == World(6).messages
    w = World(6, peers=False)   # no PeerService to hand them to: only the heads would be left
    assert w.relays.plan("assign", w.messages) == w.messages


def test_what_a_head_names_failed_loses_or_leaves_unanswered_goes_direct_if_still_current() -> None:
    w = World(6, width=2)
    out = w.plan()
    b1, b2 = (msg.relay.bundle for _, msg in out)
    w.relays.done("n3", pb.RelayDone(bundle=b1, failed=["n1"]))   # not this head's bundle: ignored
    assert w.sent == []
    w.relays.done("n0", pb.RelayDone(bundle=b1, failed=["n1", "n9"]))
    assert w.sent == [("n1", w.messages[1][1])] and w.relays.relayed == 2 and w.relays.direct == 1
    w.relays.done("n0", pb.RelayDone(bundle=b1, failed=["n2"]))   # answered already
    assert len(w.sent) == 1
    w.relays.head_lost("n3")
    assert [n for n, _ in w.sent[1:]] == ["n3", "n4", "n5"]
    w.relays.done("n3", pb.RelayDone(bundle=b2))   # too late: sent direct already
    assert w.relays.relayed == 2


def test_a_silent_head_times_out_and_an_ended_attempt_is_not_sent() -> None:
    w = World(3, width=2)
    w.plan()
    w.now += WAIT_S - 0.1
    w.relays.due()
    assert w.sent == []
    w.now += 0.2
    w.live = False   # the attempt ended meanwhile: nothing to send
    w.relays.due()
    assert w.sent == [] and w.relays.direct == 0
    w2 = World(3, width=2)
    w2.plan()
    w2.now += WAIT_S
    w2.relays.due()
    assert [n for n, _ in w2.sent] == ["n0", "n1", "n2"]


def test_a_relay_the_head_could_not_be_handed_or_that_never_committed() -> None:
    w = World(3, width=2)
    out = w.relays.plan("assign", w.messages)
    w.relays.handed(out[0][1], False)   # the head is not connected
    assert [n for n, _ in w.sent] == ["n0", "n1", "n2"]
    out = w.relays.plan("assign", w.messages)
    w.relays.dropped(out[0][1])
    w.relays.handed(out[0][1], True)    # not a planned relay any more: nothing waits for an answer
    w.now += WAIT_S
    w.relays.due()
    assert len(w.sent) == 3


def item_for(key: bytes, node: str, seq: int, msg: pb.CoordinatorMessage, via: str = "") -> pb.Relayed:
    data = msg.SerializeToString()
    return pb.Relayed(node=node, peer="127.0.0.1:1", seq=seq, message=data, report_via=via,
                      mac=relay_mac(key, DOWN, node, seq, data, via.encode()))


def up_batch(key: bytes, node: str, seq: int, rank: int = 0) -> pb.NodeBatch:
    data = pb.ReportBatch(reports=[pb.RankReport(job_id="j-000001", attempt=2, seq=seq,
                                                 status=pb.RankStatus(rank=rank, phase="running"))]).SerializeToString()
    return pb.NodeBatch(node=node, seq=seq, batch=data, mac=relay_mac(key, UP, node, seq, data))


def test_a_head_carries_only_batches_its_nodes_signed_and_a_lost_head_makes_them_resend() -> None:
    w = World(4, width=3)
    n1, n2 = w.nodes.sessions["n1"], w.nodes.sessions["n2"]
    got = w.relays.up("n0", up_batch(n1.relay_key, "n1", 1))
    assert got is not None and got[0] is n1 and got[1].reports[0].status.rank == 0
    assert w.relays.up("n0", up_batch(n1.relay_key, "n1", 1)) is None        # replayed
    assert w.relays.up("n0", up_batch(n2.relay_key, "n1", 2)) is None        # another node's key: forged
    forged = up_batch(n1.relay_key, "n1", 3)
    forged.batch = up_batch(n1.relay_key, "n1", 3, rank=1).batch             # altered on the way
    assert w.relays.up("n0", forged) is None
    down = item_for(n1.relay_key, "n1", 4, assign())   # a down item passed off as a batch
    assert w.relays.up("n0", pb.NodeBatch(node="n1", seq=4, batch=down.message, mac=down.mac)) is None
    assert w.relays.up("n0", up_batch(n2.relay_key, "n2", 1)) is not None
    w.relays.reported_direct("n2")   # n2 now reports on its own stream
    n1.record.last_seq = 7
    w.relays.head_lost("n0")
    assert [(n, m.ack.last_seq, m.ack.resend) for n, m in w.sent] == [("n1", 7, True)]
    w.relays.head_lost("n0")
    assert len(w.sent) == 1


def test_a_node_takes_only_its_own_signed_fresh_assigns() -> None:
    got: list[pb.Assign] = []

    async def dispatch(a: pb.Assign) -> None:
        got.append(a)

    async def run() -> None:
        inbox, uplink = RelayInbox(), Uplink("n1", None, None)
        inbox.bind("n1", dispatch, None, uplink)
        key = b"k" * 32
        uplink.keyed(key)
        with pytest.raises(RelayRefused, match="handed to node 'n1'"):
            inbox.check(item_for(key, "n2", 1, assign()))
        with pytest.raises(RelayRefused, match="not signed"):
            inbox.check(item_for(b"x" * 32, "n1", 1, assign()))
        forged = item_for(key, "n1", 1, assign())
        forged.message = assign(attempt=9).SerializeToString()   # the head altered it
        with pytest.raises(RelayRefused, match="not signed"):
            inbox.check(forged)
        with pytest.raises(RelayRefused, match="not an Assign"):
            inbox.check(item_for(key, "n1", 1, pb.CoordinatorMessage(cancel=pb.Cancel(job_id="j"))))
        via = item_for(key, "n1", 2, assign(), via="127.0.0.1:9000")
        via.report_via = "127.0.0.1:6666"   # a head sending the node's batches elsewhere
        with pytest.raises(RelayRefused, match="not signed"):
            inbox.check(via)
        inbox.deliver(item_for(key, "n1", 2, assign(), via="127.0.0.1:9000"))
        assert uplink.via == "127.0.0.1:9000"   # its reports go through that head from now on
        with pytest.raises(RelayRefused, match="replay"):
            inbox.check(item_for(key, "n1", 2, assign()))
        uplink.keyed(b"n" * 32)   # a new session: the old key's items are refused
        with pytest.raises(RelayRefused, match="not signed"):
            inbox.check(item_for(key, "n1", 3, assign()))
        await asyncio.sleep(0)
        await inbox.close()

    asyncio.run(run())
    assert got == [assign().assign]


def test_a_copy_of_an_assign_is_taken_once() -> None:
    inbox = RelayInbox()
    a2 = assign(attempt=2).assign
    assert inbox.fresh(a2) and not inbox.fresh(a2)
    assert inbox.fresh(assign(attempt=2, first=4).assign)   # not a copy: judged on its own


def test_a_head_names_the_nodes_it_could_not_reach() -> None:
    async def run() -> pb.RelayDone:
        taken: list[pb.Assign] = []

        async def dispatch(a: pb.Assign) -> None:
            taken.append(a)

        inbox, uplink = RelayInbox(), Uplink("n0", None, None)
        inbox.bind("n0", dispatch, None, uplink)
        uplink.keyed(b"k" * 32)
        relay = pb.Relay(bundle=7)
        relay.items.append(item_for(b"k" * 32, "n0", 1, assign()))
        closed = item_for(b"z" * 32, "n1", 1, assign(first=2))
        closed.peer = "127.0.0.1:1"   # a closed loopback port
        relay.items.append(closed)
        done = await forward(relay, inbox, None)
        await asyncio.sleep(0)
        assert [a.first_rank for a in taken] == [0]
        await inbox.close()
        return done

    done = asyncio.run(run())
    assert done.bundle == 7 and list(done.failed) == ["n1"] and "UNAVAILABLE" in done.error
