"""The ``train`` kind's rank entry (``run(ctx)``): one rank's training loop.

Per step ``s`` (1-based): this rank's micro-batches (its DP slice of the global batch,
``kinds.train.data``; under context parallelism each CP rank's share of every sequence,
``parallel.context.cp_shard_batch``, with the tokens' global positions), forward/backward
through ``step_fn`` (loss sum / global token count per micro-batch; gradients reduced over
``dp_cp`` by ``GradReducer`` during each chunk's last backward), the tied embedding's
gradients summed between the first and last pipeline stage, global-norm clipping over
``mp`` (tp x pp), AdamW with warm-up + cosine LR, then a status record with loss, lr, grad
norm, tokens/s, step time and peak memory (the last rank also prints a line for about every 20th step, as
a training script does: ``ctl logs``). Held-out loss every ``train.eval_every`` steps, a
sharded checkpoint every ``train.checkpoint_every`` steps and when the daemon asks for one (the
rank's control file), both saved before the step's status record, and an in-memory snapshot
every ``train.snapshot_every`` steps (copied before the record, written in the background;
``kinds.train.train_state``).

Layouts. A rank holds ``chunks``: its pipeline stage's model chunks (``models.stages``; one,
the whole model, when pp = 1; ``parallel.vpp`` of them when set). pp = 1 runs ``plain_step``;
pp > 1 runs ``pipelined_step``: the schedule ``parallel.schedule`` (gpipe | 1f1b, interleaved
with vpp) interpreted by ``parallel.pipeline.pipeline_step`` over ``m = global_batch /
(micro_batch * dp)`` micro-batches. cp > 1 swaps every chunk's attention core for ring
attention over the ``cp`` group.

Loss. ``step_fn`` returns the local loss sum, or None on a stage without the head; the
global loss is the sum over ``dp_cp`` of the local sums divided by the global token count.
Stages without the head report ``loss: null`` (metrics and result), so the coordinator takes
the job's losses from a last-stage rank (``kinds.common.losses_result``).

Mixture of experts (``model.moe``, ``models.moe``). Every chunk is built with the MoE config
and ``ExpertGroups.from_pgs``; each chunk's ``MoETracker.loss_scale`` is the loss sum's scale
(1 / global tokens), so the auxiliary load-balancing loss enters backward on every stage.
Gradients: two reducers (``GradReducers``), dense over ``dp_cp``/``tp`` and expert over
``expt_dp``/``expt_tp``; the norm adds the expert part over ``tp_ep_pp`` (``kinds.train.optim``).
Per step the trackers' statistics (per MoE layer: tokens per expert, dropped copies, aux-loss
sum) are all-reduced over the world in one fixed-size tensor (that is the sum over
``tp_dp_cp`` of each stage, then over the stages), so every rank knows every layer's figures.
The reported training ``loss`` is the cross-entropy mean plus the aux losses
(``Σ_layers mean_b L_b``: the objective that is differentiated, and what the serial run
reports); ``aux_loss`` in the metrics is the aux part alone, and ``expert_tokens`` maps each
MoE layer (``layers.<i>.mlp``) to its tokens per expert over the step's global batch (the
result's ``final`` holds the last step's). ``val_loss`` stays the plain cross-entropy.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import torch

from rankctl.contract.files.rankfiles import SAVED_ON_REQUEST
from rankctl.kinds.context import RankContext
from rankctl.kinds.train import optim
from rankctl.kinds.train.data import VAL, TokenDataset
from rankctl.kinds.train.render import printed_step, step_line
from rankctl.contract.files.rankfiles import CheckpointRequests
from rankctl.kinds.train.train_state import Snapshots, restore_or_reset, save_after_step
from rankctl.kinds.train.trainer import Batch, Layout, StepFn, Trainer, TrainState
from rankctl.models.attention import RingAttention, set_attention
from rankctl.models.embedding_sync import duplicate_params, sync_embedding_grads
from rankctl.models.gpt import GPTConfig
from rankctl.models.moe import MoEConfig
from rankctl.models.shard import ShardedModel
from rankctl.models.stages import build_chunks
from rankctl.parallel import data_parallel
from rankctl.parallel.data_parallel import GradReducer, GradReducers
from rankctl.parallel.experts import ExpertGroups
from rankctl.parallel.pipeline import init_p2p, pipeline_step

EVAL_BATCHES = 2  # held-out global batches per evaluation (the same samples every time)


def _build_chunks(ctx: RankContext, model_cfg: GPTConfig, layout: Layout, sp: bool, seed: int,
                  moe: MoEConfig | None = None) -> list[ShardedModel]:
    extra: dict[str, Any] = {}
    if moe is not None:
        extra = {"moe": moe, "expert_groups": ExpertGroups.from_pgs(ctx.groups)}
    chunks = build_chunks(model_cfg, pp=layout.pp, vpp=layout.vpp, stage=layout.stage, tp_group=ctx.groups.get("tp"),
                          sequence_parallel=sp, seed=seed, device=ctx.device, **extra)
    if layout.cp > 1:
        core = RingAttention(ctx.groups.get("cp"))
        for chunk in chunks:
            set_attention(chunk.module, core)
    return chunks


def reducers(ctx: RankContext, chunks: list[ShardedModel], moe: MoEConfig | None) -> GradReducer | GradReducers:
    """One reducer for a dense model; dense + expert ones for a MoE model."""
    named = [np for c in chunks for np in c.named_parameters()]
    if moe is None:
        return GradReducer(named, ctx.groups.get("dp_cp"), ctx.groups.get("tp"),
                           bucket_bytes=data_parallel.DEFAULT_BUCKET_BYTES)
    kinds = ((False, "dp_cp", "tp"), (True, "expt_dp", "expt_tp"))
    return GradReducers(GradReducer([np for c in chunks for np in c.named_parameters_by_kind(expert)],
                                    ctx.groups.get(dp_kind), ctx.groups.get(tp_kind),
                                    bucket_bytes=data_parallel.DEFAULT_BUCKET_BYTES)
                        for expert, dp_kind, tp_kind in kinds)


def setup(ctx: RankContext) -> Trainer:
    spec = ctx.spec  # validated and checked at submit (kinds.train.checks)
    cfg = spec.train
    moe = MoEConfig.from_spec(spec.model.moe) if spec.model.moe is not None else None
    model_cfg = GPTConfig.from_spec(spec.model.model_copy(update={"moe": None}))
    torch.manual_seed(cfg.seed)
    layout = Layout.of(spec.parallel, ctx.groups)
    sp = spec.parallel.sequence_parallel
    chunks = _build_chunks(ctx, model_cfg, layout, sp, cfg.seed, moe)
    named = [np for c in chunks for np in c.named_parameters()]
    reducer = reducers(ctx, chunks, moe)
    if layout.pp > 1:
        init_p2p(ctx.groups, ctx.device)
    use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and ctx.device.type == "cuda")
    return Trainer(
        ctx=ctx, cfg=cfg, chunks=chunks, optimizer=optim.build_optimizer(named, cfg.lr), reducer=reducer,
        data=TokenDataset.load(cfg.data, model_cfg.seq_len, model_cfg.vocab),
        dp_rank=ctx.assignment.coords.get("dp", 0), dp_size=ctx.groups.size("dp"), use_bf16=use_bf16,
        state=TrainState(), layout=layout, moe=moe,
    )


def _positions(batch: Batch) -> torch.Tensor | None:
    return batch[2] if len(batch) > 2 else None


def plain_step(t: Trainer) -> StepFn:
    """pp = 1: forward/backward of every micro-batch in turn; the reducer syncs on the last one."""
    model, scale = t.chunks[0], 1.0 / t.tokens()

    def step(batches: list[Batch]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=t.device)
        for m, batch in enumerate(batches):
            t.reducer.set_sync(m == len(batches) - 1)
            with t.autocast():
                loss = model(batch[0], batch[1], positions=_positions(batch))  # fp32 sum over the tokens
            (loss * scale).backward()
            total += loss.detach().float()
        return total

    return step


def pipelined_step(t: Trainer) -> StepFn:
    """pp > 1: the stage's schedule; DP sync on each chunk's last backward. Returns the loss
    sum on the last stage, None elsewhere."""
    actions = t.layout.actions(t.cfg.global_batch // (t.cfg.micro_batch * t.dp_size))

    def step(batches: list[Batch]) -> torch.Tensor | None:
        with t.autocast():
            sums = pipeline_step(t.chunks, actions, batches, t.ctx.groups, loss_scale=1.0 / t.tokens(),
                                 before_backward=lambda _chunk, last: t.reducer.set_sync(last))
        if not t.has_loss:
            return None
        return torch.tensor(sums, dtype=torch.float32, device=t.device).sum()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train_step(t: Trainer, step_fn: StepFn, step: int) -> dict[str, Any]:
    """One optimizer step; returns its metrics (``loss`` is None on a stage without it)."""
    _sync(t.device)
    t0 = time.perf_counter()
    t.set_moe_loss_scale(1.0 / t.tokens())
    local = step_fn(t.batches(step))
    t.reducer.finish()
    sync_embedding_grads(t.chunks, t.ctx.groups)
    loss = t.global_mean(local, t.tokens()) if local is not None else None
    moe = t.moe_stats()
    extra: dict[str, Any] = {}
    if moe is not None:
        aux = moe["aux_sum"] / t.tokens()
        loss = None if loss is None else loss + aux
        extra = {"aux_loss": aux, "expert_tokens": moe["expert_tokens"], "expert_dropped": moe["expert_dropped"]}
    norm = optim.clip_grad_norm(t.params, t.cfg.grad_clip, t.ctx.groups.get("mp"), exclude=duplicate_params(t.chunks),
                                expert_group=t.ctx.groups.get("tp_ep_pp") if t.moe is not None else None)
    lr = optim.lr_at(step, lr=t.cfg.lr, warmup=t.cfg.warmup, steps=t.cfg.steps)
    optim.set_lr(t.optimizer, lr)
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    _sync(t.device)
    dt = time.perf_counter() - t0
    return {"loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": t.tokens() / dt, "step_time_s": dt,
            "peak_mem_mb": peak_memory_mb(t.device), **extra}


@torch.no_grad()
def evaluate(t: Trainer) -> float | None:
    """Mean loss over ``EVAL_BATCHES`` fixed held-out global batches (None off the last stage)."""
    n = EVAL_BATCHES * t.cfg.global_batch
    batches = t.batches(0, VAL, global_batch=n)
    for c in t.chunks:
        c.module.eval()
    with t.autocast():
        if t.layout.pp > 1:  # the GPipe order runs every forward first, so its prefix is forward-only
            actions = t.layout.actions(len(batches), schedule="gpipe")
            sums = pipeline_step(t.chunks, actions, batches, t.ctx.groups, loss_scale=1.0, forward_only=True)
            total = torch.tensor(sums, dtype=torch.float32, device=t.device).sum() if t.has_loss else None
        else:
            total = sum((t.chunks[0](b[0], b[1], positions=_positions(b)).float() for b in batches),
                        torch.zeros((), dtype=torch.float32, device=t.device))
    for c in t.chunks:
        c.module.train()
    return t.global_mean(total, t.tokens(n)) if total is not None else None


def _every(n: int, step: int) -> bool:
    return n > 0 and step % n == 0


def train(t: Trainer, step_fn: StepFn | None = None) -> dict[str, Any]:
    """Steps ``state.step + 1 .. steps``; returns the job result."""
    step_fn = step_fn or (pipelined_step(t) if t.layout.pp > 1 else plain_step(t))
    st, log = t.state, t.ctx.log
    snapshots = Snapshots(t, t.cfg.snapshot_every)
    requests = CheckpointRequests(t.ctx.assignment.run_dir, t.ctx.assignment.rank)
    metrics: dict[str, Any] = {}
    printer = t.ctx.assignment.rank == t.ctx.assignment.world_size - 1   # the last stage's: it has the loss
    try:
        for step in range(st.step + 1, last_step(t.cfg) + 1):
            metrics = train_step(t, step_fn, step)
            st.step = step
            st.losses.append({"step": step, "loss": metrics["loss"]})
            if _every(t.cfg.eval_every, step) or (t.cfg.eval_every and step == t.cfg.steps):
                metrics["val_loss"] = evaluate(t)
                st.val_losses.append({"step": step, "loss": metrics["val_loss"]})
            save_after_step(t, step, snapshots, requests,  # a checkpoint is complete before the step's record
                            stop=step == t.cfg.stop_at)
            t.ctx.status.write("running", step=step, metrics=metrics if requests.served < 0 else
                               {**metrics, SAVED_ON_REQUEST: requests.served})
            if printer and printed_step(step, t.cfg.steps, "val_loss" in metrics):  # as a training script prints
                print(step_line(step, t.cfg.steps, metrics), flush=True)
            log.info("step", step=step, **{k: round(v, 6) for k, v in metrics.items() if isinstance(v, (int, float))})
    finally:
        snapshots.wait(t)
    if snapshots.every:
        log.info("snapshots", written=len(snapshots.written), waited_s=round(snapshots.waited_s, 3))
    final = {"step": st.step, **metrics}
    if st.val_losses:
        final["val_loss"] = st.val_losses[-1]["loss"]
    out = {"losses": st.losses, "val_losses": st.val_losses, "final": final, "resumed_from": st.resumed_from}
    if st.resumed_layout:   # resumed under another layout: the one the checkpoint was written under
        out["resumed_layout"] = st.resumed_layout
    if t.cfg.stop_at is not None and t.cfg.stop_at < t.cfg.steps and st.step == t.cfg.stop_at:
        out["ended"] = (f"stopped at step {st.step} of {t.cfg.steps} (train.stop_at) with a checkpoint; "
                        f"train.resume: true goes on from it")
    return out


def last_step(cfg: Any) -> int:
    """The step the run ends after: ``train.stop_at`` when set, else ``train.steps``."""
    return cfg.steps if cfg.stop_at is None else min(cfg.stop_at, cfg.steps)


def run(ctx: RankContext) -> dict[str, Any]:
    """The ``train`` job kind."""
    t = setup(ctx)
    with ctx.busy("restore"):
        restore_or_reset(t, restart=ctx.assignment.restart)  # the coordinator's restart of the same job
    try:
        return train(t)
    finally:
        t.reducer.remove_hooks()
