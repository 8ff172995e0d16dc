"""Parameter groups, the LR schedule and global-norm clipping (pure: no processes)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from rankctl.models.gpt import GPTConfig
from rankctl.models.shard import build_shard, shard_slice
from rankctl.parallel.tensor import TPContext
from rankctl.kinds.train.optim import (
    MIN_LR_RATIO,
    build_optimizer,
    clip_grad_norm,
    global_grad_norm,
    lr_at,
    param_groups,
)

CFG = GPTConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=250)


def test_lr_warms_up_linearly_then_decays_by_cosine_to_ten_percent() -> None:
    lrs = [lr_at(s, lr=1.0, warmup=4, steps=20) for s in range(1, 21)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a > b for a, b in itertools.pairwise(lrs[3:]))
    assert lrs[-1] == pytest.approx(MIN_LR_RATIO)
    assert lr_at(12, lr=1.0, warmup=4, steps=20) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 2)))
    assert lr_at(1, lr=2.0, warmup=0, steps=1) == pytest.approx(0.2)
    assert lr_at(3, lr=1.0, warmup=5, steps=3) == pytest.approx(0.6)  # still warming up


def test_weight_decay_on_matrices_and_embeddings_only() -> None:
    model = build_shard(CFG, seed=0)
    decay, no_decay = param_groups(model.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in decay["params"]} >= {"wte.weight", "wpe.weight", "layers.0.attn.qkv.weight"}
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(model.named_parameters())
    opt = build_optimizer(model.named_parameters(), 1e-3)
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.param_groups[0]["weight_decay"] == 0.1


def _random_grads(model, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_on_one_rank_equals_torch(max_norm: float) -> None:
    ours, ref = build_shard(CFG, seed=0), build_shard(CFG, seed=0)
    _random_grads(ours), _random_grads(ref)
    expected = torch.nn.utils.clip_grad_norm_([p for _, p in ref.named_parameters()], max_norm)
    norm = clip_grad_norm([p for _, p in ours.named_parameters()], max_norm, None)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0, msg=name)


@pytest.mark.parametrize("sp", [False, True])
def test_tp_shards_count_replicated_parameters_once(sp: bool) -> None:
    """With each TP rank's grads the slices of the serial grads, the per-rank squared norms
    (what the mp all-reduce sums) add up to the serial norm."""
    serial = build_shard(CFG, seed=0)
    _random_grads(serial)
    expected = global_grad_norm([p for _, p in serial.named_parameters()], None)
    full = dict(serial.named_parameters())
    total = 0.0
    for rank in range(2):
        shard = build_shard(CFG, seed=0, tp=TPContext(None, rank, 2, sp))
        for name, p in shard.named_parameters():
            meta = shard.meta[name]
            p.grad = shard_slice(full[name].grad, meta.shard_dim, rank, 2).clone()
        total += float(global_grad_norm([p for _, p in shard.named_parameters()], None)) ** 2
    assert math.sqrt(total) == pytest.approx(float(expected), rel=1e-6)
