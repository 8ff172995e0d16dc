"""Unit tests of parallel.placement: node-major rank arithmetic, group summaries, layout documents and ``place``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rankctl.contract.limits import PLAN_MAX_RANKS_LISTED
from rankctl.parallel.layout import ParallelConfig, RankLayout
from rankctl.parallel.placement import (
    INTRA_NODE_GROUPS, NodeSlots, PlacementError, group_summary, layout_document, local_rank, node_of_rank, place,
    ranks_of_node,
)


def _layout(**kw: int) -> RankLayout:
    return RankLayout(ParallelConfig(**kw))


def test_node_of_rank_and_local_rank_split_a_rank_node_major() -> None:
    assert [node_of_rank(r, 4) for r in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert [local_rank(r, 4) for r in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_node_of_rank_works_element_wise_on_numpy_arrays() -> None:
    out = node_of_rank(np.array([[0, 3], [4, 11]]), 4)
    assert out.tolist() == [[0, 0], [1, 2]]


def test_ranks_of_node_are_the_consecutive_slots_of_that_node() -> None:
    assert list(ranks_of_node(0, 4)) == [0, 1, 2, 3]
    assert list(ranks_of_node(2, 3)) == [6, 7, 8]
    assert all(node_of_rank(r, 3) == 2 for r in ranks_of_node(2, 3))


def test_intra_node_groups_are_tp_cp_and_ep() -> None:
    assert set(INTRA_NODE_GROUPS) == {"tp", "cp", "ep"}


def test_group_summary_counts_groups_sizes_and_groups_that_cross_nodes() -> None:
    summary = group_summary(_layout(world_size=8, tp=2, pp=2), slots_per_node=4)
    assert summary["tp"] == {"groups": 4, "size": 2, "cross_node": 0}
    assert summary["pp"] == {"groups": 4, "size": 2, "cross_node": 4}
    assert summary["dp"] == {"groups": 4, "size": 2, "cross_node": 0}


def test_group_summary_on_one_node_has_no_cross_node_group() -> None:
    summary = group_summary(_layout(world_size=8, tp=2, pp=2), slots_per_node=8)
    assert all(entry["cross_node"] == 0 for entry in summary.values())
    assert set(summary) == set(RankLayout.names)


def test_a_tp_that_does_not_divide_the_slots_puts_tp_groups_across_nodes() -> None:
    summary = group_summary(_layout(world_size=12, tp=4), slots_per_node=6)
    assert summary["tp"] == {"groups": 3, "size": 4, "cross_node": 1}


def test_layout_document_of_a_small_world_lists_every_group_and_each_ranks_node() -> None:
    lay = _layout(world_size=8, tp=2, pp=2)
    doc = layout_document(lay, 4)
    assert doc["gpus_per_node"] == 4
    assert doc["config"] == lay.config.to_dict()
    assert doc["kinds"] == group_summary(lay, 4)
    assert doc["groups"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert doc["node_of_rank"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert "omitted" not in doc and "note" not in doc
    json.dumps(doc)


def test_layout_document_above_the_listing_limit_omits_per_rank_lists_and_says_how_to_get_them() -> None:
    world = PLAN_MAX_RANKS_LISTED * 2
    doc = layout_document(_layout(world_size=world), 8)
    assert doc["omitted"] == ["groups", "node_of_rank"]
    assert "groups" not in doc and "node_of_rank" not in doc
    assert f"world_size={world} is above {PLAN_MAX_RANKS_LISTED} ranks" in doc["note"]
    assert "--all-ranks" in doc["note"]
    assert doc["kinds"]["dp"] == {"groups": 1, "size": world, "cross_node": 1}


def test_layout_document_lists_every_rank_of_a_big_world_when_asked() -> None:
    world = PLAN_MAX_RANKS_LISTED + 4
    doc = layout_document(_layout(world_size=world), 4, all_ranks=True)
    assert len(doc["node_of_rank"]) == world and doc["node_of_rank"][-1] == (world - 1) // 4
    assert "omitted" not in doc


def test_layout_document_at_exactly_the_limit_still_lists_the_ranks() -> None:
    doc = layout_document(_layout(world_size=PLAN_MAX_RANKS_LISTED), 8)
    assert len(doc["node_of_rank"]) == PLAN_MAX_RANKS_LISTED


def test_place_takes_the_first_fitting_nodes_in_the_given_order() -> None:
    nodes = [NodeSlots("b", 8), NodeSlots("a", 2), NodeSlots("c", 4), NodeSlots("d", 4)]
    assert place(2, 4, nodes) == ["b", "c"]
    assert place(1, 8, nodes) == ["b"]


def test_place_of_zero_nodes_is_empty() -> None:
    assert place(0, 4, []) == []


def test_place_names_each_nodes_free_slots_in_its_shortfall() -> None:
    with pytest.raises(PlacementError) as err:
        place(2, 4, [NodeSlots("a", 4), NodeSlots("b", 3)])
    assert str(err.value) == "needs 2 node(s) with 4 free slots each, 1 available (a: 4 free, b: 3 free)"


def test_place_with_no_nodes_says_none_are_connected() -> None:
    with pytest.raises(PlacementError, match=r"0 available \(no nodes connected\)$"):
        place(1, 1, [])


def test_placement_error_is_a_runtime_error() -> None:
    assert issubclass(PlacementError, RuntimeError)
