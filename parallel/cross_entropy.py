"""Cross-entropy over logits split along the vocabulary, without gathering them.

Rank r holds ``logits[..., s:s+V_r]`` (``s = vocab_start``). Forward, per token:

1. ``m = all_reduce_max(max_j z_j)``                       (numerical stability)
2. ``S = all_reduce_sum(sum_j exp(z_j - m))``
3. ``z_t = all_reduce_sum(z_t - m if t is local else 0)``  (target logit, shifted)
4. ``loss = log S - z_t``

Backward: ``dL/dz_j = (softmax_j - [j == t]) * dloss`` on the local columns only; the
softmax is ``exp(z_j - m) / S``, saved from the forward. Columns set to -inf (vocabulary
padding) contribute 0 to S and get gradient 0.

``VocabParallelHead`` is the output layer that produces such logits and feeds them here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from rankctl.parallel.tensor import ShardSpec, TPContext, VocabParallelEmbedding, enter_tp, padded


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, vocab_start: int,
                group: "dist.ProcessGroup") -> Tensor:
        # logits (N, V_local), targets (N,)
        local_max = logits.max(dim=-1).values  # (N,)
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)  # (N,)
        dist.all_reduce(sum_exp, group=group)

        local_t = targets - vocab_start
        is_local = (local_t >= 0) & (local_t < logits.size(-1))
        idx = local_t.clamp(0, logits.size(-1) - 1)
        target_logit = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(is_local, target_logit, torch.zeros_like(target_logit))
        dist.all_reduce(target_logit, group=group)

        exp.div_(sum_exp.unsqueeze(-1))  # now the local softmax
        ctx.save_for_backward(exp, idx, is_local)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, dloss: Tensor) -> tuple[Tensor, None, None, None]:
        softmax, idx, is_local = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, idx] -= is_local.to(grad.dtype)
        grad.mul_(dloss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, group: "dist.ProcessGroup | None",
                                 vocab_start: int | None = None) -> Tensor:
    """Per-token losses, shape ``targets.shape``, equal to ``F.cross_entropy(full_logits,
    targets, reduction="none")``.

    ``logits``: ``(..., V_local)``, this rank's vocabulary columns; ``vocab_start``: the
    global id of its first column (default ``rank * V_local``, equal shards). With a
    ``None`` or single-member group this is plain ``F.cross_entropy``.
    """
    if group is None or dist.get_world_size(group) == 1:
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view_as(targets)
    if vocab_start is None:
        vocab_start = dist.get_rank(group) * logits.size(-1)
    flat = _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), vocab_start, group)
    return flat.view_as(targets)


class VocabParallelHead(nn.Module):
    """Output layer + loss: local logits ``x Wᵀ`` over this rank's vocab rows, then the
    vocab-parallel cross-entropy; the full logits are never gathered.

    ``tied`` is the ``VocabParallelEmbedding`` whose weight is reused (not registered here);
    without it the head owns a weight split the same way. Padding rows get logit -inf.
    """

    def __init__(self, dim: int, vocab: int, tp: TPContext, tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.local_rows = padded(vocab, tp.size) // tp.size
        self.vocab_start = tp.rank * self.local_rows
        self._tied = (tied,) if tied is not None else ()
        if tied is None:
            self.weight = nn.Parameter(torch.empty(self.local_rows, dim))
            self.tp_shards = {"weight": ShardSpec(0, (vocab, dim))}

    def output_weight(self) -> Tensor:
        return self._tied[0].weight if self._tied else self.weight

    def logits(self, x: Tensor) -> Tensor:
        """This rank's logits ``(B, T, V_local)``; padding columns are -inf."""
        logits = F.linear(enter_tp(x, self.tp), self.output_weight())  # (B, T, V/tp)
        valid = self.vocab - self.vocab_start
        if valid < self.local_rows:
            pad = torch.arange(self.local_rows, device=x.device) >= valid
            logits = logits.masked_fill(pad, float("-inf"))
        return logits

    def forward(self, x: Tensor, targets: Tensor) -> Tensor:
        """Per-token losses ``(B, T)`` in fp32, identical on every TP rank."""
        logits = self.logits(x).float()
        return vocab_parallel_cross_entropy(logits, targets, self.tp.group, self.vocab_start)
