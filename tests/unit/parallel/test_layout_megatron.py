"""Conformance: every kind's groups equal megatron-core's, and Megatron's rejections are ours.

megatron-core (dev extra) is the oracle; ``megatron_ref`` replays the checks and the two
RankGenerators of ``initialize_model_parallel`` without a process group.
"""

from __future__ import annotations

import itertools
import random

import pytest

from rankctl.parallel.layout import GROUP_NAMES, LayoutError, ParallelConfig, RankLayout

megatron = pytest.importorskip("megatron.core")
from megatron_ref import megatron_groups  # noqa: E402

WORLD_SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 18, 24, 30, 32, 36, 48, 64, 72, 96, 128, 160, 192, 256]
SIZES = [1, 2, 3, 4, 8]
ORDERS = [
    "tp-cp-ep-dp-pp",
    "tp-cp-ep-pp-dp",
    "tp-pp-dp",
    "tp-dp-pp",
    "tp-ep-dp-pp",
    "cp-tp-ep-dp-pp",
    "tp-cp-pp-ep-dp",
    "ep-tp-cp-dp-pp",
    "dp-tp-cp-ep-pp",
    "pp-tp-cp-ep-dp",
]


def _grid(seed: int = 20261129, n: int = 1500) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for world in WORLD_SIZES:
        combos = list(itertools.product(SIZES, SIZES, [1, 2, 3], SIZES, [None, 1, 2, 4], [None, 2], ORDERS))
        fits = [c for c in combos if world % (c[0] * c[1] * c[2]) == 0 and world % ((c[4] or c[0]) * c[3] * c[1]) == 0]
        per_world = n // len(WORLD_SIZES)
        picked = rng.sample(fits, min(len(fits), 2 * per_world // 3))
        picked += rng.sample(combos, per_world - len(picked))
        for tp, pp, cp, ep, etp, vpp, order in picked:
            out.append(dict(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vpp=vpp, order=order))
    # the headline configurations, always
    out += [
        dict(world_size=16, tp=2, pp=4),
        dict(world_size=256, tp=8, cp=2, pp=4, ep=4, etp=2),
        dict(world_size=256, tp=4, pp=4, ep=8, etp=1, vpp=2, order="tp-cp-ep-dp-pp"),
        dict(world_size=192, tp=2, pp=3, cp=2, ep=4, etp=2, order="tp-cp-ep-pp-dp"),
        dict(world_size=96, tp=4, pp=2, ep=3, etp=1, order="tp-cp-ep-dp-pp"),
    ]
    return out


def _ours(kw: dict) -> dict[str, list[list[int]]] | None:
    try:
        lay = RankLayout(ParallelConfig(**kw))
    except LayoutError as exc:
        assert str(exc), "a LayoutError carries a message"
        return None
    return {k: lay.groups(k) for k in GROUP_NAMES}


def _theirs(kw: dict) -> dict[str, list[list[int]]] | None:
    try:
        return megatron_groups(**kw)
    except (RuntimeError, AssertionError, KeyError, ZeroDivisionError):
        return None


def test_grid_matches_megatron() -> None:
    grid = _grid()
    accepted = rejected = 0
    for kw in grid:
        ours, theirs = _ours(kw), _theirs(kw)
        if theirs is None:
            assert ours is None, f"megatron rejects {kw} but rankctl accepts it"
            rejected += 1
            continue
        assert ours is not None, f"megatron accepts {kw} but rankctl rejects it"
        for kind in GROUP_NAMES:
            assert ours[kind] == sorted(sorted(g) for g in theirs[kind]), (kind, kw)
        accepted += 1
    # the grid must exercise both sides substantially
    assert accepted > 300 and rejected > 300, (accepted, rejected)


def test_megatron_group_order_is_ours_unsorted() -> None:
    # not only the same sets: the same member order and group order as Megatron emits
    kw = dict(world_size=192, tp=2, pp=3, cp=2, ep=4, etp=2, order="tp-cp-ep-dp-pp")
    theirs = megatron_groups(**kw)
    lay = RankLayout(ParallelConfig(**kw))
    for kind in GROUP_NAMES:
        assert lay.groups(kind) == theirs[kind], kind
