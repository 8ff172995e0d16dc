"""End to end: a real coordinator and two real worker daemons (separate processes) on loopback.

One cluster is shared by the module (each daemon's launcher imports torch once). The tests
that break things (worker SIGKILL, coordinator restart) repair the cluster for the next one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster import CTL, ProcCluster, ctl, rank_pids, start_coordinator, status, wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HEARTBEAT_TIMEOUT = 3.0
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = ProcCluster(tmp_path_factory.mktemp("e2e"), ["worker-0", "worker-1"], 4, HEARTBEAT_TIMEOUT)
    yield c
    c.stop()


def long_job(c: ProcCluster, seconds: float) -> str:
    return c.submit(str(EXAMPLES / "comm-check.yaml"), "--set", f"comm_check.duration={seconds}",
                  "--set", "comm_check.size_bytes=4096")


def test_comm_check_through_separate_daemons(cluster: ProcCluster) -> None:
    out = ctl(cluster.address, "submit", str(EXAMPLES / "comm-check.yaml"), "--wait")
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip()
    assert "\n" not in job_id  # the id alone on stdout
    st = status(cluster.address, job_id)
    assert st["state"] == "SUCCEEDED", st
    assert sorted(r["rank"] for r in st["ranks"]) == list(range(8))
    assert {r["node"] for r in st["ranks"]} == {"worker-0", "worker-1"}
    assert [r["node"] for r in sorted(st["ranks"], key=lambda r: r["rank"])][:4] == [st["nodes"][0]] * 4
    kinds = {row["kind"] for row in st["result"]["comm"]}
    assert {"tp", "pp", "dp", "mp", "tp_dp"} <= kinds
    human = ctl(cluster.address, "status", job_id)
    assert "all-reduce" in human.stdout and "SUCCEEDED" in human.stdout
    logs = ctl(cluster.address, "logs", job_id, "--rank", "0")
    assert logs.returncode == 0
    watched = ctl(cluster.address, "watch", job_id, "--json")
    assert watched.returncode == 0 and json.loads(watched.stdout)["state"] == "SUCCEEDED"
    for cmd in (["jobs"], ["nodes"]):
        out = ctl(cluster.address, *cmd)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert job_id in ctl(cluster.address, "jobs").stdout


@pytest.mark.parametrize(
    "text, words",
    [
        ("name: bad\nkind: comm-check\nparallel: {tp: 2\n", ["not valid YAML", "line"]),
        ("name: bad\nkind: comm-check\ncolour: red\n", ["colour", "unknown field"]),
        ("name: bad\nkind: comm-check\nparallel: {tp: two}\n", ["parallel.tp", "'two'", "integer"]),
        ("name: bad\nkind: comm-check\nresources: {nodes: 1, slots_per_node: 6}\nparallel: {tp: 4}\n",
         ["world_size=6", "tp*pp*cp=4"]),
        ("name: Bad_Name\nkind: comm-check\n", ["name", "Bad_Name"]),
    ],
)
def test_invalid_job_files_are_refused(cluster: ProcCluster, tmp_path: Path, text: str, words: list[str]) -> None:
    before = json.loads(ctl(cluster.address, "jobs", "--json").stdout)
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    out = ctl(cluster.address, "submit", str(bad))
    assert out.returncode == 2, out
    assert out.stdout == "" and "Traceback" not in out.stderr
    for w in words:
        assert w in out.stderr, (w, out.stderr)
    after = json.loads(ctl(cluster.address, "jobs", "--json").stdout)
    assert len(after) == len(before)


def test_unreachable_coordinator_exit_3() -> None:
    out = subprocess.run(CTL + ["--coordinator", "127.0.0.1:1", "jobs"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3
    assert "127.0.0.1:1" in out.stderr and "Traceback" not in out.stderr


def test_cancel_stops_every_rank(cluster: ProcCluster) -> None:
    job = long_job(cluster, 120)
    cluster.wait_state(job, {"RUNNING"}, 60)
    out = ctl(cluster.address, "cancel", job)
    assert out.returncode == 0, out.stderr
    st = cluster.wait_state(job, {"CANCELLED"}, 10)
    assert st["reason"] == "cancelled by user", st["reason"]   # was "cancelled: cancelled by user"
    wait_for(lambda: not rank_pids(job), 15, "every rank of the cancelled job to exit")
    # the ranks the cancel stopped are not failures (an outside probe saw "failed 8 of 8", each "killed by SIGTERM
    # (its log's last lines above)" with no lines above)
    wait_for(lambda: status(cluster.address, job)["summary"]["exited"] == 8, 15, "every rank's exit reported")
    st = status(cluster.address, job)
    assert st["summary"]["failed"] == 0 and not st["summary"]["failing"], st["summary"]
    assert {r["error"] for r in st["ranks"]} == {"stopped: cancelled by user"}, st["ranks"]
    again = ctl(cluster.address, "cancel", job)
    assert again.returncode == 0 and "nothing to cancel" not in again.stderr      # cancelled already: as asked


def test_coordinator_restart_mid_job(cluster: ProcCluster) -> None:
    job = long_job(cluster, 8)
    cluster.wait_state(job, {"RUNNING"}, 60)
    events_before = ctl(cluster.address, "status", job, "--json")
    cluster.coord.kill(signal.SIGKILL)
    time.sleep(1.0)
    cluster.coord, address = start_coordinator(cluster.root / "coord", HEARTBEAT_TIMEOUT, listen=cluster.address)
    assert address == cluster.address
    st = status(cluster.address, job)  # the job survived the restart
    assert st["state"] in {"RUNNING", "SUCCEEDED"}, st
    cluster.wait_ready()  # daemons reconnected
    st = cluster.wait_state(job, {"SUCCEEDED", "FAILED"}, 120)
    assert st["state"] == "SUCCEEDED", st
    assert sorted(r["rank"] for r in st["ranks"]) == list(range(8))
    assert events_before.returncode == 0


def test_worker_sigkill_fails_job_and_leaves_no_rank(cluster: ProcCluster) -> None:
    job = long_job(cluster, 300)
    st = cluster.wait_state(job, {"RUNNING"}, 60)
    victim = st["nodes"][1]
    assert rank_pids(job), "ranks should be running"
    cluster.workers[victim].kill(signal.SIGKILL)
    st = cluster.wait_state(job, {"FAILED"}, HEARTBEAT_TIMEOUT + 10)   # not FAILED by then: fails here
    assert st["state"] == "FAILED" and f"node {victim} lost" in st["reason"], st   # failed by the node's loss
    assert victim in st["reason"] and "4-7" in st["reason"], st["reason"]
    wait_for(lambda: not rank_pids(job), 15, "no rank of the failed job left on any node")
    nodes = json.loads(ctl(cluster.address, "nodes", "--json").stdout)
    assert {n["name"]: n["state"] for n in nodes}[victim] == "LOST"
    cluster.restart_worker(victim)


def test_ctl_up_comm_check(tmp_path: Path) -> None:
    out = subprocess.run(CTL + ["up", str(EXAMPLES / "comm-check.yaml"), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["state"] == "SUCCEEDED" and len(doc["ranks"]) == 8
    assert {"tp", "pp", "dp"} <= {row["kind"] for row in doc["result"]["comm"]}
    human = subprocess.run(CTL + ["up", str(EXAMPLES / "comm-check.yaml")], capture_output=True, text=True,
                           timeout=300)
    assert human.returncode == 0, human.stderr[-3000:]
    assert "all-reduce" in human.stdout and "SUCCEEDED" in human.stdout



def test_logs_follow_reads_every_rank_from_its_node_until_the_job_ends(cluster: ProcCluster) -> None:
    """Logs stay on the nodes (issue 12): ``ctl logs -f`` started mid-run reads every rank's file from the
    daemon that runs it and ends with the job, having shown each rank's last line."""
    job = long_job(cluster, 4)
    cluster.wait_state(job, {"RUNNING"}, 60)
    out = ctl(cluster.address, "logs", job, "-f", "--records", timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert status(cluster.address, job)["state"] == "SUCCEEDED"
    for rank in range(8):
        mine = [line for line in out.stdout.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert any("done" in line for line in mine), (rank, mine[-5:])
    tail = ctl(cluster.address, "logs", job, "--rank", "5", "--tail", "1", "--records")
    assert tail.returncode == 0 and len(tail.stdout.splitlines()) == 1 and "done" in tail.stdout, tail.stdout


def test_a_coordinator_that_accepts_but_never_answers_is_told_apart_from_tls() -> None:
    """A stopped (SIGSTOP) or hung coordinator: the kernel still accepts connections, nothing answers. ``ctl``
    says so (exit 3), not that the coordinator serves TLS (which a plain-text one was taken for)."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)   # never accept()ed nor read: what a stopped process's socket does
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        out = subprocess.run(CTL + ["--coordinator", address, "jobs"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    assert "accepts connections but does not answer (stopped, hung or overloaded)" in out.stderr
    assert "TLS" not in out.stderr and "Traceback" not in out.stderr


def test_a_coordinator_stopped_for_seconds_fails_no_job(cluster: ProcCluster) -> None:
    """SIGSTOP of the coordinator for 8 s (a frozen VM, a debugger): the daemons drop its streams after 4 s of
    unanswered pings, and used to be taken for lost nodes on SIGCONT, failing a healthy job. They reconnect;
    the job goes on in its first attempt."""
    job = long_job(cluster, 25)
    cluster.wait_state(job, {"RUNNING"}, 60)
    cluster.coord.p.send_signal(signal.SIGSTOP)
    try:
        time.sleep(8.0)
    finally:
        cluster.coord.p.send_signal(signal.SIGCONT)
    st = cluster.wait_state(job, {"SUCCEEDED", "FAILED"}, 120)
    assert st["state"] == "SUCCEEDED" and st["attempt"] == 1, (st["state"], st["reason"], st.get("attempt"))
    cluster.wait_ready()


def test_a_train_jobs_nodes_list_it_and_its_logs_show_what_the_ranks_printed(cluster: ProcCluster) -> None:
    """Issue 43, item 8: `ctl nodes` had no jobs column though docs/operations.md says to wait until it shows
    none; `ctl logs JOB` of a train job printed nothing (rc 0): its last rank prints its steps, as a
    training script does."""
    steps = 100
    job = cluster.submit(str(EXAMPLES / "gpt-tp-dp.yaml"), "--set", f"train.steps={steps}")
    nodes = cluster.wait_state(job, {"RUNNING"}, 120)["nodes"]   # then ~10 s of steps at least
    table = ctl(cluster.address, "nodes").stdout.splitlines()
    listed = {n["name"]: n["jobs"] for n in json.loads(ctl(cluster.address, "nodes", "--json").stdout)}
    assert cluster.wait_state(job, {"SUCCEEDED", "FAILED"}, 300)["state"] == "SUCCEEDED"
    assert "jobs" in table[2] and all(job in line for line in table if any(n in line for n in nodes)), table
    assert {n: listed[n] for n in nodes} == {n: [job] for n in nodes}, listed
    idle = json.loads(ctl(cluster.address, "nodes", "--json").stdout)
    assert all(n["jobs"] == [] for n in idle), idle
    logs = ctl(cluster.address, "logs", job)
    assert logs.returncode == 0 and f"[rank 3] step {steps}/{steps}  loss " in logs.stdout, (logs.stdout, logs.stderr)
    assert f"[rank 3] step 1/{steps}  loss " in logs.stdout and "[rankctl " not in logs.stdout, logs.stdout
    one = ctl(cluster.address, "logs", job, "--rank", "3", "--tail", "1")
    assert one.stdout.startswith(f"step {steps}/{steps}  loss "), one.stdout
