"""What a training rank saves and restores: glue between ``kinds.train.loop`` and ``kinds.train.checkpoint``.

A rank file holds the local shard (``model``: every local pipeline chunk's parameters, keyed
by their serial names, which never collide between chunks), its metadata
(``meta``: ``models.shard.ParamMeta`` as dicts), the optimizer state, the RNG state, the step,
the loss history, and the layout (``world_size``, ``coords``, ``parallel``, ``model_config``).
Every rank writes its own file, so a MoE model's experts are saved by the ranks that own them
(each ep rank, every expt_tp slice); ``kinds.train.checkpoint.export_full_state_dict`` reads the
expert parameters from the ranks with ``edp == 0`` and the dense ones from ``dp == cp == 0``.
Data are a pure function of (seed, step, i), so params + optimizer + step (+ RNG) are all a
resumed run needs to reproduce the uninterrupted run's later losses.

Resume (``train.resume: true``, or a restart of the same job: ``restore_or_reset(restart=True)``;
never inferred from attempt numbers, which count from 1 for every job): every rank lists the
steps its own marker says it finished with the same fingerprint (``identity_of``), the lists
are all-gathered over the world, and the latest step common to all is loaded; checkpoints of
a different identity are refused with the fields that differ. A fresh run with checkpointing
on first deletes this rank's files under the job name, so shards of an earlier run of the same
name can never be mixed with new ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from rankctl.contract.names import job_id_problem, job_name_problem
from rankctl.kinds.train import checkpoint as ckpt

if TYPE_CHECKING:
    from rankctl.kinds.train.loop import Trainer


@dataclass
class TrainState:
    step: int = 0  # last finished step
    losses: list[dict[str, float | None]] = field(default_factory=list)  # loss None off the last stage
    val_losses: list[dict[str, float | None]] = field(default_factory=list)
    resumed_from: int | None = None


def _layout(t: Trainer) -> tuple[dict[str, Any], dict[str, Any]]:
    par = t.ctx.spec.parallel
    parallel = {k: getattr(par, k) for k in ("tp", "pp", "cp", "ep", "order", "sequence_parallel")}
    if par.vpp is not None:  # which layers a stage holds (absent when unset: older fingerprints hold)
        parallel["vpp"] = par.vpp
    if par.etp is not None:  # how experts are sliced (likewise absent when unset)
        parallel["etp"] = par.etp
    model = dataclasses.asdict(t.model_config)
    if t.moe is not None:
        model["moe"] = dataclasses.asdict(t.moe)
    return parallel, model


def root_of(t: Trainer) -> str:
    """``{state}/checkpoints/{job name}``; the name must be one safe path component."""
    a = t.ctx.assignment
    name = a.spec.get("name", a.job_id)
    problem = job_name_problem(name) if "name" in a.spec else job_id_problem(name)
    if problem:
        raise ValueError(f"no checkpoint directory: {problem}")
    return ckpt.checkpoint_root(a.run_dir, name)


DIGEST_TOKENS = 1 << 19  # tokens hashed at each end of each split


def data_identity(t: Trainer) -> dict[str, Any]:
    """The corpus: its source, size and a digest of both ends of each split (cheap for any size,
    and a file replaced under the same path shows)."""
    h = hashlib.sha1(usedforsecurity=False)
    for tokens in (t.data.train, t.data.val):
        h.update(tokens[:DIGEST_TOKENS].tobytes())
        h.update(tokens[-DIGEST_TOKENS:].tobytes())
    return {"source": t.cfg.data, "tokens": len(t.data.train) + len(t.data.val), "digest": h.hexdigest()[:16]}


def identity_of(t: Trainer) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: world size, layout and model (what the shards
    hold), the seed and the data (samples are a pure function of (seed, step, i): another seed
    or corpus would continue these weights on another run's samples).

    Left out on purpose: lr, warmup, steps, grad_clip, batch sizes, dtype, eval and checkpoint
    cadence. They steer the optimisation from here on but do not change what the saved tensors
    mean, and changing them on resume is legitimate (train longer, lower the lr)."""
    parallel, model = _layout(t)
    return {"world_size": t.ctx.assignment.world_size, "parallel": parallel, "model": model,
            "train": {"seed": t.cfg.seed, "data": data_identity(t)}}


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def state_dict(t: Trainer, step: int) -> dict[str, Any]:
    a = t.ctx.assignment
    parallel, model = _layout(t)
    return {
        "step": step, "rank": a.rank, "world_size": a.world_size, "coords": dict(a.coords),
        "parallel": parallel, "model_config": model,
        "model": {n: p.detach().cpu() for n, p in t.named_parameters()},
        "meta": {n: dataclasses.asdict(m) for n, m in t.meta().items()},
        "optimizer": t.optimizer.state_dict(),
        "rng": _rng_state(t.device),
        "history": {"losses": list(t.state.losses), "val_losses": list(t.state.val_losses)},
    }


def save_checkpoint(t: Trainer, step: int) -> str:
    identity = identity_of(t)
    return ckpt.save_rank(root_of(t), step, t.ctx.assignment.rank, state_dict(t, step), ckpt.fingerprint(identity),
                          identity)


@torch.no_grad()
def load_state(t: Trainer, state: dict[str, Any]) -> None:
    for name, p in t.named_parameters():
        p.copy_(state["model"][name].to(p.device))
    t.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and t.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], t.device)
    t.state = TrainState(step=state["step"], losses=list(state["history"]["losses"]),
                         val_losses=list(state["history"]["val_losses"]), resumed_from=state["step"])


def _latest_identity(root: str, rank: int, steps: list[int]) -> dict[str, Any] | None:
    marker = ckpt.read_marker(root, steps[-1], rank) if steps else None
    return (marker or {}).get("identity")


def refusal(root: str, saved: dict[str, Any] | None, identity: dict[str, Any]) -> str:
    """One line: why the checkpoints under ``root`` cannot be resumed by this job."""
    diffs = ckpt.differences(saved, identity) if saved else []
    what = "; ".join(diffs) if diffs else "a different world size, layout, model, seed or data"
    hint = "resume with the same settings, or submit with train.resume: false to start afresh"
    if not diffs or any(d.startswith(("world_size", "parallel.")) for d in diffs):
        hint += " (checkpoint.export_full_state_dict re-slices a checkpoint for another layout)"
    return f"cannot resume from {root}: its checkpoints were written by another run ({what}); {hint}"


def agree_resume_step(root: str, rank: int, world_size: int, identity: dict[str, Any], *,
                      restart: bool = False) -> int | None:
    """The latest step every rank has finished with this ``identity`` (one world collective);
    None when there is no checkpoint at all, or (``restart``) when no step is held by every rank
    (a replacement node has none: the attempt starts over); RuntimeError naming what differs otherwise."""
    fp, every = ckpt.fingerprint(identity), ckpt.complete_for(root, [rank])
    mine = (ckpt.complete_for(root, [rank], fp), every, _latest_identity(root, rank, every))
    views = [mine]
    if world_size > 1:
        views = [None] * world_size
        dist.all_gather_object(views, mine)
    common = set.intersection(*(set(v[0]) for v in views))
    if common:
        return max(common)
    if restart:
        return None
    if any(v[1] for v in views):
        saved = next((v[2] for v in views if v[2] is not None), None)
        raise RuntimeError(refusal(root, saved, identity))
    return None


def restore_or_reset(t: Trainer, *, restart: bool = False) -> None:
    """Load the latest complete checkpoint when resuming; clear stale files on a fresh run.

    ``restart``: this attempt restarts the same job after a failure, so it continues from the
    job's own checkpoints even without ``train.resume`` (the one place to pass that in).
    """
    a, cfg = t.ctx.assignment, t.cfg
    root = root_of(t)
    if cfg.resume or restart:
        step = agree_resume_step(root, a.rank, a.world_size, identity_of(t), restart=restart and not cfg.resume)
        if step is not None:
            load_state(t, ckpt.load_rank(root, step, a.rank))
            t.ctx.log.info("resumed", step=step, root=root, restart=restart)
        elif restart:
            t.ctx.log.info("restart without a checkpoint every rank has; starting over", root=root)
        return
    if cfg.checkpoint_every > 0 and ckpt.remove_rank_files(root, a.rank):
        t.ctx.log.info("removed stale checkpoint files", root=root)
