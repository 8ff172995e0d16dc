"""Checkpoint save and load under the same layout and under another one, side by side (issue 29).

One process plays every rank in turn (each rank's shard is built without process groups, as the tests do):
the ranks of ``--from`` save a checkpoint step (parameters and AdamW state after one optimizer step, the
real rank files with their markers), then the ranks of the same layout load it as a same-layout resume does
(``checkpoint.load_rank``: the whole rank file) and the ranks of ``--to`` load it re-sliced
(``kinds.train.reshard.OldStates``: ``mmap``, only their slices). Printed per layout: the mean seconds a
rank takes to save and to load, and the bytes each rank reads on average and at most (a same-layout load
reads its file; a re-sliced one the slices it copies), then the ratios of the re-sliced load to the
same-layout one. Every loaded tensor is checked against the saved model (the bench fails on a mismatch).

    python bench/reshard.py                       # tp2 pp2 -> tp4 pp1, a ~40M-parameter GPT
    python bench/reshard.py --from 1,4 --to 2,2 --hidden 256 --layers 8
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from rankctl.kinds.train import checkpoint as ckpt
from rankctl.kinds.train import optim
from rankctl.kinds.train.reshard import OldStates
from rankctl.models.gpt import GPTConfig
from rankctl.models.shard import ShardedModel, shard_slice
from rankctl.models.stages import build_chunks
from rankctl.parallel.layout import ParallelConfig, RankLayout
from rankctl.parallel.tensor import TPContext

SEED = 5


def layout_of(text: str) -> tuple[int, int]:
    tp, pp = (int(x) for x in text.split(","))
    return tp, pp


def rank_chunks(cfg: GPTConfig, tp: int, pp: int, rank: int) -> tuple[list[ShardedModel], dict]:
    layout = RankLayout(ParallelConfig(world_size=tp * pp, tp=tp, pp=pp))
    coords = layout.coords(rank)
    ctx = TPContext(None, coords["tp"], tp)
    return build_chunks(cfg, pp=pp, vpp=None, stage=coords["pp"], seed=SEED, tp=ctx), coords


def named(chunks: list[ShardedModel]) -> list[tuple[str, torch.nn.Parameter]]:
    return [np for c in chunks for np in c.named_parameters()]


def identity(cfg: GPTConfig, tp: int, pp: int) -> dict:
    parallel = {"tp": tp, "pp": pp, "cp": 1, "ep": 1, "order": "tp-cp-ep-dp-pp", "sequence_parallel": False}
    return {"world_size": tp * pp, "parallel": parallel, "model": {"hidden": cfg.hidden, "layers": cfg.layers},
            "train": {"seed": SEED}}


def save_all(root: str, cfg: GPTConfig, tp: int, pp: int) -> tuple[float, int]:
    """Every rank of tp x pp saves step 1; (mean seconds a rank, mean bytes a rank)."""
    ident = identity(cfg, tp, pp)
    fp = ckpt.fingerprint(ident)
    took, sizes = [], []
    for rank in range(tp * pp):
        chunks, coords = rank_chunks(cfg, tp, pp, rank)
        params = named(chunks)
        opt = optim.build_optimizer(params, 1e-3)
        for _, p in params:   # one optimizer step: AdamW state exists and differs from the parameters
            p.grad = torch.full_like(p, 0.01) + p.detach() * 0.5
        opt.step()
        state = {"step": 1, "rank": rank, "world_size": tp * pp, "coords": coords, "parallel": ident["parallel"],
                 "model_config": ident["model"], "model": {n: p.detach() for n, p in params},
                 "meta": {n: m.__dict__ for c in chunks for n, m in c.meta.items()}, "optimizer": opt.state_dict(),
                 "rng": {"torch": torch.get_rng_state()}, "history": {"losses": [], "val_losses": []}}
        t0 = time.perf_counter()
        path = ckpt.save_rank(root, 1, rank, state, fp, ident)
        took.append(time.perf_counter() - t0)
        sizes.append(os.path.getsize(path))
    return sum(took) / len(took), sum(sizes) // len(sizes)


def load_same(root: str, cfg: GPTConfig, tp: int, pp: int) -> tuple[float, list[int]]:
    took, read = [], []
    for rank in range(tp * pp):
        chunks, _ = rank_chunks(cfg, tp, pp, rank)
        t0 = time.perf_counter()
        state = ckpt.load_rank(root, 1, rank)
        with torch.no_grad():
            for name, p in named(chunks):
                p.copy_(state["model"][name])
        took.append(time.perf_counter() - t0)
        read.append(os.path.getsize(ckpt.rank_file(root, 1, rank)))
    return sum(took) / len(took), read


def load_resliced(root: str, cfg: GPTConfig, tp: int, pp: int, old_ident: dict, full: dict) -> tuple[float, list[int]]:
    took, read = [], []
    for rank in range(tp * pp):
        chunks, _ = rank_chunks(cfg, tp, pp, rank)
        params = named(chunks)
        metas = {n: m for c in chunks for n, m in c.meta.items()}
        t0 = time.perf_counter()
        old = OldStates(root, 1, old_ident)
        copied = 0
        with torch.no_grad():
            for name, p in params:
                value = old.param(name, metas[name], p.shape)
                adam = old.adam(name, metas[name], p.shape)
                p.copy_(value)
                copied += value.numel() * value.element_size()
                copied += sum(v.numel() * v.element_size() for k, v in (adam or {}).items() if k != "step")
        took.append(time.perf_counter() - t0)
        read.append(copied)
        for c in chunks:   # the re-sliced parameters are the saved model's
            for name, p in c.named_parameters():
                m = c.meta[name]
                src = name if name in full else m.init_key
                want = full[src]
                if m.shard_dim is not None:
                    want = shard_slice(want, m.shard_dim, m.tp_rank, m.tp_size)
                if not torch.equal(p.detach(), want):
                    raise SystemExit(f"rank {rank} of tp{tp} pp{pp}: {name} differs from the saved model")
    return sum(took) / len(took), read


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", default="2,2", help="tp,pp of the saving layout")
    ap.add_argument("--to", dest="dst", default="4,1", help="tp,pp of the loading layout")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ns = ap.parse_args()
    (tp_a, pp_a), (tp_b, pp_b) = layout_of(ns.src), layout_of(ns.dst)
    cfg = GPTConfig(vocab=ns.vocab, seq_len=128, layers=ns.layers, hidden=ns.hidden, heads=8)
    root = tempfile.mkdtemp(prefix="rankctl-bench-reshard-")
    try:
        save_s, size = save_all(root, cfg, tp_a, pp_a)
        full = ckpt.export_full_state_dict(ckpt.step_dir(root, 1))   # every load is checked against it
        params = sum(t.numel() for t in full.values())
        same_s, same_read = load_same(root, cfg, tp_a, pp_a)
        other_s, other_read = load_resliced(root, cfg, tp_b, pp_b, identity(cfg, tp_a, pp_a), full)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"reshard bench: GPT of {params / 1e6:.1f}M parameters (hidden {ns.hidden}, {ns.layers} layers, vocab "
          f"{ns.vocab}), fp32 with AdamW state; saved by tp{tp_a} pp{pp_a} ({tp_a * pp_a} ranks)")
    print(f"  save, per rank          : {save_s:.3f} s, {mib(size)} a rank file")
    rows = [("same layout", f"tp{tp_a} pp{pp_a}", same_s, same_read),
            ("another layout", f"tp{tp_b} pp{pp_b}", other_s, other_read)]
    for what, lay, s, read in rows:
        print(f"  load, {what:<15}: {lay:<9} {s:.3f} s a rank; reads {mib(sum(read) / len(read))} a rank on average, "
              f"{mib(max(read))} at most")
    print(f"reshard: load under another layout {other_s:.3f} s vs same layout {same_s:.3f} s -> "
          f"{other_s / same_s:.2f}x the time; bytes read a rank "
          f"{sum(other_read) / len(other_read) / (sum(same_read) / len(same_read)):.2f}x")


if __name__ == "__main__":
    main()
