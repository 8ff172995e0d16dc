"""The toy kind's rank entry: every rank adds (rank + 1) * toy.value over the world."""

import torch
import torch.distributed as dist


def run(ctx) -> dict:
    x = torch.tensor([float((ctx.assignment.rank + 1) * ctx.spec.toy.value)])
    dist.all_reduce(x)
    return {"sum": float(x.item()), "value": ctx.spec.toy.value}
