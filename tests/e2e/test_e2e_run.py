"""``ctl run``: torchrun's command line through the real ``ctl``, coordinator and daemons.

Most runs go to the module's shared cluster (``--coordinator``: a configured coordinator); one starts its own
embedded cluster, as ``ctl run`` does when none is configured. What each rank prints is on stdout after
``[rankN]:``; the exit code is the job's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.grpc_in_process]
CTL = [sys.executable, "-m", "rankctl.cli.main"]
ENVIRON = """import os, sys
print("env", *(os.environ[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")),
      "argv", *sys.argv[1:], flush=True)
"""
FAILS = """import os, signal, sys
rank = int(os.environ["RANK"])
if sys.argv[1] == "exit" and rank == 2:
    sys.exit(3)
if sys.argv[1] == "raise" and rank == 1:
    raise ValueError("boom")
if sys.argv[1] == "kill" and rank == 3:
    os.kill(os.getpid(), signal.SIGKILL)
"""
ONCE = """import os, sys
from pathlib import Path
marker = Path(sys.argv[1]) / f"failed-{os.environ['RANK']}"
if os.environ["RANK"] == "1" and not marker.exists():
    marker.write_text("")
    sys.exit(5)
print("second time lucky", flush=True)
"""
TICKS = """import time
for i in range(600):
    print("tick", i, flush=True)
    time.sleep(0.2)
"""
MODULE = """import sys
import torch.distributed as dist
dist.init_process_group("gloo")
total = dist.get_world_size() * (dist.get_world_size() - 1) // 2
import torch
x = torch.tensor([float(dist.get_rank())])
dist.all_reduce(x)
print("module", __name__, sys.argv[1:], "sum", int(x.item()), "expected", total, flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("project")
    for name, text in (("environ.py", ENVIRON), ("fails.py", FAILS), ("once.py", ONCE), ("ticks.py", TICKS)):
        (root / name).write_text(text)
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "main.py").write_text(MODULE)
    return root


def ctl_run(runner, project: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*CTL, "--coordinator", runner.ctx.coordinator, "run", *args], cwd=project,
                          capture_output=True, text=True, timeout=timeout)


def rank_lines(stdout: str, word: str) -> dict[int, str]:
    """``[rankN]: WORD ...`` lines of stdout by rank."""
    out = {}
    for line in stdout.splitlines():
        head, sep, text = line.partition("]: ")
        if sep and head.startswith("[rank") and text.startswith(word):
            out[int(head.removeprefix("[rank"))] = text
    return out


def test_torchrun_flags_run_the_script_in_every_rank_with_torchruns_environment(runner, project: Path) -> None:
    done = ctl_run(runner, project, "--nnodes", "2", "--nproc_per_node=2", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", "10.9.9.9:29400", "--tee", "3", "environ.py", "--lr", "3e-4",
                   "--coordinator", "x")
    assert done.returncode == 0, done.stderr
    lines = rank_lines(done.stdout, "env")
    assert lines == {r: f"env {r} {r % 2} {r // 2} 4 2 argv --lr 3e-4 --coordinator x" for r in range(4)}
    assert "ctl run: --tee: rankctl's coordinator does this; ignored" in done.stderr
    assert "ctl run: --rdzv-backend c10d: rankctl's coordinator does this; ignored" in done.stderr
    assert "ctl run: job environ-" in done.stderr


def test_the_exit_code_is_the_failing_ranks_own(runner, project: Path) -> None:
    exits = ctl_run(runner, project, "--nnodes", "2", "--nproc-per-node", "2", "fails.py", "exit")
    assert exits.returncode == 3, exits.stderr
    assert "FAILED: rank 2 on node" in exits.stderr and "fails.py exited with code 3" in exits.stderr
    job_id = exits.stderr.split("ctl run: job ", 1)[1].split()[0]
    status = subprocess.run([*CTL, "--coordinator", runner.ctx.coordinator, "status", job_id, "--json"],
                            capture_output=True, text=True, timeout=60)
    failure = json.loads(status.stdout)["attempts"][-1]["failure"]
    assert failure["cause"] == "rank-exit" and failure["rank"] == 2 and failure["exit_code"] == 3, failure
    raises = ctl_run(runner, project, "--nnodes", "2", "--nproc-per-node", "2", "fails.py", "raise")
    assert raises.returncode == 1, raises.stderr
    assert "[rank1]: ValueError: boom" in raises.stdout   # its traceback, as torchrun's --tee shows it
    killed = ctl_run(runner, project, "--nnodes", "2", "--nproc-per-node", "2", "fails.py", "kill")
    assert killed.returncode == 128 + signal.SIGKILL, killed.stderr


def test_max_restarts_runs_it_again(runner, project: Path, tmp_path: Path) -> None:
    done = ctl_run(runner, project, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
                   "once.py", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "ctl run: attempt 2 started (a restart)" in done.stderr
    assert set(rank_lines(done.stdout, "second time lucky")) == {0, 1}


def test_dash_m_runs_a_module_of_the_workdir_as_main(runner, project: Path) -> None:
    done = ctl_run(runner, project, "--nnodes=2", "--nproc-per-node=2", "--local-ranks-filter", "0", "-m",
                   "pkg.main", "a", "-b")
    assert done.returncode == 0, done.stderr
    assert rank_lines(done.stdout, "module") == {r: "module __main__ ['a', '-b'] sum 6 expected 6" for r in (0, 2)}
    assert set(rank_lines(done.stdout, "")) == {0, 2}   # local rank 0 only


def test_dry_run_prints_a_job_file_that_ctl_submit_runs(runner, project: Path, tmp_path: Path) -> None:
    dry = ctl_run(runner, project, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-id", "dry", "--dry-run",
                  "environ.py", "x")
    assert dry.returncode == 0 and dry.stdout.startswith("# ctl run --nnodes=2 --nproc-per-node=1 environ.py x")
    (tmp_path / "job.yaml").write_text(dry.stdout)
    done = subprocess.run([*CTL, "--coordinator", runner.ctx.coordinator, "submit", str(tmp_path / "job.yaml"),
                           "--wait", "--json"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert '"name": "dry"' in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "0", "environ.py"], "--nnodes '0': need 1 <= MIN <= MAX"),
    (["--nproc-per-node", "lots", "environ.py"], "--nproc-per-node 'lots' must be a number"),
    (["--no-python", "environ.py"], "--no-python: rankctl runs Python"),
    (["../elsewhere.py"], "script '../elsewhere.py' not found"),
    (["--bogus", "environ.py"], "No such option '--bogus'"),
    (["--rdzv-backend", "rankctl", "environ.py"], "--rdzv-backend rankctl needs --rdzv-endpoint"),
])
def test_bad_flags_are_refused_with_their_rule_and_nothing_is_submitted(runner, project: Path, args: list[str],
                                                                        message: str) -> None:
    with runner.ctx.client() as c:
        before = len(c.jobs())
    done = ctl_run(runner, project, *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    with runner.ctx.client() as c:
        assert len(c.jobs()) == before


def test_ctrl_c_cancels_the_job(runner, project: Path) -> None:
    proc = subprocess.Popen([*CTL, "--coordinator", runner.ctx.coordinator, "run", "--nproc-per-node", "2",
                             "ticks.py"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("[rank1]: tick"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    job_id = err.split("ctl run: job ", 1)[1].split()[0]
    assert f"ctl run: job {job_id} cancelled (SIGINT)" in err
    final = runner.wait(job_id, timeout=60)
    assert final["state"] == "CANCELLED" and "interrupted: SIGINT to ctl run" in final["reason"]


def test_without_a_configured_coordinator_it_starts_one_here(project: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKCTL_")}
    env["RANKCTL_CONFIG"] = str(tmp_path / "no-config.yaml")   # no contexts: nothing configured
    done = subprocess.run([*CTL, "run", "--nnodes", "2", "--nproc-per-node", "1", "environ.py"], cwd=project,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "starting a coordinator and 2 worker daemon(s) x 1 slot(s) here" in done.stderr
    assert rank_lines(done.stdout, "env") == {r: f"env {r} 0 {r} 2 1 argv" for r in range(2)}


def test_an_outside_training_script_runs_unchanged(runner, project: Path) -> None:
    """Hugging Face Accelerate's own DDP training check (``accelerate.test_utils.scripts.test_sync``: a model under
    DDP, AdamW, a scheduler, gradient accumulation, each step's gradients compared with a single-process copy), as
    installed from PyPI: on CPU Accelerate takes gloo when told ``ACCELERATE_USE_CPU=1`` (what ``accelerate launch
    --cpu`` sets)."""
    module = "accelerate.test_utils.scripts.test_sync"
    done = ctl_run(runner, project, "--nnodes", "2", "--nproc-per-node", "2", "--env", "ACCELERATE_USE_CPU=1",
                   "-m", module)
    assert done.returncode == 0, done.stderr + done.stdout[-2000:]
    distributed = rank_lines(done.stdout, "**Test Distributed `no_sync` context manager**")
    assert set(distributed) == {0, 2}   # accelerate prints on each node's local rank 0: 2 nodes of a world of 4
    assert "NOOP" not in done.stdout     # not four single processes
    broken = ctl_run(runner, project, "--nnodes", "2", "--nproc-per-node", "2", "--env", "ACCELERATE_USE_CPU=1",
                     "--env", "ACCELERATE_TORCH_DEVICE=nope", "-m", module)
    assert broken.returncode == 1, broken.stderr
    assert "FAILED: rank" in broken.stderr and "nope" in broken.stdout


def component_records(text: str) -> list[str]:
    """Lines that are a component's log record (structlog's JSON or console form), not ctl's own messages."""
    import re

    found = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and ("event" in doc or "level" in doc) or \
                re.match(r"^\S*\d\d:\d\d:\d\d\S* \[(debug|info|warning|error|critical)\s*\]", line):
            found.append(line)
    return found


def test_an_embedded_run_with_a_restart_prints_no_component_log_record(project: Path, tmp_path: Path) -> None:
    """Issue 53, item 4: ``ctl run`` printed the coordinator's ``job.restarting`` and ``node.lost`` records among
    the ranks' output. They go to a log file now (``--verbose`` shows them); a restart is still said in one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKCTL_")}
    env["RANKCTL_CONFIG"] = str(tmp_path / "no-config.yaml")
    done = subprocess.run([*CTL, "run", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1", "once.py",
                           str(tmp_path)], cwd=project, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "ctl run: attempt 2 started (a restart)" in done.stderr
    assert component_records(done.stdout + done.stderr) == [], done.stderr


def test_a_job_too_big_for_the_cluster_is_told_an_option_ctl_run_has(runner, project: Path) -> None:
    """Issue 53, item 6: on a cluster too small ``ctl run`` said "submit with --queue-anyway", an option it lacked.
    It has it now: refused without it (exit 2, nothing created), queued with it (Ctrl-C cancels it)."""
    refused = ctl_run(runner, project, "--nnodes", "3", "--nproc-per-node", "4", "environ.py")
    assert refused.returncode == 2 and "--queue-anyway" in refused.stderr, refused.stderr
    proc = subprocess.Popen([*CTL, "--coordinator", runner.ctx.coordinator, "run", "--queue-anyway", "--nnodes", "3",
                             "--nproc-per-node", "4", "--rdzv-id", "too-big", "environ.py"], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def pending() -> bool:
            listed = subprocess.run([*CTL, "--coordinator", runner.ctx.coordinator, "jobs", "--json"],
                                    capture_output=True, text=True, timeout=60)
            return any(j["name"] == "too-big" and j["state"] == "PENDING" for j in json.loads(listed.stdout or "[]"))
        wait_for(pending, 60, "the job queued")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert "cancelled (SIGINT)" in err, err



def test_a_100kb_argument_runs_and_a_directory_is_named_as_one(runner, project: Path) -> None:
    """Issue 53, item 8: a 100 KB script argument was refused (``python.args.0`` at most 4,096 characters; torchrun
    passes it: Linux allows 128 KiB an argument); a directory given as the script was "not found"."""
    (project / "argsize.py").write_text("import sys\nprint('argsize', len(sys.argv[1]), flush=True)\n")
    done = ctl_run(runner, project, "--nnodes", "1", "--nproc-per-node", "1", "argsize.py", "x" * 100_000)
    assert done.returncode == 0, done.stderr[-2000:]
    assert rank_lines(done.stdout, "argsize") == {0: "argsize 100000"}
    (project / "adir").mkdir(exist_ok=True)
    refused = ctl_run(runner, project, "adir")
    assert refused.returncode == 2 and "script 'adir' is a directory" in refused.stderr, refused.stderr


LAYOUT = """import torch.distributed as dist
import rankctl
ctx = rankctl.context()
print("sizes", dist.get_world_size(ctx.group("tp")), dist.get_world_size(ctx.group("pp")), flush=True)
"""


def test_layout_flags_give_the_job_its_megatron_groups_and_the_output_names_the_layout(runner, project: Path) -> None:
    """Issue 53, item 7: ``ctl run`` had no layout but an undocumented ``--set parallel.tp=2``; without it every
    group was of one rank. ``--tp/--pp/--cp/--ep/--etp`` set it, and ctl run says which layout the job runs."""
    (project / "layout.py").write_text(LAYOUT)
    done = ctl_run(runner, project, "--nnodes", "1", "--nproc-per-node", "4", "--tp", "2", "--pp", "2", "layout.py")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ctl run: layout tp=2 pp=2 cp=1 ep=1 dp=1" in done.stderr, done.stderr
    assert rank_lines(done.stdout, "sizes") == {r: "sizes 2 2" for r in range(4)}, done.stdout
    bad = ctl_run(runner, project, "--nproc-per-node", "4", "--tp", "3", "layout.py")
    assert bad.returncode == 2 and "tp" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
