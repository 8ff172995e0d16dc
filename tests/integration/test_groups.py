"""ProcessGroups: creation order, dedupe and access (no processes), then real gloo groups."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rankctl.parallel.groups import ProcessGroups, SingletonGroupError, creation_order, group_name
from rankctl.parallel.layout import ParallelConfig, RankLayout
from ranks import fork_ranks


def layout(world: int, **sizes: int) -> RankLayout:
    return RankLayout(ParallelConfig(world_size=world, **sizes))


def test_creation_order_is_sorted_distinct_and_skips_singletons() -> None:
    groups = layout(8, tp=2, pp=2).rank_groups(5)
    order = creation_order(5, groups)
    assert order == sorted(set(order))
    assert all(len(m) > 1 and 5 in m for m in order)
    assert (4, 5) in order and (1, 5) in order and (5, 7) in order  # tp, pp, dp


def test_every_member_creates_a_group_after_the_same_smaller_groups() -> None:
    """The lock-ordering property: for any group G, its members agree on G's position
    relative to every other group they share, so no two members wait on each other."""
    lay = layout(16, tp=2, pp=2, cp=2)
    orders = {r: creation_order(r, lay.rank_groups(r)) for r in range(16)}
    for r, order in orders.items():
        for s in range(16):
            shared = [g for g in order if s in g]
            assert shared == [g for g in orders[s] if r in g]


def test_non_member_and_repeated_rank_are_rejected() -> None:
    with pytest.raises(ValueError, match="rank 3 is not a member of its tp group"):
        creation_order(3, {"tp": [0, 1]})
    with pytest.raises(ValueError, match="repeats a rank"):
        creation_order(1, {"tp": [1, 1]})


class FakeNewGroup:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, ranks: list[int], **kwargs: object) -> object:
        assert kwargs["use_local_synchronization"] is True
        self.calls.append(ranks)
        return ("pg", tuple(ranks))


def test_dedupes_kinds_and_reuses_world() -> None:
    fake = FakeNewGroup()
    groups = layout(8, tp=2, pp=2).rank_groups(0)
    pgs = ProcessGroups.build(0, 8, groups, new_group=fake)
    assert fake.calls == [list(m) for m in creation_order(0, groups)]
    assert len(fake.calls) == len({tuple(m) for m in groups.values() if len(m) > 1})
    assert pgs["tp"] is pgs["tp_cp"] is pgs["expt_tp"]
    assert pgs.ranks("dp") == [0, 2] and pgs.size("mp") == 4 and pgs.local_rank("pp") == 0
    assert pgs.get("world") is dist.group.WORLD
    assert (tuple(range(8)), ["world"]) in pgs.distinct()
    assert list(range(8)) not in fake.calls  # the world is the default group, not a new one


def test_singleton_group_has_no_communicator() -> None:
    pgs = ProcessGroups.build(1, 4, layout(4, tp=2).rank_groups(1), new_group=FakeNewGroup())
    assert pgs.size("cp") == 1 and pgs.get("cp") is None
    with pytest.raises(SingletonGroupError, match="cp group of rank 1 has one member"):
        pgs["cp"]
    with pytest.raises(KeyError, match="no 'bogus' group"):
        pgs.ranks("bogus")


def test_group_name_depends_on_members_only() -> None:
    assert group_name([0, 2]) == group_name([0, 2]) != group_name([0, 1])


# -- real gloo groups, ranks forked from this process -------------------------------------------

def _rank_main(rank: int, world: int, store_path: str, cfg: ParallelConfig) -> None:
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    groups = RankLayout(cfg).rank_groups(rank)
    pgs = ProcessGroups.build(rank, world, groups, timeout=timedelta(seconds=30))
    for members, kinds in pgs.distinct():
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=pgs[kinds[0]])
        assert t.item() == sum(m + 1 for m in members), (kinds, members, t.item())
        assert dist.get_process_group_ranks(pgs[kinds[0]]) == list(members)
    pgs.destroy()
    dist.destroy_process_group()


def test_overlapping_groups_with_gloo(tmp_path) -> None:
    """tp2·pp2·dp2: each rank builds only its own groups; every group reduces correctly."""
    cfg = ParallelConfig(world_size=8, tp=2, pp=2)
    assert fork_ranks(8, _rank_main, str(tmp_path / "store"), cfg) == [0] * 8
