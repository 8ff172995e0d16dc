"""Expert parallelism (EP) and expert tensor parallelism (ETP); groups are always arguments.

Expert layers factor the ranks of a pipeline stage as (etp, ep, expt_dp) instead of
(tp, cp, dp) (``parallel.layout``). Every rank routes *its own* tokens (see ``models.moe``:
under tp > 1 the tokens are first split over the TP group, so no two ranks of a stage hold
the same token). The ``E`` experts are split contiguously over the ``ep`` group: ep rank j
owns experts ``j·E/ep … (j+1)·E/ep − 1`` (``ExpertGroups.local_experts``); with etp > 1 each
expert's fc is further split column-wise and its proj row-wise over ``expt_tp``.

:func:`run_experts` moves a rank's expert-sorted token copies through the experts and back:

1. exchange per-expert counts over ``ep`` (``all_to_all_single`` on an (ep, E/ep) matrix);
2. ``all_to_all_single`` of the tokens with those *uneven* splits (:func:`all_to_all`);
3. etp > 1: all-gather the received tokens over ``expt_tp`` (uneven, padded), so every
   slice of an expert sees the same tokens;
4. regroup by local expert, run each expert, restore the received order;
5. etp > 1: reduce-scatter the partial proj outputs back over ``expt_tp`` and add the
   (replicated) proj bias once;
6. ``all_to_all_single`` back with the splits swapped.

Each collective is an autograd function whose backward is its conjugate (all-to-all with
swapped splits, all-gather <-> reduce-scatter), so gradients equal the serial model's.

Gradient contract for expert parameters (``ParamMeta.expert``): SUM over ``expt_dp`` (not
``dp_cp``); the replicated proj bias (``tp_grad_sum``) also over ``expt_tp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from rankctl.parallel.tensor import ShardSpec, TPContext, divide


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class ExpertGroups:
    """The groups a MoE layer talks over (``None`` = size 1).

    ``ep``: ranks owning different experts; ``etp``: slices of the same experts;
    ``cp``: the context-parallel group (a sequence's tokens are spread over it).
    The dense ``tp`` context comes from the shard (``models.shard.build_shard``).
    """

    ep: dist.ProcessGroup | None = None
    etp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None

    @classmethod
    def from_pgs(cls, pgs: Any) -> ExpertGroups:
        """From a ``parallel.groups.ProcessGroups``: kinds ``ep``, ``expt_tp`` and ``cp``."""
        return cls(ep=pgs.get("ep"), etp=pgs.get("expt_tp"), cp=pgs.get("cp") if "cp" in pgs else None)

    @property
    def ep_size(self) -> int:
        return _size(self.ep)

    @property
    def ep_rank(self) -> int:
        return _rank(self.ep)

    @property
    def etp_context(self) -> TPContext:
        return TPContext.from_group(self.etp)

    def local_experts(self, experts: int) -> range:
        """Global indices of the experts this ep rank owns (contiguous)."""
        per = divide(experts, self.ep_size, "model.moe.experts (split over ep)")
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)


# -- uneven collectives ---------------------------------------------------------------------

def all_to_all_raw(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    """``all_to_all_single``: send ``in_splits[j]`` rows to rank j, receive ``out_splits[i]``."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _gather_uneven(x: Tensor, sizes: list[int], group: Any) -> Tensor:
    """Concatenate every rank's ``x`` (``sizes[q]`` rows on rank q) in rank order."""
    pad = max(sizes)
    local = torch.cat([x, x.new_zeros((pad - x.size(0), *x.shape[1:]))]) if x.size(0) < pad else x
    parts = [torch.empty_like(local) for _ in sizes]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def _reduce_scatter_uneven(x: Tensor, sizes: list[int], group: Any) -> Tensor:
    """Sum over ranks of segment q of ``x`` (``sizes[q]`` rows) lands on rank q."""
    pad = max(sizes)
    chunks = []
    for seg in torch.split(x, sizes):
        chunks.append(torch.cat([seg, seg.new_zeros((pad - seg.size(0), *seg.shape[1:]))]).contiguous())
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out[: sizes[_rank(group)]]


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all with (out, in) splits; backward: all-to-all with them swapped."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all_raw(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return all_to_all_raw(dy, in_splits, out_splits, ctx.group), None, None, None


class _GatherUneven(torch.autograd.Function):
    """Forward: uneven all-gather over the group; backward: uneven reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sizes: list[int], group: Any) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _gather_uneven(x, sizes, group)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None]:
        return _reduce_scatter_uneven(dy, ctx.sizes, ctx.group), None, None


class _ReduceScatterUneven(torch.autograd.Function):
    """Forward: uneven reduce-scatter over the group; backward: uneven all-gather."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sizes: list[int], group: Any) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_uneven(x, sizes, group)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None]:
        return _gather_uneven(dy, ctx.sizes, ctx.group), None, None


class _SplitToTP(torch.autograd.Function):
    """Replicated -> this rank's chunk along ``dim``; backward all-gathers the chunks.

    The conjugate of ``tensor.gather_from_tp`` (all-gather forward, keep chunk backward)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        size = dist.get_world_size(group)
        divide(x.size(dim), size, f"dimension {dim} (tokens split over tp for the MoE)")
        return x.chunk(size, dim)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None]:
        dy = dy.contiguous()
        parts = [torch.empty_like(dy) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, dy, group=ctx.group)
        return torch.cat(parts, ctx.dim), None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    return x if _size(group) == 1 else _AllToAll.apply(x, out_splits, in_splits, group)


def split_to_tp(x: Tensor, group: Any, dim: int = 1) -> Tensor:
    return x if _size(group) == 1 else _SplitToTP.apply(x, group, dim)


# -- experts ---------------------------------------------------------------------------------

class _ExpertLinear(nn.Module):
    """Holds one expert linear's local weight (and bias); the parameter metadata reads
    ``tp_shards``, ``expert_tp`` (the slicing group) and ``partial_replicated_grads``."""

    partial_replicated_grads = True  # a replicated bias sees only this rank's tokens

    def __init__(self, etp: TPContext, shape: tuple[int, int], shard_dim: int, full: tuple[int, int]) -> None:
        super().__init__()
        self.expert_tp = etp
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(shape[0]))
        self.tp_shards = {"weight": ShardSpec(shard_dim, full)}
        if shard_dim == 0:
            self.tp_shards["bias"] = ShardSpec(0, (full[0],))


class ExpertMLP(nn.Module):
    """One expert, ``proj(gelu(fc(x)))``: fc split column-wise and proj row-wise over
    ``etp``. With etp > 1 ``forward`` returns the partial proj output *without* the proj
    bias (the caller sums over ``etp`` first, then adds the bias once: ``_with_bias``)."""

    def __init__(self, hidden: int, ffn: int, etp: TPContext) -> None:
        super().__init__()
        self.etp_size = etp.size
        local = divide(ffn, etp.size, "model.ffn_hidden (experts split over etp)")
        self.fc = _ExpertLinear(etp, (local, hidden), 0, (ffn, hidden))
        self.proj = _ExpertLinear(etp, (hidden, local), 1, (hidden, ffn))

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(F.linear(x, self.fc.weight, self.fc.bias))  # (n, ffn/etp)
        bias = self.proj.bias if self.etp_size == 1 else None
        return F.linear(h, self.proj.weight, bias)  # (n, C), partial when etp > 1


def expert_major(counts: Tensor) -> Tensor:
    """Rows of a buffer laid out as segments (g, l) in row-major order of ``counts`` (G, L),
    listed expert-major (all of expert 0's segments, then expert 1's …)."""
    flat = counts.flatten()
    starts = torch.cumsum(flat, 0) - flat
    order = torch.arange(counts.numel()).view(counts.shape).t().flatten()
    return torch.cat([torch.arange(int(starts[i]), int(starts[i] + flat[i])) for i in order.tolist()]
                     + [torch.zeros(0, dtype=torch.long)])


def _run_local(x: Tensor, segments: Tensor, experts: list[ExpertMLP]) -> Tensor:
    """Rows of ``x`` laid out as ``segments`` (G, L) through local expert l, same order back."""
    perm = expert_major(segments).to(x.device)
    grouped = torch.split(x.index_select(0, perm), segments.sum(0).tolist())
    y = torch.cat([expert(part) for expert, part in zip(experts, grouped)])
    return torch.empty_like(y).index_copy(0, perm, y)  # (n, C) in the order of x


def _with_bias(y: Tensor, counts: Tensor, experts: list[ExpertMLP]) -> Tensor:
    """Add each expert's proj bias to its rows (``counts`` (G, L) row-major segments)."""
    expert_of = torch.arange(counts.size(1)).repeat(counts.size(0)).repeat_interleave(counts.flatten())
    bias = torch.stack([e.proj.bias for e in experts])  # (L, C)
    return y + bias.index_select(0, expert_of.to(y.device))


def run_experts(x: Tensor, counts: Tensor, experts: list[ExpertMLP], groups: ExpertGroups) -> Tensor:
    """Expert outputs for ``x`` (A, C): a rank's token copies sorted by global expert, with
    ``counts`` (E,) rows per expert. ``experts`` are this rank's local ones. Returns (A, C)
    in the order of ``x``. A collective over ``ep`` and ``expt_tp``; every member calls it.
    Counts travel on ``x``'s device (NCCL needs that) and come back to the host for splits."""
    ep, etp = groups.ep_size, _size(groups.etp)
    local = counts.cpu().view(ep, -1)  # (ep, L): rows for ep rank j's experts
    recv = local
    if ep > 1:
        recv = all_to_all_raw(local.to(x.device), [1] * ep, [1] * ep, groups.ep).cpu()  # (ep sources, L)
        x = all_to_all(x, recv.sum(1).tolist(), local.sum(1).tolist(), groups.ep)
    segments = recv
    if etp > 1:
        segments = _gather_uneven(recv.to(x.device), [ep] * etp, groups.etp).cpu()  # (etp*ep, L)
        sizes = segments.view(etp, -1).sum(1).tolist()
        x = _GatherUneven.apply(x, sizes, groups.etp)
    y = _run_local(x, segments, experts)
    if etp > 1:
        y = _with_bias(_ReduceScatterUneven.apply(y, sizes, groups.etp), recv, experts)
    if ep > 1:
        y = all_to_all(y, local.sum(1).tolist(), recv.sum(1).tolist(), groups.ep)
    return y
