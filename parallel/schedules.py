"""Pipeline schedules as data: each stage's ordered list of actions.

Pure (no torch). A schedule is a list per pipeline stage of ``Action(kind, microbatch,
chunk, peer)``; ``rankctl.parallel.pipeline`` interprets one stage's list with p2p.

Model chunks. With ``pp`` stages and ``vpp`` chunks per stage there are ``V = pp*vpp``
virtual stages; local chunk ``c`` of stage ``s`` is virtual stage ``v = c*pp + s`` and holds
model chunk ``v`` (``models.stages``). Micro-batch ``i`` flows ``v = 0 .. V-1`` forward and
back again backward, so virtual stage ``V-1`` (last chunk of the last stage) holds the loss.

Communication. A FORWARD not on virtual stage 0 needs a ``RECV_FWD`` (its input activation)
and one not on ``V-1`` a ``SEND_FWD`` of its output; a BACKWARD not on ``V-1`` needs a
``RECV_BWD`` (the gradient of its output) and one not on virtual stage 0 a ``SEND_BWD`` of
its input's gradient. Compute is grouped in steps (one action, or an interleaved steady
(forward, backward) pair); a step's receives come right before it and its sends right after,
so the sends of one step and the receives of the next form one batch (Megatron's
``send_forward_recv_backward`` and friends). ``peer`` is the pp stage on the other side.

Batching rule (the interpreter's, and the simulator's): a maximal run of consecutive
communication actions is posted as one ``batch_isend_irecv`` and waited on as a whole.
Messages between two ranks match in posting order per direction (as NCCL and gloo with one
tag do), so both sides must list them in the same order. ``parallel.schedule_sim.simulate``
checks that, and that blocking execution of all stages completes (no deadlock).

Schedules (compute order per stage, then communication inserted as above):

* ``gpipe``: every forward, then every backward (all ``m * vpp`` activations live at once);
* ``1f1b`` with vpp = 1, in three phases: warm-up of ``pp - s - 1`` forwards, steady state of
  (forward, backward) pairs, cool-down of the remaining backwards (at most ``pp - s``
  micro-batches live on stage ``s``);
* ``1f1b`` with vpp > 1 (interleaved, Narayanan et al. 2021): forwards walk micro-batches in
  groups of ``pp``, all chunks of a group before the next group, backwards likewise with the
  chunks reversed; warm-up ``2(pp - s - 1) + (vpp - 1)pp`` forwards. Needs ``m % pp == 0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

ScheduleName = Literal["gpipe", "1f1b"]


class Kind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_FWD = "SF"
    RECV_FWD = "RF"
    SEND_BWD = "SB"
    RECV_BWD = "RB"

    @property
    def is_comm(self) -> bool:
        return self not in (Kind.FORWARD, Kind.BACKWARD)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_FWD, Kind.SEND_BWD)


@dataclass(frozen=True)
class Action:
    """One step of a stage: compute or move micro-batch ``microbatch`` of local ``chunk``.

    ``peer``: for send/recv, the pp stage index (not the global rank) on the other side.
    """

    kind: Kind
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __str__(self) -> str:
        to = "" if self.peer is None else f"@{self.peer}"
        return f"{self.kind.value}{self.microbatch}.{self.chunk}{to}"


@dataclass(frozen=True, kw_only=True)
class PipelineShape:
    """``pp`` stages of ``vpp`` chunks each, ``microbatches`` per step."""

    pp: int
    vpp: int = 1
    microbatches: int

    def __post_init__(self) -> None:
        for name in ("pp", "vpp", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.vpp > 1 and self.microbatches % self.pp:
            raise ValueError(f"the interleaved schedule (vpp={self.vpp}) needs micro-batches "
                             f"({self.microbatches}) to be a multiple of pp={self.pp}")

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.vpp

    def virtual(self, stage: int, chunk: int) -> int:
        return chunk * self.pp + stage

    def locate(self, virtual: int) -> tuple[int, int]:
        """(stage, local chunk) of a virtual stage."""
        return virtual % self.pp, virtual // self.pp


# -- compute order ----------------------------------------------------------------------------

def chunk_order(shape: PipelineShape, backward: bool) -> list[tuple[int, int]]:
    """(micro-batch, local chunk) in the order a stage runs them: groups of ``pp``
    micro-batches, every chunk of a group before the next group (chunks reversed backward)."""
    group = shape.pp if shape.vpp > 1 else shape.microbatches
    order = []
    for start in range(0, shape.microbatches, group):
        for c in range(shape.vpp):
            chunk = shape.vpp - 1 - c if backward else c
            order += [(i, chunk) for i in range(start, min(start + group, shape.microbatches))]
    return order


def warmup(shape: PipelineShape, stage: int, name: ScheduleName) -> int:
    """Forwards before the first backward on ``stage``."""
    total = shape.microbatches * shape.vpp
    if name == "gpipe":
        return total
    if shape.vpp == 1:
        return min(shape.pp - stage - 1, total)
    return min(2 * (shape.pp - stage - 1) + (shape.vpp - 1) * shape.pp, total)


def compute_steps(shape: PipelineShape, stage: int, name: ScheduleName) -> list[tuple[Action, ...]]:
    """FORWARD/BACKWARD actions of ``stage`` in three phases: warm-up forwards, steady
    (forward, backward) pairs, cool-down backwards. A step's receives are posted before it and
    its sends after it, so the interleaved steady state exchanges both directions at once."""
    fwd = [Action(Kind.FORWARD, i, c) for i, c in chunk_order(shape, backward=False)]
    bwd = [Action(Kind.BACKWARD, i, c) for i, c in chunk_order(shape, backward=True)]
    w = warmup(shape, stage, name)
    warm = [(f,) for f in fwd[:w]]
    if shape.vpp == 1:  # plain 1F1B: a forward and a backward are separate steps
        steady = [(x,) for f, b in zip(fwd[w:], bwd, strict=False) for x in (f, b)]
    else:
        steady = list(zip(fwd[w:], bwd, strict=False))
    return warm + steady + [(b,) for b in bwd[len(fwd) - w:]]  # the pairs took len(fwd) - w


def compute_order(shape: PipelineShape, stage: int, name: ScheduleName) -> list[Action]:
    return [a for step in compute_steps(shape, stage, name) for a in step]


# -- communication ----------------------------------------------------------------------------

def _recv(shape: PipelineShape, stage: int, a: Action) -> Action | None:
    v, prev, nxt = shape.virtual(stage, a.chunk), (stage - 1) % shape.pp, (stage + 1) % shape.pp
    if a.kind is Kind.FORWARD:
        return Action(Kind.RECV_FWD, a.microbatch, a.chunk, prev) if v > 0 else None
    return Action(Kind.RECV_BWD, a.microbatch, a.chunk, nxt) if v < shape.virtual_stages - 1 else None


def _send(shape: PipelineShape, stage: int, a: Action) -> Action | None:
    v, prev, nxt = shape.virtual(stage, a.chunk), (stage - 1) % shape.pp, (stage + 1) % shape.pp
    if a.kind is Kind.FORWARD:
        return Action(Kind.SEND_FWD, a.microbatch, a.chunk, nxt) if v < shape.virtual_stages - 1 else None
    return Action(Kind.SEND_BWD, a.microbatch, a.chunk, prev) if v > 0 else None


def with_communication(shape: PipelineShape, stage: int, steps: list[tuple[Action, ...]]) -> list[Action]:
    """Each step's receives before it, its sends after it (adjacent ones then batch)."""
    out: list[Action] = []
    for step in steps:
        out += [r for r in (_recv(shape, stage, a) for a in step) if r is not None]
        out += step
        out += [t for t in (_send(shape, stage, a) for a in step) if t is not None]
    return out


def stage_actions(name: ScheduleName, shape: PipelineShape, stage: int) -> list[Action]:
    """The ordered action list of pipeline stage ``stage``."""
    if name not in ("gpipe", "1f1b"):
        raise ValueError(f"unknown pipeline schedule {name!r}; schedules are gpipe, 1f1b")
    if not 0 <= stage < shape.pp:
        raise ValueError(f"stage={stage} is outside 0..{shape.pp - 1}")
    return with_communication(shape, stage, compute_steps(shape, stage, name))


def schedule(name: ScheduleName, shape: PipelineShape) -> list[list[Action]]:
    """Every stage's action list."""
    return [stage_actions(name, shape, s) for s in range(shape.pp)]


def last_backward(actions: list[Action]) -> dict[int, int]:
    """Index into ``actions`` of each chunk's final BACKWARD (when its gradients are complete)."""
    return {a.chunk: i for i, a in enumerate(actions) if a.kind is Kind.BACKWARD}


def batches(actions: list[Action]) -> list[list[Action]]:
    """The interpreter's batching: a compute action alone, or a maximal run of comm actions."""
    out: list[list[Action]] = []
    for a in actions:
        if a.kind.is_comm and out and out[-1][0].kind.is_comm:
            out[-1].append(a)
        else:
            out.append([a])
    return out
