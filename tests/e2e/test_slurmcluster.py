"""The local Slurm cluster of ``slurmcluster.py``: real munged, slurmctld and three slurmd on loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmcluster import ClusterError, SlurmCluster, job_processes, processes_of, slurm_problem

pytestmark = pytest.mark.skipif(slurm_problem() is not None, reason=f"no local Slurm cluster: {slurm_problem()}")


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3) as c:
        yield c


@pytest.fixture
def idle(cluster: SlurmCluster) -> SlurmCluster:
    cluster.wait_idle(timeout=30)
    return cluster


def submit(cluster: SlurmCluster, *args: str) -> str:
    return cluster.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]


def job(cluster: SlurmCluster, job_id: str) -> dict | None:
    return next((j for j in cluster.squeue() if j["id"] == job_id), None)


def test_every_node_comes_up_idle_under_its_own_name(idle: SlurmCluster) -> None:
    assert idle.node_states() == {"n1": "idle", "n2": "idle", "n3": "idle"}
    assert sorted(idle.pids()) == ["munged", "slurmctld", "slurmd-n1", "slurmd-n2", "slurmd-n3"]


def test_a_step_runs_one_task_on_each_of_three_nodes(idle: SlurmCluster) -> None:
    out = idle.run("srun", "-N3", "--ntasks-per-node=1", "bash", "-c", "echo $SLURMD_NODENAME $SLURM_NODEID",
                   timeout=60)
    assert sorted(out.stdout.split("\n")[:-1]) == ["n1 0", "n2 1", "n3 2"]


def test_a_batch_job_on_two_nodes_runs_and_leaves_the_queue(idle: SlurmCluster) -> None:
    out = idle.out_dir / "two-nodes.out"
    job_id = submit(idle, "-N2", "-J", "two-nodes", "-o", str(out),
                    "--wrap", "srun bash -c 'echo $SLURMD_NODENAME'")
    queued = job(idle, job_id)
    assert queued is None or (queued["name"], queued["nodes"]) == ("two-nodes", 2)
    wait_until(lambda: job(idle, job_id) is None, 30, f"job {job_id} to leave squeue")
    names = out.read_text().split()
    assert len(names) == 2 and len(set(names)) == 2 and set(names) <= set(idle.names), names


def test_scancel_ends_a_running_batch_job(idle: SlurmCluster) -> None:
    job_id = submit(idle, "-N1", "-J", "sleeper", "--wrap", "sleep 300")
    running = wait_until(lambda: (j := job(idle, job_id)) and j["state"] == "RUNNING" and j, 30, "the job to run")
    assert running["nodes"] == 1 and running["nodelist"] in idle.names
    wait_until(lambda: len(job_processes(idle.base, idle.conf)) >= 3, 30, "slurmstepd, its script and sleep")
    idle.run("scancel", job_id)
    wait_until(lambda: job(idle, job_id) is None, 30, f"job {job_id} to leave squeue")
    wait_until(lambda: not job_processes(idle.base, idle.conf), 30, "the job's processes to end")


def test_stop_leaves_no_process_of_ours_even_with_a_job_running(tmp_path: Path) -> None:
    c = SlurmCluster(tmp_path / "c", nodes=2, cpus=2)
    c.start()
    try:
        job_id = submit(c, "-N2", "--wrap", "srun sleep 300")
        wait_until(lambda: (j := job(c, job_id)) and j["state"] == "RUNNING", 30, "the job to run")
        wait_until(lambda: len(job_processes(c.base, c.conf)) >= 4, 30, "slurmstepd and sleep on both nodes")
        assert set(c.pids().values()) <= set(processes_of(c.base))
    finally:
        c.stop()
    assert processes_of(c.base, any_command=True) == []
    assert job_processes(c.base, c.conf) == []
    c.stop()  # twice is fine
    assert (c.base / "slurm.conf").exists(), "stop removes no file"


def test_a_failed_start_names_the_daemon_and_its_log(tmp_path: Path) -> None:
    c = SlurmCluster(tmp_path / "bad", nodes=1, timeout=20, extra_conf="NoSuchParameter=1\n")
    with pytest.raises(ClusterError) as failed:
        c.start()
    assert "slurmctld exited" in str(failed.value) and "NoSuchParameter" in str(failed.value)
    assert processes_of(c.base, any_command=True) == []
    c.stop()


def test_the_command_line_brings_a_cluster_up_and_down(tmp_path: Path) -> None:
    base, script = tmp_path / "cli", Path(__file__).resolve().parents[1] / "slurmcluster.py"
    up = subprocess.Popen([sys.executable, str(script), "up", "--nodes", "2", "--dir", str(base)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = up.stdout.readline()
        assert first == f"export SLURM_CONF={base / 'slurm.conf'}\n", first or up.communicate(timeout=60)[1]
        assert "slurmd-n2=" in up.stdout.readline()
        down = subprocess.run([sys.executable, str(script), "down", "--dir", str(base)],
                              capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        assert up.wait(timeout=60) == 0
    finally:
        up.kill()
        up.communicate()
    assert processes_of(base, any_command=True) == []
