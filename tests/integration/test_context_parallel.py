"""Context parallelism: the balanced split (pure), ring attention and the whole GPT against
the serial model on 4 forked gloo ranks.

One fork of the ranks runs every multi-rank check: cp=2 on [0, 1] / [2, 3], cp=4 on the world, and
cp=2 × tp=2 with the order tp-cp (tp groups [0, 1] / [2, 3], cp groups [0, 2] / [1, 3]).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from ranks import fork_ranks
import torch.distributed as dist
import torch.nn.functional as F

from rankctl.models.attention import RingAttention, causal_attention, set_attention
from rankctl.models.gpt import GPT, GPTConfig
from rankctl.models.shard import build_shard
from rankctl.parallel import context
from rankctl.parallel.context import cp_indices, cp_shard_batch, gather_from_cp, ring_attention, split_for_cp

WORLD = 4
RTOL = 1e-5


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Relative to the tensor's scale: elementwise rtol on values, RTOL * max|want| floor."""
    atol = RTOL * max(want.abs().max().item(), 1e-12)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def qkv_and_grad(T: int, seed: int = 7) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, T, 8, generator=g) for _ in range(4))  # q, k, v, dout


def serial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


# -- pure ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 4])
def test_indices_partition_the_sequence_and_balance_causal_work(cp: int) -> None:
    T = 32
    parts = [cp_indices(T, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(T))
    assert all(len(p) == T // cp for p in parts)
    pairs = [int((p + 1).sum()) for p in parts]  # unmasked (q, k) pairs: query at i sees i + 1 keys
    assert len(set(pairs)) == 1 and sum(pairs) == T * (T + 1) // 2
    if cp == 2:
        assert parts[0].tolist() == [*range(8), *range(24, 32)]


def test_split_gather_roundtrip_and_shard_batch() -> None:
    x = torch.arange(2 * 16 * 3).view(2, 16, 3)
    for cp in (1, 2, 4):
        parts = [split_for_cp(x, 1, cp, r) for r in range(cp)]
        assert torch.equal(gather_from_cp(parts, 1), x)
    tokens, targets = torch.arange(32).view(2, 16), torch.arange(32).view(2, 16) + 100
    t, y, pos = cp_shard_batch(tokens, targets, 2, 1)
    assert pos.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(t, tokens[:, pos]) and torch.equal(y, targets[:, pos])
    with pytest.raises(ValueError, match="not divisible by 2\\*cp=8"):
        cp_shard_batch(torch.zeros(1, 12, dtype=torch.long), torch.zeros(1, 12, dtype=torch.long), 4, 0)


def test_ring_math_on_one_rank_matches_serial() -> None:
    """The tile / online-softmax / recompute math alone (no group), with tokens out of order."""
    q, k, v, dout = qkv_and_grad(16)
    want = serial_attention(q, k, v, dout)
    order = torch.cat([cp_indices(16, 4, r) for r in range(4)])  # a permuted sequence
    args = [t[:, :, order].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*args, order, None)
    got = (out.detach(), *torch.autograd.grad(out, args, dout[:, :, order]))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(g, w[:, :, order], f"{name} one rank")


def test_explicit_tile_path_matches_serial(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path other devices take: scores materialised per tile instead of the fused kernel."""
    monkeypatch.setattr(context, "_fused", lambda q, kind: False)
    q, k, v, dout = qkv_and_grad(16)
    want = serial_attention(q, k, v, dout)
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*args, torch.arange(16), None)
    got = (out.detach(), *torch.autograd.grad(out, args, dout))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(g, w, f"{name} explicit path")


def test_attention_core_is_injectable() -> None:
    cfg = GPTConfig(layers=2, hidden=16, heads=2, seq_len=8, vocab=32)
    model = GPT(cfg)
    assert all(b.attn.core is causal_attention for b in model.layers.values())
    core = RingAttention(None)
    assert set_attention(model, core) == 2 and model.layers["1"].attn.core is core
    assert GPT(cfg, attention=core).layers["0"].attn.core is core


# -- multi-rank -----------------------------------------------------------------------------

def check_ring(group: dist.ProcessGroup) -> None:
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout = qkv_and_grad(16)
    want = serial_attention(q, k, v, dout)
    args = [split_for_cp(t, 2, cp, r).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*args, cp_indices(16, cp, r), group)
    got = (out.detach(), *torch.autograd.grad(out, args, split_for_cp(dout, 2, cp, r)))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(g, split_for_cp(w, 2, cp, r), f"ring {name} cp={cp} rank={r}")


def check_model(cp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup | None, pe: str, sp: bool) -> None:
    cp, r = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    cfg = GPTConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=64, position_embedding=pe)
    where = f"cp={cp} rank={r} tp={tp_group is not None} pe={pe} sp={sp}"
    data = torch.randint(0, cfg.vocab, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(11))
    tokens, targets = data[:, :-1], data[:, 1:]

    serial = build_shard(cfg, None, seed=42).module
    serial_loss = serial(tokens, targets)
    serial_loss.backward()

    shard = build_shard(cfg, tp_group, sp, seed=42)
    set_attention(shard.module, RingAttention(cp_group))
    x, y, pos = cp_shard_batch(tokens, targets, cp, r)
    loss = shard(x, y, positions=pos)  # the SUM over this rank's tokens
    loss.backward()
    dist.all_reduce(loss := loss.detach().clone(), group=cp_group)
    for p in shard.parameters():  # what the trainer's dp_cp reduction does: a plain SUM
        dist.all_reduce(p.grad, group=cp_group)
    for p in shard.tp_grad_sum_params():
        dist.all_reduce(p.grad, group=tp_group)

    assert_close(loss, serial_loss.detach(), f"loss {where}")
    grads = shard.full_state_dict(grads=True)
    for name, p in serial.named_parameters():
        assert_close(grads[name], p.grad, f"grad of {name} {where}")


def _rank_main(rank: int, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # cp=2 alone; tp groups of tp-cp
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # cp groups of tp=2 × cp=2
    pair, stride = pairs[rank // 2], strided[rank % 2]
    for group in (pair, dist.group.WORLD):
        check_ring(group)
    check_model(pair, None, "learned", False)
    check_model(pair, None, "rope", False)
    check_model(dist.group.WORLD, None, "rope", False)
    check_model(stride, pair, "learned", False)
    check_model(stride, pair, "rope", True)
    dist.destroy_process_group()


def test_context_parallel_matches_serial(tmp_path) -> None:
    codes = fork_ranks(WORLD, lambda rank, _world, path: _rank_main(rank, path), str(tmp_path / "store"))
    assert codes == [0] * WORLD, codes   # (forked from this warm process: no interpreter pays for importing torch)
