"""End to end: mixture-of-experts training jobs through the public path (coordinator + daemons
+ launchers + ranks) equal the serial MoE run: per-step losses (cross-entropy + aux loss)
within 1e-5 relative, the final gradient norm within 1e-5 relative, the last step's tokens per
expert exactly, and the final parameters, exported from the checkpoints (experts gathered from
their ep ranks and expt_tp slices), within 1e-5.

Layouts: expert parallelism alone (ep 2 and 4, with dense dp and expert dp), with tensor
parallelism whose expert TP differs (tp 2, etp 1), with expert TP alone (etp 2, tp 1), with
pipeline parallelism, and all three (tp 2, ep 2, pp 2 on 8 ranks). No capacity factor, so no
token is dropped and every layout routes exactly as the serial run. lr 3e-3 as in
``test_e2e_parallel`` (see there why a larger one amplifies fp32 rounding through Adam).
One embedded local cluster (2 nodes x 4 slots) serves the module.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rankctl.cli.errors import CtlError
from rankctl.kinds.train.checkpoint import export_full_state_dict
from test_e2e_train import Runner, close

pytestmark = [pytest.mark.timeout(600), pytest.mark.grpc_in_process]
STEPS = 8
BASE = """
name: {name}
kind: train
resources: {{nodes: {nodes}, slots_per_node: {slots}}}
parallel: {parallel}
model: {{layers: {layers}, hidden: 32, heads: 4, seq_len: 16, vocab: 256,
         moe: {{experts: 4, top_k: 2, every: 1, aux_loss: 0.01}}}}
train: {{steps: {steps}, global_batch: 16, micro_batch: 2, lr: 3.0e-3, warmup: 2, seed: 7, grad_clip: 0.5,
         checkpoint_every: {steps}, data: builtin:pydoc}}
"""
# name -> (parallel section, (nodes, slots per node), layers)
LAYOUTS: dict[str, tuple[dict[str, Any], tuple[int, int], int]] = {
    "ep2-dp4": ({"ep": 2}, (1, 4), 2),  # dense dp 4, expert dp 2
    "ep4": ({"ep": 4}, (1, 4), 2),  # dense dp 4, expert dp 1
    "tp2-ep2-etp1": ({"tp": 2, "ep": 2, "etp": 1}, (1, 4), 2),  # dense tp 2 dp 2; experts ep 2 edp 2
    "ep2-etp2": ({"ep": 2, "etp": 2}, (1, 4), 2),  # dense dp 4; experts etp 2 ep 2
    "ep2-pp2": ({"ep": 2, "pp": 2}, (1, 4), 4),
    "tp2-ep2-pp2": ({"tp": 2, "ep": 2, "etp": 1, "pp": 2}, (2, 4), 4),
}


def job_yaml(name: str, parallel: dict[str, Any], nodes: int = 1, slots: int = 1, layers: int = 2) -> str:
    flow = "{" + ", ".join(f"{k}: {v}" for k, v in parallel.items()) + "}"
    return BASE.format(name=name, nodes=nodes, slots=slots, parallel=flow, layers=layers, steps=STEPS)


def summary(runner: Runner, name: str, job: dict) -> dict:
    assert job["state"] == "SUCCEEDED", (name, job["reason"])
    final = job["result"]["final"]
    return {"losses": [x["loss"] for x in job["result"]["losses"]], "norm": final["grad_norm"],
            "aux": final["aux_loss"], "tokens": final["expert_tokens"],
            "params": export_full_state_dict(runner.step_dirs(name, STEPS))}


@pytest.fixture(scope="module")
def jobs(runner: Runner) -> dict[str, dict]:
    """Every job submitted at once (FIFO on the cluster), the serial references first."""
    texts = {f"serial-l{n}": job_yaml(f"serial-l{n}", {}, layers=n) for n in (2, 4)}
    texts |= {name: job_yaml(name, par, *res, layers=layers) for name, (par, res, layers) in LAYOUTS.items()}
    ids = {name: runner.submit(text) for name, text in texts.items()}
    return {name: runner.wait(job_id) for name, job_id in ids.items()}


@pytest.fixture(scope="module")
def serial(runner: Runner, jobs: dict) -> dict[int, dict]:
    """layers -> the serial run's summary."""
    return {n: summary(runner, f"serial-l{n}", jobs[f"serial-l{n}"]) for n in (2, 4)}


def test_serial_moe_trains(serial: dict) -> None:
    s = serial[2]
    assert len(s["losses"]) == STEPS and s["losses"][-1] < s["losses"][0] - 0.3, s["losses"]
    assert 0.015 < s["aux"] < 0.03, s["aux"]  # two MoE layers, each about aux_loss = 0.01
    assert sorted(s["tokens"]) == ["layers.0.mlp", "layers.1.mlp"]
    for tokens in s["tokens"].values():  # top-2 of the global batch's 16 x 16 tokens
        assert len(tokens) == 4 and sum(tokens) == 2 * 16 * 16
    assert {k for k in s["params"] if ".experts." in k} == {
        f"layers.{i}.mlp.experts.{e}.{m}.{p}" for i in range(2) for e in range(4)
        for m in ("fc", "proj") for p in ("weight", "bias")}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_serial(runner: Runner, jobs: dict, serial: dict, name: str) -> None:
    _, (nodes, slots), layers = LAYOUTS[name]
    job, world = jobs[name], nodes * slots
    assert job["world_size"] == world and len(job["ranks"]) == world
    ours, ref = summary(runner, name, job), serial[layers]
    assert len(ours["losses"]) == STEPS
    bad = [(s + 1, a, b) for s, (a, b) in enumerate(zip(ours["losses"], ref["losses"])) if not close(a, b)]
    assert not bad, f"steps whose loss differs from the serial run (step, ours, serial): {bad}"
    assert close(ours["norm"], ref["norm"]), (ours["norm"], ref["norm"])
    assert close(ours["aux"], ref["aux"]), (ours["aux"], ref["aux"])
    assert ours["tokens"] == ref["tokens"]
    assert ours["params"].keys() == ref["params"].keys()
    for key, full in ours["params"].items():
        torch.testing.assert_close(full, ref["params"][key], rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize(
    "parallel, slots, edit, words",
    [
        ({"ep": 4}, 4, ("experts: 4", "experts: 6"), ["model.moe.experts=6", "parallel.ep=4"]),
        ({"ep": 2, "etp": 4}, 4, None, ["world_size=4", "etp*ep*pp=8"]),
        ({"ep": 2, "etp": 4}, 8, ("hidden: 32", "hidden: 32, ffn_hidden: 126"), ["model.ffn_hidden=126",
                                                                                  "parallel.etp=4"]),
        ({"ep": 2, "tp": 4}, 8, ("seq_len: 16", "seq_len: 18"), ["model.seq_len=18", "parallel.tp=4"]),
        ({"ep": 2, "cp": 2}, 4, ("aux_loss: 0.01", "aux_loss: 0.01, capacity_factor: 1.5"),
         ["model.moe.capacity_factor", "parallel.cp=2"]),
    ],
)
def test_bad_moe_jobs_are_refused(runner: Runner, parallel: dict, slots: int, edit: tuple[str, str] | None,
                                  words: list[str]) -> None:
    text = job_yaml("bad", parallel, 1 if slots <= 4 else 2, min(slots, 4))
    if edit is not None:
        text = text.replace(*edit)
    with runner.ctx.client() as c:
        before = len(c.jobs())
        with pytest.raises(CtlError) as err:
            c.submit(text, [], "bad.yaml")
        assert err.value.exit_code == 2
        for w in words:
            assert w in err.value.message, (w, err.value.message)
        assert len(c.jobs()) == before
