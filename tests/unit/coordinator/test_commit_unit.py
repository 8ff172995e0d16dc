"""Unit tests of coordinator.jobs.commit: StoreGuard's resync after a refused write, Outgoing's held messages."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from rankctl.coordinator.fleet.nodes import NodeSession, NodeStatus, NodeTable
from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.jobs.commit import Outgoing, StoreGuard
from rankctl.coordinator.jobs.signals import Signals
from rankctl.coordinator.model.records import JobRecord, NodeRecord
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.scheduling.fanout import Fanouts
from rankctl.coordinator.store.database import Store, StoreError
from rankctl.kinds.spec import build_spec
from rankctl.proto import rankctl_pb2 as pb


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "state")
    yield s
    s.close()


def _job(job_id: str = "a-000001", state: JobState = JobState.RUNNING, attempt: int = 1) -> JobRecord:
    spec = build_spec({"name": "a", "kind": "comm-check", "resources": {"nodes": 1, "slots_per_node": 2}})
    return JobRecord(id=job_id, name="a", kind="comm-check", spec=spec, state=state, reason="r", world_size=2,
                     slots_per_node=2, created_at=1.0, attempt=attempt, nodes=["n0"])


def _book(store: Store) -> JobBook:
    return JobBook(store, lambda: 10.0, Signals())


def _table(*names: str, status: NodeStatus = NodeStatus.READY) -> tuple[NodeTable, dict[str, list]]:
    boxes: dict[str, list] = {n: [] for n in names}
    sessions = {n: NodeSession(NodeRecord(n, f"{n}:7000", 2), status, outbox=boxes[n].append) for n in names}
    return NodeTable(sessions), boxes


def _msg(job_id: str = "a-000001", attempt: int = 1) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(assign=pb.Assign(job_id=job_id, attempt=attempt))


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- StoreGuard ----------------------------------------------------------------------------------------------


def test_a_block_that_completes_leaves_memory_as_the_block_left_it(store: Store) -> None:
    nodes, _ = _table("n0")
    guard = StoreGuard(store, _book(store), nodes)
    with guard.consistent():
        nodes.sessions["n0"].record.last_seq = 5
        nodes.draining["n0"] = "mine"
    assert nodes.sessions["n0"].record.last_seq == 5 and nodes.draining == {"n0": "mine"}


def test_a_refused_write_brings_report_numbers_drains_and_exclusions_back_to_the_store(store: Store) -> None:
    store.put_node(NodeRecord("n0", "n0:7000", 2, {}, "s", 17, 1.0))
    store.set_drain("n0", "maintenance", 1.0)
    store.add_exclusion("a-000001", "n0", "failed twice", 1.0)
    nodes, _ = _table("n0", "n1")
    guard = StoreGuard(store, _book(store), nodes)
    with pytest.raises(StoreError, match="disk full"):
        with guard.consistent():
            nodes.sessions["n0"].record.last_seq = 99
            nodes.sessions["n1"].record.last_seq = 4
            nodes.draining = {"n1": "not stored"}
            nodes.excluded = {"b-000002": {"n1": "not stored"}}
            raise StoreError("disk full", full=True)
    assert nodes.sessions["n0"].record.last_seq == 17
    assert nodes.sessions["n1"].record.last_seq == 0
    assert nodes.draining == {"n0": "maintenance"}
    assert nodes.excluded == {"a-000001": {"n0": "failed twice"}}


def test_a_refused_write_puts_jobs_back_in_place_and_forgets_jobs_never_stored(store: Store) -> None:
    book = _book(store)
    stored = _job()
    book.add(stored)
    guard = StoreGuard(store, book, NodeTable())
    with pytest.raises(StoreError):
        with guard.consistent():
            stored.state, stored.reason = JobState.FAILED, "memory only"
            book.jobs["b-000002"] = _job("b-000002")
            raise StoreError("refused")
    assert book.jobs["a-000001"] is stored
    assert (stored.state, stored.reason) == (JobState.RUNNING, "r")
    assert "b-000002" not in book.jobs


def test_a_refusal_inside_an_open_transaction_is_left_to_the_outermost_block(store: Store) -> None:
    store.put_node(NodeRecord("n0", "n0:7000", 2, {}, "s", 3, 1.0))
    nodes, _ = _table("n0")
    guard = StoreGuard(store, _book(store), nodes)
    seen_inside: list[int] = []
    with pytest.raises(StoreError):
        with guard.consistent():
            with store.transaction():
                try:
                    with guard.consistent():
                        nodes.sessions["n0"].record.last_seq = 50
                        raise StoreError("refused")
                finally:
                    seen_inside.append(nodes.sessions["n0"].record.last_seq)
    assert seen_inside == [50]
    assert nodes.sessions["n0"].record.last_seq == 3


def test_other_errors_pass_through_without_a_resync(store: Store) -> None:
    store.put_node(NodeRecord("n0", "n0:7000", 2, {}, "s", 3, 1.0))
    nodes, _ = _table("n0")
    guard = StoreGuard(store, _book(store), nodes)
    with pytest.raises(ValueError, match="not the store"):
        with guard.consistent():
            nodes.sessions["n0"].record.last_seq = 50
            raise ValueError("not the store")
    assert nodes.sessions["n0"].record.last_seq == 50


def test_the_callers_store_error_is_raised_even_when_the_resync_itself_fails(store: Store) -> None:
    nodes, _ = _table("n0")
    guard = StoreGuard(store, _book(store), nodes)
    refusal = StoreError("the refusal")
    with pytest.raises(StoreError) as err:
        with guard.consistent():
            store.close()
            raise refusal
    assert err.value is refusal


# -- Outgoing ------------------------------------------------------------------------------------------------


def test_a_message_outside_a_block_goes_to_the_node_at_once(store: Store) -> None:
    nodes, boxes = _table("n0")
    out = Outgoing(nodes, Fanouts(), _book(store))
    msg = _msg()
    out.send("n0", msg)
    assert boxes["n0"] == [msg]


def test_messages_inside_a_block_wait_until_it_completes_then_go_in_order(store: Store) -> None:
    nodes, boxes = _table("n0", "n1")
    out = Outgoing(nodes, Fanouts(), _book(store))
    first, second, third = _msg(attempt=1), _msg(attempt=2), _msg(attempt=3)
    with out.after_commit():
        out.send("n0", first)
        out.send("n1", second)
        out.send("n0", third)
        assert boxes == {"n0": [], "n1": []}
    assert boxes == {"n0": [first, third], "n1": [second]}


def test_messages_of_a_block_that_raises_are_never_sent_and_later_ones_go_at_once(store: Store) -> None:
    nodes, boxes = _table("n0")
    out = Outgoing(nodes, Fanouts(), _book(store))
    with pytest.raises(KeyboardInterrupt):
        with out.after_commit():
            out.send("n0", _msg(attempt=1))
            raise KeyboardInterrupt
    assert boxes["n0"] == []
    later = _msg(attempt=2)
    out.send("n0", later)
    assert boxes["n0"] == [later]


def test_a_nested_block_holds_its_messages_until_the_outermost_completes(store: Store) -> None:
    nodes, boxes = _table("n0")
    out = Outgoing(nodes, Fanouts(), _book(store))
    msg = _msg()
    with out.after_commit():
        with out.after_commit():
            out.send("n0", msg)
        assert boxes["n0"] == []
    assert boxes["n0"] == [msg]


def test_to_nodes_sends_once_to_each_node_named_and_times_the_fan_out(store: Store) -> None:
    nodes, boxes = _table("n0", "n1")
    clock = _Clock()
    fanouts = Fanouts(monotonic=clock, wall=lambda: 5000.0)
    out = Outgoing(nodes, fanouts, _book(store))
    msg = _msg()
    out.to_nodes(["n1", "n0", "n1"], msg, kind="cancel")
    assert boxes == {"n0": [msg], "n1": [msg]}
    clock.now = 102.5
    fanouts.handed(msg)
    assert "cancel" not in fanouts.last
    fanouts.handed(msg)
    done = fanouts.last["cancel"]
    assert (done.seconds, done.ended_at, done.nodes) == (2.5, 5000.0, 2)


def test_to_nodes_without_a_kind_times_nothing(store: Store) -> None:
    nodes, boxes = _table("n0")
    fanouts = Fanouts()
    out = Outgoing(nodes, fanouts, _book(store))
    msg = _msg()
    out.to_nodes(["n0"], msg)
    fanouts.handed(msg)
    assert boxes["n0"] == [msg] and fanouts.last == {}


def test_a_message_to_a_node_not_connected_is_dropped_and_not_counted_in_its_fan_out(store: Store) -> None:
    nodes, boxes = _table("n0", "n1")
    nodes.sessions["n1"].status = NodeStatus.LOST
    fanouts = Fanouts(monotonic=_Clock(), wall=lambda: 1.0)
    out = Outgoing(nodes, fanouts, _book(store))
    msg = _msg()
    out.to_nodes(["n0", "n1"], msg, kind="cancel")
    assert boxes == {"n0": [msg], "n1": []}
    fanouts.handed(msg)
    assert fanouts.last["cancel"].nodes == 1


def test_fan_out_sends_each_node_its_own_message(store: Store) -> None:
    nodes, boxes = _table("n0", "n1")
    fanouts = Fanouts(monotonic=_Clock(), wall=lambda: 1.0)
    out = Outgoing(nodes, fanouts, _book(store))
    m0, m1 = _msg(attempt=1), _msg(attempt=2)
    out.fan_out("assign", [("n0", m0), ("n1", m1)])
    assert boxes == {"n0": [m0], "n1": [m1]}
    fanouts.handed(m0)
    fanouts.handed(m1)
    assert fanouts.last["assign"].nodes == 2


def _relaying_table(*names: str) -> tuple[NodeTable, dict[str, list]]:
    nodes, boxes = _table(*names)
    for k, s in enumerate(nodes.sessions.values()):
        s.relays, s.peer_port = True, 8000 + k
    return nodes, boxes


def test_a_wide_assign_fan_out_goes_through_one_relay_head_once_the_block_commits(store: Store) -> None:
    nodes, boxes = _relaying_table("n0", "n1", "n2")
    out = Outgoing(nodes, Fanouts(), _book(store))
    out.relays.width = 2
    with out.after_commit():
        out.fan_out("assign", [(n, _msg(attempt=k + 1)) for k, n in enumerate(["n0", "n1", "n2"])])
    assert boxes["n1"] == [] and boxes["n2"] == []
    [wrapper] = boxes["n0"]
    assert wrapper.WhichOneof("body") == "relay"
    assert [item.node for item in wrapper.relay.items] == ["n0", "n1", "n2"]
    assert out.relays.bundles == 1


def test_a_relay_planned_in_a_block_that_raises_is_dropped_unsent(store: Store) -> None:
    nodes, boxes = _relaying_table("n0", "n1", "n2")
    out = Outgoing(nodes, Fanouts(), _book(store))
    out.relays.width = 2
    with pytest.raises(RuntimeError):
        with out.after_commit():
            out.fan_out("assign", [(n, _msg()) for n in ["n0", "n1", "n2"]])
            raise RuntimeError("rolled back")
    assert boxes == {"n0": [], "n1": [], "n2": []}
    assert out.relays.bundles == 0 and out.relays._planned == {}


def test_an_assign_is_current_only_for_the_attempt_under_way_of_a_job_not_ended(store: Store) -> None:
    book = _book(store)
    book.add(_job("a-000001", JobState.RUNNING, attempt=2))
    book.add(_job("b-000002", JobState.FAILED, attempt=1))
    out = Outgoing(NodeTable(), Fanouts(), book)
    assert out.relays.current(_msg("a-000001", 2)) is True
    assert out.relays.current(_msg("a-000001", 1)) is False
    assert out.relays.current(_msg("b-000002", 1)) is False
    assert out.relays.current(_msg("c-000003", 1)) is False
