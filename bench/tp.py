"""Tensor parallelism side by side: rankctl's tp=2 against PyTorch's DTensor TP, same model.

Forks 2 gloo ranks once (FileStore rendezvous in a temporary directory, 1 torch thread
each) and trains two copies of the same GPT (same ``GPTConfig``, same initial weights
from ``gpt.full_init``, same batches from ``kinds.train.data``) in the same processes, taking
turns step by step (the order flips every round) so that outside load hits both alike:

* rankctl: ``build_shard(cfg, tp_group)`` and ``kinds.train.loop.train_step`` with
  ``plain_step``, as the ``train`` job runs it. Parallel: wte (vocab-parallel embedding),
  every qkv/fc (column) and attn/mlp proj (row), and the tied head with the
  vocab-parallel cross-entropy. Replicated: wpe and the LayerNorms.
* torch: the serial ``GPT`` (``SerialLayers``) through ``parallelize_module`` on a 1-D
  ``DeviceMesh``: qkv/fc ``ColwiseParallel``, attn/mlp proj ``RowwiseParallel`` (local
  outputs, so attention sees its local heads), wte ``RowwiseParallel`` (torchtitan's
  embedding recipe) and the tied head computed on the sharded wte weight as a DTensor,
  its cross-entropy under ``loss_parallel()``. Replicated: wpe and the LayerNorms.
  The step mirrors ``train_step``: global-norm clipping (``get_total_norm`` over the
  DTensor and plain gradients), the same LR schedule, the same AdamW (``kinds.train.optim``).

Each step is timed on both ranks between a barrier and the end of the optimizer step;
a step's time is the slower rank's. Reported: median tokens/s over the timed steps
(tokens = micro-batch x seq per step, the same on both sides) and the step-1 and last
losses of both, which match when the two compute the same thing.

    python bench/tp.py [--layers 4] [--hidden 256] [--heads 8] [--seq 256] [--batch 4]
                       [--steps 20] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from rankctl.kinds.train.data import BUILTIN_PYDOC, TokenDataset
from rankctl.models.gpt import GPT, GPTConfig, full_init
from rankctl.models.shard import build_shard
from rankctl.parallel.data_parallel import GradReducer
from rankctl.parallel.groups import ProcessGroups
from rankctl.parallel.layout import ParallelConfig, RankLayout
from rankctl.kinds.train import optim
from rankctl.kinds.train.loop import Trainer, plain_step, train_step
from rankctl.kinds.train.spec import TrainSpec
from rankctl.kinds.train.train_state import TrainState

TP = 2
SEED = 1234
StepFn = Callable[[int], float]  # step (1-based) -> global mean loss


def model_config(ns: argparse.Namespace) -> GPTConfig:
    return GPTConfig(layers=ns.layers, hidden=ns.hidden, heads=ns.heads, seq_len=ns.seq, vocab=256)


def train_config(ns: argparse.Namespace) -> TrainSpec:
    """One micro-batch per step; the schedule spans warm-up and timed steps."""
    return TrainSpec(steps=ns.warmup + ns.steps, global_batch=ns.batch, micro_batch=ns.batch,
                       seed=SEED, dtype="fp32", data=BUILTIN_PYDOC)


# -- rankctl ----------------------------------------------------------------------------------

def rankctl_case(ns: argparse.Namespace, pgs: ProcessGroups, data: TokenDataset) -> tuple[Trainer, StepFn]:
    """A ``Trainer`` as ``kinds.train.loop.setup`` builds it, without the job plumbing."""
    cfg = train_config(ns)
    model = build_shard(model_config(ns), pgs.get("tp"), sequence_parallel=False, seed=cfg.seed)
    named = model.named_parameters()
    ctx = SimpleNamespace(device=torch.device("cpu"), groups=pgs, log=None)
    t = Trainer(ctx=ctx, cfg=cfg, chunks=[model], optimizer=optim.build_optimizer(named, cfg.lr),
                reducer=GradReducer(named, pgs.get("dp_cp"), pgs.get("tp")), data=data,
                dp_rank=0, dp_size=1, use_bf16=False, state=TrainState())
    fn = plain_step(t)
    return t, lambda step: train_step(t, fn, step)["loss"]


# -- torch.distributed.tensor.parallel ---------------------------------------------------------

class DTensorTiedHead(nn.Module):
    """The tied output layer on the sharded embedding weight (Shard(0) = vocab rows): the
    replicated input enters as a DTensor, the logits come out Shard(-1), and the
    cross-entropy runs on them under ``loss_parallel()`` (no logits gathered). This is
    ``ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
    use_local_output=False)`` written out, since the weight is wte's."""

    def __init__(self, wte: nn.Embedding, mesh: DeviceMesh) -> None:
        super().__init__()
        self._tied, self.mesh = (wte,), mesh  # a tuple: not registered twice

    def forward(self, x: Tensor, targets: Tensor) -> Tensor:
        x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        logits = F.linear(x, self._tied[0].weight)  # (B, T, V) DTensor, Shard(-1)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)


def torch_model(cfg: GPTConfig, mesh: DeviceMesh, seed: int) -> GPT:
    """The serial GPT with the serial initial weights, parallelised by torch's TP plan."""
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full_init(model.init_key(name), tuple(p.shape), seed, cfg))
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    for i in model.layers:
        plan |= {f"layers.{i}.attn.qkv": ColwiseParallel(), f"layers.{i}.attn.proj": RowwiseParallel(),
                 f"layers.{i}.mlp.fc": ColwiseParallel(), f"layers.{i}.mlp.proj": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    model.head = DTensorTiedHead(model.wte, mesh)
    return model


@torch.no_grad()
def clip_mixed(params: list[nn.Parameter], max_norm: float) -> None:
    """Global-norm clipping over DTensor and plain gradients (torch's foreach kernels refuse
    a mixed list): one norm per kind, the DTensor one materialised (an all-reduce)."""
    kinds = ([p for p in params if p.grad is not None and isinstance(p.grad, DTensor)],
             [p for p in params if p.grad is not None and not isinstance(p.grad, DTensor)])
    norms = [get_total_norm([p.grad for p in ps]) for ps in kinds]
    total = torch.stack([norms[0].full_tensor(), norms[1]]).norm()
    for ps in kinds:
        clip_grads_with_norm_(ps, max_norm, total)


def torch_case(ns: argparse.Namespace, mesh: DeviceMesh, batches: Callable) -> StepFn:
    cfg = train_config(ns)
    model = torch_model(model_config(ns), mesh, cfg.seed)
    params = list(model.parameters())
    opt = optim.build_optimizer(model.named_parameters(), cfg.lr)
    tokens = cfg.global_batch * ns.seq

    def step(s: int) -> float:
        (x, y), = batches(s)
        with loss_parallel():
            loss = model(x, y)  # fp32 sum, DTensor (Replicate)
            (loss / tokens).backward()
        clip_mixed(params, cfg.grad_clip)
        optim.set_lr(opt, optim.lr_at(s, lr=cfg.lr, warmup=cfg.warmup, steps=cfg.steps))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach().full_tensor()) / tokens

    return step


# -- measurement ------------------------------------------------------------------------------

def timed(fn: StepFn, step: int) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    loss = fn(step)
    return time.perf_counter() - t0, loss


def measure(ns: argparse.Namespace, pgs: ProcessGroups) -> dict:
    torch.manual_seed(SEED)
    data = TokenDataset.load(BUILTIN_PYDOC, ns.seq)
    trainer, ours = rankctl_case(ns, pgs, data)
    mesh = DeviceMesh("cpu", list(range(TP)))
    theirs = torch_case(ns, mesh, trainer.batches)
    cases = {"rankctl": ours, "torch": theirs}
    times: dict[str, list[float]] = {k: [] for k in cases}
    losses: dict[str, list[float]] = {k: [] for k in cases}
    for s in range(1, ns.warmup + ns.steps + 1):
        order = list(cases) if s % 2 else list(reversed(cases))
        for name in order:
            dt, loss = timed(cases[name], s)
            losses[name].append(loss)
            if s > ns.warmup:
                times[name].append(dt)
    for name in cases:  # a step takes as long as its slower rank
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = t.tolist()
    return {"times": times, "losses": losses}


def _rank_main(rank: int, store_path: str, ns: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, TP), rank=rank,
                            world_size=TP, timeout=timedelta(seconds=120))
    pgs = ProcessGroups.build(rank, TP, RankLayout(ParallelConfig(world_size=TP, tp=TP)).rank_groups(rank))
    result = measure(ns, pgs)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


LABELS = {"rankctl": "rankctl ColumnParallel/RowParallel + vocab-parallel CE",
          "torch": "torch.distributed.tensor.parallel (DTensor)"}


def report(ns: argparse.Namespace, result: dict) -> None:
    tokens = ns.batch * ns.seq
    tps = {k: tokens / statistics.median(v) for k, v in result["times"].items()}
    width = max(map(len, LABELS.values()))
    print(f"tp bench: tp={TP} on {TP} CPU processes (gloo, 1 thread each), layers={ns.layers} "
          f"hidden={ns.hidden} heads={ns.heads} seq={ns.seq} batch={ns.batch}, fp32, "
          f"fwd+bwd+clip+AdamW, median of {ns.steps} steps after {ns.warmup} warm-up")
    print("  both: wte vocab-split, qkv/fc colwise, attn/mlp proj rowwise, tied head + vocab-parallel CE; "
          "wpe and LayerNorms replicated")
    for k, label in LABELS.items():
        ms = 1e3 * statistics.median(result["times"][k])
        best = tokens / min(result["times"][k])
        first, last = result["losses"][k][0], result["losses"][k][-1]
        print(f"  {label:<{width}} : {tps[k]:6.0f} tokens/s  ({ms:5.1f} ms/step, best {best:.0f} tokens/s; "
              f"loss step 1 {first:.6f}, step {len(result['losses'][k])} {last:.6f})")
    best = min(result["times"]["torch"]) / min(result["times"]["rankctl"])
    print(f"  ratio rankctl/torch: {tps['rankctl'] / tps['torch']:.2f}x (median), {best:.2f}x (best)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="micro-batch = batch per step")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    ap.add_argument("--warmup", type=int, default=3)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.start_processes(_rank_main, args=(str(Path(tmp) / "store"), ns, out), nprocs=TP,
                           join=True, start_method="fork")
        report(ns, json.loads(Path(out).read_text()))


if __name__ == "__main__":
    main()
