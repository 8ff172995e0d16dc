"""The mixture-of-experts MLP in one process: routing, aux-loss formula, capacity dropping,
the expert-major regrouping, the MoE GPT's shape, init and parameter metadata."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rankctl.kinds.train.spec import ModelSpec, MoeSpec
from rankctl.models.gpt import MLP, GPTConfig, full_init
from rankctl.models.moe import (
    MoE,
    MoEConfig,
    aux_loss_sum,
    capacity_keep,
    route,
    sequence_counts,
)
from rankctl.models.shard import build_shard
from rankctl.parallel.experts import expert_major

CFG = GPTConfig(layers=2, hidden=16, heads=2, seq_len=8, vocab=31)


def batch(B: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, CFG.vocab, (B, CFG.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def test_route_top_k() -> None:
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0]]])
    probs, gates, experts = route(logits, 2)
    assert experts.tolist() == [[[1, 3]]]
    assert torch.allclose(probs.sum(-1), torch.ones(1, 1))
    assert torch.equal(gates, probs.gather(-1, experts))  # not renormalised


def test_aux_loss_formula_and_additivity() -> None:
    g = torch.Generator().manual_seed(1)
    B, T, E, k, alpha = 3, 6, 4, 2, 0.1
    probs, _, experts = route(torch.randn(B, T, E, generator=g), k)
    counts = sequence_counts(experts, E)
    assert counts.sum().item() == B * T * k
    got = aux_loss_sum(probs, counts, alpha, k, T)
    f, P = counts / (k * T), probs.mean(1)  # (B, E)
    want = T * sum(alpha * E * (f[b] * P[b]).sum() for b in range(B))  # T * sum_b L_b
    assert torch.allclose(got, want)
    halves = [aux_loss_sum(p, counts, alpha, k, T) for p in probs.split(T // 2, dim=1)]
    assert torch.allclose(sum(halves), got)  # parts of sequences add up (tp split, cp)
    uniform = torch.full((B, T, E), 1.0 / E)
    assert torch.allclose(aux_loss_sum(uniform, torch.full((B, E), T * k / E), alpha, k, T),
                          torch.tensor(alpha * B * T))


def test_capacity_keeps_first_tokens_in_order() -> None:
    experts = torch.tensor([[[0, 1], [0, 2], [0, 1], [2, 0]]])  # (B=1, T=4, k=2)
    keep = capacity_keep(experts, 3, capacity=2)
    assert keep.tolist() == [[[True, True], [True, True], [False, True], [True, False]]]
    offset = torch.tensor([[1, 0, 2]])  # earlier parts of the sequence already used some capacity
    keep = capacity_keep(experts, 3, capacity=2, offset=offset)
    assert keep.tolist() == [[[True, True], [False, False], [False, True], [False, False]]]
    assert torch.equal(capacity_keep(experts, 3, 2), capacity_keep(experts, 3, 2))


def test_expert_major_regrouping() -> None:
    counts = torch.tensor([[1, 2], [0, 3]])  # segments (g, l) row-major: rows 0 | 1 2 | - | 3 4 5
    assert expert_major(counts).tolist() == [0, 1, 2, 3, 4, 5]
    counts = torch.tensor([[1, 1], [2, 1]])  # rows 0 | 1 | 2 3 | 4
    assert expert_major(counts).tolist() == [0, 2, 3, 1, 4]
    assert expert_major(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


def reference_moe(moe: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token: sum over its kept top-k experts of gate * proj(gelu(fc(x)))."""
    _, gates, experts = route(moe.router(x), moe.moe.top_k)
    out = torch.zeros_like(x)
    for b, t, j in torch.cartesian_prod(*(torch.arange(n) for n in experts.shape)).tolist():
        if keep is not None and not keep[b, t, j]:
            continue
        e = moe.experts[str(experts[b, t, j].item())]
        h = F.gelu(F.linear(x[b, t], e.fc.weight, e.fc.bias))
        out[b, t] += gates[b, t, j] * F.linear(h, e.proj.weight, e.proj.bias)
    return out


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_moe_layer_matches_token_loop(capacity_factor: float | None) -> None:
    moe_cfg = MoEConfig(experts=4, top_k=2, aux_loss=0.0, capacity_factor=capacity_factor)
    model = build_shard(CFG, seed=2, moe=moe_cfg)
    layer = model.module.layers["0"].mlp
    x = torch.randn(2, CFG.seq_len, CFG.hidden, generator=torch.Generator().manual_seed(4))
    keep = None
    if capacity_factor is not None:
        cap = math.ceil(capacity_factor * 2 * CFG.seq_len / 4)
        keep = capacity_keep(route(layer.router(x), 2)[2], 4, cap)
        assert not keep.all()
    with torch.no_grad():
        y = layer(x)
        assert torch.allclose(y, reference_moe(layer, x, keep), atol=1e-6)
    stats = model.moe.take()["layers.0.mlp"]
    dropped = 0 if keep is None else int((~keep).sum())
    assert stats.tokens.sum().item() == 2 * CFG.seq_len * 2 - dropped and stats.dropped == dropped
    assert model.moe.take() == {}


def test_moe_gpt_shape_init_and_metadata() -> None:
    model = build_shard(CFG, seed=5, moe=MoEConfig(experts=3, top_k=1, every=2))
    gpt = model.module
    assert isinstance(gpt.layers["0"].mlp, MoE) and isinstance(gpt.layers["1"].mlp, MLP)
    tokens, targets = batch()
    assert gpt(tokens, targets, reduction="none").shape == tokens.shape
    params = dict(gpt.named_parameters())
    assert params["layers.0.mlp.router.weight"].shape == (3, CFG.hidden)
    w = params["layers.0.mlp.experts.2.fc.weight"]
    assert torch.equal(w, full_init("layers.0.mlp.experts.2.fc.weight", (CFG.ffn, CFG.hidden), 5, CFG))
    experts = {n for n, m in model.meta.items() if m.expert}
    assert experts == {n for n in params if ".experts." in n} and len(experts) == 12
    assert not any(m.tp_grad_sum for m in model.meta.values())  # serial: nothing to sum
    assert {n for n, _ in model.named_parameters_by_kind(expert=True)} == experts


def test_aux_loss_gradient_is_scaled_into_the_router() -> None:
    """Router grad with aux - without aux == loss_scale * d(aux)/dW, computed independently."""
    tokens, targets = batch()
    scale, alpha = 0.25, 0.5
    grads, inputs = {}, {}
    for a in (0.0, alpha):
        model = build_shard(CFG, seed=6, moe=MoEConfig(experts=4, top_k=2, every=2, aux_loss=a))
        layer = model.module.layers["0"].mlp
        layer.register_forward_pre_hook(lambda m, args, a=a: inputs.__setitem__(a, args[0].detach()))
        model.moe.loss_scale = scale
        (model(tokens, targets) * scale).backward()
        grads[a] = layer.router.weight.grad.clone()
        aux = model.moe.take()["layers.0.mlp"].aux
    w = layer.router.weight.detach().clone().requires_grad_()
    probs, _, experts = route(F.linear(inputs[alpha], w), 2)
    want = aux_loss_sum(probs, sequence_counts(experts, 4), alpha, 2, CFG.seq_len)
    assert abs(want.item() - aux) < 1e-6
    (want_grad,) = torch.autograd.grad(want, w)
    torch.testing.assert_close(grads[alpha] - grads[0.0], scale * want_grad, rtol=1e-4, atol=1e-7)


def test_moe_config_from_spec_and_build_from_model_spec() -> None:
    spec = ModelSpec(layers=2, hidden=16, heads=2, seq_len=8, vocab=31,
                     moe=MoeSpec(experts=4, top_k=1, every=1, aux_loss=0.02, capacity_factor=1.5))
    model = build_shard(spec, seed=1)
    assert isinstance(model.module.layers["1"].mlp, MoE)
    assert model.module.layers["1"].mlp.moe == MoEConfig(experts=4, top_k=1, aux_loss=0.02, capacity_factor=1.5)
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(experts=2, top_k=3)
