"""End to end (issue 29): a train job stopped at a step (``train.stop_at``) and resumed under other layouts from
checkpoints in a directory every node reads (``train.checkpoint_dir``) trains exactly as the uninterrupted
run: every loss within 1e-5. Through an embedded local cluster of 3 daemons x 2 slots."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster import ctl, events
from test_e2e_train import Runner

pytestmark = [pytest.mark.timeout(900), pytest.mark.grpc_in_process]
STEPS = 30
JOB = """
name: {name}
kind: train
resources: {{nodes: {nodes}, slots_per_node: {slots}}}
parallel: {{tp: {tp}, pp: {pp}, cp: {cp}, ep: {ep}}}
model: {{layers: 4, hidden: 32, heads: 4, seq_len: 16, vocab: 257{moe}}}
train: {{steps: {steps}, global_batch: 8, micro_batch: 2, lr: 1.0e-2, warmup: 2, seed: 11, data: builtin:pydoc,
         resume: {resume}{extra}}}
"""


class Cluster(Runner):
    def run(self, text: str) -> dict:
        return self.wait(self.submit(text))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("reshard"), nodes=3, slots=2)
    yield c
    c.cluster.stop()


def job(name: str, tp: int, pp: int, *, cp: int = 1, ep: int = 1, resume: bool = False, moe: bool = False,
        nodes: int = 2, slots: int = 2, steps: int = STEPS, **train: object) -> str:
    extra = "".join(f", {k}: {v}" for k, v in train.items())
    return JOB.format(name=name, tp=tp, pp=pp, cp=cp, ep=ep, steps=steps, resume=str(resume).lower(), extra=extra,
                      moe=", moe: {experts: 4, top_k: 2}" if moe else "", nodes=nodes, slots=slots)


def losses(done: dict) -> dict[int, float]:
    assert done["state"] == "SUCCEEDED", done["reason"]
    return {x["step"]: x["loss"] for x in done["result"]["losses"]}


def assert_same(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-6), (s, got[s], want[s])


def test_stopped_then_resumed_under_three_other_layouts_equals_the_uninterrupted_run(cluster: Cluster,
                                                                                     tmp_path: Path) -> None:
    """tp2 dp2 to step 15 (stop_at), tp1 pp2 dp2 to 20, tp1 cp2 dp2 to 25, tp2 pp2 to the end."""
    shared = tmp_path / "shared-checkpoints"          # what a shared filesystem is to the three daemons
    whole = losses(cluster.run(job("whole", 2, 1)))  # tp2 dp2, uninterrupted
    first = cluster.run(job("moved", 2, 1, stop_at=15, checkpoint_dir=shared))
    assert "stopped at step 15 of 30 (train.stop_at)" in first["reason"], first["reason"]
    assert sorted(losses(first)) == list(range(1, 16))
    assert_same(losses(first), whole, range(1, 16))
    second = cluster.run(job("moved", 1, 2, resume=True, stop_at=20, checkpoint_dir=shared))   # tp1 pp2 dp2
    assert second["result"]["resumed_from"] == 15, second["result"]
    notes = [m for k, m in events(cluster.cluster.address, second["id"]) if k == "notice"]
    assert notes == ["rank 0: resumed from checkpoint step 15, written by 4 rank(s) (tp=2), re-sliced for this "
                     "layout; step 16 runs next"], notes
    assert_same(losses(second), whole, range(16, 21))
    third = cluster.run(job("moved", 1, 1, cp=2, resume=True, stop_at=25, checkpoint_dir=shared))   # tp1 cp2 dp2
    assert third["result"]["resumed_from"] == 20, third["result"]
    assert_same(losses(third), whole, range(21, 26))
    fourth = cluster.run(job("moved", 2, 2, resume=True, checkpoint_dir=shared))                 # tp2 pp2 dp1
    assert fourth["result"]["resumed_from"] == 25 and fourth["reason"].startswith("all 4 ranks exited 0"), fourth
    assert_same(losses(fourth), whole, range(26, STEPS + 1))


def test_a_moe_model_resumed_under_another_expert_parallelism_equals_the_uninterrupted_run(
        cluster: Cluster, tmp_path: Path) -> None:
    shared = tmp_path / "moe-checkpoints"
    whole = losses(cluster.run(job("moe-whole", 1, 1, ep=2, moe=True)))      # ep2 edp2
    first = cluster.run(job("moe", 1, 1, ep=2, moe=True, stop_at=12, checkpoint_dir=shared))
    assert_same(losses(first), whole, range(1, 13))
    second = cluster.run(job("moe", 1, 1, ep=4, moe=True, resume=True, checkpoint_dir=shared))   # ep4
    assert second["result"]["resumed_from"] == 12, second["result"]
    assert_same(losses(second), whole, range(13, STEPS + 1))


def test_another_layout_from_node_local_checkpoints_is_refused_saying_what_is_needed(cluster: Cluster) -> None:
    assert losses(cluster.run(job("local", 2, 1, stop_at=5)))
    refused = cluster.run(job("local", 1, 2, resume=True))
    assert refused["state"] == "FAILED", refused
    assert "set train.checkpoint_dir to a directory on a filesystem all nodes share" in refused["reason"], refused


def test_init_from_an_exported_serial_state_dict_or_a_checkpoint_under_tp2_pp2_equals_the_serial_run(
        cluster: Cluster, tmp_path: Path) -> None:
    shared = tmp_path / "init-checkpoints"
    source = losses(cluster.run(job("source", 2, 1, steps=6, checkpoint_every=6, checkpoint_dir=shared)))
    full = tmp_path / "full.pt"
    out = subprocess.run([sys.executable, "-m", "rankctl.cli.main", "checkpoint", "export",
                          str(shared / "source" / "step-00000006"), "--out", str(full)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    serial = cluster.run(job("from-dict-serial", 1, 1, nodes=1, slots=1, steps=8, init_from=full))
    assert serial["result"]["resumed_from"] is None and sorted(losses(serial)) == list(range(1, 9))
    assert losses(serial)[1] < source[1] - 0.2, (losses(serial), source)   # trained weights, not the seed's
    notes = [m for k, m in events(cluster.cluster.address, serial["id"]) if k == "notice"]
    assert notes == [f"rank 0: initialised from the state dict {full}"], notes
    parallel = cluster.run(job("from-dict", 2, 2, steps=8, init_from=full))
    assert_same(losses(parallel), losses(serial), range(1, 9))
    from_ckpt = cluster.run(job("from-ckpt", 2, 2, steps=8, init_from=shared / "source"))   # the job's checkpoints
    assert_same(losses(from_ckpt), losses(serial), range(1, 9))
    other = cluster.run(job("other-model", 1, 1, nodes=1, slots=1, steps=2, init_from=full).replace("hidden: 32",
                                                                                                  "hidden: 64"))
    assert other["state"] == "FAILED" and "has shape" in other["reason"] and "another model?" in other["reason"], other


def test_a_newer_step_of_another_layout_wins_and_a_damaged_one_is_passed_over(cluster: Cluster, tmp_path: Path) -> None:
    """An outside probe: under another layout a shard with flipped bytes was loaded without a check (wrong losses),
    a truncated one failed the job, and `train.resume` took this layout's older step over another layout's newer
    one (training steps again and overwriting part of the newer step)."""
    shared, steps = tmp_path / "mixed-checkpoints", 10
    whole = losses(cluster.run(job("mixed-whole", 2, 1, steps=steps)))                               # tp2 dp2
    first = cluster.run(job("mixed", 2, 1, steps=steps, stop_at=4, checkpoint_every=2, checkpoint_dir=shared))
    assert_same(losses(first), whole, range(1, 5))                                                  # steps 2, 4
    second = cluster.run(job("mixed", 1, 2, steps=steps, resume=True, stop_at=6, checkpoint_every=2,
                             checkpoint_dir=shared))                                                # tp1 pp2: 6
    assert second["result"]["resumed_from"] == 4, second["result"]
    shard = shared / "mixed" / "step-00000006" / "rank-00002.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF                      # same size, done-marker kept
    shard.write_bytes(bytes(data))
    third = cluster.run(job("mixed", 1, 1, cp=2, steps=steps, resume=True, stop_at=8, checkpoint_every=2,
                            checkpoint_dir=shared))                                                 # tp1 cp2: 6, 8
    assert third["result"]["resumed_from"] == 4, third["result"]
    notes = [m for k, m in events(cluster.cluster.address, third["id"]) if k == "notice"]
    assert any(n.startswith("rank 0: checkpoint step 6 (written by 4 rank(s) under another layout) is damaged (")
               and "rank-00002.pt does not match the SHA-256" in n and n.endswith("passed over") for n in notes), notes
    assert_same(losses(third), whole, range(5, 9))
    fourth = cluster.run(job("mixed", 2, 1, steps=steps, resume=True, checkpoint_dir=shared))      # tp2 dp2 again
    assert fourth["result"]["resumed_from"] == 8, fourth["result"]   # not its own layout's older step 4
    assert_same(losses(fourth), whole, range(9, steps + 1))


def test_a_shard_of_the_wrong_shape_with_a_matching_checksum_is_passed_over_naming_step_file_and_tensor(
        cluster: Cluster, tmp_path: Path) -> None:
    """An outside probe: a shard rewritten with a tensor a row short and its marker to match (size, SHA-256) failed
    the resume under another layout with 'start (0) + length (96) exceeds dimension size (95)'. The step is passed
    over for the one before, with an event naming the step, the file and the tensor; the export names them too;
    ``ctl status`` says the job resumed, and from which layout."""
    from test_checkpoint import reshaped

    shared = tmp_path / "reshaped-checkpoints"
    first = cluster.run(job("reshaped", 2, 1, steps=8, stop_at=4, checkpoint_every=2, checkpoint_dir=shared))
    assert sorted(losses(first)) == [1, 2, 3, 4]                                                   # tp2 dp2: 2, 4
    reshaped(str(shared / "reshaped"), 4, 1, "wte.weight")
    shard = shared / "reshaped" / "step-00000004" / "rank-00001.pt"
    second = cluster.run(job("reshaped", 1, 2, steps=8, resume=True, stop_at=6, checkpoint_dir=shared))  # tp1 pp2
    assert second["state"] == "SUCCEEDED" and second["result"]["resumed_from"] == 2, second["result"]
    assert second["result"]["resumed_layout"] == "tp2 dp2", second["result"]
    notes = [m for k, m in events(cluster.cluster.address, second["id"]) if k == "notice"]
    assert any(n.startswith("rank 0: checkpoint step 4 (written by 4 rank(s) under another layout) is damaged (")
               and f"{shard}: tensor 'wte.weight' has shape (128, 32), its metadata's is (129, 32)" in n
               and n.endswith("passed over") for n in notes), notes
    text = ctl(cluster.cluster.address, "status", second["id"])
    assert "resumed from step 2 (checkpoint of tp2 dp2, resharded to pp2 dp2)" in text.stdout, text.stdout
    out = subprocess.run([sys.executable, "-m", "rankctl.cli.main", "checkpoint", "export", str(shard.parent),
                          "--out", str(tmp_path / "full.pt")], capture_output=True, text=True)
    assert out.returncode != 0 and f"{shard}: tensor 'wte.weight' has shape (128, 32)" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "full.pt").exists()
