"""``kind: python`` end to end: the user's own code in every rank, on one embedded local cluster
(2 nodes x 4 slots, conftest's ``runner``): an unmodified torchrun script, a loop on
``rankctl.context()`` (every group kind, reported losses), Megatron-Core on rankctl's groups, and
the ways a script fails (an exception, a non-zero exit, no such file, a refused spec)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rankctl.cli.errors import CtlError
from rankctl.kinds.python.checks import absolute_workdir
from rankctl.kinds.spec import build_spec
from rankctl.parallel.layout import ParallelConfig, RankLayout
from rankctl.worker.daemon.config import cpu_share

pytestmark = [pytest.mark.timeout(300), pytest.mark.grpc_in_process]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WORKDIR = f"python.workdir={EXAMPLES / 'python'}"
SCRIPT = """
name: {name}
kind: python
resources: {{nodes: 2, slots_per_node: 2}}
python: {{entrypoint: {entry}, workdir: {workdir}}}
"""
RAISES = """import os
def inner():
    raise ValueError(f"boom from rank {os.environ['RANK']}")
if os.environ["RANK"] == "2":
    inner()
"""
EXITS = "import sys\nsys.exit(3)\n"
FUNCTION = """import os, sys, rankctl
def main():
    ctx = rankctl.context()
    ctx.report(1, loss=float(sys.argv[1]) + ctx.rank, flag=float(os.environ["MY_FLAG"]))
def threads():
    import torch
    rankctl.context().report(1, loss=0.0, threads=float(torch.get_num_threads()),
                             omp=float(os.environ["OMP_NUM_THREADS"]))
"""
OWN_GROUP = """import torch, torch.distributed as dist, rankctl
dist.init_process_group("gloo")
ctx = rankctl.context()
x = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(x, group=ctx.group("tp"))
assert x.item() == sum(r + 1 for r in ctx.ranks("tp")), x
ctx.report(1, loss=x.item())
dist.destroy_process_group()
"""


def example(name: str) -> str:
    return (EXAMPLES / name).read_text()


def submit(runner, text: str, overrides: list[str] = ()) -> str:
    with runner.ctx.client() as c:
        return c.submit(text, list(overrides), "test").id


def logs(runner, job_id: str, rank: int, want: str, timeout: float = 20) -> list[str]:
    """``ctl logs JOB --rank R``, once the line ``want`` has been shipped."""
    end, lines = time.monotonic() + timeout, []
    while time.monotonic() < end:
        with runner.ctx.client() as c:
            lines = [x.line for x in c.logs(job_id, rank, False, 200)]
        if any(want in line for line in lines):
            return lines
        time.sleep(0.2)
    raise AssertionError(f"no {want!r} in rank {rank}'s log of {job_id}: {lines[-10:]}")


@pytest.fixture(scope="module")
def jobs(runner, tmp_path_factory) -> dict[str, dict]:
    """Every job of the module, submitted at once (small ones first) and waited for."""
    scripts = tmp_path_factory.mktemp("scripts")
    (scripts / "raises.py").write_text(RAISES)
    (scripts / "exits.py").write_text(EXITS)
    (scripts / "own_group.py").write_text(OWN_GROUP)
    (scripts / "user_mod.py").write_text(FUNCTION)
    ids = {
        "torchrun": submit(runner, example("python-torchrun.yaml"), [WORKDIR]),
        "raises": submit(runner, SCRIPT.format(name="raises", entry="raises.py", workdir=scripts)),
        "exits": submit(runner, SCRIPT.format(name="exits", entry="exits.py", workdir=scripts)),
        "own_group": submit(runner, SCRIPT.format(name="own-group", entry="own_group.py", workdir=scripts),
                            ["parallel.tp=2"]),
        "function": submit(runner, SCRIPT.format(name="function", entry="user_mod:main", workdir=scripts),
                           ["python.args=['2.5']", "python.env={MY_FLAG: '7'}"]),
        "threads": submit(runner, SCRIPT.format(name="threads", entry="user_mod:threads", workdir=scripts),
                          ["resources.nodes=1", "resources.slots_per_node=1"]),
        "missing": submit(runner, SCRIPT.format(name="missing", entry="no_such_script.py", workdir=scripts)),
        "context": submit(runner, example("python-context.yaml"), [WORKDIR]),
        "megatron": submit(runner, example("megatron-core.yaml"),  # tp2 x dp2: 4 ranks import megatron-core
                           [WORKDIR, "resources.slots_per_node=2", "parallel.pp=1"]),
    }
    return {name: runner.wait(job_id, timeout=240) for name, job_id in ids.items()}


def test_an_unmodified_torchrun_script_succeeds(runner, jobs) -> None:
    job = jobs["torchrun"]
    assert job["state"] == "SUCCEEDED", job["reason"]
    assert job["world_size"] == 4 and {r["node"] for r in job["ranks"]} == set(runner.cluster.names)
    for rank in range(4):
        line = next(x for x in logs(runner, job["id"], rank, "all_reduce sum") if "all_reduce sum" in x)
        assert f"rank {rank}/4 (local {rank % 2}/2, node {rank // 2}" in line
        assert "all_reduce sum 20, expected 20; hello from rankctl" in line  # --scale 2, the job's env


def test_context_ranks_all_reduce_over_every_kind_and_report_losses(runner, jobs) -> None:
    job = jobs["context"]
    assert job["state"] == "SUCCEEDED", job["reason"]
    layout = RankLayout(ParallelConfig(world_size=8, tp=2, pp=2))
    for rank in range(8):
        line = next(x for x in logs(runner, job["id"], rank, "sums ok") if "sums ok" in x)
        groups = {"world": list(range(8)), **layout.rank_groups(rank)}
        assert json.loads(line.split("sums ok ", 1)[1]) == {k: float(sum(r + 1 for r in m)) for k, m in groups.items()}
        assert len(groups) >= 15  # world and the 16 kinds but embd/pos_embd where the rank is no member
    losses = [x["loss"] for x in job["losses"]]
    assert [x["step"] for x in job["losses"]] == list(range(1, 21))
    assert losses[-1] < losses[0] / 100
    assert job["metrics"] == {"loss": losses[-1], "lr": 0.1}
    assert all(r["step"] == 20 for r in job["ranks"])
    kept = sorted(p.name for p in runner.root.glob("local-*/checkpoints/python-context/rank-*.txt"))
    assert kept == [f"rank-{r}.txt" for r in range(8)]  # ctx.checkpoint_dir: the job name's, per node


def test_context_groups_work_on_the_default_group_a_script_created(jobs) -> None:
    job = jobs["own_group"]
    assert job["state"] == "SUCCEEDED", job["reason"]
    assert job["losses"] == [{"step": 1, "loss": 3.0}]  # rank 0's tp group is ranks 0 and 1


def test_a_function_entry_point_is_imported_and_called_with_args_and_env(jobs) -> None:
    job = jobs["function"]
    assert job["state"] == "SUCCEEDED", job["reason"]
    assert job["losses"] == [{"step": 1, "loss": 2.5}] and job["metrics"] == {"loss": 2.5, "flag": 7.0}


def test_a_rank_takes_its_share_of_the_nodes_cores_whatever_the_jobs_size(jobs) -> None:
    """A 1-rank job on a 4-slot node runs with the node's cores over its 4 slots (as every rank there does), not
    every core: ranks of jobs that share a node each took them all, and two 1-rank jobs on 2 cores ran 60x slower."""
    job = jobs["threads"]
    assert job["state"] == "SUCCEEDED", job["reason"]
    share = cpu_share(4)
    assert (job["metrics"]["threads"], job["metrics"]["omp"]) == (share, share), (job["metrics"], share)


def test_ctl_makes_a_relative_workdir_absolute_against_the_job_files_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir("/")  # where ctl runs does not matter
    spec = build_spec({"name": "w", "kind": "python", "python": {"entrypoint": "t.py", "workdir": "sub"}})
    assert absolute_workdir(spec, tmp_path) == [f'python.workdir="{tmp_path / "sub"}"']
    spec = build_spec({"name": "w", "kind": "python", "python": {"entrypoint": "t.py"}})
    assert absolute_workdir(spec, tmp_path) == [f'python.workdir="{tmp_path}"']
    assert absolute_workdir(build_spec({"name": "w", "kind": "python", "python": {"entrypoint": "m:f"}}), tmp_path) == []


def test_a_raising_script_fails_the_job_naming_the_rank_and_the_error(runner, jobs) -> None:
    job = jobs["raises"]
    assert job["state"] == "FAILED"
    assert re.fullmatch(r"rank 2 on node local-\d exited with code 1: ValueError: boom from rank 2", job["reason"])
    lines = logs(runner, job["id"], 2, "ValueError: boom from rank 2")
    assert any('in inner' in x for x in lines) and any("Traceback" in x for x in lines)


def test_a_script_exiting_non_zero_fails_the_job(jobs) -> None:
    job = jobs["exits"]
    assert job["state"] == "FAILED"
    assert re.fullmatch(r"rank \d on node local-\d exited with code 3: exits.py exited with code 3",
                        job["reason"]), job["reason"]  # whichever rank the coordinator hears of first


def test_a_missing_entry_point_fails_the_job_saying_so(jobs) -> None:
    job = jobs["missing"]
    assert job["state"] == "FAILED"
    assert "FileNotFoundError: python.entrypoint 'no_such_script.py' not found: no file " in job["reason"]


def test_megatron_core_runs_on_rankctls_groups(runner, jobs) -> None:
    job = jobs["megatron"]
    assert job["state"] == "SUCCEEDED", job["reason"]
    line = next(x for x in logs(runner, job["id"], 3, "tp mappings ok") if "tp mappings ok" in x)
    assert line.startswith("rank 3: tp rank 1, pp rank 0, dp rank 1; all-reduce sums over Megatron's groups ok")
    line = next(x for x in logs(runner, job["id"], 3, "ProcessGroupCollection") if "ProcessGroupCollection" in x)
    assert line.startswith("rank 3: ProcessGroupCollection tp [2, 3], dp [1, 3]; Megatron's parallel MLP on it "
                           "matches the serial one"), line


@pytest.mark.parametrize("section, words", [
    ("{}", "python.entrypoint is required"),
    ("{entrypoint: t.py, env: {RANK: '1'}}", "env RANK is set by rankctl"),
    ("{entrypoint: t.py, env: {MASTER_PORT: '1'}}", "may not override"),
    ("{entrypoint: t.py, env: {'1BAD': x}}", "must match"),
    ("{entrypoint: 'a b:c'}", "neither a script path"),
    ("{entrypoint: t.py, args: [%s]}" % ",".join(["a"] * 1001), "1000"),
])
def test_bad_python_sections_are_refused(runner, section: str, words: str) -> None:
    text = f"name: bad\nkind: python\npython: {section}\n"
    with pytest.raises(CtlError, match=re.escape(words)):
        submit(runner, text)


def test_context_outside_a_rank_says_so_and_import_is_light() -> None:
    code = ("import sys, rankctl\nassert 'torch' not in sys.modules\ntry:\n    rankctl.context()\n"
            "except RuntimeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "rankctl.context() is only available inside a rank that rankctl started" in out.stdout
