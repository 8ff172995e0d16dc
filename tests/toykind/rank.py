"""The toy kind's rank entry: every rank adds (rank + 1) * toy.value over the world. With ``toy.steps`` it
reports steps, saves its step to its checkpoint when the daemon asks (``checkpoint_at``: at that step, or at the
step it is in when the request comes late, as train does), and resumes from it."""

import json
import os
import time

import torch
import torch.distributed as dist

from rankctl.contract.files.rankfiles import control_path, read_control


def _checkpoint(ctx) -> str:
    return os.path.join(ctx.checkpoint_dir, f"toy-rank-{ctx.assignment.rank}.json")


def _steps(ctx) -> int | None:
    """Report toy.steps steps; the step this rank resumed from, if any."""
    path, control = _checkpoint(ctx), control_path(ctx.assignment.run_dir, ctx.assignment.rank)
    resumed = json.load(open(path))["step"] if os.path.exists(path) else None
    saved = None
    for step in range((resumed or 0) + 1, ctx.spec.toy.steps + 1):
        time.sleep(0.1)
        at = read_control(control).get("checkpoint_at")
        if isinstance(at, int) and at <= step and saved != at:   # at the step asked, or the one it is in if late
            with open(path, "w") as f:
                json.dump({"step": at}, f)   # a toy's state is its step: the one asked, whichever step saves it
            saved = at
        ctx.report(step, loss=1.0 / step)
    return resumed


def run(ctx) -> dict:
    if ctx.spec.toy.path:
        open(ctx.spec.toy.path).close()
    resumed = _steps(ctx) if ctx.spec.toy.steps else None
    x = torch.tensor([float((ctx.assignment.rank + 1) * ctx.spec.toy.value)])
    dist.all_reduce(x)
    return {"sum": float(x.item()), "value": ctx.spec.toy.value, "resumed_from": resumed}
