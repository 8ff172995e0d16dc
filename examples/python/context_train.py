"""A training script that uses ``rankctl.context()`` (examples/python-context.yaml).

1. Every group kind (``world`` and the layout's 16): an all-reduce of ``rank + 1`` must equal the
   sum over the members ``ctx.ranks(kind)`` names.
2. A data-parallel linear regression: gradients and the loss averaged over the ``dp`` group,
   the loss reported each step with ``ctx.report(step, loss=...)``.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

import rankctl

TRUE_W = torch.tensor([1.0, -2.0, 3.0, 0.5])


def check_groups(ctx) -> dict[str, float]:
    """kind -> the all-reduced sum, checked against the members' sum."""
    sums = {}
    for kind in ("world", *ctx.layout.names):
        try:
            members = ctx.ranks(kind)
        except KeyError:  # embd, pos_embd: only the first (and last) pipeline stage is a member
            continue
        x = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(x, group=ctx.group(kind))
        expected = float(sum(r + 1 for r in members))
        if x.item() != expected:
            raise AssertionError(f"rank {ctx.rank}: {kind} all-reduce gave {x.item()}, expected {expected}")
        sums[kind] = x.item()
    return sums


def train(ctx, steps: int, lr: float) -> float:
    dp, dp_size = ctx.group("dp"), len(ctx.ranks("dp"))
    gen = torch.Generator().manual_seed(1000 + ctx.coords["dp"])  # each dp rank its own data
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=lr)
    loss_value = float("nan")
    for step in range(1, steps + 1):
        x = torch.randn(32, 4, generator=gen)
        loss = ((x @ w - x @ TRUE_W) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        dist.all_reduce(w.grad, group=dp)
        w.grad /= dp_size
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp)
        loss_value = mean.item() / dp_size
        opt.step()
        ctx.report(step, loss=loss_value, lr=lr)
    return loss_value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    ctx = rankctl.context()
    sums = check_groups(ctx)
    print(f"rank {ctx.rank} coords {ctx.coords} node {ctx.node}: all-reduce sums ok "
          f"{json.dumps(sums, sort_keys=True)}", flush=True)
    final = train(ctx, args.steps, args.lr)
    with open(os.path.join(ctx.checkpoint_dir, f"rank-{ctx.rank}.txt"), "w") as f:
        f.write(f"{final}\n")
    print(f"rank {ctx.rank}: final loss {final:.6f}", flush=True)


if __name__ == "__main__":
    main()
