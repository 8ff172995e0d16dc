"""`pip install rankctl` is the client and the coordinator, without torch (issue 23): a real coordinator and
every client command run in interpreters where torch cannot be imported (tests/notorch/sitecustomize.py), against
a worker that has it; `ctl worker` without torch says what to install. The wheel's metadata says the same."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path


from cluster import CTL, Proc, ready_nodes, start_worker, wait_for

ROOT = Path(__file__).resolve().parents[2]
NO_TORCH = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "notorch"), os.environ.get("PYTHONPATH", "")])}
JOB = """
name: client-no-torch
kind: comm-check
resources: {nodes: 1, slots_per_node: 2}
backend: gloo
parallel: {tp: 2}
comm_check: {size_bytes: 1024, iters: 1, warmup: 0}
"""


def ctl_no_torch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(CTL + list(args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **NO_TORCH})


def test_the_blocker_really_hides_torch() -> None:
    out = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True,
                         env={**os.environ, **NO_TORCH})
    assert out.returncode != 0 and "No module named 'torch'" in out.stderr


def test_a_torchless_coordinator_and_client_run_a_job_on_a_worker_with_torch(tmp_path: Path) -> None:
    state = tmp_path / "coord"
    state.mkdir()
    coord = Proc(["coordinator", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--heartbeat-timeout", "3"],
                 tmp_path / "coord.log", env=NO_TORCH)
    worker = None
    try:
        address = wait_for(lambda: (state / "address").exists() and (state / "address").read_text().strip(),
                           30, "coordinator address")
        worker = start_worker(address, "n0", 2, tmp_path)
        wait_for(lambda: ready_nodes(address) == ["n0"], 60, "the worker")
        job = tmp_path / "job.yaml"
        job.write_text(JOB)
        assert ctl_no_torch("plan", str(job)).returncode == 0
        sub = ctl_no_torch("--coordinator", address, "submit", "--wait", str(job))
        assert sub.returncode == 0, sub.stderr
        job_id = sub.stdout.split()[0]
        st = ctl_no_torch("--coordinator", address, "status", job_id, "--json")
        assert st.returncode == 0 and json.loads(st.stdout)["state"] == "SUCCEEDED", st.stderr
        for args in (["jobs"], ["nodes"], ["logs", job_id, "--rank", "0"], ["watch", job_id]):
            out = ctl_no_torch("--coordinator", address, *args)
            assert out.returncode == 0, (args, out.stderr)
            assert "Traceback" not in out.stderr and "ModuleNotFoundError" not in out.stderr, (args, out.stderr)
        assert coord.p.poll() is None
        assert "ModuleNotFoundError" not in coord.output() and "Traceback" not in coord.output()
    finally:
        if worker is not None:
            worker.stop()
        coord.stop()


def test_ctl_worker_without_torch_says_what_to_install(tmp_path: Path) -> None:
    out = ctl_no_torch("worker", "--coordinator", "127.0.0.1:1", "--state-dir", str(tmp_path), "--slots", "1")
    assert out.returncode == 2
    assert "needs torch" in out.stderr and "rankctl[worker]" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_wheel_needs_torch_only_for_workers_and_carries_its_metadata(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy of the tracked tree: the build writes build/ beside its sources
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)]
    built = subprocess.run([*wheel, "--no-build-isolation"], capture_output=True, text=True, timeout=300)
    if built.returncode != 0:  # the venv's setuptools is older than the build needs: let pip fetch it
        built = subprocess.run(wheel, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("rankctl-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in z.namelist())
    requires = meta.get_all("Requires-Dist")
    torch = [r for r in requires if r.startswith("torch")]
    assert torch and all('extra == "worker"' in r for r in torch), torch
    megatron = [r for r in requires if r.startswith("megatron-core")]
    assert len(megatron) == 1 and 'extra == "megatron"' in megatron[0], megatron
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert len(meta.get_all("Classifier")) >= 5 and meta.get_all("Project-URL")
    assert "worker" in meta.get_all("Provides-Extra")
