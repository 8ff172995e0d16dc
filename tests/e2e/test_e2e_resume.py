"""End to end: when a train job resumes from checkpoints under its name, and when it must not.

Through the embedded local cluster (coordinator + daemons + launchers + ranks). Attempts count
from 1 for every job, so nothing may be inferred from them: only ``train.resume: true`` (or a
restart of the same job) resumes, and a resume must match the checkpoint's seed and data too.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.grpc_in_process]
JOB = """
name: {name}
kind: train
resources: {{nodes: 1, slots_per_node: 1}}
model: {{layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256}}
train: {{steps: {steps}, global_batch: 8, micro_batch: 2, lr: 1.0e-2, warmup: 1, seed: {seed},
         checkpoint_every: {ckpt}, resume: {resume}, data: builtin:pydoc}}
"""


def job(name: str, seed: int, steps: int = 4, ckpt: int = 2, resume: bool = False) -> str:
    return JOB.format(name=name, seed=seed, steps=steps, ckpt=ckpt, resume=str(resume).lower())


def run(runner, text: str) -> dict:
    return runner.wait(runner.submit(text), timeout=240)


def losses(done: dict) -> list[tuple[int, float]]:
    assert done["state"] == "SUCCEEDED", done["reason"]
    return [(x["step"], x["loss"]) for x in done["result"]["losses"]]


def test_fresh_job_with_a_reused_name_ignores_the_earlier_checkpoints(runner) -> None:
    """B (fresh, seed 8) after A (seed 7, checkpointed, more steps) under the same name trains
    exactly as B did on the clean cluster, before any checkpoint of that name existed."""
    b_text = job("reused", seed=8)
    clean = run(runner, b_text)
    earlier = run(runner, job("reused", seed=7, steps=6, ckpt=3))
    again = run(runner, b_text)
    assert earlier["result"]["resumed_from"] is None, "A is a fresh job too"
    assert again["result"]["resumed_from"] is None, again["result"]
    assert losses(again) == losses(clean)
    assert [s for s, _ in losses(again)] == [1, 2, 3, 4]


def test_resume_with_another_seed_is_refused_naming_the_seed(runner) -> None:
    assert losses(run(runner, job("reseed", seed=7)))
    refused = run(runner, job("reseed", seed=9, steps=6, resume=True))
    assert refused["state"] == "FAILED", refused
    reason = refused["reason"]
    assert "cannot resume" in reason and "train.seed: checkpoint 7, this job 9" in reason, reason
    same = run(runner, job("reseed", seed=7, steps=6, resume=True))  # the same seed resumes
    assert same["result"]["resumed_from"] == 4 and [s for s, _ in losses(same)][-2:] == [5, 6]
