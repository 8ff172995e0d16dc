"""The toy kind's rank entry: every rank adds (rank + 1) * toy.value over the world. With ``toy.steps`` it
reports steps, saves its step to its checkpoint when the daemon asks and resumes from it. The ranks agree on the
step they save at (``CheckpointRequests.agreed``: one world all-reduce MAX a step, as train does), so a rank
whose request came late saves at the others' step, and each reports it (``SAVED_ON_REQUEST``): the coordinator
moves a drained job once that step is complete."""

import json
import os
import time

import torch
import torch.distributed as dist

from rankctl.contract.files.rankfiles import SAVED_ON_REQUEST, CheckpointRequests


def _checkpoint(ctx) -> str:
    return os.path.join(ctx.checkpoint_dir, f"toy-rank-{ctx.assignment.rank}.json")


def _world_max(value: int) -> int:
    x = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return int(x.item())


def _steps(ctx) -> int | None:
    """Report toy.steps steps; the step this rank resumed from, if any. Every rank takes part in each step's
    agreement, its own resumed steps included (a rank moved to a new node holds no checkpoint and starts from 1),
    so the collectives match."""
    path = _checkpoint(ctx)
    requests = CheckpointRequests(ctx.assignment.run_dir, ctx.assignment.rank)
    resumed = json.load(open(path))["step"] if os.path.exists(path) else None
    world = _world_max if ctx.assignment.world_size > 1 else None
    for step in range(1, ctx.spec.toy.steps + 1):
        mine = step > (resumed or 0)
        if mine:
            time.sleep(0.1)
        at = requests.agreed(step, world)
        if at is not None:   # every rank saves now, at the step asked (or the one it is in if the request was late)
            with open(path, "w") as f:
                json.dump({"step": at}, f)   # a toy's state is its step: the one asked, whichever step saves it
            requests.saved(at)
        if mine:
            ctx.report(step, loss=1.0 / step, **({SAVED_ON_REQUEST: requests.served} if requests.served >= 0 else {}))
    return resumed


def run(ctx) -> dict:
    if ctx.spec.toy.path:
        open(ctx.spec.toy.path).close()
    resumed = _steps(ctx) if ctx.spec.toy.steps else None
    x = torch.tensor([float((ctx.assignment.rank + 1) * ctx.spec.toy.value)])
    dist.all_reduce(x)
    return {"sum": float(x.item()), "value": ctx.spec.toy.value, "resumed_from": resumed}
