"""End to end, issue 53 (defects found from outside): each through a real coordinator (``--head-wait 5``), two real
worker daemons of two slots and ``ctl``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cluster import CTL, ProcCluster, ctl, status, wait_for

pytestmark = pytest.mark.timeout(600)
HEAD_WAIT_S = 5.0
COMM = """name: {name}
kind: comm-check
resources: {{nodes: {nodes}, slots_per_node: 2}}
parallel: {{tp: 2}}
comm_check: {{size_bytes: 4096, duration: {duration}}}
"""


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory):
    c = ProcCluster(tmp_path_factory.mktemp("newcomer"), ["node-0", "node-1"], 2, 3.0,
                    coord_extra=("--head-wait", str(HEAD_WAIT_S)))
    yield c
    c.stop()


def submit(c: ProcCluster, tmp: Path, name: str, nodes: int, duration: float) -> str:
    path = tmp / f"{name}.yaml"
    path.write_text(COMM.format(name=name, nodes=nodes, duration=duration))
    return c.submit(str(path))


def test_a_job_that_fits_backfills_by_time_alone_after_head_wait(two: ProcCluster, tmp_path: Path) -> None:
    """Item 1: a long job on one node, a two-node job at the head of the queue, a one-node job behind it. After
    ``--head-wait`` the one-node job starts on the free node by time alone (before, it stayed "queued behind" until
    some other event woke the queue: minutes)."""
    long = submit(two, tmp_path, "long", 1, 120)
    wait_for(lambda: status(two.address, long)["state"] == "RUNNING", 120, "the long job running")
    wide = submit(two, tmp_path, "wide", 2, 0)
    small = submit(two, tmp_path, "small", 1, 0)
    assert status(two.address, small)["reason"] == f"queued behind {wide}"
    done = wait_for(lambda: (s := status(two.address, small))["state"] in ("SUCCEEDED", "FAILED") and s, 120,
                    "the small job to backfill and finish while the long job runs")
    assert done["state"] == "SUCCEEDED", done["reason"]
    assert status(two.address, long)["state"] == "RUNNING" and status(two.address, wide)["state"] == "PENDING"
    for job in (long, wide):
        assert ctl(two.address, "cancel", job).returncode == 0


def test_usage_errors_are_one_line_in_our_form(two: ProcCluster) -> None:
    """Item 9: a mistyped command, an unknown option and a misplaced ``--json`` print ``error: ...`` on one line (with
    the suggestion), not Click's four-line usage block; the exit code stays 2."""
    env = {**os.environ, "RANKCTL_COORDINATOR": two.address}
    for args, words in ((["stauts"], "No such command 'stauts'"), (["status", "--bogus", "x"], "--bogus"),
                        (["--json", "completion", "bash"], "--json")):
        out = subprocess.run([*CTL, *args], capture_output=True, text=True, env=env, timeout=60)
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], \
            (args, out.stderr)
        assert "Usage:" not in out.stderr and "Traceback" not in out.stderr, out.stderr


MANY_STEPS = """
import rankctl
ctx = rankctl.context()
for step in range(1, 1501):
    ctx.report(step, loss=1.0 / step)
"""


def test_a_1500_step_python_job_shows_its_losses(two: ProcCluster, tmp_path: Path) -> None:
    """Item 2: a finished 1,500-step python job that reported a loss every step showed none in ``ctl status --json``
    (its rank's result passed the report's bound and was dropped whole); now every k-th loss, first and last kept,
    with ``losses_total`` and ``losses_every``."""
    import json

    (tmp_path / "many.py").write_text(MANY_STEPS)
    (tmp_path / "many.yaml").write_text(f"name: many\nkind: python\nresources: {{nodes: 1, slots_per_node: 1}}\n"
                                        f"python: {{entrypoint: many.py, workdir: {tmp_path}}}\n")
    job = two.submit(str(tmp_path / "many.yaml"))
    done = two.wait_state(job, {"SUCCEEDED", "FAILED"}, 180)
    assert done["state"] == "SUCCEEDED", done["reason"]
    shown = json.loads(ctl(two.address, "status", job, "--json").stdout)
    steps = [x["step"] for x in shown["losses"]]
    assert steps[0] == 1 and steps[-1] == 1500 and len(steps) > 100, steps[:5]
    assert shown["losses_total"] == {"losses": 1500} and steps[1] - steps[0] == shown["losses_every"], shown


TRAIN = """name: tiny
kind: train
resources: {nodes: 1, slots_per_node: 2}
parallel: {tp: 2}
model: {layers: 1, hidden: 32, heads: 4, seq_len: 16, vocab: 256}
train: {steps: 3, global_batch: 4, micro_batch: 2, data: builtin:pydoc}
"""


def test_an_empty_rank_log_says_which_rank_prints_a_train_jobs_steps(two: ProcCluster, tmp_path: Path) -> None:
    """Item 15: ``ctl logs TRAINJOB --rank 0`` printed nothing with exit 0 and no hint that only the last rank (the
    last pipeline stage) prints the step lines."""
    (tmp_path / "tiny.yaml").write_text(TRAIN)
    job = two.submit(str(tmp_path / "tiny.yaml"))
    assert two.wait_state(job, {"SUCCEEDED", "FAILED"}, 300)["state"] == "SUCCEEDED"
    empty = ctl(two.address, "logs", job, "--rank", "0")
    assert empty.returncode == 0 and empty.stdout == "", empty.stdout
    assert f"rank 0 of {job} printed nothing; a train job's step lines come from its last rank" in empty.stderr
    assert f"ctl logs {job} --rank 1" in empty.stderr, empty.stderr
    assert "step 3/3" in ctl(two.address, "logs", job, "--rank", "1").stdout


BOOM = """
def inner():
    raise ValueError("boom in the user's code")

def outer():
    inner()

outer()
"""


def test_a_failing_ranks_traceback_starts_at_the_users_code(two: ProcCluster, tmp_path: Path) -> None:
    """Item 11: the traceback a failing rank reports began with about eight rankctl and runpy frames before the
    user's line; it starts at the user's script now (as torchrun's error file does), the whole one in the log."""
    import json

    (tmp_path / "boom.py").write_text(BOOM)
    (tmp_path / "boom.yaml").write_text(f"name: boom\nkind: python\nresources: {{nodes: 1, slots_per_node: 1}}\n"
                                        f"python: {{entrypoint: boom.py, workdir: {tmp_path}}}\n")
    job = two.submit(str(tmp_path / "boom.yaml"))
    assert two.wait_state(job, {"SUCCEEDED", "FAILED"}, 120)["state"] == "FAILED"
    error = json.loads(ctl(two.address, "status", job, "--json").stdout)["summary"]["failing"][0]["error"]
    frames = [line for line in error.splitlines() if line.strip().startswith("File ")]
    assert frames and "boom.py" in frames[0] and len(frames) == 3, error       # <module>, outer, inner
    assert not any("rankctl" in f or "runpy" in f for f in frames), error
    assert error.splitlines()[-1] == "ValueError: boom in the user's code", error
    log = ctl(two.address, "logs", job, "--rank", "0").stdout
    assert "runpy" in log and "boom in the user's code" in log, log[-2000:]
