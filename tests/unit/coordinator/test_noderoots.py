"""``coordinator.scheduling.noderoots``: a submit's train.checkpoint_dir against the roots registered nodes reported (pure)."""

from __future__ import annotations

from types import SimpleNamespace

from rankctl.coordinator.scheduling.noderoots import roots_problems
from rankctl.kinds.spec import build_spec


def train(checkpoint_dir: str | None):
    return build_spec({"name": "j", "kind": "train", "train": {"data": "builtin:pydoc",
                                                                "checkpoint_dir": checkpoint_dir}})


def problems(spec, nodes) -> list[str]:
    """With one worker pool, "workers-1", of the general queue; other pools are allocations' own."""
    return roots_problems(spec, nodes, lambda pool: pool == "workers-1")


def node(*roots: str, pool: str = "") -> SimpleNamespace:
    return SimpleNamespace(data_roots=tuple(roots), pool=pool)


def test_a_checkpoint_dir_under_no_nodes_root_is_named_with_the_rule() -> None:
    nodes = [node("/state/a", "/data"), node("/state/b", "/scratch")]
    (problem,) = problems(train("/elsewhere/ck"), nodes)
    assert problem.startswith("train.checkpoint_dir='/elsewhere/ck' lies under no registered node's --data-root")
    assert "2 nodes" in problem and "/data" in problem and "ctl worker --data-root" in problem
    assert problems(train("/data2/ck"), nodes)   # a prefix of a root is not under it
    assert problems(train("/data/../etc"), nodes)   # '..' is taken as written, not resolved


def test_under_any_one_nodes_root_is_accepted() -> None:
    nodes = [node("/state/a", "/data"), node("/state/b", "/scratch")]
    assert problems(train("/scratch/ck"), nodes) == []
    assert problems(train("/data"), nodes) == []
    assert problems(train(None), nodes) == []   # the node's own state dir


def test_it_is_left_to_the_node_when_no_node_of_the_general_queue_reported_roots() -> None:
    assert problems(train("/elsewhere"), []) == []                                 # no node yet
    assert problems(train("/elsewhere"), [node(), node()]) == []                   # none said
    assert problems(train("/elsewhere"), [node("/data"), node()])                  # those that said decide
    assert problems(train("/elsewhere"), [node("/data", pool="alloc-1")]) == []    # only pool nodes
    assert problems(train("/elsewhere"), [node("/data"), node("/elsewhere", pool="p")])  # allocations' don't count
    assert problems(train("/elsewhere"), [node("/data"), node("/elsewhere", pool="workers-1")]) == []  # a worker pool
