"""The ``comm-check`` kind's rank entry (``run``): verify and time every group of the layout, like nccl-tests.

For each distinct group (size > 1) a rank belongs to, plus the world, run all-reduce and
all-gather on a known payload (rank + 1), check the results exactly, and time them.
Bandwidths follow nccl-tests (``S`` bytes, time ``t``, ``n`` ranks)::

    algbw = S / t
    all-reduce busbw = algbw * 2(n-1)/n     (S = buffer size)
    all-gather busbw = algbw * (n-1)/n      (S = gathered output size)

Spec section (all optional): ``comm_check: {size_bytes: 1048576, warmup: 2, iters: 5, duration: 0}``.
``duration > 0`` is a soak: the check repeats in rounds until rank 0 has seen ``duration``
seconds pass (rank 0 broadcasts "go on" each round so all ranks run the same rounds);
the result keeps each op's slowest round and the round count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from rankctl.kinds.comm_check.ops import BUS_FACTOR, OPS
from rankctl.kinds.comm_check.spec import CommCheckSpec

from rankctl.kinds.context import RankContext
from rankctl.parallel.groups import ProcessGroups


class CommCheckError(RuntimeError):
    """A collective returned a wrong value."""


@dataclass(frozen=True, kw_only=True)
class _Group:
    names: list[str]  # the group names sharing these members
    members: list[int]
    pg: Any  # dist.ProcessGroup
    rank: int

    def where(self) -> str:
        return f"{'/'.join(self.names)} group {self.members} (observed on rank {self.rank})"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify_allreduce(out: torch.Tensor, g: _Group) -> None:
    expected = float(sum(m + 1 for m in g.members))
    bad = (out != expected).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise CommCheckError(
            f"allreduce wrong on {g.where()}: element {i} is {out[i].item()}, expected {expected} "
            f"(sum of rank+1 over ranks {g.members}); {bad.shape[0]} of {out.numel()} elements wrong"
        )


def verify_allgather(out: torch.Tensor, g: _Group) -> None:
    chunks = out.view(len(g.members), -1)
    for src, chunk in zip(g.members, chunks):
        bad = (chunk != float(src + 1)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise CommCheckError(
                f"allgather wrong on {g.where()}: the chunk from rank {src} has element {i} = "
                f"{chunk[i].item()}, expected {float(src + 1)}"
            )


Step = tuple[Callable[[], Any], Callable[[], Any], torch.Tensor]  # (prepare, call, output)


def _allreduce_step(g: _Group, count: int, device: torch.device) -> Step:
    buf = torch.empty(count, dtype=torch.float32, device=device)
    return (lambda: buf.fill_(g.rank + 1)), (lambda: dist.all_reduce(buf, group=g.pg)), buf


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _allgather_step(g: _Group, count: int, device: torch.device) -> Step:
    n = len(g.members)
    inp = torch.empty(max(1, count // n), dtype=torch.float32, device=device)
    out = torch.empty(inp.numel() * n, dtype=torch.float32, device=device)
    return (lambda: inp.fill_(g.rank + 1)), (lambda: _all_gather_single(out, inp, group=g.pg)), out


STEPS = {"allreduce": (_allreduce_step, verify_allreduce), "allgather": (_allgather_step, verify_allgather)}


def bench_op(op: str, g: _Group, cfg: CommCheckSpec, device: torch.device) -> dict[str, Any]:
    """Warm up, then time ``cfg.iters`` calls; every call's output is verified (untimed).

    A wrong value does not stop the loop: every member must issue the same collectives
    or the others would wait forever. The first wrong value is returned under ``error``.
    """
    make, verify = STEPS[op]
    prepare, call, out = make(g, cfg.size_bytes // 4, device)
    times, error = [], None
    for i in range(cfg.warmup + cfg.iters):
        prepare()
        _sync(device)
        t0 = time.perf_counter()
        call()
        _sync(device)
        if i >= cfg.warmup:
            times.append(time.perf_counter() - t0)
        try:
            verify(out, g)
        except CommCheckError as exc:
            error = error or str(exc)
    result = metrics(op, out.numel() * out.element_size(), len(g.members), sum(times) / len(times))
    return {**result, "error": error} if error else result


def metrics(op: str, nbytes: int, n: int, seconds: float) -> dict[str, float]:
    algbw = nbytes / seconds / 1e9
    return {"us": seconds * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * BUS_FACTOR[op](n), "bytes": nbytes}


def check_groups(pgs: "ProcessGroups", rank: int, cfg: CommCheckSpec, device: torch.device) -> list[dict[str, Any]]:
    """Verify and time every distinct group of size > 1 this rank belongs to (world included).

    Rows carry ``error`` per op where a value was wrong; ``errors(rows)`` lists them.
    """
    out = []
    for members, names in pgs.distinct():
        g = _Group(names=names, members=list(members), pg=pgs[names[0]], rank=rank)
        row: dict[str, Any] = {"kinds": names, "members": list(members)}  # the result's key stays
        for op in OPS:
            row[op] = bench_op(op, g, cfg, device)
        out.append(row)
    return out


def errors(rows: list[dict[str, Any]]) -> list[str]:
    """Every wrong-value message in ``check_groups`` rows."""
    return [row[op]["error"] for row in rows for op in OPS if row[op].get("error")]


def merge_rounds(worst: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keep, per group and op, the slowest measurement (and the first error) of two rounds."""
    out = []
    for old, new in zip(worst, rows):
        row = dict(old)
        for op in OPS:
            slow = new[op] if new[op]["us"] > old[op]["us"] else old[op]
            error = old[op].get("error") or new[op].get("error")
            row[op] = {**slow, "error": error} if error else {k: v for k, v in slow.items() if k != "error"}
        out.append(row)
    return out


def _go_on(started: float, cfg: CommCheckSpec, device: torch.device) -> bool:
    """Rank 0's clock decides for everyone whether another soak round runs."""
    flag = torch.tensor([float(time.monotonic() - started < cfg.duration)], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def run(ctx: RankContext) -> dict[str, Any]:
    """The ``comm-check`` job kind: this rank's per-group results; raises on any wrong value."""
    cfg = ctx.spec.comm_check
    torch.set_num_threads(1)
    started, rounds = time.monotonic(), 1
    groups = check_groups(ctx.groups, ctx.assignment.rank, cfg, ctx.device)
    while cfg.duration > 0 and _go_on(started, cfg, ctx.device):
        groups = merge_rounds(groups, check_groups(ctx.groups, ctx.assignment.rank, cfg, ctx.device))
        ctx.status.write("running", step=rounds, metrics={"errors": float(len(errors(groups)))})
        rounds += 1
    if wrong := errors(groups):
        raise CommCheckError(f"{len(wrong)} wrong collective result(s): " + "; ".join(wrong))
    ctx.log.info("comm-check passed", groups=len(groups), rounds=rounds)
    return {"size_bytes": cfg.size_bytes, "iters": cfg.iters, "rounds": rounds, "groups": groups}

