"""Unit tests of coordinator.scheduling.capacity: free slots, fitting nodes, shortfalls, passing and re-placement."""

from __future__ import annotations

import pytest

from rankctl.coordinator.fleet.nodes import NodeSession, NodeStatus
from rankctl.coordinator.model.records import JobRecord, NodeRecord
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.scheduling.capacity import (
    fitting_nodes, free_slots, jobs_by_node, may_pass, place_keeping, shortfall,
)
from rankctl.kinds.spec import build_spec
from rankctl.parallel.placement import NodeSlots, PlacementError


def _session(name: str, slots: int, status: NodeStatus = NodeStatus.READY) -> NodeSession:
    return NodeSession(NodeRecord(name, "10.0.0.1:7000", slots), status)


def _job(job_id: str, nodes: list[str], slots_per_node: int = 2, nodes_needed: int | None = None) -> JobRecord:
    needed = nodes_needed if nodes_needed is not None else max(1, len(nodes))
    spec = build_spec({"name": "j", "kind": "comm-check",
                       "resources": {"nodes": needed, "slots_per_node": slots_per_node}})
    return JobRecord(id=job_id, name="j", kind="comm-check", spec=spec, state=JobState.RUNNING, reason="",
                     world_size=needed * slots_per_node, slots_per_node=slots_per_node, created_at=0.0,
                     nodes=list(nodes))


def test_free_slots_subtracts_each_jobs_slots_per_node_on_each_of_its_nodes() -> None:
    ready = [_session("a", 8), _session("b", 4)]
    active = [_job("j1", ["a", "b"], slots_per_node=2), _job("j2", ["a"], slots_per_node=3)]
    assert free_slots(ready, active) == {"a": 3, "b": 2}


def test_free_slots_ignores_nodes_that_are_not_in_the_ready_list() -> None:
    assert free_slots([_session("a", 4)], [_job("j1", ["gone", "a"], slots_per_node=1)]) == {"a": 3}


def test_free_slots_of_no_ready_nodes_is_empty() -> None:
    assert free_slots([], [_job("j1", ["a"])]) == {}


def test_free_slots_can_go_below_zero_when_jobs_overcommit_a_node() -> None:
    assert free_slots([_session("a", 2)], [_job("j1", ["a"], 2), _job("j2", ["a"], 2)]) == {"a": -2}


def test_jobs_by_node_lists_job_ids_per_node_in_the_order_given() -> None:
    jobs = [_job("j1", ["a", "b"]), _job("j2", ["b", "c"]), _job("j3", [])]
    assert jobs_by_node(jobs) == {"a": ["j1"], "b": ["j1", "j2"], "c": ["j2"]}


def test_jobs_by_node_of_no_jobs_is_empty() -> None:
    assert jobs_by_node([]) == {}


def test_fitting_nodes_counts_every_state_but_lost_with_enough_slots() -> None:
    sessions = [_session("a", 4), _session("b", 4, NodeStatus.DISCONNECTED), _session("c", 8, NodeStatus.LOST),
                _session("d", 2)]
    assert fitting_nodes(sessions, 4) == 2
    assert fitting_nodes(sessions, 2) == 3
    assert fitting_nodes(sessions, 5) == 0


def test_shortfall_is_none_when_enough_nodes_fit() -> None:
    assert shortfall([_session("a", 4), _session("b", 4)], 2, 4) is None


def test_shortfall_names_the_need_the_fitting_count_the_known_count_and_the_biggest_node() -> None:
    sessions = [_session("a", 4), _session("b", 2, NodeStatus.DISCONNECTED), _session("c", 16, NodeStatus.LOST)]
    assert shortfall(sessions, 2, 4) == (
        "resources: the job needs 2 node(s) with 4 slots each; the cluster has 1 such node(s) "
        "(2 known, at most 4 slots per node)")


def test_shortfall_on_an_empty_cluster_says_zero_slots() -> None:
    assert shortfall([], 1, 1) == ("resources: the job needs 1 node(s) with 1 slots each; the cluster has 0 such "
                                   "node(s) (0 known, at most 0 slots per node)")


def test_may_pass_once_the_head_waited_its_time_even_when_it_fits() -> None:
    head = _job("h", [], slots_per_node=4, nodes_needed=1)
    sessions = [_session("a", 4)]
    assert may_pass(head, sessions, waited=10.0, head_wait=10.0) is True
    assert may_pass(head, sessions, waited=9.99, head_wait=10.0) is False


def test_may_pass_at_once_when_the_head_can_never_fit() -> None:
    head = _job("h", [], slots_per_node=8, nodes_needed=2)
    assert may_pass(head, [_session("a", 8)], waited=0.0, head_wait=600.0) is True


def test_place_keeping_without_previous_nodes_places_in_the_given_order() -> None:
    nodes = [NodeSlots("c", 4), NodeSlots("a", 1), NodeSlots("b", 4)]
    assert place_keeping([], 2, 4, nodes) == ["c", "b"]


def test_place_keeping_keeps_each_previous_node_that_still_fits_at_its_index() -> None:
    nodes = [NodeSlots("a", 4), NodeSlots("b", 4), NodeSlots("c", 4), NodeSlots("d", 4)]
    assert place_keeping(["d", "b"], 2, 4, nodes) == ["d", "b"]


def test_place_keeping_replaces_only_the_nodes_that_no_longer_fit_with_spares_in_order() -> None:
    nodes = [NodeSlots("a", 4), NodeSlots("b", 1), NodeSlots("c", 4), NodeSlots("d", 4)]
    assert place_keeping(["c", "b", "x"], 3, 4, nodes) == ["c", "a", "d"]


def test_place_keeping_for_a_smaller_attempt_keeps_the_first_previous_nodes() -> None:
    nodes = [NodeSlots("a", 4), NodeSlots("b", 4), NodeSlots("c", 4)]
    assert place_keeping(["c", "b", "a"], 2, 4, nodes) == ["c", "b"]


def test_place_keeping_for_a_bigger_attempt_adds_spares_after_the_kept_nodes() -> None:
    nodes = [NodeSlots("a", 4), NodeSlots("b", 4), NodeSlots("c", 4)]
    assert place_keeping(["c"], 3, 4, nodes) == ["c", "a", "b"]


def test_place_keeping_raises_the_placement_shortfall_when_spares_run_out() -> None:
    nodes = [NodeSlots("a", 4), NodeSlots("b", 2)]
    with pytest.raises(PlacementError, match=r"needs 2 node\(s\) with 4 free slots each, 1 available"):
        place_keeping(["a", "b"], 2, 4, nodes)
