"""A simulator for pipeline schedules (pure): executes every stage's action list at once.

Semantics are the interpreter's (``parallel.pipeline``): compute actions run one at a time;
a maximal run of send/recv actions is posted as one batch and the stage blocks until every
message of the batch has met its counterpart (a send waits for the matching receive: no
buffering is assumed, the strict model under which NCCL can hang). Messages on a directed
link match in posting order; the k-th send must carry what the k-th receive expects.
Time: a forward of one chunk costs ``t_fwd``, a backward ``t_bwd``, communication nothing;
a batch completes at the latest posting time of its messages. The result's makespan gives
the bubble, ``peak_live`` the activation memory (forwards whose backward has not run).
"""

from __future__ import annotations

from dataclasses import dataclass

from rankctl.parallel.schedules import Action, Kind, PipelineShape, batches

Link = tuple[int, int, bool]  # (source stage, destination stage, posted by the sender)
Posted = dict[Link, list[tuple[tuple[str, int, int], float]]]  # message id, posting time


class Deadlock(RuntimeError):
    """The stages' action lists cannot all complete under blocking batched p2p."""


def _message(shape: PipelineShape, stage: int, a: Action) -> tuple[str, int, int]:
    """What a send/recv carries, named by the producing virtual stage: (direction, mb, v)."""
    v = shape.virtual(stage, a.chunk)
    if a.kind is Kind.SEND_FWD:
        return "fwd", a.microbatch, v
    if a.kind is Kind.RECV_FWD:
        return "fwd", a.microbatch, v - 1
    if a.kind is Kind.SEND_BWD:
        return "bwd", a.microbatch, v
    return "bwd", a.microbatch, v + 1


@dataclass(frozen=True, kw_only=True)
class SimResult:
    makespan: float
    finish: tuple[float, ...]  # per stage
    peak_live: tuple[int, ...]  # per stage: max forwards without their backward yet


def simulate(shape: PipelineShape, stages: list[list[Action]], *, t_fwd: float = 1.0,
             t_bwd: float = 2.0) -> SimResult:
    """Run every stage's list with blocking batched p2p and unit-cost compute per chunk.

    Raises ``Deadlock`` when no stage can progress, ``ValueError`` when a message arrives
    out of order (the k-th send on a link is not what the k-th receive expects) or when a
    backward precedes its forward or a stage's input has not arrived.
    """
    plan = [batches(acts) for acts in stages]
    pos, clock = [0] * shape.pp, [0.0] * shape.pp
    posted: Posted = {}
    mine: list[list[tuple[Link, int]] | None] = [None] * shape.pp
    live, peak = [0] * shape.pp, [0] * shape.pp
    while any(pos[s] < len(plan[s]) for s in range(shape.pp)):
        progressed = False
        for s in range(shape.pp):
            while pos[s] < len(plan[s]):
                batch = plan[s][pos[s]]
                if not batch[0].kind.is_comm:
                    clock[s] += t_fwd if batch[0].kind is Kind.FORWARD else t_bwd
                    live[s] += 1 if batch[0].kind is Kind.FORWARD else -1
                    peak[s] = max(peak[s], live[s])
                    pos[s] += 1
                    progressed = True
                    continue
                if mine[s] is None:
                    mine[s] = [_post(shape, s, a, clock[s], posted) for a in batch]
                    progressed = True
                done = _completion(mine[s], posted)
                if done is None:
                    break
                clock[s], mine[s], pos[s] = max(done, clock[s]), None, pos[s] + 1
        if not progressed:
            stuck = {s: [str(a) for a in plan[s][pos[s]]] for s in range(shape.pp) if pos[s] < len(plan[s])}
            raise Deadlock(f"no stage can progress; waiting batches: {stuck}")
    for s, acts in enumerate(stages):
        _check_order(s, acts)
    return SimResult(makespan=max(clock), finish=tuple(clock), peak_live=tuple(peak))


def _post(shape: PipelineShape, s: int, a: Action, t: float,
          posted: Posted) -> tuple[Link, int]:
    assert a.peer is not None, f"{a} has no peer"
    link = (s, a.peer, True) if a.kind.is_send else (a.peer, s, False)
    mine = posted.setdefault(link, [])
    mine.append((_message(shape, s, a), t))
    theirs = posted.get((link[0], link[1], not link[2]), [])
    k = len(mine) - 1
    if k < len(theirs) and theirs[k][0] != mine[k][0]:
        raise ValueError(f"stage {s}: message {k} on link {link[:2]} is {mine[k][0]} here, "
                         f"{theirs[k][0]} on the other side")
    return link, k


def _completion(ops: list[tuple[Link, int]], posted: Posted) -> float | None:
    """When every op of a posted batch has met its counterpart, the latest posting time."""
    t = 0.0
    for link, k in ops:
        theirs = posted.get((link[0], link[1], not link[2]), [])
        if k >= len(theirs):
            return None
        t = max(t, theirs[k][1], posted[link][k][1])
    return t


def _check_order(stage: int, actions: list[Action]) -> None:
    """Forward before backward per (micro-batch, chunk); receives before their compute."""
    present = {(a.kind, a.microbatch, a.chunk) for a in actions}
    needs = {Kind.BACKWARD: (Kind.FORWARD, Kind.RECV_BWD), Kind.FORWARD: (Kind.RECV_FWD,),
             Kind.SEND_FWD: (Kind.FORWARD,), Kind.SEND_BWD: (Kind.BACKWARD,)}
    seen: set[tuple[Kind, int, int]] = set()
    for a in actions:
        for need in needs.get(a.kind, ()):
            key = (need, a.microbatch, a.chunk)
            if key not in seen and (need in (Kind.FORWARD, Kind.BACKWARD) or key in present):
                raise ValueError(f"stage {stage}: {a} comes before its {need.name}")
        seen.add((a.kind, a.microbatch, a.chunk))
