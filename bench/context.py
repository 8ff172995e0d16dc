"""Context parallelism side by side: one attention layer at cp = 1, 2, 4 on a long sequence.

Forks 4 gloo ranks (FileStore rendezvous in a temporary directory, one thread each) and runs
the GPT's own ``CausalSelfAttention`` layer (qkv projection, causal attention, output
projection), forward + backward, for a batch of ``--batch`` sequences of ``--seq`` tokens:

* ``serial``: cp=1 with the default core (SDPA, fused causal kernel), on rank 0;
* ``ring cp=N``: the same layer with ``RingAttention`` over N ranks, each holding T/N tokens
  of the balanced split (cp=1: the ring code alone, no communication).

Per rank it reports:

* saved: the most bytes autograd held saved for backward at once (``saved_tensors_hooks``;
  each storage counted once, parameters excluded): the layer's activation memory, which
  should fall as 1/cp;
* rss: the peak growth of the process's resident memory over one forward + backward
  (``/proc/self/clear_refs`` resets ``VmHWM``, then ``VmHWM`` − ``VmRSS`` before). Children
  run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns every large block on free
  and the peak is not hidden by memory kept from an earlier round. It includes transient
  buffers (scores inside kernels, received K/V blocks, dK/dV in flight). Ring backward keeps
  a few K/V-sized blocks live (the block in use, the next one arriving, its dK/dV and the
  dK/dV arriving), each 2·(T/cp)·hidden values, so rss falls as 1/cp only from cp=2 on;
* step: wall time of forward + backward, best of ``--rounds`` after one warm-up, of the
  slowest rank.

Ratios are against the serial row. On a 2-core machine cp=4 runs 4 single-thread ranks on
2 cores, so its step time shows time-sharing, not the speed-up of 4 devices.

    python bench/context.py [--seq 4096] [--hidden 64] [--heads 4] [--batch 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rankctl.models.attention import AttentionCore, RingAttention, causal_attention
from rankctl.models.gpt import CausalSelfAttention, GPTConfig, SerialLayers
from rankctl.parallel.context import cp_indices

WORLD = 4
CASES = (("serial", 1), ("ring", 1), ("ring", 2), ("ring", 4))


class SavedBytes:
    """Live and peak bytes of the storages autograd holds saved for backward."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        if key not in self.skip:
            if key not in self.refs:
                self.live += t.untyped_storage().nbytes()
                self.peak = max(self.peak, self.live)
            self.refs[key] = self.refs.get(key, 0) + 1
        return (key, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        return packed[1]

    def release(self) -> None:
        """The graph is gone (after backward): nothing is held any more."""
        self.refs.clear()
        self.live = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _proc_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def build_layer(ns: argparse.Namespace, core: AttentionCore) -> CausalSelfAttention:
    cfg = GPTConfig(layers=1, hidden=ns.hidden, heads=ns.heads, seq_len=ns.seq, vocab=256)
    layer = CausalSelfAttention(cfg, SerialLayers(), "attn", core)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return layer


def one_step(layer: CausalSelfAttention, x: torch.Tensor, pos: torch.Tensor,
             meter: SavedBytes) -> tuple[float, int]:
    """(seconds, peak RSS growth in bytes) of one forward + backward."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _proc_bytes("VmRSS")
    start = time.perf_counter()
    with meter.hooks():
        y = layer(x, pos)
    y.backward(torch.ones_like(y))
    seconds = time.perf_counter() - start
    del y
    meter.release()
    return seconds, _proc_bytes("VmHWM") - base


def run_case(ns: argparse.Namespace, kind: str, cp: int, group: "dist.ProcessGroup | None") -> dict:
    rank = dist.get_rank(group) if group is not None else 0
    core = causal_attention if kind == "serial" else RingAttention(group)
    layer = build_layer(ns, core)
    pos = cp_indices(ns.seq, cp, rank)
    x = torch.randn(ns.batch, ns.seq // cp, ns.hidden, generator=torch.Generator().manual_seed(rank))
    x.requires_grad_()
    meter = SavedBytes(list(layer.parameters()))
    one_step(layer, x, pos, meter)  # warm-up
    best, rss, saved = float("inf"), 0, 0
    for _ in range(ns.rounds):
        if group is not None:
            dist.barrier(group=group)
        meter.peak = 0
        seconds, rss = one_step(layer, x, pos, meter)
        best, saved = min(best, seconds), meter.peak
    return {"case": f"{kind} cp={cp}", "cp": cp, "rank": rank, "step_s": best, "rss": rss, "saved": saved}


def _rank_main(rank: int, store_path: str, ns: argparse.Namespace, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=300))
    groups = {2: dist.new_group([0, 1]), 4: dist.group.WORLD}
    rows = []
    for kind, cp in CASES:
        if rank < cp:
            rows.append(run_case(ns, kind, cp, groups.get(cp)))
        dist.barrier()
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        report(ns, [r for per_rank in gathered for r in per_rank])
    dist.destroy_process_group()


def report(ns: argparse.Namespace, rows: list[dict]) -> None:
    mib = 2.0 ** 20
    print(f"attention layer, seq={ns.seq} hidden={ns.hidden} heads={ns.heads} batch={ns.batch}, "
          f"fp32, {os.cpu_count()} CPU cores, 1 thread per rank")
    print(f"{'case':<12} {'saved/rank':>12} {'ratio':>6} {'rss/rank':>12} {'ratio':>6} {'step':>9} {'ratio':>6}")
    base: dict[str, float] = {}
    for kind, cp in CASES:
        mine = [r for r in rows if r["case"] == f"{kind} cp={cp}"]
        saved, rss = max(r["saved"] for r in mine), max(r["rss"] for r in mine)
        step = max(r["step_s"] for r in mine)
        base = base or {"saved": saved, "rss": rss, "step": step}
        print(f"{kind + ' cp=' + str(cp):<12} {saved / mib:>8.1f} MiB {saved / base['saved']:>6.2f} "
              f"{rss / mib:>8.1f} MiB {rss / max(base['rss'], 1):>6.2f} {step * 1e3:>7.0f}ms {step / base['step']:>6.2f}")
        if cp > 1:
            spread = [f"{r['step_s'] * 1e3:.0f}" for r in sorted(mine, key=lambda r: r["rank"])]
            print(f"{'':<12} per-rank step ms: {', '.join(spread)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc in each spawned child
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(os.path.join(tmp, "store"), ns, tmp), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
