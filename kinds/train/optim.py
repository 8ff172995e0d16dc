"""Optimizer, learning-rate schedule and global-norm clipping across shards.

AdamW (betas 0.9/0.95, eps 1e-8) with nanoGPT's weight-decay convention: every parameter
with two or more dimensions (linear weights and embeddings) decays by ``WEIGHT_DECAY``;
biases and LayerNorm parameters (one dimension) do not. Sharding does not change a
parameter's number of dimensions, so every layout makes the same choice.

Schedule (steps count from 1): linear warm-up ``lr * s / warmup`` for ``s <= warmup``, then
cosine decay from ``lr`` to ``MIN_LR_RATIO * lr`` at ``s = steps``.

Clipping: the global norm is over the *full* model's gradients. Each rank sums the squares
of its local gradients, counting a parameter replicated across TP (``meta.tp_replicated``)
only on TP rank 0, and the sums are all-reduced over the model-parallel group ``mp``
(tp x pp). DP and CP replicas hold identical gradients after the data-parallel reduction,
so they are not summed. A parameter that two pipeline stages hold (the tied word embedding's
copy on the last stage, ``parallel.embedding_sync.duplicate_params``) is left out of the norm
(``exclude``) but clipped like the rest. Every rank then applies the same coefficient, as
``torch.nn.utils.clip_grad_norm_`` does on the serial model: ``min(1, max / (norm + 1e-6))``.

Mixture of experts (``expert_group`` = ``tp_ep_pp``): expert parameters (``meta.expert``) are
split over ep (different experts) and expt_tp, and replicated over expt_dp. Their squares are
summed separately: a sharded one on every rank, a replicated one (over expt_tp) only on
expt_tp rank 0 (``meta.tp_rank`` is the expt_tp rank for them), all-reduced over
``tp_ep_pp``, which holds each distinct expert shard of every stage exactly once. The total
square is dense + expert. Every member of ``expert_group`` must pass it (also a stage
without MoE layers), since the all-reduce is a collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
EPS = 1e-8
MIN_LR_RATIO = 0.1


def param_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float = WEIGHT_DECAY) -> list[dict]:
    """Two AdamW groups: decayed (dim >= 2) and not decayed (dim < 2), registration order kept."""
    decay, no_decay = [], []
    for _, p in named:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(named: Iterable[tuple[str, nn.Parameter]], lr: float, *,
                    weight_decay: float = WEIGHT_DECAY) -> torch.optim.AdamW:
    fused = None
    groups = param_groups(named, weight_decay)
    if any(p.is_cuda for g in groups for p in g["params"]):
        fused = True
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, fused=fused)


def lr_at(step: int, *, lr: float, warmup: int, steps: int, min_ratio: float = MIN_LR_RATIO) -> float:
    """Learning rate of ``step`` (1-based)."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    min_lr = lr * min_ratio
    if steps <= warmup:
        return min_lr
    progress = min(1.0, (step - warmup) / (steps - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _counts_here(p: nn.Parameter) -> bool:
    """Whether this rank contributes ``p`` to the global norm (TP replicas: rank 0 only)."""
    meta = getattr(p, "_rankctl_meta", None)
    return meta is None or not meta.tp_replicated or meta.tp_rank == 0


def _is_expert(p: nn.Parameter) -> bool:
    return bool(getattr(getattr(p, "_rankctl_meta", None), "expert", False))


def _local_square(params: list[nn.Parameter], device: torch.device, group: dist.ProcessGroup | None) -> torch.Tensor:
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None and _counts_here(p):
            sq += p.grad.detach().float().pow(2).sum()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return sq


def global_grad_norm(params: Iterable[nn.Parameter], mp_group: dist.ProcessGroup | None, *,
                     expert_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of the full model's gradient (fp32 scalar, same on every rank).
    Expert parameters are summed over ``expert_group`` (``tp_ep_pp``), the rest over ``mp_group``."""
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    sq = _local_square([p for p in params if not _is_expert(p)], device, mp_group)
    experts = [p for p in params if _is_expert(p)]
    if experts or expert_group is not None:
        sq = sq + _local_square(experts, device, expert_group)
    return sq.sqrt()


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float,
                   mp_group: dist.ProcessGroup | None, *, exclude: Iterable[nn.Parameter] = (),
                   expert_group: dist.ProcessGroup | None = None) -> float:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))``; returns the norm before
    clipping. ``max_norm <= 0`` only measures. ``exclude``: parameters left out of the norm
    (another rank counts the same gradient) but scaled all the same."""
    params = list(params)
    skip = {id(p) for p in exclude}
    norm = global_grad_norm([p for p in params if id(p) not in skip], mp_group, expert_group=expert_group)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.dtype))
    return float(norm)
