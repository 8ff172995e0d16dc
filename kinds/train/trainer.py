"""The rank's training state (``Trainer``, ``TrainState``, ``Layout``): what ``loop`` trains with and
``train_state`` saves and restores; both import it, neither imports the other's module for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rankctl.contract.spec import DEFAULT_SCHEDULE, ParallelSpec
from rankctl.kinds.context import RankContext
from rankctl.kinds.train.data import TRAIN, TokenDataset, as_tensors, dp_slice, micro_batches
from rankctl.kinds.train.spec import TrainSpec
from rankctl.models.gpt import GPTConfig
from rankctl.models.moe import MoEConfig
from rankctl.models.shard import ParamMeta, ShardedModel
from rankctl.parallel.context import cp_shard_batch
from rankctl.parallel.data_parallel import GradReducer, GradReducers
from rankctl.parallel.groups import ProcessGroups
from rankctl.parallel.pipeline import MicroBatch
from rankctl.parallel.schedules import Action, PipelineShape, stage_actions


@dataclass
class TrainState:
    step: int = 0  # last finished step
    losses: list[dict[str, float | None]] = field(default_factory=list)  # loss None off the last stage
    val_losses: list[dict[str, float | None]] = field(default_factory=list)
    resumed_from: int | None = None   # the checkpoint's step (the state after it): training went on with the next
    resumed_layout: str | None = None  # the layout that checkpoint was written under, when another ("tp2 dp2")
    stale_checkpoints: bool = False  # not saved: this fresh run's first checkpoint clears older files first


Batch = MicroBatch  # (inputs, targets[, positions]): (micro_batch, T) each; T/cp and (T/cp,) under CP
StepFn = Callable[[list[Batch]], "torch.Tensor | None"]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What the loop itself needs of the layout (the groups carry the rest)."""

    pp: int = 1
    vpp: int | None = None
    schedule: str = DEFAULT_SCHEDULE
    stage: int = 0  # this rank's pipeline stage
    cp: int = 1
    cp_rank: int = 0

    @classmethod
    def of(cls, par: ParallelSpec, pgs: ProcessGroups) -> Layout:
        return cls(pp=par.pp, vpp=par.vpp, schedule=par.schedule, stage=pgs.local_rank("pp") if par.pp > 1 else 0,
                   cp=par.cp, cp_rank=pgs.local_rank("cp") if par.cp > 1 else 0)

    def actions(self, microbatches: int, schedule: str | None = None) -> list[Action]:
        """This stage's action list for a step of ``microbatches``."""
        shape = PipelineShape(pp=self.pp, vpp=self.vpp or 1, microbatches=microbatches)
        return stage_actions(schedule or self.schedule, shape, self.stage)


@dataclass
class Trainer:
    """Everything one rank trains with; built by ``setup``."""

    ctx: RankContext
    cfg: TrainSpec
    chunks: list[ShardedModel]  # this rank's model chunks, in local chunk order
    optimizer: torch.optim.Optimizer
    reducer: GradReducer | GradReducers
    data: TokenDataset
    dp_rank: int
    dp_size: int
    use_bf16: bool
    state: TrainState
    layout: Layout = field(default_factory=Layout)
    moe: MoEConfig | None = None

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def model_config(self) -> GPTConfig:
        return self.chunks[0].config

    @property
    def has_loss(self) -> bool:
        """Whether this rank holds the head (the last pipeline stage; every rank when pp = 1)."""
        return any(c.module.has_head for c in self.chunks)

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Every chunk's parameters; names are the serial model's, so they do not collide."""
        return [np for c in self.chunks for np in c.named_parameters()]

    def meta(self) -> dict[str, ParamMeta]:
        return {n: m for c in self.chunks for n, m in c.meta.items()}

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def tokens(self, global_batch: int | None = None) -> int:
        return (global_batch or self.cfg.global_batch) * self.model_config.seq_len

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16)

    def batches(self, step: int, split: int = TRAIN, global_batch: int | None = None) -> list[Batch]:
        """This rank's micro-batches: its DP slice, and under CP its share of each sequence."""
        mine = dp_slice(global_batch or self.cfg.global_batch, self.dp_size, self.dp_rank)
        out = [as_tensors(*self.data.samples(self.cfg.seed, step, mb, split), device=self.device)
               for mb in micro_batches(mine, self.cfg.micro_batch)]
        if self.layout.cp > 1:
            return [cp_shard_batch(x, y, self.layout.cp, self.layout.cp_rank) for x, y in out]
        return out

    def global_mean(self, local_sum: torch.Tensor, tokens: int) -> float:
        """Sum over ``dp_cp`` of the local loss sums, divided by the global token count."""
        total = local_sum.detach().float().clone()
        if self.ctx.groups.size("dp_cp") > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.ctx.groups["dp_cp"])
        return float(total) / tokens

    def moe_layers(self) -> list[str]:
        """Module paths of every MoE layer of the whole model (every stage), in order."""
        if self.moe is None:
            return []
        return [f"layers.{i}.mlp" for i in range(self.model_config.layers) if self.moe.is_moe_layer(i)]

    def set_moe_loss_scale(self, scale: float) -> None:
        for c in self.chunks:
            if c.moe is not None:
                c.moe.loss_scale = scale

    def moe_stats(self) -> dict[str, Any] | None:
        """This step's MoE figures for the whole model and global batch (a world collective;
        every rank calls it): ``{"aux_sum", "expert_tokens", "expert_dropped"}``."""
        if self.moe is None:
            return None
        names, E = self.moe_layers(), self.moe.experts
        table = torch.zeros((len(names), E + 2), dtype=torch.float64)
        for c in self.chunks:
            for name, s in (c.moe.take() if c.moe is not None else {}).items():
                row = table[names.index(name)]
                row[:E] += s.tokens.double().cpu()
                row[E] += s.dropped
                row[E + 1] += s.aux
        if self.ctx.assignment.world_size > 1:
            table = table.to(self.device)
            dist.all_reduce(table, op=dist.ReduceOp.SUM)
            table = table.cpu()
        return {"aux_sum": float(table[:, E + 1].sum()),
                "expert_tokens": {n: [round(v) for v in table[i, :E].tolist()] for i, n in enumerate(names)},
                "expert_dropped": round(float(table[:, E].sum()))}
