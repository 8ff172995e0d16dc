"""Pipeline schedules as data, checked without processes: every stage's action list is
executed by the simulator with blocking batched p2p (the interpreter's batching rule)."""

from __future__ import annotations

from collections import Counter

import pytest

from rankctl.parallel.schedule_sim import Deadlock, simulate
from rankctl.parallel.schedules import (
    Action,
    Kind,
    PipelineShape,
    batches,
    compute_order,
    last_backward,
    schedule,
    stage_actions,
)

SCHEDULES = ("gpipe", "1f1b")
GRID = [(pp, vpp) for pp in range(1, 9) for vpp in range(1, 5) if vpp == 1 or pp > 1]


def shapes(pp: int, vpp: int) -> list[PipelineShape]:
    return [PipelineShape(pp=pp, vpp=vpp, microbatches=m) for m in range(1, 17) if vpp == 1 or m % pp == 0]


def computes(actions: list[Action]) -> list[Action]:
    return [a for a in actions if not a.kind.is_comm]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("pp", "vpp"), GRID)
def test_every_schedule_completes_without_deadlock(name: str, pp: int, vpp: int) -> None:
    for shape in shapes(pp, vpp):
        stages = schedule(name, shape)
        simulate(shape, stages)  # raises on deadlock or an out-of-order message
        for s, actions in enumerate(stages):
            work = computes(actions)
            want = {(i, c) for i in range(shape.microbatches) for c in range(vpp)}
            for kind in (Kind.FORWARD, Kind.BACKWARD):
                got = Counter((a.microbatch, a.chunk) for a in work if a.kind is kind)
                assert set(got) == want and set(got.values()) == {1}, (shape, s, kind)
            done = set()
            for a in work:  # each forward precedes its backward on this stage and chunk
                if a.kind is Kind.BACKWARD:
                    assert (a.microbatch, a.chunk) in done, (shape, s, a)
                done.add((a.microbatch, a.chunk))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("pp", "vpp"), GRID)
def test_sends_match_receives_on_the_neighbour_in_order(name: str, pp: int, vpp: int) -> None:
    for shape in shapes(pp, vpp):
        stages = schedule(name, shape)
        links: dict[tuple[int, int, bool], list[tuple[str, int, int]]] = {}
        for s, actions in enumerate(stages):
            for a in actions:
                if not a.kind.is_comm:
                    continue
                v = shape.virtual(s, a.chunk)
                fwd = a.kind in (Kind.SEND_FWD, Kind.RECV_FWD)
                producer = v if a.kind.is_send else (v - 1 if fwd else v + 1)
                link = (s, a.peer, True) if a.kind.is_send else (a.peer, s, False)
                assert shape.locate(producer)[0] == (s if a.kind.is_send else a.peer)
                links.setdefault(link, []).append(("fwd" if fwd else "bwd", a.microbatch, producer))
        for (src, dst, is_send), sent in links.items():
            if is_send:
                assert sent == links[(src, dst, False)], (shape, src, dst)
        assert all((src, dst, True) in links for src, dst, _ in links)


@pytest.mark.parametrize("pp", range(1, 9))
def test_1f1b_phases_and_memory(pp: int) -> None:
    for shape in shapes(pp, 1):
        m = shape.microbatches
        for s in range(pp):
            work = computes(stage_actions("1f1b", shape, s))
            w = min(pp - s - 1, m)
            assert all(a.kind is Kind.FORWARD for a in work[:w])  # warm-up
            steady = work[w: w + 2 * (m - w)]
            assert [a.kind for a in steady] == [Kind.FORWARD, Kind.BACKWARD] * (m - w)
            assert all(a.kind is Kind.BACKWARD for a in work[w + 2 * (m - w):])  # cool-down
        live = simulate(shape, schedule("1f1b", shape)).peak_live
        assert live[0] == min(pp, m) and max(live) <= pp
        assert simulate(shape, schedule("gpipe", shape)).peak_live[0] == m


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_interleaving_shrinks_the_bubble(pp: int, m: int) -> None:
    """Same model, same pp and m; a chunk costs 1/vpp of a stage (backward = 2x forward)."""
    spans = {}
    for vpp in (1, 2, 4):
        shape = PipelineShape(pp=pp, vpp=vpp, microbatches=m)
        spans[vpp] = simulate(shape, schedule("1f1b", shape), t_fwd=1 / vpp, t_bwd=2 / vpp).makespan
        assert spans[vpp] == pytest.approx(3 * m + 3 * (pp - 1) / vpp)  # (m + (p-1)/v) (f + b)
    assert spans[4] < spans[2] < spans[1]


def test_interleaved_needs_a_multiple_of_pp() -> None:
    with pytest.raises(ValueError, match="multiple of pp=4"):
        PipelineShape(pp=4, vpp=2, microbatches=6)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        stage_actions("zb", PipelineShape(pp=2, microbatches=2), 0)  # type: ignore[arg-type]


def test_interleaved_order_walks_groups_of_pp() -> None:
    shape = PipelineShape(pp=2, vpp=2, microbatches=4)
    fwd = [(a.microbatch, a.chunk) for a in compute_order(shape, 0, "gpipe") if a.kind is Kind.FORWARD]
    assert fwd == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    bwd = [(a.microbatch, a.chunk) for a in compute_order(shape, 0, "gpipe") if a.kind is Kind.BACKWARD]
    assert bwd == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    actions = stage_actions("1f1b", shape, 0)
    assert set(last_backward(actions)) == {0, 1}
    assert actions[last_backward(actions)[0]] == Action(Kind.BACKWARD, 3, 0)


def test_steady_interleaved_exchanges_both_directions_in_one_batch() -> None:
    shape = PipelineShape(pp=4, vpp=2, microbatches=8)
    kinds = {frozenset(a.kind for a in b) for b in batches(stage_actions("1f1b", shape, 1)) if b[0].kind.is_comm}
    assert frozenset({Kind.SEND_FWD, Kind.SEND_BWD, Kind.RECV_FWD, Kind.RECV_BWD}) in kinds


def test_simulator_catches_deadlock_and_disorder() -> None:
    shape = PipelineShape(pp=2, microbatches=1)
    f0, f1 = Action(Kind.FORWARD, 0, 0), Action(Kind.FORWARD, 0, 0)
    # both stages receive first: nobody ever sends
    waits = [[Action(Kind.RECV_BWD, 0, 0, 1), f0, Action(Kind.SEND_FWD, 0, 0, 1)],
             [Action(Kind.RECV_FWD, 0, 0, 0), f1, Action(Kind.SEND_BWD, 0, 0, 0)]]
    with pytest.raises(Deadlock):
        simulate(shape, waits)
    two = PipelineShape(pp=2, microbatches=2)
    good = schedule("gpipe", two)
    swapped = list(good[1])
    i, j = swapped.index(Action(Kind.RECV_FWD, 0, 0, 0)), swapped.index(Action(Kind.RECV_FWD, 1, 0, 0))
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ValueError):
        simulate(two, [good[0], swapped])
