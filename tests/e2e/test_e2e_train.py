"""End to end: train jobs through the public path (coordinator + daemons + launchers + ranks)
equal the serial run: per-step losses within 1e-5 relative and the final parameters, exported
from the checkpoints to full tensors, within 1e-5 except for at most a few elements within
what AdamW can do (``compare.assert_params_close``: the argument is there). At lr 1e-2 this
config has 4 elements whose Adam denominator falls below eps, where rounding is amplified by
``lr / eps`` (``bench/adam_drift.py --config train`` lists them).

One embedded local cluster (2 nodes x 4 slots) serves the module; every layout is submitted
once and the jobs queue FIFO on it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rankctl.cli.context import Ctx
from rankctl.cli.errors import CtlError
from rankctl.cli.local import LocalCluster
from rankctl.cli.view.render import job_to_dict
from rankctl.kinds.train.checkpoint import export_full_state_dict, step_dir
from compare import assert_params_close, lr_schedule

pytestmark = [pytest.mark.timeout(900), pytest.mark.grpc_in_process]
STEPS, LR, WARMUP = 10, 1.0e-2, 2   # 10 steps of 8 sequences: the serial loss falls by more than 1.0 (asserted)
BASE = """
name: {name}
kind: train
resources: {{nodes: {nodes}, slots_per_node: {slots}}}
parallel: {{tp: {tp}, sequence_parallel: {sp}}}
model: {{layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256, position_embedding: {pos}}}
train: {{steps: {steps}, global_batch: 8, micro_batch: 2, lr: {lr}, warmup: {warmup}, seed: 7,
         checkpoint_every: {ckpt}, data: builtin:pydoc}}
"""
# (tp, sequence_parallel, dp): tp in {1, 2, 4} with and without SP, dp in {1, 2, 4}, world <= 8
LAYOUTS = [(1, False, 2), (1, False, 4), (2, False, 1), (2, True, 1), (2, False, 2), (2, True, 2),
           (2, True, 4), (4, False, 1), (4, True, 1), (4, False, 2), (4, True, 2)]


def job_yaml(name: str, tp: int = 1, sp: bool = False, dp: int = 1, steps: int = STEPS, ckpt: int = STEPS,
             pos: str = "learned") -> str:
    world = tp * dp
    nodes, slots = (2, world // 2) if world == 8 else (1, world)
    return BASE.format(name=name, nodes=nodes, slots=slots, tp=tp, sp=str(sp).lower(), steps=steps, ckpt=ckpt,
                       pos=pos, lr=LR, warmup=WARMUP)


class Runner:
    def __init__(self, root: Path, nodes: int = 2, slots: int = 4) -> None:
        self.root = root
        self.cluster = LocalCluster(nodes, slots, root).start()
        self.ctx = Ctx(coordinator=self.cluster.address)

    def submit(self, text: str) -> str:
        with self.ctx.client() as c:
            return c.submit(text, [], "test").id

    def wait(self, job_id: str, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        with self.ctx.client() as c:
            while time.monotonic() < deadline:
                d = job_to_dict(c.get(job_id))
                # ended, and every rank confirmed gone: its slots are free again, so the next job of the same
                # layout lands where this one ran (node-local checkpoints; CI saw a resume placed on the other
                # node while the cancelled ranks were still stopping, with nothing there to resume from)
                if d["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and not d["stopping"]:
                    return d
                time.sleep(0.2)
        raise AssertionError(f"{job_id} did not finish in {timeout} s")

    def step_dirs(self, name: str, step: int) -> list[str]:
        dirs = [step_dir(str(self.root / node / "checkpoints" / name), step) for node in self.cluster.names]
        return [d for d in dirs if Path(d).exists()]


@pytest.fixture(scope="module")
def serial(runner: Runner) -> dict:
    job = runner.wait(runner.submit(job_yaml("serial")))
    assert job["state"] == "SUCCEEDED", job
    return {"losses": [x["loss"] for x in job["result"]["losses"]],
            "params": export_full_state_dict(runner.step_dirs("serial", STEPS))}


@pytest.fixture(scope="module")
def layout_jobs(runner: Runner, serial: dict) -> dict:
    ids = {lay: runner.submit(job_yaml(f"tp{lay[0]}-sp{int(lay[1])}-dp{lay[2]}", *lay)) for lay in LAYOUTS}
    return {lay: runner.wait(job_id) for lay, job_id in ids.items()}


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_serial_loss_falls(serial: dict) -> None:
    losses = serial["losses"]
    assert len(losses) == STEPS and losses[0] > 5.0 and losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"tp{lay[0]}-sp{int(lay[1])}-dp{lay[2]}")
def test_layout_equals_serial(runner: Runner, serial: dict, layout_jobs: dict, layout) -> None:
    job = layout_jobs[layout]
    assert job["state"] == "SUCCEEDED", job["reason"]
    tp, sp, dp = layout
    assert job["world_size"] == tp * dp and len(job["ranks"]) == tp * dp
    losses = [x["loss"] for x in job["result"]["losses"]]
    assert len(losses) == STEPS
    bad = [(s + 1, a, b) for s, (a, b) in enumerate(zip(losses, serial["losses"])) if not close(a, b)]
    assert not bad, f"steps whose loss differs from the serial run (step, ours, serial): {bad}"
    params = export_full_state_dict(runner.step_dirs(f"tp{tp}-sp{int(sp)}-dp{dp}", STEPS))
    assert_params_close(params, serial["params"], lr_schedule(LR, WARMUP, STEPS))


def test_killed_job_resumes_with_the_same_losses(runner: Runner) -> None:
    """Long enough (40 steps, ~0.25 s each) that the kill, sent once every rank passed step 6, lands mid-run;
    the reference is the same job file run uninterrupted under another name."""
    steps = 40
    text = job_yaml("resume", tp=2, sp=True, dp=2, steps=steps, ckpt=5)
    job_id = runner.submit(text)
    with runner.ctx.client() as c:  # kill it once a checkpoint exists
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            d = job_to_dict(c.get(job_id))
            # every rank past step 6: each has finished its step-5 checkpoint (one rank ahead is not enough:
            # CI saw a kill land while another rank still wrote step 5, and nothing to resume from)
            if min((r["step"] for r in d["ranks"]), default=0) >= 6 or d["state"] not in ("PENDING", "PLACED",
                                                                                         "STARTING", "RUNNING"):
                break
            time.sleep(0.02)
        c.cancel(job_id, "test: kill after a checkpoint")
    killed = runner.wait(job_id)
    assert killed["state"] == "CANCELLED", killed
    resumed = runner.wait(runner.submit(text.replace("checkpoint_every: 5,", "checkpoint_every: 5, resume: true,")))
    assert resumed["state"] == "SUCCEEDED", resumed["reason"]
    start = resumed["result"]["resumed_from"]
    assert start is not None and 5 <= start < steps
    whole = runner.wait(runner.submit(text.replace("name: resume", "name: resume-whole")))
    assert whole["state"] == "SUCCEEDED", whole["reason"]
    reference = {x["step"]: x["loss"] for x in whole["result"]["losses"]}
    later = {x["step"]: x["loss"] for x in resumed["result"]["losses"] if x["step"] > start}
    assert sorted(later) == list(range(start + 1, steps + 1))
    for step, loss in later.items():
        assert close(loss, reference[step]), (step, loss, reference[step])


@pytest.mark.parametrize(
    "edit, words",
    [
        (("heads: 4", "heads: 3"), ["model.heads=3", "parallel.tp=2"]),
        (("global_batch: 8", "global_batch: 10"), ["train.global_batch=10", "micro_batch*dp"]),
        (("data: builtin:pydoc", "data: builtin:nonsense"), ["train.data", "builtin"]),
        (("vocab: 256", "vocab: 256, colour: red"), ["model.colour", "unknown field"]),
        ([("tp: 2,", "tp: 1, pp: 2, vpp: 2,")], ["model.layers=2", "pp*vpp=4"]),
        ([("tp: 2,", "tp: 1, pp: 2, vpp: 1,"), ("global_batch: 8", "global_batch: 12")],
         ["parallel.vpp=1", "micro-batches per step (3)", "multiple of parallel.pp=2"]),
        ([("tp: 2,", "tp: 1, cp: 4,"), ("seq_len: 16", "seq_len: 12")], ["model.seq_len=12", "2*parallel.cp=8"]),
    ],
)
def test_bad_train_jobs_are_refused(runner: Runner, edit, words: list[str]) -> None:
    text = job_yaml("bad", tp=2, dp=2)
    for old, new in edit if isinstance(edit, list) else [edit]:
        assert old in text
        text = text.replace(old, new)
    with runner.ctx.client() as c:
        before = len(c.jobs())
        with pytest.raises(CtlError) as err:
            c.submit(text, [], "bad.yaml")
        assert err.value.exit_code == 2
        for w in words:
            assert w in err.value.message, (w, err.value.message)
        assert len(c.jobs()) == before
