"""Pipeline schedules side by side: GPipe, 1F1B and interleaved 1F1B at the same pp and m.

Forks ``pp`` gloo ranks (FileStore rendezvous in a temporary directory). For each schedule
it measures, per stage:

* step: the wall time of one training step's forwards and backwards (best of ``--steps``
  rounds, the schedules taking turns so that outside load hits them alike), the slowest stage;
* work: the same rank's compute alone (every chunk's forward + backward of ``m``
  micro-batches, no communication, no waiting), the slowest stage;
* measured bubble = step / work, against the ideal ``(m + (p - 1)/v) / m`` (v = vpp;
  ``(m + p - 1)/m`` for GPipe and 1F1B) and the simulator's makespan ratio;
* peak activations: the most bytes that autograd held saved for backward at once
  (``saved_tensors_hooks``; parameters excluded), per stage.

    python bench/pipeline.py [--pp 2] [--m 8] [--steps 5]

On 2 CPU cores use pp=2: with more ranks than cores the stages time-share the cores and
the bubble hides in the scheduler.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rankctl.models.gpt import GPTConfig
from rankctl.models.stages import build_chunks
from rankctl.parallel.groups import ProcessGroups
from rankctl.parallel.layout import ParallelConfig, RankLayout
from rankctl.parallel.pipeline import activation_shape, pipeline_step
from rankctl.parallel.schedule_sim import simulate
from rankctl.parallel.schedules import PipelineShape, schedule, stage_actions

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("1f1b", 2))


class ActivationMeter:
    """Live bytes of tensors autograd saved for backward (a saved tensor is freed with its graph)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.skip = {p.data_ptr() for p in params}
        self.live = self.peak = 0

    def _pack(self, t: torch.Tensor) -> object:
        meter, nbytes = self, 0 if t.data_ptr() in self.skip else t.numel() * t.element_size()

        class Held:
            def __init__(self) -> None:
                self.t = t
                meter.live += nbytes
                meter.peak = max(meter.peak, meter.live)

            def __del__(self) -> None:
                meter.live -= nbytes
        return Held()

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.t)


def work_time(chunks: list, batches: list, shape: PipelineShape) -> float:
    """Compute alone: every chunk's forward and backward of every micro-batch, no p2p."""
    t0 = time.perf_counter()
    for chunk in chunks:
        for tokens, targets in batches:
            if chunk.module.has_embedding:
                x = tokens
            else:
                x = torch.randn(activation_shape(chunk, tokens), requires_grad=True)
            out = chunk(x, targets) if chunk.module.has_head else chunk(x)
            torch.autograd.backward(out, None if out.dim() == 0 else torch.randn_like(out))
    return time.perf_counter() - t0


def setup(ns: argparse.Namespace, pgs: ProcessGroups, name: str, vpp: int) -> dict:
    """One schedule's chunks, actions and data on this rank; measures peak activations."""
    cfg = GPTConfig(layers=ns.layers, hidden=ns.hidden, heads=4, seq_len=ns.seq, vocab=256)
    stage = pgs.local_rank("pp")
    chunks = build_chunks(cfg, pp=ns.pp, vpp=vpp, stage=stage, seed=1)
    shape = PipelineShape(pp=ns.pp, vpp=vpp, microbatches=ns.m)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (ns.m, ns.micro_batch, ns.seq + 1), generator=g)
    case = {"chunks": chunks, "actions": stage_actions(name, shape, stage), "shape": shape,
            "batches": [(d[:, :-1], d[:, 1:]) for d in data], "scale": 1.0 / data[..., 1:].numel()}
    meter = ActivationMeter([p for c in chunks for p in c.parameters()])
    with meter.hooks():
        step(case, pgs)
    case.update(peak=meter.peak, step=[], work=[])
    return case


def step(case: dict, pgs: ProcessGroups) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    pipeline_step(case["chunks"], case["actions"], case["batches"], pgs, loss_scale=case["scale"])
    return time.perf_counter() - t0


def measure(ns: argparse.Namespace, pgs: ProcessGroups) -> list[dict]:
    """Rounds over the schedules, so that load from elsewhere hits them alike; best of rounds."""
    cases = [setup(ns, pgs, name, vpp) for name, vpp in SCHEDULES]
    for _ in range(ns.steps):
        for case in cases:
            case["step"].append(step(case, pgs))
            dist.barrier()
            case["work"].append(work_time(case["chunks"], case["batches"], case["shape"]))
    return [{"step": min(c["step"]), "work": min(c["work"]), "peak": c["peak"]} for c in cases]


def _rank_main(rank: int, store_path: str, ns: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, ns.pp), rank=rank,
                            world_size=ns.pp, timeout=timedelta(seconds=120))
    layout = RankLayout(ParallelConfig(world_size=ns.pp, pp=ns.pp))
    pgs = ProcessGroups.build(rank, ns.pp, layout.rank_groups(rank))
    results = measure(ns, pgs)
    gathered = [None] * ns.pp
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def report(ns: argparse.Namespace, per_rank: list[list[dict]]) -> None:
    p, m = ns.pp, ns.m
    print(f"pp={p} m={m} micro_batch={ns.micro_batch} seq={ns.seq} hidden={ns.hidden} "
          f"layers={ns.layers} (fp32, CPU, 1 thread per rank)")
    print(f"{'schedule':<16}{'step ms':>9}{'work ms':>9}{'bubble':>8}{'ideal':>7}{'sim':>7}   "
          "peak activations per stage (MiB)")
    for k, (name, vpp) in enumerate(SCHEDULES):
        rows = [r[k] for r in per_rank]
        step, work = max(r["step"] for r in rows), max(r["work"] for r in rows)
        shape = PipelineShape(pp=p, vpp=vpp, microbatches=m)
        sim = simulate(shape, schedule(name, shape), t_fwd=1 / vpp, t_bwd=2 / vpp).makespan / (3 * m)
        ideal = (m + (p - 1) / vpp) / m
        label = f"{name}" + (f" vpp={vpp}" if vpp > 1 else "")
        peaks = " ".join(f"{r['peak'] / 2**20:7.2f}" for r in rows)
        print(f"{label:<16}{step * 1e3:9.1f}{work * 1e3:9.1f}{step / work:8.3f}{ideal:7.3f}{sim:7.3f}   {peaks}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--m", type=int, default=8, help="micro-batches per step (a multiple of pp)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        mp.start_processes(_rank_main, args=(str(Path(tmp) / "store"), ns, out), nprocs=ns.pp,
                           join=True, start_method="fork")
        report(ns, json.loads(Path(out).read_text()))


if __name__ == "__main__":
    main()
