"""Pipeline parallelism against the serial model, on 4 forked gloo ranks (one pool).

Every case runs one training step's forwards and backwards over ``m`` micro-batches with
the interpreter, then sums the tied embedding gradients over ``embd``; the step loss and
every gradient (gathered to full tensors, per stage, compared by serial name) must equal
the serial model's within 1e-5. Cases: pp=4 and pp=2 (dp=2: two independent pipelines),
vpp 1 and 2, gpipe and 1f1b, and tp=2 x pp=2 with and without sequence parallelism.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from rankctl.models.gpt import GPTConfig
from rankctl.models.shard import build_shard
from rankctl.models.stages import build_chunks
from rankctl.models.embedding_sync import sync_embedding_grads
from rankctl.parallel.groups import ProcessGroups
from rankctl.parallel.layout import ParallelConfig, RankLayout
from ranks import CachedGroups, fork_ranks, run_cases
from rankctl.parallel.pipeline import pipeline_step
from rankctl.parallel.schedules import PipelineShape, stage_actions

WORLD = 4
RTOL = 1e-5
M = 4  # micro-batches per step
# (tp, pp, vpp, schedule, sequence parallel, position embedding, tied)
CASES = [
    (1, 4, 1, "gpipe", False, "learned", True),
    (1, 4, 1, "1f1b", False, "learned", True),
    (1, 4, 2, "gpipe", False, "learned", True),
    (1, 4, 2, "1f1b", False, "rope", False),
    (1, 2, 1, "1f1b", False, "learned", True),
    (1, 2, 2, "1f1b", False, "learned", True),
    (1, 2, 2, "gpipe", False, "rope", True),
    (2, 2, 1, "1f1b", False, "learned", True),
    (2, 2, 1, "gpipe", True, "learned", True),
    (2, 2, 2, "1f1b", True, "rope", False),
]


def model_config(pe: str, tied: bool) -> GPTConfig:
    return GPTConfig(layers=8, hidden=16, heads=2, seq_len=8, vocab=63, position_embedding=pe,
                     tie_embeddings=tied)


def micro_batches(cfg: GPTConfig, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab, (M, 2, cfg.seq_len + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def serial_step(cfg: GPTConfig, batches: list) -> tuple[float, dict[str, torch.Tensor]]:
    model = build_shard(cfg, seed=7).module
    scale = 1.0 / sum(t.numel() for t, _ in batches)
    total = sum(model(tokens, targets) for tokens, targets in batches) * scale
    total.backward()
    return total.item(), {n: p.grad for n, p in model.named_parameters()}


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    atol = RTOL * max(want.abs().max().item(), 1e-12)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def run_case(rank: int, case: tuple, new_group: CachedGroups) -> None:
    tp, pp, vpp, name, sp, pe, tied = case
    where = f"rank {rank} case {case}"
    layout = RankLayout(ParallelConfig(world_size=WORLD, tp=tp, pp=pp, vpp=vpp if vpp > 1 else None))
    pgs = ProcessGroups.build(rank, WORLD, layout.rank_groups(rank), new_group=new_group)
    cfg = model_config(pe, tied)
    batches = micro_batches(cfg, seed=layout.coords(rank)["dp"])  # DP replicas see other data
    want_loss, want_grads = serial_step(cfg, batches)

    stage = pgs.local_rank("pp")
    chunks = build_chunks(cfg, pp=pp, vpp=vpp, stage=stage, tp_group=pgs.get("tp"), sequence_parallel=sp, seed=7)
    actions = stage_actions(name, PipelineShape(pp=pp, vpp=vpp, microbatches=M), stage)
    scale = 1.0 / sum(t.numel() for t, _ in batches)
    hooks: list[tuple[int, bool]] = []
    losses = pipeline_step(chunks, actions, batches, pgs, loss_scale=scale,
                           before_backward=lambda c, last: hooks.append((c, last)))
    sync_embedding_grads(chunks, pgs)
    assert len(hooks) == M * vpp and sorted(c for c, last in hooks if last) == list(range(vpp)), where
    assert all(not any(c2 == c for c2, _ in hooks[i + 1:]) for i, (c, last) in enumerate(hooks) if last), where

    has_head = any(c.module.has_head for c in chunks)
    assert len(losses) == (M if has_head else 0), where
    if has_head:
        assert abs(sum(losses) * scale - want_loss) <= RTOL * abs(want_loss), (where, losses, want_loss)
    for chunk in chunks:
        for p in chunk.tp_grad_sum_params():  # what the DP/grad code does under SP
            dist.all_reduce(p.grad, group=pgs.get("tp"))
        for n, g in chunk.full_state_dict(grads=True).items():
            assert_close(g, want_grads[chunk.meta[n].init_key], f"grad of {n} on {where}")


def test_single_stage_runs_without_processes() -> None:
    """pp=1: the 1F1B list is F, B per micro-batch and needs no communicator."""
    cfg = model_config("learned", True)
    batches = micro_batches(cfg, seed=3)
    want_loss, want_grads = serial_step(cfg, batches)
    pgs = ProcessGroups(0, 1, {"pp": [0]}, {})
    chunks = build_chunks(cfg, pp=1, vpp=None, stage=0, seed=7)
    actions = stage_actions("1f1b", PipelineShape(pp=1, microbatches=M), 0)
    scale = 1.0 / sum(t.numel() for t, _ in batches)
    losses = pipeline_step(chunks, actions, batches, pgs, loss_scale=scale)
    assert abs(sum(losses) * scale - want_loss) <= RTOL * abs(want_loss)
    for n, p in chunks[0].named_parameters():
        assert_close(p.grad, want_grads[n], f"grad of {n}")


def test_pipeline_matches_serial(tmp_path) -> None:
    assert fork_ranks(WORLD, run_cases, str(tmp_path / "store"), CASES, run_case) == [0] * WORLD
