"""parallel.layout: Megatron's documented example, invariants and validation errors (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankctl.parallel.layout import GROUP_NAMES, LayoutError, ParallelConfig, RankLayout, shared_layout


def layout(**kw) -> RankLayout:
    return RankLayout(ParallelConfig(**kw))


def test_megatron_docstring_example() -> None:
    # initialize_model_parallel's docstring: 16 GPUs, tp=2, pp=4 -> dp=2
    lay = layout(world_size=16, tp=2, pp=4)
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert lay.groups("embd") == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert lay.groups("pos_embd") == [[0], [1], [2], [3]]
    assert lay.groups("mp") == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def test_dense_rank_formula() -> None:
    lay = layout(world_size=48, tp=2, cp=2, pp=3)  # dp = 4
    for rank in range(48):
        c = lay.coords(rank)
        assert rank == c["tp"] + 2 * (c["cp"] + 2 * (c["dp"] + 4 * c["pp"]))


def test_embd_single_stage_is_first_alone() -> None:
    assert layout(world_size=4, tp=2).groups("embd") == [[0], [1], [2], [3]]


def test_expert_grid_is_second_factorisation() -> None:
    lay = layout(world_size=16, tp=2, pp=2, ep=2, etp=1)  # dense dp=4, expert edp=4
    assert lay.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lay.groups("expt_tp") == [[r] for r in range(16)]
    assert lay.groups("expt_dp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert lay.coords(5) == {"tp": 1, "cp": 0, "ep": 1, "dp": 2, "pp": 0, "etp": 0, "edp": 2}


def test_to_dict_shape() -> None:
    d = layout(world_size=8, tp=2, pp=2).to_dict()
    assert d["config"]["dp"] == 2 and d["config"]["world_size"] == 8
    assert set(d["groups"]) == set(GROUP_NAMES)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


configs = st.builds(
    lambda tp, cp, pp, dp, ep_div, etp_div, order_pp_last: dict(
        world_size=tp * cp * pp * dp, tp=tp, cp=cp, pp=pp,
        ep=_divisors(tp * cp * dp)[ep_div % len(_divisors(tp * cp * dp))],
        etp=[1, tp][etp_div % 2],
        order="tp-cp-ep-dp-pp" if order_pp_last else "tp-cp-ep-pp-dp",
    ),
    st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 3]),
    st.sampled_from([1, 2, 3, 4]), st.integers(0, 2), st.integers(0, 1), st.booleans(),
)


def _valid(kw: dict) -> RankLayout | None:
    if (kw["world_size"] % (kw["etp"] * kw["ep"] * kw["pp"])) != 0:
        return None
    try:
        return layout(**kw)
    except LayoutError:
        return None


@settings(max_examples=80, deadline=None)
@given(configs)
def test_each_kind_partitions_the_ranks(kw: dict) -> None:
    lay = _valid(kw)
    if lay is None:
        return
    world = kw["world_size"]
    for kind in GROUP_NAMES:
        arr = lay.group_array(kind)
        flat = np.sort(arr.ravel())
        if kind in ("embd", "pos_embd"):
            assert len(np.unique(flat)) == flat.size  # disjoint subset
        else:
            assert flat.tolist() == list(range(world)), kind
        assert all(row == sorted(row) for row in arr.tolist())
        assert [row[0] for row in arr.tolist()] == sorted(row[0] for row in arr.tolist())


@settings(max_examples=60, deadline=None)
@given(configs, st.integers(0, 10_000))
def test_rank_groups_agree_with_groups(kw: dict, pick: int) -> None:
    lay = _valid(kw)
    if lay is None:
        return
    rank = pick % kw["world_size"]
    mine = lay.rank_groups(rank)
    for kind in GROUP_NAMES:
        containing = [g for g in lay.groups(kind) if rank in g]
        if containing:
            assert mine[kind] == containing[0], kind
        else:
            assert kind not in mine


@settings(max_examples=60, deadline=None)
@given(configs)
def test_coordinates_round_trip(kw: dict) -> None:
    lay = _valid(kw)
    if lay is None:
        return
    seen = set()
    for rank in range(kw["world_size"]):
        c = lay.coords(rank)
        dense = (c["tp"], c["cp"], c["dp"], c["pp"])
        assert dense not in seen
        seen.add(dense)
        # the rank is the unique member shared by its groups of each single dimension
        g = lay.rank_groups(rank)
        assert g["tp"][c["tp"]] == rank and g["pp"][c["pp"]] == rank and g["dp"][c["dp"]] == rank
        assert g["ep"][c["ep"]] == rank and g["expt_tp"][c["etp"]] == rank and g["expt_dp"][c["edp"]] == rank


def test_rank_groups_scale_free() -> None:
    lay = layout(world_size=131072, tp=8, cp=2, pp=8, ep=8)
    g = lay.rank_groups(99_999)
    assert len(g["tp"]) == 8 and 99_999 in g["dp_cp"]


# one test per validation rule -------------------------------------------------------------

@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(world_size=12, tp=5), ["world_size=12", "tp*pp*cp=5", "divisible"]),
        (dict(world_size=8, tp=2, pp=2, cp=4), ["world_size=8", "tp*pp*cp=16"]),
        (dict(world_size=8, tp=2, ep=3), ["etp*ep*pp=6", "divisible"]),
        (dict(world_size=8, tp=1, etp=3), ["etp*ep*pp=3"]),
        (dict(world_size=8, tp=2, vpp=2), ["vpp=2", "pp > 1", "pp=1"]),
        (dict(world_size=8, tp=2, order="cp-ep-dp-pp"), ["omits tp", "tp=2"]),
        (dict(world_size=8, tp=2, pp=2, order="tp-cp-ep-dp"), ["omits pp", "pp=2"]),
        (dict(world_size=8, tp=2, ep=2, order="tp-cp-dp-pp"), ["omits ep", "ep=2"]),
        (dict(world_size=8, tp=2, order="tp-cp-xp-dp-pp"), ["unknown token 'xp'"]),
        (dict(world_size=8, tp=2, order="tp-cp-tp-dp-pp"), ["repeats tp"]),
        (dict(world_size=8, tp=0), ["tp=0", "at least 1"]),
        (dict(world_size=0), ["world_size=0", "at least 1"]),
        (dict(world_size=8, ep=-1), ["ep=-1"]),
        (dict(world_size=8, pp=2, vpp=0), ["vpp=0"]),
        (dict(world_size=8, tp="2"), ["tp='2'", "integer"]),
        (dict(world_size=8, tp=2, pp=2, ep=1, etp=1, order="tp-cp-ep-pp-dp"),
         ["does not end in pp", "expert_dp=4", "dp=2"]),
    ],
)
def test_invalid_configs_raise_layout_error(kw: dict, words: list[str]) -> None:
    with pytest.raises(LayoutError) as err:
        ParallelConfig(**kw)
    assert isinstance(err.value, ValueError)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_pp_groups_differ_between_grids_is_rejected() -> None:
    # edp == dp, but pp comes after ep and before cp: dense pp stride 2, expert pp stride 4
    with pytest.raises(LayoutError, match="pp groups differ"):
        ParallelConfig(world_size=16, tp=2, cp=2, pp=2, ep=4, etp=1, order="tp-ep-pp-cp-dp")


def test_config_is_immutable() -> None:
    cfg = ParallelConfig(world_size=8, tp=2)
    with pytest.raises(Exception):
        cfg.tp = 4  # type: ignore[misc]
    assert cfg.dp == 4 and cfg.expert_dp == 4


def test_pipelines_are_the_same_in_both_grids_whenever_pp_is_outermost() -> None:
    """``_check_expert_grid`` skips building the pp groups when the order ends in pp (so that an elastic job's
    check at every world size stays linear): over every small layout, they are indeed equal then."""
    import itertools

    checked = 0
    for world, tp, cp, ep, etp, pp in itertools.product((8, 12, 16, 24), (1, 2), (1, 2), (1, 2, 4), (1, 2), (1, 2, 4)):
        for order in ("tp-cp-ep-dp-pp", "tp-ep-cp-dp-pp", "cp-tp-dp-ep-pp", "tp-dp-cp-ep-pp"):
            try:
                cfg = ParallelConfig(world_size=world, tp=tp, cp=cp, ep=ep, etp=etp, pp=pp, order=order)
            except LayoutError:
                continue
            assert np.array_equal(cfg.dense_grid.groups(("pp",)), cfg.expert_grid.groups(("pp",)))
            checked += 1
    assert checked > 100


def test_an_order_too_long_is_refused_quoting_a_short_prefix() -> None:
    with pytest.raises(LayoutError, match=r"order='x{40}'\.\.\. \(200000 characters\) must be at most 32") as err:
        ParallelConfig(world_size=8, order="x" * 200_000)
    assert len(str(err.value)) < 300


def test_a_process_builds_each_layout_once_and_its_groups_cannot_be_changed_by_a_caller() -> None:
    """Issue 44 item 6: the planner at every attempt, PlanJob, the daemon at every Assign and the rank share one
    ``RankLayout`` per config (``shared_layout``); its cached group arrays are read-only."""
    cfg = ParallelConfig(world_size=16, tp=2, pp=2)
    layout = shared_layout(cfg)
    assert shared_layout(ParallelConfig(world_size=16, tp=2, pp=2)) is layout        # equal configs: one layout
    assert shared_layout(ParallelConfig(world_size=16, tp=4, pp=2)) is not layout
    groups = layout.group_array("tp")
    assert layout.group_array("tp") is groups and layout.rank_groups(3)["tp"] == [2, 3]
    with pytest.raises(ValueError, match="read-only"):
        groups[0, 0] = 99
    assert np.array_equal(groups[0], [0, 1])
