"""Mixture-of-experts MLP: a top-k softmax router over GELU expert MLPs, serial or expert parallel.

Layer ``i`` is a MoE layer when ``i % moe.every == 0`` (Megatron's ``moe_layer_freq``);
the other layers keep the dense ``MLP``. Module paths: ``layers.<i>.mlp.router`` (weight
(E, C), replicated, no bias) and ``layers.<i>.mlp.experts.<e>.{fc,proj}.{weight,bias}``
with the *global* expert index ``e``; a rank holds only its own experts
(``parallel.experts``). Each expert is initialised as its full tensor from (seed, name).

Routing (per token, fp32): ``p = softmax(x Wᵀ)`` over the E experts, the token goes to its
top-k experts with gates ``p`` (not renormalised; Switch / Megatron pre-softmax style), and
the output is ``Σ_j gate_j · expert_j(x)``. Every rank routes its own tokens; with tp > 1 the
(replicated) tokens are first split over the TP group along the sequence (under sequence
parallelism they already are), so the router's gradient is partial per TP rank
(``tp_grad_sum``).

Auxiliary load-balancing loss, per sequence (so that it is additive over sequences and every
layout gives the serial value). For sequence b of T tokens, with ``c_be`` = number of its
tokens routed to expert e (top-k assignments, before capacity dropping) and
``s_be = Σ_t p_te``::

    L_b = aux_loss · E · Σ_e f_be · P_be,   f_be = c_be / (k·T),   P_be = s_be / T

(= aux_loss when routing is uniform). The layer adds ``T · Σ_b L_b`` to the loss *sum*, so
after the trainer's division by the global token count the loss holds ``mean_b L_b`` per MoE
layer. A rank holding a part of a sequence (tp split, cp) contributes
``aux_loss·E/(k·T) Σ_be c_be · s_be(its tokens)`` with ``c`` summed over the sequence's
ranks first (a detached all-reduce): the parts add up to the serial value. The term enters
backward through the layer output (``MoETracker.loss_scale`` is its backward scale: set it
to the scale the trainer multiplies the loss sum by), so pipeline stages without the loss
get it too; the forward loss returned by ``GPT`` does not include it — read it from the
tracker.

Capacity (optional ``capacity_factor``): per sequence, expert e accepts at most
``ceil(capacity_factor · k · T / E)`` assignments, in token order; later assignments are
dropped (their slot contributes 0; the residual passes the token on). Under tp the earlier
TP ranks' counts are added first, so the dropping equals the serial one. Not with cp > 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from rankctl.contract import model as D
from rankctl.models.gpt import MLP, GPTConfig, LayerFactory, MLPBuilder
from rankctl.parallel.experts import ExpertGroups, ExpertMLP, run_experts, split_to_tp
from rankctl.parallel.tensor import TPContext, gather_from_tp


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    experts: int
    top_k: int = D.MOE_TOP_K
    every: int = D.MOE_EVERY
    aux_loss: float = D.MOE_AUX_LOSS
    capacity_factor: float | None = D.MOE_CAPACITY_FACTOR

    def __post_init__(self) -> None:
        if self.experts < 1 or self.every < 1 or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"model.moe needs experts >= 1, every >= 1 and 1 <= top_k <= experts: {self}")
        if self.aux_loss < 0 or (self.capacity_factor is not None and self.capacity_factor <= 0):
            raise ValueError(f"model.moe needs aux_loss >= 0 and capacity_factor > 0: {self}")

    @classmethod
    def from_spec(cls, spec: Any) -> MoEConfig:
        """From a job file's ``model.moe`` section (``kinds.train.spec.MoeSpec``)."""
        names = ("experts", "top_k", "every", "aux_loss", "capacity_factor")
        return cls(**{n: getattr(spec, n) for n in names})

    def is_moe_layer(self, layer: int) -> bool:
        return layer % self.every == 0


@dataclass
class LayerStats:
    """One MoE layer's figures over the forwards since the last ``take``; each is additive
    over the ranks of a pipeline stage (sum over ``tp_dp_cp`` for the global figure)."""

    tokens: Tensor  # (E,) int64: this rank's token copies each expert processed (after dropping)
    dropped: int = 0  # token copies dropped by the capacity
    aux: float = 0.0  # this rank's aux-loss contribution, in loss-sum units (see module doc)


@dataclass
class MoETracker:
    """Mutable MoE state of one shard, shared by its MoE layers (no globals).

    ``loss_scale``: the factor the trainer multiplies each micro-batch's loss sum by before
    backward (1 / global tokens); the aux loss's gradient is scaled by it.
    """

    loss_scale: float = 1.0
    layers: dict[str, LayerStats] = field(default_factory=dict)

    def record(self, name: str, tokens: Tensor, dropped: int, aux: float) -> None:
        s = self.layers.setdefault(name, LayerStats(torch.zeros_like(tokens)))
        s.tokens += tokens
        s.dropped += dropped
        s.aux += aux

    def take(self) -> dict[str, LayerStats]:
        """The statistics so far (per layer, by module path), and reset."""
        out, self.layers = self.layers, {}
        return out


class _AuxLossGrad(torch.autograd.Function):
    """Forward: ``y`` unchanged; backward: ``dy``, and ``loss_scale`` as the aux term's gradient."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, aux: Tensor, tracker: MoETracker) -> Tensor:
        ctx.tracker = tracker
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, None]:
        return dy, torch.full((), ctx.tracker.loss_scale, dtype=torch.float32, device=dy.device), None


def route(logits: Tensor, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(probs (…, E), gates (…, k), experts (…, k)) from fp32 router logits."""
    probs = torch.softmax(logits.float(), dim=-1)
    gates, experts = probs.topk(top_k, dim=-1)
    return probs, gates, experts


def sequence_counts(experts: Tensor, num_experts: int) -> Tensor:
    """(B, E) float: per sequence, how many of the (B, T, k) assignments go to each expert."""
    return F.one_hot(experts, num_experts).sum((1, 2)).float()


def aux_loss_sum(probs: Tensor, counts: Tensor, coeff: float, top_k: int, seq_len: int) -> Tensor:
    """``coeff·E/(k·T) Σ_be c_be · Σ_t p_bte``: this part's share of ``T·Σ_b L_b``.

    ``probs`` (B, T_local, E); ``counts`` (B, E) over whole sequences of ``seq_len`` tokens."""
    E = probs.size(-1)
    return coeff * E / (top_k * seq_len) * (counts * probs.sum(1)).sum()


def capacity_keep(experts: Tensor, num_experts: int, capacity: int, offset: Tensor | None = None) -> Tensor:
    """(B, T, k) bool: assignment kept when fewer than ``capacity`` tokens of its sequence
    went to its expert before it (token order; ``offset`` (B, E) = earlier parts' counts)."""
    hits = F.one_hot(experts, num_experts).sum(2)  # (B, T, E): token t goes to e
    before = torch.cumsum(hits, 1) - hits  # earlier tokens of the sequence routed to e
    if offset is not None:
        before = before + offset.to(before.dtype).unsqueeze(1)
    return before.gather(2, experts) < capacity


def dispatch_combine(x: Tensor, gates: Tensor, experts: Tensor, keep: Tensor | None,
                     local: list[ExpertMLP], groups: ExpertGroups, num_experts: int) -> tuple[Tensor, Tensor]:
    """``Σ_j gate_j · expert_j(x)`` for tokens ``x`` (n, C); gates/experts/keep (n, k).
    Returns the output (n, C) and the kept assignments per expert (E,)."""
    k = experts.size(-1)
    token = torch.arange(x.size(0), device=x.device).repeat_interleave(k)
    expert, gate = experts.flatten(), gates.flatten()
    if keep is not None:
        token, expert, gate = token[keep.flatten()], expert[keep.flatten()], gate[keep.flatten()]
    order = torch.argsort(expert, stable=True)  # grouped by expert, token order inside
    token, gate = token[order], gate[order]
    counts = torch.bincount(expert, minlength=num_experts)
    y = run_experts(x.index_select(0, token), counts, local, groups)  # (A, C)
    out = torch.zeros_like(x).index_add(0, token, (y.float() * gate.unsqueeze(1)).to(x.dtype))
    return out, counts.cpu()


class Router(nn.Module):
    """Replicated router weight; with tp > 1 each TP rank routes its own tokens only."""

    partial_replicated_grads = True

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.weight.float())  # (B, T, E) fp32 logits


def _all_reduce(t: Tensor, group: Any) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _earlier_counts(counts: Tensor, tp: TPContext) -> Tensor | None:
    """Sum of the TP ranks before this one of their (B, E) counts (None when tp = 1)."""
    if tp.size == 1:
        return None
    parts = [torch.empty_like(counts) for _ in range(tp.size)]
    dist.all_gather(parts, counts.contiguous(), group=tp.group)
    return sum(parts[: tp.rank], torch.zeros_like(counts))


class MoE(nn.Module):
    """A MoE MLP (see the module doc). ``tp``: the dense TP context (tokens are split over
    it); ``groups``: ep / expt_tp / cp; ``tracker``: loss scale and statistics."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, prefix: str, *, tp: TPContext,
                 groups: ExpertGroups, tracker: MoETracker) -> None:
        super().__init__()
        if moe.capacity_factor is not None and groups.cp is not None and dist.get_world_size(groups.cp) > 1:
            raise NotImplementedError("model.moe.capacity_factor is not supported with context parallelism")
        cp = 1 if groups.cp is None else dist.get_world_size(groups.cp)
        if tp.size > 1 and (cfg.seq_len // cp) % tp.size:
            raise ValueError(f"model.seq_len={cfg.seq_len} / cp={cp} is not divisible by tp={tp.size}: "
                             "the MoE layers split each rank's tokens over tp")
        self.moe, self.prefix, self.tp, self.groups, self.tracker = moe, prefix, tp, groups, tracker
        self.router = Router(cfg.hidden, moe.experts)
        etp = groups.etp_context
        self.experts = nn.ModuleDict({str(e): ExpertMLP(cfg.hidden, cfg.ffn, etp)
                                      for e in groups.local_experts(moe.experts)})

    def forward(self, x: Tensor) -> Tensor:
        split = self.tp.size > 1 and not self.tp.sequence_parallel
        if split:
            x = split_to_tp(x, self.tp.group, dim=1)  # (B, T/tp, C): this rank's tokens
        B, T, C = x.shape
        seq_len = T * self.tp.size * (1 if self.groups.cp is None else dist.get_world_size(self.groups.cp))
        probs, gates, experts = route(self.router(x), self.moe.top_k)  # (B, T, E), (B, T, k) x2
        local = sequence_counts(experts, self.moe.experts)  # (B, E) this rank's part
        keep = self._keep(experts, local, seq_len)
        y, counts = dispatch_combine(x.reshape(B * T, C), gates.reshape(B * T, -1), experts.reshape(B * T, -1),
                                     keep, list(self.experts.values()), self.groups, self.moe.experts)
        y = y.view(B, T, C)
        aux = torch.zeros(())
        if self.moe.aux_loss > 0:
            whole = _all_reduce(_all_reduce(local.clone(), self.tp.group), self.groups.cp)
            aux = aux_loss_sum(probs, whole, self.moe.aux_loss, self.moe.top_k, seq_len)
            y = _AuxLossGrad.apply(y, aux, self.tracker)
        if self.training:
            dropped = 0 if keep is None else int((~keep).sum())
            self.tracker.record(self.prefix, counts, dropped, float(aux.detach()))
        return gather_from_tp(y, self.tp.group, dim=1) if split else y

    def _keep(self, experts: Tensor, local: Tensor, seq_len: int) -> Tensor | None:
        if self.moe.capacity_factor is None:
            return None
        capacity = math.ceil(self.moe.capacity_factor * self.moe.top_k * seq_len / self.moe.experts)
        return capacity_keep(experts, self.moe.experts, capacity, _earlier_counts(local, self.tp))


def moe_mlp_builder(moe: MoEConfig, tp: TPContext, groups: ExpertGroups, tracker: MoETracker) -> MLPBuilder:
    """The ``GPT(mlp=...)`` builder: a ``MoE`` for every ``moe.every``-th layer, else ``MLP``."""

    def build(cfg: GPTConfig, make: LayerFactory, prefix: str) -> nn.Module:
        layer = int(prefix.split(".")[1])  # "layers.<i>.mlp"
        if not moe.is_moe_layer(layer):
            return MLP(cfg, make, prefix)
        return MoE(cfg, moe, prefix, tp=tp, groups=groups, tracker=tracker)

    return build
