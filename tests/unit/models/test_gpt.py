"""The GPT definition, its deterministic init and the TP shard construction, in one process."""

from __future__ import annotations

import pytest
import torch

from rankctl.models.gpt import GPTConfig, Stage, full_init
from rankctl.models.shard import build_shard, shard_slice
from rankctl.parallel.tensor import TPContext
from rankctl.parallel.tp_plan import GPT_TP_PLAN, resolve_style


def config(**kw: object) -> GPTConfig:
    base = dict(layers=2, hidden=32, heads=4, seq_len=16, vocab=255)
    return GPTConfig(**{**base, **kw})


def batch(cfg: GPTConfig, B: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab, (B, cfg.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


@pytest.mark.parametrize("pe", ["learned", "rope"])
def test_shapes_and_loss_contract(pe: str) -> None:
    cfg = config(position_embedding=pe)
    model = build_shard(cfg, seed=1).module
    tokens, targets = batch(cfg)
    losses = model(tokens, targets, reduction="none")
    assert losses.shape == (2, 16) and losses.dtype == torch.float32
    loss = model(tokens, targets)
    assert loss.shape == () and torch.allclose(loss, losses.sum())
    assert abs(loss.item() / tokens.numel() - torch.log(torch.tensor(255.0)).item()) < 0.1
    assert model.head.logits(model.embed(tokens)).shape == (2, 16, 255)
    assert ("wpe.weight" in dict(model.named_parameters())) == (pe == "learned")
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("pe", ["learned", "rope"])
def test_future_tokens_do_not_change_earlier_losses(pe: str) -> None:
    cfg = config(position_embedding=pe)
    model = build_shard(cfg, seed=2).module
    tokens, targets = batch(cfg)
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % cfg.vocab
    a, b = model(tokens, targets, reduction="none"), model(changed, targets, reduction="none")
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_rope_depends_on_relative_positions_only() -> None:
    cfg = config(position_embedding="rope")
    model = build_shard(cfg, seed=3).module
    tokens, targets = batch(cfg)
    default = model(tokens, targets, reduction="none")
    shifted = model(tokens, targets, positions=torch.arange(16) + 100, reduction="none")
    torch.testing.assert_close(default, shifted, rtol=1e-4, atol=1e-4)
    learned = build_shard(config(seq_len=32), seed=3).module
    assert not torch.allclose(learned(tokens, targets), learned(tokens, targets, positions=torch.arange(16) + 16))


def test_init_is_a_function_of_seed_and_name_only() -> None:
    cfg = config()
    torch.manual_seed(0)
    a = build_shard(cfg, seed=7).module.state_dict()
    torch.manual_seed(123)  # the global RNG must not matter
    b = build_shard(cfg, seed=7).module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = build_shard(cfg, seed=8).module.state_dict()
    assert not torch.equal(a["layers.0.attn.qkv.weight"], c["layers.0.attn.qkv.weight"])
    assert torch.equal(a["layers.0.ln1.weight"], torch.ones(32)) and not a["layers.1.mlp.fc.bias"].any()
    assert abs(a["layers.0.mlp.proj.weight"].std().item() - 0.02 / 2) < 0.002  # 0.02 / sqrt(2 * layers)


def test_pipeline_stages_start_from_the_serial_weights() -> None:
    cfg = config(layers=3)
    full = build_shard(cfg, seed=5).module.state_dict()
    last = build_shard(cfg, seed=5, stage=Stage(first=2, has_embedding=False)).module
    assert sorted(k.split(".")[1] for k in last.state_dict() if k.startswith("layers.")) == ["2"] * 11  # ln1 (2), qkv weight, proj (2), ln2 (2), fc (2), proj (2)
    for name, value in last.state_dict().items():
        torch.testing.assert_close(value, full["wte.weight" if name == "head.weight" else name], rtol=0, atol=0)
    first = build_shard(cfg, seed=5, stage=Stage(last=1, has_head=False)).module
    tokens, _ = batch(cfg)
    assert first(tokens).shape == (2, 16, 32) and not hasattr(first, "head")


@pytest.mark.parametrize("tp,sp", [(2, False), (4, True)])
def test_shards_are_slices_of_the_serial_init(tp: int, sp: bool) -> None:
    cfg = config(hidden=64, heads=4, vocab=250)
    serial = dict(build_shard(cfg, seed=9).module.named_parameters())
    shards = [build_shard(cfg, seed=9, tp=TPContext(None, r, tp, sp)) for r in range(tp)]
    for name, full in serial.items():
        meta = shards[0].meta[name]
        parts = [dict(s.module.named_parameters())[name].detach() for s in shards]
        for r, part in enumerate(parts):
            assert torch.equal(part, shard_slice(full.detach(), meta.shard_dim, r, tp)), name
        if meta.shard_dim is not None:
            joined = torch.cat(parts, meta.shard_dim).narrow(meta.shard_dim, 0, full.size(meta.shard_dim))
            assert torch.equal(joined, full.detach()), name
        assert meta.full_shape == tuple(full.shape)
        assert meta.tp_grad_sum == (sp and meta.shard_dim is None)
    assert shards[0].meta["wte.weight"].shard_dim == 0 and shards[0].meta["layers.0.attn.proj.bias"].shard_dim is None


def test_qkv_split_gives_each_rank_whole_heads() -> None:
    cfg = config(hidden=64, heads=4)
    serial = build_shard(cfg, seed=4).module.layers["0"].attn.qkv
    x = torch.randn(2, 16, 64)
    full = serial(x).view(2, 16, 4, 3, 16)  # (B, T, nh, 3, hs)
    for r in range(2):
        local = build_shard(cfg, seed=4, tp=TPContext(None, r, 2)).module.layers["0"].attn.qkv
        torch.testing.assert_close(local(x).view(2, 16, 2, 3, 16), full[:, :, 2 * r:2 * r + 2])


def test_plan_covers_every_layer_and_rejects_unknown_paths() -> None:
    shard = build_shard(config(), seed=0, tp=TPContext(None, 0, 2))
    modules = dict(shard.module.named_modules())
    assert set(shard.styles) <= set(modules)
    assert {resolve_style(p, GPT_TP_PLAN) for p in shard.styles} == {s for _, s in GPT_TP_PLAN}
    with pytest.raises(KeyError, match="no entry for module 'layers.0.attn.rotary'"):
        resolve_style("layers.0.attn.rotary", GPT_TP_PLAN)
    with pytest.raises(ValueError, match="heads=4 is not divisible by tp=3"):
        build_shard(config(heads=4, hidden=48), tp=TPContext(None, 0, 3))


def test_config_from_job_spec() -> None:
    from rankctl.kinds.train.spec import ModelSpec, MoeSpec

    cfg = GPTConfig.from_spec(ModelSpec(layers=2, hidden=64, heads=4, vocab=255, position_embedding="rope"))
    assert (cfg.ffn, cfg.head_dim, cfg.vocab, cfg.tie_embeddings) == (256, 16, 255, True)
    with pytest.raises(NotImplementedError, match="moe"):
        GPTConfig.from_spec(ModelSpec(moe=MoeSpec(experts=2)))


def test_full_init_rules() -> None:
    cfg = config()
    w = full_init("wte.weight", (255, 32), 1, cfg)
    assert torch.equal(w, full_init("wte.weight", (255, 32), 1, cfg))
    assert not torch.equal(w, full_init("wpe.weight", (255, 32), 1, cfg))
    assert torch.equal(full_init("ln_f.bias", (32,), 1, cfg), torch.zeros(32))
    with pytest.raises(ValueError, match="not divisible by model.heads"):
        config(hidden=30)
