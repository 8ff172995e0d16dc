"""Job kind ``train``: one rank's training loop (``run(ctx)``).

Per step ``s`` (1-based): this rank's micro-batches (its DP slice of the global batch,
``models.data``), forward/backward through ``step_fn`` (loss sum / global token count per
micro-batch; gradients reduced by ``GradReducer`` on the last one), global-norm clipping,
AdamW with warm-up + cosine LR, then a status record with loss, lr, grad norm, tokens/s,
step time and peak memory. Held-out loss every ``train.eval_every`` steps, a sharded
checkpoint every ``train.checkpoint_every`` steps (``worker.checkpoint``).

Seams for pipeline parallelism: ``StepFn`` maps a step's micro-batches to the local loss
sum, or None on a stage without the loss; a schedule replaces ``plain_step``. The global
loss is the sum over ``dp_cp`` of the local sums divided by the global token count.
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from rankctl.models.data import (
    BUILTIN_PYDOC,
    TRAIN,
    VAL,
    TokenDataset,
    as_tensors,
    dp_slice,
    micro_batches,
)
from rankctl.models.gpt import GPTConfig
from rankctl.models.shard import ShardedModel, build_shard
from rankctl.parallel import data_parallel
from rankctl.parallel.data_parallel import GradReducer
from rankctl.worker import optim
from rankctl.worker.train_state import TrainState, restore_or_reset, save_checkpoint

if TYPE_CHECKING:
    from rankctl.worker.rank import RankContext

EVAL_BATCHES = 2  # held-out global batches per evaluation (the same samples every time)
Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), each (micro_batch, T)
StepFn = Callable[[list[Batch]], "torch.Tensor | None"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The job file's ``train`` section (validated by the coordinator; defaults match)."""

    steps: int = 20
    global_batch: int = 16
    micro_batch: int = 2
    lr: float = 3.0e-4
    warmup: int = 2
    grad_clip: float = 1.0
    seed: int = 1234
    dtype: str = "auto"
    data: str = BUILTIN_PYDOC
    eval_every: int = 0
    checkpoint_every: int = 0
    resume: bool = False

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (spec.get("train") or {}).items() if k in known})


@dataclass
class Trainer:
    """Everything one rank trains with; built by ``setup``."""

    ctx: RankContext
    cfg: TrainConfig
    model: ShardedModel
    optimizer: torch.optim.Optimizer
    reducer: GradReducer
    data: TokenDataset
    dp_rank: int
    dp_size: int
    use_bf16: bool
    state: TrainState

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.model.named_parameters()]

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16)

    def batches(self, step: int, split: int = TRAIN, global_batch: int | None = None) -> list[Batch]:
        mine = dp_slice(global_batch or self.cfg.global_batch, self.dp_size, self.dp_rank)
        return [as_tensors(*self.data.samples(self.cfg.seed, step, mb, split), device=self.device)
                for mb in micro_batches(mine, self.cfg.micro_batch)]

    def global_mean(self, local_sum: torch.Tensor, tokens: int) -> float:
        """Sum over ``dp_cp`` of the local loss sums, divided by the global token count."""
        total = local_sum.detach().float().clone()
        if self.ctx.groups.size("dp_cp") > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.ctx.groups["dp_cp"])
        return float(total) / tokens


def check_layout(spec: Mapping[str, Any]) -> None:
    par = spec.get("parallel") or {}
    for dim in ("pp", "cp"):
        if par.get(dim, 1) > 1:
            raise NotImplementedError(f"the train kind does not support parallel.{dim}={par[dim]} yet")


def setup(ctx: RankContext) -> Trainer:
    spec = ctx.assignment.spec
    check_layout(spec)
    cfg = TrainConfig.from_spec(spec)
    model_cfg = GPTConfig.from_spec(SimpleNamespace(**(spec.get("model") or {})))
    if ctx.device.type == "cpu":
        slots = (spec.get("resources") or {}).get("slots_per_node", 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // slots))
    torch.manual_seed(cfg.seed)
    sp = bool((spec.get("parallel") or {}).get("sequence_parallel", False))
    model = build_shard(model_cfg, ctx.groups.get("tp"), sp, cfg.seed, device=ctx.device)
    named = model.named_parameters()
    reducer = GradReducer(named, ctx.groups.get("dp_cp"), ctx.groups.get("tp"),
                          bucket_bytes=data_parallel.DEFAULT_BUCKET_BYTES)
    use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and ctx.device.type == "cuda")
    return Trainer(
        ctx=ctx, cfg=cfg, model=model, optimizer=optim.build_optimizer(named, cfg.lr), reducer=reducer,
        data=TokenDataset.load(cfg.data, model_cfg.seq_len, model_cfg.vocab),
        dp_rank=ctx.assignment.coords.get("dp", 0), dp_size=ctx.groups.size("dp"), use_bf16=use_bf16,
        state=TrainState(),
    )


def plain_step(t: Trainer) -> StepFn:
    """Forward/backward of every micro-batch in turn; the reducer syncs on the last one."""
    tokens = t.cfg.global_batch * t.model.config.seq_len

    def step(batches: list[Batch]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=t.device)
        for m, (x, y) in enumerate(batches):
            t.reducer.set_sync(m == len(batches) - 1)
            with t.autocast():
                loss = t.model(x, y)  # fp32 sum over the micro-batch's tokens
            (loss / tokens).backward()
            total += loss.detach().float()
        return total

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train_step(t: Trainer, step_fn: StepFn, step: int) -> dict[str, float]:
    """One optimizer step; returns its metrics (``loss`` is NaN on a stage without it)."""
    _sync(t.device)
    t0 = time.perf_counter()
    local = step_fn(t.batches(step))
    t.reducer.finish()
    tokens = t.cfg.global_batch * t.model.config.seq_len
    loss = t.global_mean(local, tokens) if local is not None else math.nan
    norm = optim.clip_grad_norm(t.params, t.cfg.grad_clip, t.ctx.groups.get("mp"))
    lr = optim.lr_at(step, lr=t.cfg.lr, warmup=t.cfg.warmup, steps=t.cfg.steps)
    optim.set_lr(t.optimizer, lr)
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    _sync(t.device)
    dt = time.perf_counter() - t0
    return {"loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tokens / dt, "step_time_s": dt,
            "peak_mem_mb": peak_memory_mb(t.device)}


@torch.no_grad()
def evaluate(t: Trainer) -> float:
    """Mean loss over ``EVAL_BATCHES`` fixed held-out global batches."""
    t.model.module.eval()
    n = EVAL_BATCHES * t.cfg.global_batch
    total = torch.zeros((), dtype=torch.float32, device=t.device)
    for x, y in t.batches(0, VAL, global_batch=n):
        with t.autocast():
            total += t.model(x, y).float()
    t.model.module.train()
    return t.global_mean(total, n * t.model.config.seq_len)


def _every(n: int, step: int) -> bool:
    return n > 0 and step % n == 0


def train(t: Trainer, step_fn: StepFn | None = None) -> dict[str, Any]:
    """Steps ``state.step + 1 .. steps``; returns the job result."""
    step_fn = step_fn or plain_step(t)
    st, log = t.state, t.ctx.log
    metrics: dict[str, float] = {}
    for step in range(st.step + 1, t.cfg.steps + 1):
        metrics = train_step(t, step_fn, step)
        st.step = step
        st.losses.append({"step": step, "loss": metrics["loss"]})
        if _every(t.cfg.eval_every, step) or (t.cfg.eval_every and step == t.cfg.steps):
            metrics["val_loss"] = evaluate(t)
            st.val_losses.append({"step": step, "loss": metrics["val_loss"]})
        t.ctx.status.write("running", step=step, metrics=metrics)
        log.info("step", step=step, **{k: round(v, 6) for k, v in metrics.items()})
        if _every(t.cfg.checkpoint_every, step):
            path = save_checkpoint(t, step)
            log.info("checkpoint", step=step, path=path)
    final = {"step": st.step, **metrics}
    if st.val_losses:
        final["val_loss"] = st.val_losses[-1]["loss"]
    return {"losses": st.losses, "val_losses": st.val_losses, "final": final, "resumed_from": st.resumed_from}


def run(ctx: RankContext) -> dict[str, Any]:
    """The ``train`` job kind."""
    t = setup(ctx)
    restore_or_reset(t)
    try:
        return train(t)
    finally:
        t.reducer.remove_hooks()
