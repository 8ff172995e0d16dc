"""End to end: a hung rank and a dead launcher, through a real ``ctl coordinator`` and ``ctl worker``.

One coordinator and one worker daemon (2 slots) serve the module; every job is a 2-rank
comm-check soak that runs until something breaks it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import grpc
import pytest

import cluster
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import Proc, ProcCluster, ready_nodes, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.grpc_in_process]
NODE = "node-a"
JOB = """
name: {name}
kind: comm-check
resources: {{nodes: 1, slots_per_node: 2}}
parallel: {{tp: 2}}
comm_check: {{size_bytes: 4096, iters: 1, warmup: 0, duration: {duration}}}
restart: {{collective_timeout: {timeout}}}
"""


class Node(ProcCluster):
    """A coordinator and one worker daemon, ``NODE``, with 2 slots."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, [NODE], 2)

    @property
    def worker(self) -> Proc:
        return self.workers[NODE]

    def submit_job(self, name: str, duration: float = 120, timeout: float = 300) -> str:
        path = self.root / f"{name}.yaml"
        path.write_text(JOB.format(name=name, duration=duration, timeout=timeout))
        return self.submit(str(path))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    n = Node(tmp_path_factory.mktemp("faults"))
    yield n
    n.stop()


def rank_pid(job_id: str, rank: int) -> int | None:
    """The rank's process (the one writing its status file: ``cluster.rank_pid``), None until it runs."""
    try:
        return cluster.rank_pid(job_id, rank)
    except AssertionError:
        return None


PTRACE_ATTACH, PTRACE_DETACH, WALL = 16, 17, 0x40000000


@contextlib.contextmanager
def traced(pid: int):
    """Hold ``pid`` in a tracing stop, as a debugger attached to it does (``t`` in ``/proc/PID/stat``)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    assert libc.ptrace(PTRACE_ATTACH, pid, None, None) == 0, os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        if libc.ptrace(PTRACE_DETACH, pid, None, None) != 0:   # it died traced: its end is ours to reap first
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, WALL)


def test_a_rank_held_by_a_debugger_is_a_pause_and_its_peer_fails_at_the_collective_timeout(node: Node) -> None:
    """Issue 45: a rank held by a tracer (a debugger attached) is a pause, not a hang: the coordinator leaves it
    to the upper bounds. Its peer's collective times out after the job's 5 s and the job fails blaming no one
    (the peer's error is a victim's, not necessarily the cause)."""
    job = node.submit_job("hang", timeout=5)
    node.wait_state(job, {"RUNNING"}, 60)
    pid = wait_for(lambda: rank_pid(job, 1), 30, "rank 1's process")
    try:
        with traced(pid):
            st = node.wait_state(job, {"FAILED", "SUCCEEDED", "CANCELLED"}, 60)   # still running at 60 s fails here
    finally:
        with contextlib.suppress(ProcessLookupError):  # the daemon may have ended it already
            os.kill(pid, signal.SIGKILL)
    assert st["state"] == "FAILED", st
    reason = st["reason"]
    assert reason.startswith("rank 0 on node node-a"), reason
    assert "timed out after 5 s waiting in a collective" in reason and "victim, not necessarily the cause" in reason, reason


def launcher_pid(daemon_pid: int) -> int | None:
    """The daemon's launcher: its child running ``python -m rankctl.worker.launcher.main``."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == daemon_pid and b"rankctl.worker.launcher.main" in cmdline:
            return int(entry)
    return None


def health_port(log: str) -> int:
    for line in log.splitlines():
        if '"worker started"' in line:
            return int(json.loads(line)["health_port"])
    raise AssertionError(f"no 'worker started' line in the worker's log:\n{log[-2000:]}")


def health(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_dead_launcher_fails_its_job_and_the_daemon_serves_again(node: Node) -> None:
    port = health_port(node.worker.output())
    assert health(port) == "SERVING"
    job = node.submit_job("orphaned")
    node.wait_state(job, {"RUNNING"}, 60)
    old = launcher_pid(node.worker.pid)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    seen: list[str] = []

    def serving_again() -> bool:
        seen.append(health(port))
        return "NOT_SERVING" in seen and seen[-1] == "SERVING"

    wait_for(serving_again, 60, "the health service: NOT_SERVING, then SERVING again", interval=0.05)
    st = node.wait_state(job, {"FAILED", "SUCCEEDED", "CANCELLED"}, 10)
    assert st["state"] == "FAILED" and "on node node-a" in st["reason"] and "launcher" in st["reason"], st
    assert node.worker.p.poll() is None and launcher_pid(node.worker.pid) not in (None, old)
    wait_for(lambda: ready_nodes(node.address) == [NODE], 30, f"{NODE} READY again")
    after = node.submit_job("after", duration=0)
    assert node.wait_state(after, {"SUCCEEDED", "FAILED"}, 120)["state"] == "SUCCEEDED"
