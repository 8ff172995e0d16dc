"""The attention core: the one seam where the GPT's attention differs between layouts.

``CausalSelfAttention`` projects to q, k, v (and rotates them under RoPE), then calls its core
``core(q, k, v, positions, dropout_p) -> y`` with q, k, v, y of shape (B, nh, T, hs):

* :func:`causal_attention` (default): serial causal attention (SDPA, ``is_causal``); the
  local tokens are the whole sequence in order, so ``positions`` is not needed.
* :class:`RingAttention`: context parallelism. The local T tokens are this rank's part of
  the sequence (``parallel.context.cp_shard_batch``), ``positions`` their global indices,
  and K/V travel round the CP group (``parallel.context.ring_attention``).

A CP rank builds the same model and swaps the core in: ``GPT(cfg, make, attention=core)``,
or after ``build_shard`` with :func:`set_attention`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch.nn.functional as F
from torch import Tensor, nn

from rankctl.parallel.context import ring_attention

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class AttentionCore(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None,
                 dropout_p: float) -> Tensor: ...


def causal_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None = None,
                     dropout_p: float = 0.0) -> Tensor:
    """Serial causal self-attention over the whole (local = global) sequence."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)


class RingAttention:
    """Causal attention over the whole sequence split across a CP group (``pgs.get("cp")``;
    ``None``, a one-member group: the serial core). No attention dropout under CP."""

    def __init__(self, group: "ProcessGroup | None", n_tiles: int = 2) -> None:
        self.group, self.n_tiles = group, n_tiles

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None,
                 dropout_p: float = 0.0) -> Tensor:
        if self.group is None:
            return causal_attention(q, k, v, positions, dropout_p)
        if dropout_p:
            raise NotImplementedError("attention dropout is not supported with context parallelism")
        if positions is None:
            raise ValueError("context parallelism needs the global positions of the local tokens")
        return ring_attention(q, k, v, positions, self.group, self.n_tiles)


def set_attention(module: nn.Module, core: AttentionCore) -> int:
    """Give every attention layer of ``module`` the core ``core``; returns how many."""
    count = 0
    for mod in module.modules():
        if hasattr(mod, "core") and hasattr(mod, "qkv"):
            mod.core = core
            count += 1
    return count
