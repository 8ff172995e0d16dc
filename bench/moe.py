"""Expert parallelism side by side: the same MoE GPT at ep = 1, 2, 4 on forked CPU ranks.

For each ep the script forks ``ep`` gloo ranks (FileStore rendezvous in a temporary
directory, 1 torch thread each; world = ep, so dp = ep and every rank holds E/ep experts).
Each rank trains on its own micro-batch of ``--batch`` sequences (weak scaling: tokens per
rank fixed), one forward + backward per step with the trainer's scaling, gradients reduced
as the trainer must (dense over dp_cp, expert over expt_dp). Per step, timed between a
barrier and the end of the reduction, the slower rank counts. Reported (median over the
timed steps): step time, the time spent inside the token all-to-alls (dispatch + combine,
forward and backward, count exchange included: ``parallel.experts.all_to_all_raw``),
global tokens/s, and (JSON) the token copies each rank sends to experts. With fewer cores than
ranks the ranks share cores, so the figures then show overhead, not speed-up.

    python bench/moe.py [--eps 1,2,4] [--layers 2] [--hidden 64] [--seq 64] [--batch 4]
                        [--experts 8] [--top-k 2] [--steps 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rankctl.models.gpt import GPTConfig
from rankctl.models.moe import MoEConfig
from rankctl.models.shard import build_shard
from rankctl.parallel import experts
from rankctl.parallel.groups import ProcessGroups
from rankctl.parallel.layout import ParallelConfig, RankLayout

SEED = 1234


class A2ATimer:
    """Wraps ``experts.all_to_all_raw`` (which every dispatch/combine, forward and backward,
    goes through) and sums the seconds spent in it."""

    def __init__(self) -> None:
        self.seconds, self._raw = 0.0, experts.all_to_all_raw
        experts.all_to_all_raw = self._timed

    def _timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._raw(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def build(ns: argparse.Namespace, pgs: ProcessGroups):
    cfg = GPTConfig(layers=ns.layers, hidden=ns.hidden, heads=ns.heads, seq_len=ns.seq, vocab=256)
    moe = MoEConfig(experts=ns.experts, top_k=ns.top_k, every=1, aux_loss=0.01)
    return build_shard(cfg, seed=SEED, moe=moe, expert_groups=experts.ExpertGroups.from_pgs(pgs))


def reduce(shard, pgs: ProcessGroups) -> None:
    for expert, kind in ((False, "dp_cp"), (True, "expt_dp")):
        if pgs.size(kind) > 1:
            for _, p in shard.named_parameters_by_kind(expert):
                dist.all_reduce(p.grad, group=pgs.get(kind))


def measure(ns: argparse.Namespace, pgs: ProcessGroups, rank: int) -> dict:
    shard, timer = build(ns, pgs), A2ATimer()
    g = torch.Generator().manual_seed(SEED + rank)
    scale = 1.0 / (pgs.world_size * ns.batch * ns.seq)
    rows = []
    for s in range(ns.warmup + ns.steps):
        data = torch.randint(0, 256, (ns.batch, ns.seq + 1), generator=g)
        shard.module.zero_grad(set_to_none=True)
        shard.moe.loss_scale = scale
        dist.barrier()
        timer.seconds, t0 = 0.0, time.perf_counter()
        (shard(data[:, :-1], data[:, 1:]) * scale).backward()
        reduce(shard, pgs)
        step = time.perf_counter() - t0
        stats = shard.moe.take().values()
        kept = sum(int(st.tokens.sum()) for st in stats)
        if s >= ns.warmup:
            rows.append([step, timer.seconds, kept, sum(st.dropped for st in stats)])
    t = torch.tensor(rows, dtype=torch.float64)
    worst = t[:, :2].clone()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"step_s": statistics.median(worst[:, 0].tolist()), "a2a_s": statistics.median(worst[:, 1].tolist()),
            "copies_per_rank": statistics.mean(t[:, 2].tolist())}


def _rank_main(rank: int, store_path: str, ns: argparse.Namespace, ep: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, ep), rank=rank,
                            world_size=ep, timeout=timedelta(seconds=120))
    layout = RankLayout(ParallelConfig(world_size=ep, ep=ep))
    pgs = ProcessGroups.build(rank, ep, layout.rank_groups(rank))
    result = measure(ns, pgs, rank)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def run(ns: argparse.Namespace, ep: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.start_processes(_rank_main, args=(str(Path(tmp) / "store"), ns, ep, out), nprocs=ep,
                           join=True, start_method="fork")
        result = json.loads(Path(out).read_text())
    tokens = ep * ns.batch * ns.seq
    return {"ep": ep, "ranks": ep, "tokens_per_step": tokens, **result,
            "tokens_per_s": tokens / result["step_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eps", default="1,2,4")
    for name, default in (("layers", 2), ("hidden", 64), ("heads", 4), ("seq", 64), ("batch", 4),
                          ("experts", 8), ("top-k", 2), ("steps", 10), ("warmup", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    ns = p.parse_args()
    torch.set_num_threads(1)  # the parent forks; it must not start a thread pool
    results = [run(ns, int(ep)) for ep in ns.eps.split(",")]
    print(f"MoE GPT: layers={ns.layers} hidden={ns.hidden} seq={ns.seq} batch/rank={ns.batch} "
          f"experts={ns.experts} top_k={ns.top_k}; median of {ns.steps} steps, slower rank")
    print(f"{'ep':>3} {'tokens/step':>12} {'step ms':>9} {'a2a ms':>8} {'a2a %':>6} {'tokens/s':>10}")
    for r in results:
        print(f"{r['ep']:>3} {r['tokens_per_step']:>12} {1e3 * r['step_s']:>9.1f} {1e3 * r['a2a_s']:>8.2f} "
              f"{100 * r['a2a_s'] / r['step_s']:>6.1f} {r['tokens_per_s']:>10.0f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
