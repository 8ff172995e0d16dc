"""The train kind across real ranks (gloo, forked processes, the real ``run_rank`` path).

Every layout must reproduce the serial run: per-step losses within 1e-5 relative and the
exported full parameters within 1e-5; a run killed after a checkpoint and resumed under a
new job id reproduces the later losses. Tiny model, 6 steps, ~1 s per run.
"""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from rankctl.kinds.spec import build_spec
from rankctl.models.gpt import GPT, GPTConfig
from rankctl.parallel import data_parallel
from rankctl.parallel.data_parallel import plan_buckets
from rankctl.parallel.layout import ParallelConfig, RankLayout
from rankctl.kinds.train import checkpoint as ckpt
from rankctl.contract.assignment import RankAssignment
from rankctl.runtime.rank import run_rank
from rankctl.worker.runs.status import read_status

STEPS = 6
CRASH = 17
MODEL = {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 16}
TRAIN = {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "lr": 3e-3, "warmup": 2, "seed": 7,
         "eval_every": 3, "checkpoint_every": 2, "grad_clip": 0.5}


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch) -> None:
    """Several DP buckets even for the tiny model (forked ranks inherit the patch)."""
    monkeypatch.setattr(data_parallel, "DEFAULT_BUCKET_BYTES", 8 << 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assignments(state: Path, name: str, job_id: str, *, tp: int, dp: int, sp: bool,
                resume: bool = False) -> list[RankAssignment]:
    world = tp * dp
    spec = build_spec({"name": name, "resources": {"nodes": 1, "slots_per_node": world},
                       "parallel": {"tp": tp, "sequence_parallel": sp}, "model": MODEL,
                       "train": {**TRAIN, "resume": resume}})
    lay = RankLayout(ParallelConfig(world_size=world, tp=tp))
    port = free_port() if world > 1 else 0
    run_dir = str(state / "jobs" / job_id / "0")
    return [RankAssignment(job_id=job_id, attempt=0, rank=r, world_size=world, local_rank=r, node="n0",
                           coords=lay.coords(r), groups=lay.rank_groups(r), rendezvous=f"127.0.0.1:{port}",
                           backend="gloo", kind="train", spec=spec, run_dir=run_dir) for r in range(world)]


def _die_at(step_to_die: int) -> None:
    """In a rank: rank 0 saves ``step_to_die`` and dies, the others die before saving it,
    so that step's checkpoint is incomplete."""
    save = ckpt.save_rank

    def save_then_die(root: str, step: int, rank: int, *args: Any, **kwargs: Any) -> str:
        if step == step_to_die and rank != 0:
            os._exit(CRASH)
        out = save(root, step, rank, *args, **kwargs)
        if step == step_to_die:
            os._exit(CRASH)
        return out

    ckpt.save_rank = save_then_die


def launch(ranks: list[RankAssignment], crash_at: int | None = None) -> list[int]:
    pids = []
    for a in ranks:
        if (pid := os.fork()) == 0:
            code = 1
            try:
                if crash_at:
                    _die_at(crash_at)
                code = run_rank(a, timeout_s=60)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            os._exit(code)
        pids.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


def result(a: RankAssignment) -> dict[str, Any]:
    """The rank's result, plus the per-step gradient norms of its status records."""
    records = read_status(a.run_dir, a.rank)
    assert records[-1].phase == "done", records[-1]
    norms = [r.metrics["grad_norm"] for r in records if r.phase == "running" and r.step is not None]
    return {**records[-1].result, "grad_norms": norms}


def train(state: Path, name: str, *, tp: int = 1, dp: int = 1, sp: bool = False) -> tuple[dict, dict]:
    """(rank 0's result, exported full parameters of the last step)."""
    ranks = assignments(state, name, f"{name}-1", tp=tp, dp=dp, sp=sp)
    assert launch(ranks) == [0] * len(ranks)
    results = [result(a) for a in ranks]
    for r in results[1:]:  # every rank reports the same global losses and norms
        assert r["losses"] == results[0]["losses"] and r["grad_norms"] == results[0]["grad_norms"]
    full = ckpt.export_full_state_dict(ckpt.step_dir(str(state / "checkpoints" / name), STEPS))
    return results[0], full


@pytest.fixture(scope="module")
def serial(tmp_path_factory) -> tuple[dict, dict]:
    return train(tmp_path_factory.mktemp("serial"), "serial")


def losses(res: dict, key: str = "losses") -> list[float]:
    return [row["loss"] for row in res[key]]


def assert_same_run(res: dict, full: dict, serial: tuple[dict, dict]) -> None:
    ref, ref_full = serial
    assert [r["step"] for r in res["losses"]] == list(range(1, STEPS + 1))
    assert losses(res) == pytest.approx(losses(ref), rel=1e-5)
    assert losses(res, "val_losses") == pytest.approx(losses(ref, "val_losses"), rel=1e-5)
    n = len(res["grad_norms"])  # a resumed run reports the steps after the checkpoint
    assert res["grad_norms"] == pytest.approx(ref["grad_norms"][-n:], rel=1e-5)
    assert full.keys() == ref_full.keys()
    for name, value in ref_full.items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_serial_run_learns_and_exports_the_serial_model(serial) -> None:
    res, full = serial
    assert len(res["losses"]) == STEPS and [r["step"] for r in res["val_losses"]] == [3, 6]
    assert losses(res)[-1] < losses(res)[0] < 5.6  # starts near ln(256) = 5.55
    assert res["final"]["tokens_per_s"] > 0 and res["final"]["peak_mem_mb"] > 0
    model = GPT(GPTConfig(**MODEL, vocab=256))
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {n: tuple(t.shape) for n, t in full.items()}
    model.load_state_dict(full, strict=True)


@pytest.mark.parametrize(("tp", "dp", "sp"), [(1, 2, False), (2, 1, False), (2, 1, True), (2, 2, True)])
def test_layout_matches_serial(tmp_path, serial, tp: int, dp: int, sp: bool) -> None:
    res, full = train(tmp_path, f"tp{tp}-dp{dp}-sp{int(sp)}", tp=tp, dp=dp, sp=sp)
    assert_same_run(res, full, serial)


def test_killed_run_resumes_from_the_last_complete_checkpoint(tmp_path, serial) -> None:
    """Dies while writing step 4 (only rank 0's file lands), so the resume starts after step 2."""
    first = assignments(tmp_path, "resume", "resume-1", tp=2, dp=2, sp=True)
    assert launch(first, crash_at=4) == [CRASH] * 4
    root = str(tmp_path / "checkpoints" / "resume")
    assert ckpt.list_steps(root) == [2, 4] and ckpt.latest_complete(root, 4) == 2
    again = assignments(tmp_path, "resume", "resume-2", tp=2, dp=2, sp=True, resume=True)
    assert launch(again) == [0] * 4
    res = result(again[0])
    assert res["resumed_from"] == 2
    assert_same_run(res, ckpt.export_full_state_dict(ckpt.step_dir(root, STEPS)), serial)


def test_buckets_are_reverse_order_and_capped() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 300, 20, 30, 5)]
    assert plan_buckets(params, 100 * 4) == [[4, 3, 2, 1], [0]]
    assert plan_buckets(params, 1) == [[4], [3], [2], [1], [0]]
    assert plan_buckets(params, 1 << 20) == [[4, 3, 2, 1, 0]]
