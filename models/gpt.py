"""A decoder-only GPT, written once for the serial model, every TP shard and pipeline stage.

The model never talks to other ranks. Its linear, embedding, norm and output layers come
from a ``LayerFactory`` that is handed the module path of each layer (``layers.3.attn.qkv``):
``SerialLayers`` gives plain torch layers; ``rankctl.parallel.tp_plan.TPLayers`` looks the
path up in a plan table and gives tensor-parallel ones. Attention reads its local head
count from the qkv output, so a shard with heads/tp heads runs the same code. The attention
core is injected the same way (``attention=``, see ``models.attention``): serial causal
attention by default, ring attention over the CP group under context parallelism.

Parameters are created uninitialised; ``rankctl.models.shard.build_shard`` fills them
from full tensors drawn per parameter name (``full_init``), so every layout starts from
the serial model's weights.

Loss contract: ``model(tokens, targets)`` returns the fp32 *sum* of the per-token
cross-entropies over the micro-batch (``reduction="none"`` gives the ``(B, T)`` losses);
the trainer divides by the global token count. TP ranks all return the same value.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rankctl.contract import model as D
from rankctl.models.attention import AttentionCore, causal_attention


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int | None = D.FFN_HIDDEN  # None: 4 * hidden
    seq_len: int
    vocab: int  # logical size; TP pads the sharded tensors, never this number
    position_embedding: Literal["learned", "rope"] = D.POSITION_EMBEDDING
    tie_embeddings: bool = D.TIE_EMBEDDINGS
    dropout: float = 0.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be at least 1")
        if self.hidden % self.heads:
            raise ValueError(f"model.hidden={self.hidden} is not divisible by model.heads={self.heads}")
        if self.position_embedding not in ("learned", "rope"):
            raise ValueError(f"model.position_embedding={self.position_embedding!r} must be 'learned' or 'rope'")
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head size, got hidden/heads={self.head_dim}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_spec(cls, spec: Any, **overrides: Any) -> "GPTConfig":
        """From a job file's ``model`` section (``kinds.train.spec.ModelSpec``)."""
        if getattr(spec, "moe", None) is not None:
            raise NotImplementedError("model.moe is not supported by the dense GPT yet")
        names = ("layers", "hidden", "heads", "ffn_hidden", "seq_len", "vocab",
                 "position_embedding", "tie_embeddings")
        return cls(**{n: getattr(spec, n) for n in names}, **overrides)


@dataclass(frozen=True, kw_only=True)
class Stage:
    """The part of the model one pipeline stage holds: ``layers[first:last]`` (global indices)."""

    first: int = 0
    last: int | None = None  # None: through the final layer
    has_embedding: bool = True
    has_head: bool = True


class LayerFactory(Protocol):
    """Builds the layers whose parallel form differs; ``path`` is the module path in ``GPT``."""

    def linear(self, path: str, in_features: int, out_features: int, *, bias: bool = True) -> nn.Module: ...
    def embedding(self, path: str, num_embeddings: int, dim: int) -> nn.Module: ...
    def norm(self, path: str, dim: int, *, eps: float) -> nn.Module: ...
    def lm_head(self, path: str, dim: int, vocab: int, *, tied: nn.Module | None) -> nn.Module: ...


class LMHead(nn.Module):
    """Serial output layer + loss: ``forward(x, targets) -> (B, T)`` fp32 per-token losses."""

    def __init__(self, dim: int, vocab: int, tied: nn.Module | None = None) -> None:
        super().__init__()
        self._tied = (tied,) if tied is not None else ()  # a tuple: not registered twice
        if tied is None:
            self.weight = nn.Parameter(torch.empty(vocab, dim))

    def output_weight(self) -> Tensor:
        return self._tied[0].weight if self._tied else self.weight

    def logits(self, x: Tensor) -> Tensor:
        return F.linear(x, self.output_weight())  # (B, T, V)

    def forward(self, x: Tensor, targets: Tensor) -> Tensor:
        logits = self.logits(x).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)


class SerialLayers:
    """The ``LayerFactory`` of the single-device model."""

    def linear(self, path: str, in_features: int, out_features: int, *, bias: bool = True) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=bias, device="meta").to_empty(device="cpu")

    def embedding(self, path: str, num_embeddings: int, dim: int) -> nn.Module:
        return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))

    def norm(self, path: str, dim: int, *, eps: float) -> nn.Module:
        return nn.LayerNorm(dim, eps=eps)

    def lm_head(self, path: str, dim: int, vocab: int, *, tied: nn.Module | None) -> nn.Module:
        return LMHead(dim, vocab, tied)


def apply_rope(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """Rotate ``x`` (B, nh, T, hs) by its positions, (T,) or (B, T); half-split pairing."""
    half = x.size(-1) // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (T, hs/2) or (B, T, hs/2)
    if angles.dim() == 3:
        angles = angles.unsqueeze(1)  # (B, 1, T, hs/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    """qkv's output features are laid out per head as (nh, 3, hs), so a contiguous split
    of the output dim over TP gives each rank whole heads. ``core`` computes softmax(qkᵀ)v
    (``models.attention``: serial by default, ring attention under context parallelism)."""

    def __init__(self, cfg: GPTConfig, make: LayerFactory, prefix: str,
                 core: AttentionCore = causal_attention) -> None:
        super().__init__()
        self.head_dim, self.rope, self.dropout = cfg.head_dim, cfg.position_embedding == "rope", cfg.dropout
        self.core = core
        # no qkv bias: a K bias is redundant under softmax (its gradient is exactly 0, so Adam
        # would amplify rounding noise into it); Megatron also leaves qkv bias off by default
        self.qkv = make.linear(f"{prefix}.qkv", cfg.hidden, 3 * cfg.hidden, bias=False)
        self.proj = make.linear(f"{prefix}.proj", cfg.hidden, cfg.hidden)

    def forward(self, x: Tensor, positions: Tensor | None) -> Tensor:
        qkv = self.qkv(x)  # (B, T, nh*3*hs); T is the full sequence, nh the local heads
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)  # (B, nh, T, hs)
        if self.rope:
            pos = positions if positions is not None else torch.arange(T, device=x.device)
            q, k = apply_rope(q, pos), apply_rope(k, pos)
        p = self.dropout if self.training else 0.0
        y = self.core(q, k, v, positions, p)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, make: LayerFactory, prefix: str) -> None:
        super().__init__()
        self.fc = make.linear(f"{prefix}.fc", cfg.hidden, cfg.ffn)
        self.proj = make.linear(f"{prefix}.proj", cfg.ffn, cfg.hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))  # (B, T, ffn/tp) inside


MLPBuilder = Callable[[GPTConfig, LayerFactory, str], nn.Module]  # (cfg, make, prefix); MoE seam


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, make: LayerFactory, prefix: str, mlp: MLPBuilder = MLP,
                 attention: AttentionCore = causal_attention) -> None:
        super().__init__()
        self.ln1 = make.norm(f"{prefix}.ln1", cfg.hidden, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, make, f"{prefix}.attn", attention)
        self.ln2 = make.norm(f"{prefix}.ln2", cfg.hidden, eps=cfg.norm_eps)
        self.mlp = mlp(cfg, make, f"{prefix}.mlp")
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, positions: Tensor | None) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x), positions))  # (B, T, C), T/tp under SP
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """The whole model, or one pipeline stage of it (``stage``).

    Module paths: ``wte``, ``wpe`` (learned positions), ``layers.<i>.{ln1,attn.qkv,attn.proj,
    ln2,mlp.fc,mlp.proj}`` with the global layer index ``i``, ``ln_f``, ``head``.
    """

    def __init__(self, cfg: GPTConfig, make: LayerFactory | None = None, stage: Stage = Stage(),
                 mlp: MLPBuilder = MLP, attention: AttentionCore = causal_attention) -> None:
        super().__init__()
        make = make or SerialLayers()
        last = cfg.layers if stage.last is None else stage.last
        if not 0 <= stage.first <= last <= cfg.layers:
            raise ValueError(f"stage layers [{stage.first}:{last}] are outside 0..{cfg.layers}")
        self.cfg, self.stage = cfg, stage
        self.has_embedding, self.has_head = stage.has_embedding, stage.has_head
        if self.has_embedding:
            self.wte = make.embedding("wte", cfg.vocab, cfg.hidden)
            if cfg.position_embedding == "learned":
                self.wpe = make.embedding("wpe", cfg.seq_len, cfg.hidden)
            self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, make, f"layers.{i}", mlp, attention) for i in range(stage.first, last)}
        )
        if self.has_head:
            self.ln_f = make.norm("ln_f", cfg.hidden, eps=cfg.norm_eps)
            tied = self.wte if cfg.tie_embeddings and self.has_embedding else None
            self.head = make.lm_head("head", cfg.hidden, cfg.vocab, tied=tied)

    def init_key(self, name: str) -> str:
        """The name whose seed initialises parameter ``name``: a tied head on a stage without
        the embedding starts as a copy of ``wte.weight``."""
        return "wte.weight" if name == "head.weight" and self.cfg.tie_embeddings else name

    def embed(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        T = tokens.size(1)
        x = self.wte(tokens)  # (B, T, C), (B, T/tp, C) under SP
        if self.cfg.position_embedding == "learned":
            pos = positions if positions is not None else torch.arange(T, device=tokens.device)
            x = x + self.wpe(pos)  # (T, C) or (B, T, C) broadcast
        return self.drop(x)

    def forward(self, inputs: Tensor, targets: Tensor | None = None, positions: Tensor | None = None,
                reduction: Literal["sum", "none"] = "sum") -> Tensor:
        """``inputs``: tokens (B, T) int64 on the first stage, else hidden states (B, T, C).

        ``positions``: global positions of the T tokens, (T,) or (B, T); default 0..T-1
        (context parallelism passes its chunks' positions). Returns the fp32 loss sum (or
        the (B, T) losses with ``reduction="none"``) on the last stage, else hidden states.
        """
        x = self.embed(inputs, positions) if self.has_embedding else inputs
        for block in self.layers.values():
            x = block(x, positions)
        if not self.has_head:
            return x
        if targets is None:
            raise ValueError("the stage with the head needs targets")
        losses = self.head(self.ln_f(x), targets)  # (B, T) fp32
        return losses.sum() if reduction == "sum" else losses


# -- deterministic initialisation --------------------------------------------------------------

RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.proj.weight")


def _is_expert_projection(name: str) -> bool:
    """``layers.<i>.mlp.experts.<e>.proj.weight``: a MoE expert's output projection writes into
    the residual stream like the dense MLP's, so it gets the same scaled std (GPT-2, Megatron)."""
    parts = name.split(".")
    return len(parts) >= 4 and parts[-4] == "experts" and parts[-2:] == ["proj", "weight"]
NORMS = ("ln1", "ln2", "ln_f")


def init_rule(name: str, cfg: GPTConfig) -> tuple[Literal["normal", "zeros", "ones"], float]:
    """(kind, std) for parameter ``name``: the init is a function of the name alone."""
    module, _, leaf = name.rpartition(".")
    if module.rpartition(".")[2] in NORMS:
        return ("ones", 0.0) if leaf == "weight" else ("zeros", 0.0)
    if leaf == "bias":
        return "zeros", 0.0
    if name.endswith(RESIDUAL_PROJECTIONS) or _is_expert_projection(name):
        return "normal", cfg.init_std / math.sqrt(2 * cfg.layers)
    return "normal", cfg.init_std


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_init(name: str, shape: tuple[int, ...], seed: int, cfg: GPTConfig) -> Tensor:
    """The full (unsharded) fp32 initial value of parameter ``name``, drawn on the CPU from a
    generator seeded by (seed, name): independent of construction order and layout."""
    kind, std = init_rule(name, cfg)
    if kind == "zeros":
        return torch.zeros(shape, device="cpu")
    if kind == "ones":
        return torch.ones(shape, device="cpu")
    gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=gen)
