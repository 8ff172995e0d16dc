"""End to end (issue 29): an elastic train job (``resources.min_nodes``) keeps training on fewer nodes when one
is lost and no spare is free, and grows back when a node returns, each time resharded from its checkpoints
(``train.checkpoint_dir``) with the same global batch: its losses equal the uninterrupted run's within 1e-5.
Real coordinator and daemons (one process each), 3 daemons x 2 slots."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from cluster import ProcCluster, ctl, ctl_status, events, stepping
from test_e2e_restart import HEARTBEAT_TIMEOUT, losses

pytestmark = pytest.mark.timeout(600)
STEPS = 40
JOB = """
name: {name}
kind: train
resources: {{nodes: 3, slots_per_node: 2{elastic}}}
parallel: {{tp: 2}}
restart: {{max_restarts: 1}}
model: {{layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256}}
train: {{steps: {steps}, global_batch: 12, micro_batch: 2, lr: 1.0e-3, warmup: 2, seed: 11, checkpoint_every: 5,
         checkpoint_dir: {shared}, data: builtin:pydoc}}
"""


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory):
    c = ProcCluster(tmp_path_factory.mktemp("elastic"), ["node-0", "node-1", "node-2"], 2, HEARTBEAT_TIMEOUT)
    yield c
    c.stop()


def submit(c: ProcCluster, tmp: Path, name: str, elastic: bool = True) -> str:
    path = tmp / f"{name}.yaml"
    path.write_text(JOB.format(name=name, elastic=", min_nodes: 2" if elastic else "", steps=STEPS,
                               shared=tmp / "checkpoints"))
    return c.submit(str(path))


@pytest.fixture(scope="module")
def reference(three: ProcCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    done = three.wait_state(submit(three, tmp_path_factory.mktemp("ref"), "whole", elastic=False),
                            {"SUCCEEDED", "FAILED"}, 300)
    assert done["state"] == "SUCCEEDED", done["reason"]
    return dict(losses(done))


def assert_equal_run(done: dict, ref: dict[int, float]) -> None:
    assert done["state"] == "SUCCEEDED", done["reason"]
    got = dict(losses(done))
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in got.items():
        assert abs(loss - ref[step]) <= 1e-5 * abs(ref[step]), (step, loss, ref[step])


def attempts(c: ProcCluster, job: str) -> list[tuple[int, str]]:
    """(ranks, layout) of each attempt, as ``ctl status --json`` shows them."""
    return [(a["world_size"], a["layout"]) for a in ctl_status(c.address, job)["attempts"]]


def test_a_lost_node_without_a_spare_shrinks_the_job_and_the_losses_stay_those_of_the_whole_run(
        three: ProcCluster, reference: dict[int, float], tmp_path: Path) -> None:
    job = submit(three, tmp_path, "shrinks")
    stepping(three.root, job, 6, 7)               # every rank past step 7: a checkpoint at 5 exists
    three.workers["node-2"].kill(signal.SIGKILL)  # no spare: the cluster has three nodes
    try:
        done = three.wait_state(job, {"SUCCEEDED", "FAILED"}, 300)
    finally:
        three.restart_worker("node-2")
    assert done["attempt"] == 2 and sorted(done["nodes"]) == ["node-0", "node-1"], (done["nodes"], done["reason"])
    assert 5 <= (done["result"].get("resumed_from") or 0), done["result"]
    assert attempts(three, job) == [(6, "tp2 dp3"), (4, "tp2 dp2")]
    assert_equal_run(done, reference)


def test_a_job_started_on_fewer_nodes_grows_back_when_a_node_is_free_again(
        three: ProcCluster, reference: dict[int, float], tmp_path: Path) -> None:
    """node-2 drained: the elastic job starts on two nodes; node-2 undrained mid-run: it grows to three."""
    assert ctl(three.address, "drain", "node-2").returncode == 0
    try:
        job = submit(three, tmp_path, "grows")
        st = stepping(three.root, job, 4, 3)        # running on the two nodes there are
        assert sorted(st["nodes"]) == ["node-0", "node-1"]
    finally:
        assert ctl(three.address, "undrain", "node-2").returncode == 0
    done = three.wait_state(job, {"SUCCEEDED", "FAILED"}, 300)
    assert done["attempt"] == 2 and sorted(done["nodes"]) == ["node-0", "node-1", "node-2"], done["reason"]
    assert attempts(three, job) == [(4, "tp2 dp2"), (6, "tp2 dp3")]
    resumed = done["result"]["resumed_from"]
    assert resumed >= 3, done["result"]
    assert_equal_run(done, reference)
    # one step convention (an outside probe saw "step 79" in the grow messages and resumed_from 80): the checkpoint
    # asked for is a floor, the next attempt takes the newest every rank holds, and each message says which is which
    asked = re.search(r"every rank passed step (\d+) \(its checkpoint; the next attempt resumes from step (\d+) or a "
                      r"newer checkpoint every rank holds\)", done["attempts"][0]["reason"])
    assert asked and asked.group(1) == asked.group(2) and int(asked.group(1)) <= resumed, done["attempts"]
    notes = [m for k, m in events(three.address, job) if k == "notice"]
    assert notes == [f"rank 0: resumed from checkpoint step {resumed}, written by 4 rank(s) (tp=2), re-sliced for this "
                     f"layout; step {resumed + 1} runs next"], notes
    text = ctl(three.address, "status", job)   # the text says it resumed, and from which layout
    assert f"resumed from step {resumed} (checkpoint of tp2 dp2, resharded to tp2 dp3)" in text.stdout, text.stdout
