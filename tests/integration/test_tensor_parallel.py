"""Tensor and sequence parallelism against the serial model, on 4 forked gloo ranks.

One fork of the ranks runs every check: tp=2 on the
groups [0, 1] and [2, 3], tp=4 on the world, each with and without SP, learned and rope
positions, tied and untied heads, and vocabularies that need padding.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch
from ranks import fork_ranks
import torch.distributed as dist
import torch.nn.functional as F

from rankctl.models.gpt import GPTConfig
from rankctl.models.shard import build_shard, shard_slice
from rankctl.parallel.cross_entropy import vocab_parallel_cross_entropy
from rankctl.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TPContext, padded

WORLD = 4
RTOL = 1e-5
# (position embedding, sequence parallel, vocab, tied head)
CASES = [("learned", False, 255, True), ("learned", True, 250, True),
         ("rope", False, 256, False), ("rope", True, 255, False)]


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Relative to the tensor's scale: elementwise rtol on values, RTOL * max|want| floor."""
    atol = RTOL * max(want.abs().max().item(), 1e-12)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def check_model(tp: TPContext, case: tuple[str, bool, int, bool]) -> None:
    pe, sp, vocab, tie = case
    cfg = GPTConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=vocab,
                    position_embedding=pe, tie_embeddings=tie)
    where = f"tp={tp.size} rank={tp.rank} pe={pe} sp={sp} vocab={vocab} tie={tie}"
    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, vocab, (2, cfg.seq_len + 1), generator=g)
    tokens, targets = data[:, :-1], data[:, 1:]

    serial = build_shard(cfg, None, seed=42).module
    serial_loss = serial(tokens, targets)
    serial_loss.backward()

    shard = build_shard(cfg, tp.group, sp, seed=42)
    loss = shard(tokens, targets)
    loss.backward()
    for p in shard.tp_grad_sum_params():  # what the DP/grad code does under SP
        dist.all_reduce(p.grad, group=tp.group)

    assert_close(loss.detach(), serial_loss.detach(), f"loss {where}")
    params, grads = shard.full_state_dict(), shard.full_state_dict(grads=True)
    for name, p in serial.named_parameters():
        assert torch.equal(params[name], p.detach()), f"init of {name} {where}"
        assert_close(grads[name], p.grad, f"grad of {name} {where}")


def check_cross_entropy(tp: TPContext) -> None:
    g = torch.Generator().manual_seed(3)
    vocab = 255
    logits = torch.randn(2, 5, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, (2, 5), generator=g)
    weights = torch.rand(2, 5, generator=g)  # a non-uniform upstream gradient
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full.flatten(0, 1), targets.flatten(), reduction="none").view(2, 5)
    (want * weights).sum().backward()

    local_rows = padded(vocab, tp.size) // tp.size
    pad = torch.full((2, 5, padded(vocab, tp.size) - vocab), float("-inf"))
    local = shard_slice(torch.cat([logits, pad], -1), 2, tp.rank, tp.size).clone().requires_grad_()
    got = vocab_parallel_cross_entropy(local, targets, tp.group)
    (got * weights).sum().backward()
    assert_close(got.detach(), want.detach(), f"vocab-parallel CE tp={tp.size}")
    start = tp.rank * local_rows
    want_grad = full.grad[..., start:start + local_rows]
    assert_close(local.grad[..., :want_grad.size(-1)], want_grad, f"vocab-parallel CE grad tp={tp.size}")
    assert not local.grad[..., want_grad.size(-1):].any()


def check_linears(tp: TPContext) -> None:
    """A column-parallel linear with gathered output, then a row-parallel one, vs serial."""
    g = torch.Generator().manual_seed(5)
    w1, w2, b1 = torch.randn(8, 6, generator=g), torch.randn(4, 8, generator=g), torch.randn(8, generator=g)
    x = torch.randn(2, 4, 6, generator=g)
    col = ColumnParallelLinear(6, 8, tp, gather_output=True)
    row = RowParallelLinear(8, 4, tp, bias=False)
    with torch.no_grad():
        col.weight.copy_(shard_slice(w1, 0, tp.rank, tp.size))
        col.bias.copy_(shard_slice(b1, 0, tp.rank, tp.size))
        row.weight.copy_(shard_slice(w2, 1, tp.rank, tp.size))
    full = col(x)
    assert_close(full, F.linear(x, w1, b1), f"gathered column output tp={tp.size}")
    local = shard_slice(full, 2, tp.rank, tp.size)
    assert_close(row(local), F.linear(F.linear(x, w1, b1), w2), f"row output tp={tp.size}")


def _rank_main(rank: int, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for group, sp in itertools.product([pairs[rank // 2], dist.group.WORLD], [False, True]):
        tp = TPContext.from_group(group, sp)
        if not sp:
            check_cross_entropy(tp)
            check_linears(tp)
        for case in CASES:
            if case[1] == sp:
                check_model(tp, case)
    dist.destroy_process_group()


def test_tensor_parallel_matches_serial(tmp_path) -> None:
    codes = fork_ranks(WORLD, lambda rank, _world, path: _rank_main(rank, path), str(tmp_path / "store"))
    assert codes == [0] * WORLD, codes   # (forked from this warm process: no interpreter pays for importing torch)
