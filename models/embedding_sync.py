"""Keep the copies of embeddings that several pipeline stages hold equal: sum their gradients.

GPT-specific (it names ``wte``/``head``/``wpe``), so it lives with the model, not in ``parallel``.

Word embeddings (``embd`` group = first and last rank of each pipeline). With tied input
and output embeddings and pp > 1, the first stage holds ``wte.weight`` and the last stage a
separate ``head.weight`` that starts as a copy of it (``models.stages``). The serial model's
gradient of the one shared matrix is the sum of both uses, so after backward (and after the
data-parallel reduction; both are sums, so the order does not matter) each side all-reduces
(SUM) its copy's gradient over ``embd``. The optimizer then applies the same update to equal
weights and equal gradients, and the copies stay equal. Both copies are vocab-sharded the
same way over TP, so TP rank r of the first stage pairs with TP rank r of the last.

Gradient norm: the two copies hold the same gradient; count it once. ``duplicate_params``
names the copy to leave out (the last stage's ``head.weight``), as Megatron does with its
``shared`` flag.

Position embeddings (``pos_embd`` group = first rank of each pipeline). Learned positions
live only on model chunk 0 (first stage), so the group has one member and there is nothing
to reduce; Megatron needs a two-member group only when a second stage also embeds positions
(the decoder of an encoder-decoder split). ``sync_embedding_grads`` still sums ``wpe.weight``
over ``pos_embd`` when that group has more than one member, so the code stays right if a
layout ever places positions on two stages.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from rankctl.models.shard import ShardedModel
from rankctl.parallel.groups import ProcessGroups


def _has(pgs: ProcessGroups, kind: str) -> bool:
    return kind in pgs and pgs.size(kind) > 1


def word_embedding_params(chunks: Iterable[ShardedModel]) -> list[nn.Parameter]:
    """This rank's copies of the tied word embedding that live apart from their twin."""
    out = []
    for chunk in chunks:
        gpt = chunk.module
        if not gpt.cfg.tie_embeddings or (gpt.has_embedding and gpt.has_head):
            continue  # untied, or both uses on one chunk: autograd already sums them
        names = dict(gpt.named_parameters())
        if gpt.has_embedding:
            out.append(names["wte.weight"])
        if gpt.has_head:
            out.append(names["head.weight"])
    return out


def duplicate_params(chunks: Iterable[ShardedModel]) -> list[nn.Parameter]:
    """Parameters whose gradient another stage also holds: leave them out of the grad norm."""
    return [dict(c.module.named_parameters())["head.weight"] for c in chunks
            if c.module.cfg.tie_embeddings and c.module.has_head and not c.module.has_embedding]


def _all_reduce_grads(params: list[nn.Parameter], group: "dist.ProcessGroup") -> None:
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for p in params:
        p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def sync_embedding_grads(chunks: list[ShardedModel], pgs: ProcessGroups) -> None:
    """SUM the shared embeddings' gradients over ``embd`` (and ``pos_embd``). Call on every
    rank after the step's last backward (and DP reduction), before clipping and the optimizer;
    ranks outside those groups return at once."""
    if _has(pgs, "embd"):
        params = word_embedding_params(chunks)
        if params:
            _all_reduce_grads(params, pgs["embd"])
    if _has(pgs, "pos_embd"):
        params = [dict(c.module.named_parameters())["wpe.weight"] for c in chunks
                  if c.module.has_embedding and c.module.cfg.position_embedding == "learned"]
        if params:
            _all_reduce_grads(params, pgs["pos_embd"])
