"""Tensor (TP) and sequence (SP) parallel mappings and layers; groups are always arguments.

The Megatron paper (Shoeybi et al., 2019, fig. 3) names two conjugate operators:

* ``f`` = :func:`copy_to_tp`: identity forward, all-reduce backward (enters a TP region);
* ``g`` = :func:`reduce_from_tp`: all-reduce forward, identity backward (leaves it).

Sequence parallelism (Korthikanti et al., 2022) replaces them by a second conjugate pair
over the sequence dimension (dim 1 of ``(B, T, C)``):

* :func:`gather_from_sequence`: all-gather forward, reduce-scatter backward (replaces f);
* :func:`reduce_scatter_to_sequence`: reduce-scatter forward, all-gather backward (replaces g).

Layers here allocate only the local shard (uninitialised); each records, in ``tp_shards``,
which of its own parameters are split, along which dim and the full logical shape, so that
``rankctl.models.shard`` can initialise it from the full tensor and gather it back.
Every mapping is the identity for a ``None`` or single-member group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

SEQ_DIM = 1  # activations are (B, T, C)


@dataclass(frozen=True)
class TPContext:
    """This rank's place in its tensor-parallel group, passed to every TP layer."""

    group: "dist.ProcessGroup | None"
    rank: int = 0
    size: int = 1
    sequence_parallel: bool = False

    @classmethod
    def from_group(cls, group: "dist.ProcessGroup | None", sequence_parallel: bool = False) -> "TPContext":
        if group is None:
            return cls(None, 0, 1, sequence_parallel)
        return cls(group, dist.get_rank(group), dist.get_world_size(group), sequence_parallel)


@dataclass(frozen=True)
class ShardSpec:
    """A parameter split along ``dim`` into equal chunks of ``ceil(full/size)`` (zero-padded)."""

    dim: int
    full_shape: tuple[int, ...]


def divide(n: int, size: int, what: str) -> int:
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {size}")
    return n // size


def padded(n: int, size: int) -> int:
    """``n`` rounded up to a multiple of ``size``."""
    return -(-n // size) * size


# -- collectives ------------------------------------------------------------------------------

def _trivial(group: "dist.ProcessGroup | None") -> bool:
    return group is None or dist.get_world_size(group) == 1


def _all_reduce(x: Tensor, group: "dist.ProcessGroup") -> Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: Tensor, group: "dist.ProcessGroup", dim: int) -> Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim)


def _reduce_scatter(x: Tensor, group: "dist.ProcessGroup", dim: int) -> Tensor:
    size = dist.get_world_size(group)
    divide(x.size(dim), size, f"dimension {dim} (sequence length under SP)")
    chunks = [c.contiguous() for c in x.chunk(size, dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


def _local_chunk(x: Tensor, group: "dist.ProcessGroup", dim: int) -> Tensor:
    size = dist.get_world_size(group)
    divide(x.size(dim), size, f"dimension {dim}")
    return x.chunk(size, dim)[dist.get_rank(group)].contiguous()


# -- autograd mappings ------------------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    """f: forward ``y = x``; backward ``dx = all_reduce(dy)``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: "dist.ProcessGroup") -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(dy, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward ``y = all_reduce(x)``; backward ``dx = dy``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: "dist.ProcessGroup") -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None]:
        return dy, None


class _GatherFromSequence(torch.autograd.Function):
    """SP before a column-parallel layer: forward all-gather over T; backward reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: "dist.ProcessGroup", dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None]:
        return _reduce_scatter(dy, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """SP after a row-parallel layer: forward reduce-scatter over T; backward all-gather."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: "dist.ProcessGroup", dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None]:
        return _all_gather(dy, ctx.group, ctx.dim), None, None


class _GatherFromTP(torch.autograd.Function):
    """Forward all-gather along ``dim`` (e.g. output features); backward keep the local chunk."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: "dist.ProcessGroup", dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None]:
        return _local_chunk(dy, ctx.group, ctx.dim), None, None


def copy_to_tp(x: Tensor, group: "dist.ProcessGroup | None") -> Tensor:
    return x if _trivial(group) else _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: "dist.ProcessGroup | None") -> Tensor:
    return x if _trivial(group) else _ReduceFromTP.apply(x, group)


def gather_from_sequence(x: Tensor, group: "dist.ProcessGroup | None", dim: int = SEQ_DIM) -> Tensor:
    return x if _trivial(group) else _GatherFromSequence.apply(x, group, dim)


def reduce_scatter_to_sequence(x: Tensor, group: "dist.ProcessGroup | None", dim: int = SEQ_DIM) -> Tensor:
    return x if _trivial(group) else _ReduceScatterToSequence.apply(x, group, dim)


def gather_from_tp(x: Tensor, group: "dist.ProcessGroup | None", dim: int = -1) -> Tensor:
    return x if _trivial(group) else _GatherFromTP.apply(x, group, dim % x.dim())


def enter_tp(x: Tensor, tp: TPContext) -> Tensor:
    """Into a column-parallel region: f, or the sequence all-gather under SP."""
    return gather_from_sequence(x, tp.group) if tp.sequence_parallel else copy_to_tp(x, tp.group)


def leave_tp(x: Tensor, tp: TPContext) -> Tensor:
    """Out of a row-parallel region: g, or the sequence reduce-scatter under SP."""
    return reduce_scatter_to_sequence(x, tp.group) if tp.sequence_parallel else reduce_from_tp(x, tp.group)


# -- layers -----------------------------------------------------------------------------------

def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape))


class ColumnParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with W (and b) split along the output dim: rank r holds rows r·o/tp….

    The input is replicated (f) or, under SP, sequence-sharded and all-gathered. The output
    is this rank's slice of the features unless ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, tp: TPContext, *,
                 bias: bool = True, gather_output: bool = False) -> None:
        super().__init__()
        self.tp, self.gather_output = tp, gather_output
        self.in_features, self.out_features = in_features, out_features
        local = divide(out_features, tp.size, "out_features")
        self.weight = _empty(local, in_features)
        self.bias = _empty(local) if bias else None
        self.tp_shards = {"weight": ShardSpec(0, (out_features, in_features))}
        if bias:
            self.tp_shards["bias"] = ShardSpec(0, (out_features,))

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(enter_tp(x, self.tp), self.weight, self.bias)  # (B, T, out/tp)
        return gather_from_tp(y, self.tp.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with W split along the input dim; x is already split the same way.

    Partial products are summed (g) or, under SP, reduce-scattered over the sequence; the
    bias is replicated and added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, tp: TPContext, *, bias: bool = True) -> None:
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty(out_features, divide(in_features, tp.size, "in_features"))
        self.bias = _empty(out_features) if bias else None
        self.tp_shards = {"weight": ShardSpec(1, (out_features, in_features))}

    def forward(self, x: Tensor) -> Tensor:
        y = leave_tp(F.linear(x, self.weight), self.tp)  # (B, T or T/tp, out)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary, padded to a multiple of tp) are split over TP.

    Tokens outside this rank's rows give zeros; the partial results are summed (g) or,
    under SP, reduce-scattered over the sequence. Padding rows are never looked up.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.local_rows = padded(num_embeddings, tp.size) // tp.size
        self.vocab_start = tp.rank * self.local_rows
        self.weight = _empty(self.local_rows, embedding_dim)
        self.tp_shards = {"weight": ShardSpec(0, (num_embeddings, embedding_dim))}

    def forward(self, tokens: Tensor) -> Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.local_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C) partial
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp(out, self.tp)


class SequenceShardedEmbedding(nn.Embedding):
    """A replicated embedding (positions) inside the SP region: looks up only this rank's
    chunk of the sequence, so its output lines up with the sequence-sharded activations."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPContext) -> None:
        super().__init__(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
        self.tp = tp

    def forward(self, positions: Tensor) -> Tensor:
        if self.tp.sequence_parallel and self.tp.size > 1:
            divide(positions.size(-1), self.tp.size, "sequence length")
            positions = positions.chunk(self.tp.size, -1)[self.tp.rank]
        return super().forward(positions)
