"""One rank's shard of the GPT: built from the model config, the TP group and the seed.

Parameter metadata contract (``ShardedModel.meta[name]``, also ``param._rankctl_meta``),
one ``ParamMeta`` per parameter, keyed by its name in ``module.named_parameters()``:

* ``full_shape``: the logical full shape (the serial model's; the vocabulary unpadded).
* ``shard_dim``: ``None`` = replicated across TP ranks (every rank holds the full tensor);
  an ``int`` d = split along d: the full tensor is zero-padded along d to a multiple of
  ``tp_size`` and TP rank r holds chunk r of ``tp_size`` equal chunks. Gather: concatenate
  the chunks in TP rank order along d, then cut to ``full_shape`` (``gather_full``).
* ``tp_grad_sum``: True when the gradient must be summed over the TP group before the
  optimizer step. This is every replicated parameter under sequence parallelism (LayerNorms,
  learned positions, row-parallel biases): each TP rank saw a different slice of the
  sequence. Without SP, replicated parameters already get identical gradients.
* ``tp_replicated`` (= ``shard_dim is None``): for the gradient norm, count such a
  parameter once per TP group (e.g. only on TP rank 0), and sharded ones on every rank.
* ``init_key``: the name whose seed initialises it (``wte.weight`` for a tied head that
  lives on a pipeline stage without the embedding; see ``GPT.init_key``).
* ``expert``: a mixture-of-experts expert parameter (``models.moe``). For these, "TP" above
  means the *expert* TP group ``expt_tp`` (tp_rank/tp_size/shard_dim/tp_grad_sum refer to
  it), and the data-parallel gradient SUM runs over ``expt_dp`` instead of ``dp_cp``. The
  MoE router is a dense parameter with ``tp_grad_sum`` whenever tp > 1 (each TP rank routes
  its own share of the tokens).

Parameters are initialised as full tensors with ``gpt.full_init`` and sliced, so every
layout starts from exactly the serial model's weights. Sharding rules come from
``rankctl.parallel.tp_plan.GPT_TP_PLAN``; tp_group None (or of size 1) gives the serial model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rankctl.models.gpt import GPT, GPTConfig, MLP, MLPBuilder, SerialLayers, Stage, full_init
from rankctl.models.moe import MoEConfig, MoETracker, moe_mlp_builder
from rankctl.parallel.experts import ExpertGroups
from rankctl.parallel.tensor import TPContext, padded
from rankctl.parallel.tp_plan import GPT_TP_PLAN, Plan, TPLayers


@dataclass(frozen=True)
class ParamMeta:
    name: str
    full_shape: tuple[int, ...]
    shard_dim: int | None
    tp_rank: int
    tp_size: int
    tp_grad_sum: bool
    init_key: str
    expert: bool = False

    @property
    def tp_replicated(self) -> bool:
        return self.shard_dim is None


def shard_slice(full: Tensor, shard_dim: int | None, rank: int, size: int) -> Tensor:
    """This rank's chunk of a full tensor (zero-padded along ``shard_dim`` first)."""
    if shard_dim is None or size == 1:
        return full
    n = full.size(shard_dim)
    if n % size:
        pad_shape = list(full.shape)
        pad_shape[shard_dim] = padded(n, size) - n
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=shard_dim)
    return full.chunk(size, shard_dim)[rank]


def gather_full(local: Tensor, meta: ParamMeta, group: "dist.ProcessGroup | None") -> Tensor:
    """The full tensor of a parameter (or of its gradient) from every TP rank's chunk.
    A collective over the TP group for sharded parameters; every member must call it."""
    if meta.shard_dim is None or meta.tp_size == 1:
        return local.detach().clone()
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(meta.tp_size)]
    dist.all_gather(parts, local, group=group)
    full = torch.cat(parts, dim=meta.shard_dim)
    return full.narrow(meta.shard_dim, 0, meta.full_shape[meta.shard_dim])


class ShardedModel:
    """A rank's model (``module``), its parameter metadata and its TP context.

    ``sharded(tokens, targets)`` calls the module (see the loss contract in ``models.gpt``).
    MoE shards also carry ``moe`` (the ``MoETracker``: aux-loss scale, expert statistics)
    and ``expert_tp`` (the expert TP context); both are ``None`` for a dense model.
    """

    def __init__(self, module: GPT, meta: dict[str, ParamMeta], tp: TPContext, styles: dict[str, str],
                 moe: MoETracker | None = None, expert_tp: TPContext | None = None) -> None:
        self.module, self.meta, self.tp, self.styles = module, meta, tp, styles
        self.moe, self.expert_tp = moe, expert_tp

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.module(*args, **kwargs)

    @property
    def config(self) -> GPTConfig:
        return self.module.cfg

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters())

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def tp_grad_sum_params(self, expert: bool = False) -> list[nn.Parameter]:
        """Parameters whose gradients the DP/grad code must sum over the TP group (dense
        ones), or with ``expert=True`` over the ``expt_tp`` group (expert ones)."""
        return [p for n, p in self.module.named_parameters()
                if self.meta[n].tp_grad_sum and self.meta[n].expert == expert]

    def named_parameters_by_kind(self, expert: bool) -> list[tuple[str, nn.Parameter]]:
        """Dense (reduce over ``dp_cp``) or expert (reduce over ``expt_dp``) parameters."""
        return [(n, p) for n, p in self.module.named_parameters() if self.meta[n].expert == expert]

    def full_state_dict(self, grads: bool = False) -> dict[str, Tensor]:
        """Full (serial-shaped) parameters, or their gradients, on every TP rank (collective)."""
        out = {}
        for name, p in self.module.named_parameters():
            value = p.grad if grads else p
            if value is None:
                value = torch.zeros_like(p)
            meta = self.meta[name]
            group = self.expert_tp.group if meta.expert and self.expert_tp is not None else self.tp.group
            out[name] = gather_full(value, meta, group)
        return out


def _collect_meta(module: GPT, tp: TPContext) -> dict[str, ParamMeta]:
    meta: dict[str, ParamMeta] = {}
    for mod_name, mod in module.named_modules():
        specs = getattr(mod, "tp_shards", {})
        ctx = getattr(mod, "expert_tp", None) or tp  # expert layers are sliced over expt_tp
        partial = ctx.sequence_parallel or getattr(mod, "partial_replicated_grads", False)
        for leaf, p in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            spec = specs.get(leaf)
            shard_dim = spec.dim if spec is not None and ctx.size > 1 else None
            meta[name] = ParamMeta(
                name=name,
                full_shape=tuple(spec.full_shape) if spec is not None else tuple(p.shape),
                shard_dim=shard_dim,
                tp_rank=ctx.rank,
                tp_size=ctx.size,
                tp_grad_sum=shard_dim is None and partial and ctx.size > 1,
                init_key=module.init_key(name),
                expert=hasattr(mod, "expert_tp"),
            )
            p._rankctl_meta = meta[name]
    return meta


@torch.no_grad()
def init_parameters(module: GPT, meta: dict[str, ParamMeta], seed: int) -> None:
    """Fill every parameter with its slice of the full initial tensor."""
    for name, p in module.named_parameters():
        m = meta[name]
        full = full_init(m.init_key, m.full_shape, seed, module.cfg)
        p.copy_(shard_slice(full, m.shard_dim, m.tp_rank, m.tp_size))


def check_divisible(cfg: GPTConfig, tp: TPContext) -> None:
    problems = [f"model.{what}={n} is not divisible by tp={tp.size}"
                for what, n in (("heads", cfg.heads), ("ffn_hidden", cfg.ffn)) if n % tp.size]
    if tp.sequence_parallel and cfg.seq_len % tp.size:
        problems.append(f"model.seq_len={cfg.seq_len} is not divisible by tp={tp.size} (sequence parallel)")
    if problems:
        raise ValueError("; ".join(problems))


def _configs(model_cfg: GPTConfig | Any, moe: MoEConfig | None) -> tuple[GPTConfig, MoEConfig | None]:
    """The GPT config and the MoE config (``moe`` wins over a spec's ``model.moe``)."""
    if isinstance(model_cfg, GPTConfig):
        return model_cfg, moe
    spec_moe = getattr(model_cfg, "moe", None)
    if spec_moe is not None:
        moe = moe or MoEConfig.from_spec(spec_moe)
        model_cfg = model_cfg.model_copy(update={"moe": None})
    return GPTConfig.from_spec(model_cfg), moe


def build_shard(model_cfg: GPTConfig | Any, tp_group: "dist.ProcessGroup | None" = None,
                sequence_parallel: bool = False, seed: int = 0, *, stage: Stage = Stage(),
                mlp: MLPBuilder = MLP, plan: Plan = GPT_TP_PLAN, tp: TPContext | None = None,
                device: torch.device | str | None = None, moe: MoEConfig | None = None,
                expert_groups: ExpertGroups | None = None) -> ShardedModel:
    """This rank's shard. ``model_cfg``: a ``GPTConfig`` or a job file's ``model`` section.

    ``tp`` overrides ``tp_group`` (tests build shards of any rank without processes).
    Mixture of experts: ``moe`` (or the spec's ``model.moe``) replaces ``mlp`` by
    ``models.moe.moe_mlp_builder``; ``expert_groups`` (``ExpertGroups.from_pgs(pgs)``) gives
    the ep / expt_tp / cp groups, ``None`` = all experts on this rank.
    """
    cfg, moe = _configs(model_cfg, moe)
    tp = tp or TPContext.from_group(tp_group, sequence_parallel)
    check_divisible(cfg, tp)
    tracker, expert_tp = None, None
    if moe is not None:
        groups = expert_groups or ExpertGroups()
        tracker, expert_tp = MoETracker(), groups.etp_context
        mlp = moe_mlp_builder(moe, tp, groups, tracker)
    make = TPLayers(tp, plan) if tp.size > 1 else SerialLayers()
    module = GPT(cfg, make, stage, mlp)
    meta = _collect_meta(module, tp)
    init_parameters(module, meta, seed)
    if device is not None:
        module.to(device)
    return ShardedModel(module, meta, tp, getattr(make, "styles", {}), tracker, expert_tp)
