"""Declarative tensor-parallel plan: module path pattern -> parallel style.

``TPLayers`` is the ``LayerFactory`` of a TP shard: the model asks it for each layer by
module path, it looks the path up in the plan (first match wins, ``*`` = one path
segment) and builds the layer of that style. A path the plan does not cover is an error,
so no layer silently stays serial.

Styles:

* ``colwise``: ``ColumnParallelLinear`` (weight split on the output dim);
* ``rowwise``: ``RowParallelLinear`` (weight split on the input dim);
* ``vocab_embedding``: ``VocabParallelEmbedding`` (rows = vocabulary split);
* ``vocab_head``: ``VocabParallelHead`` (logits per vocabulary shard + vocab-parallel loss);
* ``replicated_sp``: replicated parameters in the region that SP splits along the sequence:
  a plain ``LayerNorm``, or for an embedding (learned positions) one that looks up only
  this rank's sequence chunk under SP.
"""

from __future__ import annotations

import re
from typing import Literal

from torch import nn

from rankctl.parallel.cross_entropy import VocabParallelHead
from rankctl.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceShardedEmbedding,
    TPContext,
    VocabParallelEmbedding,
)

Style = Literal["colwise", "rowwise", "vocab_embedding", "vocab_head", "replicated_sp"]
Plan = tuple[tuple[str, Style], ...]

GPT_TP_PLAN: Plan = (
    ("wte", "vocab_embedding"),
    ("wpe", "replicated_sp"),
    ("layers.*.ln1", "replicated_sp"),
    ("layers.*.attn.qkv", "colwise"),
    ("layers.*.attn.proj", "rowwise"),
    ("layers.*.ln2", "replicated_sp"),
    ("layers.*.mlp.fc", "colwise"),
    ("layers.*.mlp.proj", "rowwise"),
    ("ln_f", "replicated_sp"),
    ("head", "vocab_head"),
)

# which styles each factory method may build
_ALLOWED: dict[str, tuple[Style, ...]] = {
    "linear": ("colwise", "rowwise"),
    "embedding": ("vocab_embedding", "replicated_sp"),
    "norm": ("replicated_sp",),
    "lm_head": ("vocab_head",),
}


def _pattern(glob: str) -> re.Pattern[str]:
    return re.compile("^" + r"\.".join("[^.]+" if p == "*" else re.escape(p) for p in glob.split(".")) + "$")


def resolve_style(path: str, plan: Plan) -> Style:
    """The style of the first plan entry matching ``path``."""
    for glob, style in plan:
        if _pattern(glob).match(path):
            return style
    raise KeyError(f"the tensor-parallel plan has no entry for module {path!r}")


class TPLayers:
    """``LayerFactory`` that builds one TP rank's layers as the plan says."""

    def __init__(self, tp: TPContext, plan: Plan = GPT_TP_PLAN) -> None:
        self.tp, self.plan = tp, plan
        self.styles: dict[str, Style] = {}  # path -> style, for every layer built

    def _style(self, method: str, path: str) -> Style:
        style = resolve_style(path, self.plan)
        if style not in _ALLOWED[method]:
            raise ValueError(f"plan style {style!r} cannot build {method} {path!r}; "
                             f"use one of {_ALLOWED[method]}")
        self.styles[path] = style
        return style

    def linear(self, path: str, in_features: int, out_features: int, *, bias: bool = True) -> nn.Module:
        if self._style("linear", path) == "colwise":
            return ColumnParallelLinear(in_features, out_features, self.tp, bias=bias)
        return RowParallelLinear(in_features, out_features, self.tp, bias=bias)

    def embedding(self, path: str, num_embeddings: int, dim: int) -> nn.Module:
        if self._style("embedding", path) == "vocab_embedding":
            return VocabParallelEmbedding(num_embeddings, dim, self.tp)
        return SequenceShardedEmbedding(num_embeddings, dim, self.tp)

    def norm(self, path: str, dim: int, *, eps: float) -> nn.Module:
        self._style("norm", path)
        return nn.LayerNorm(dim, eps=eps)

    def lm_head(self, path: str, dim: int, vocab: int, *, tied: nn.Module | None) -> nn.Module:
        self._style("lm_head", path)
        if tied is not None and not isinstance(tied, VocabParallelEmbedding):
            raise TypeError(f"a tied vocab_head needs a vocab_embedding, got {type(tied).__name__}")
        return VocabParallelHead(dim, vocab, self.tp, tied)
