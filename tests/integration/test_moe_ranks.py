"""Expert parallelism against the serial MoE GPT, on 4 forked gloo ranks (one pool).

Each case builds the layout's groups, gives every DP replica its own micro-batch (the serial
model sees their concatenation), runs forward + backward with the trainer's scaling
(loss sum x 1/global tokens, ``MoETracker.loss_scale`` likewise), reduces the gradients as
the trainer must (dense: SUM over dp_cp, tp_grad_sum over tp; expert: SUM over expt_dp,
tp_grad_sum over expt_tp), gathers them over tp / expt_tp and compares every parameter this
rank holds with the serial gradient, the loss (CE + aux) with the serial one, and the
expert token counts (summed over the stage) with the serial counts, all within 1e-5.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from rankctl.models.gpt import GPTConfig
from rankctl.models.moe import MoEConfig
from rankctl.models.shard import build_shard
from rankctl.parallel.experts import ExpertGroups
from rankctl.parallel.groups import ProcessGroups
from rankctl.parallel.layout import ParallelConfig, RankLayout
from ranks import fork_ranks, run_cases

WORLD = 4
RTOL = 1e-5
B = 2  # sequences per DP replica
CFG = GPTConfig(layers=3, hidden=16, heads=2, seq_len=8, vocab=31)
# (tp, sequence parallel, ep, etp, capacity factor)
CASES = [(1, False, 4, 1, None), (1, False, 2, 1, None), (1, False, 2, 2, None),
         (2, False, 2, 1, None), (2, True, 2, 2, None), (2, False, 2, 1, 0.75)]


def moe_config(capacity: float | None) -> MoEConfig:
    return MoEConfig(experts=4, top_k=2, every=2, aux_loss=0.05, capacity_factor=capacity)


def data(dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(17)
    return torch.randint(0, CFG.vocab, (dp * B, CFG.seq_len + 1), generator=g)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    atol = RTOL * max(want.abs().max().item(), 1e-12)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def step(shard, tokens: torch.Tensor, scale: float) -> tuple[torch.Tensor, dict]:
    """Forward + backward as the trainer does; (CE sum, per-layer stats)."""
    shard.moe.loss_scale = scale
    loss = shard(tokens[:, :-1], tokens[:, 1:])
    (loss * scale).backward()
    return loss.detach(), shard.moe.take()


def reduce_grads(shard, pgs: ProcessGroups) -> None:
    """What the trainer's GradReducers must do (two of them: dense and expert)."""
    for expert, dp_kind, tp_kind in ((False, "dp_cp", "tp"), (True, "expt_dp", "expt_tp")):
        for _, p in shard.named_parameters_by_kind(expert):
            if pgs.size(dp_kind) > 1:
                dist.all_reduce(p.grad, group=pgs.get(dp_kind))
        for p in shard.tp_grad_sum_params(expert):
            dist.all_reduce(p.grad, group=pgs.get(tp_kind))


def stage_sum(t: torch.Tensor, pgs: ProcessGroups) -> torch.Tensor:
    t = t.clone()
    if pgs.size("tp_dp_cp") > 1:
        dist.all_reduce(t, group=pgs.get("tp_dp_cp"))
    return t


def run_case(rank: int, case: tuple, new_group) -> None:
    tp, sp, ep, etp, capacity = case
    where = f"rank {rank} case {case}"
    layout = RankLayout(ParallelConfig(world_size=WORLD, tp=tp, ep=ep, etp=etp))
    pgs = ProcessGroups.build(rank, WORLD, layout.rank_groups(rank), new_group=new_group)
    dp = layout.config.dp
    everything, scale = data(dp), 1.0 / (dp * B * CFG.seq_len)

    serial = build_shard(CFG, seed=9, moe=moe_config(capacity))
    want_ce, want_stats = step(serial, everything, scale)
    want_grads = {n: p.grad for n, p in serial.named_parameters()}

    shard = build_shard(CFG, pgs.get("tp"), sp, seed=9, moe=moe_config(capacity),
                        expert_groups=ExpertGroups.from_pgs(pgs))
    mine = everything[layout.coords(rank)["dp"] * B:][:B]
    ce, stats = step(shard, mine, scale)
    reduce_grads(shard, pgs)

    aux = stage_sum(torch.tensor(sum(s.aux for s in stats.values()), dtype=torch.float64), pgs)
    if pgs.size("dp_cp") > 1:
        dist.all_reduce(ce, group=pgs.get("dp_cp"))
    want_aux = sum(s.aux for s in want_stats.values())
    assert want_aux > 0 and abs(aux.item() - want_aux) <= RTOL * want_aux, (where, aux, want_aux)
    assert_close(ce + aux.float(), want_ce + want_aux, f"loss {where}")
    for name, s in want_stats.items():
        assert torch.equal(stage_sum(stats[name].tokens, pgs), s.tokens), (where, name)
        assert stage_sum(torch.tensor(stats[name].dropped), pgs).item() == s.dropped, (where, name)
    assert (want_stats["layers.0.mlp"].dropped > 0) == (capacity is not None), where
    params, grads = shard.full_state_dict(), shard.full_state_dict(grads=True)
    assert len([n for n in grads if ".experts." in n]) == 2 * 4 * 4 // ep, where
    for name, g in grads.items():
        assert torch.equal(params[name], dict(serial.named_parameters())[name].detach()), f"init {name} {where}"
        assert_close(g, want_grads[name], f"grad of {name} on {where}")


def test_expert_parallel_matches_serial(tmp_path) -> None:
    assert fork_ranks(WORLD, run_cases, str(tmp_path / "store"), CASES, run_case) == [0] * WORLD
