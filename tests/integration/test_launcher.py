"""The real launcher subprocess: comm-check over 8 forked ranks, failures, kill, launcher death."""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import json
import os
import socket
import textwrap
import time
from typing import Any

import pytest

from rankctl.parallel.layout import ParallelConfig, RankLayout
from rankctl.contract.assignment import RankAssignment
from rankctl.contract.spec import JobSpec
from rankctl.kinds import registry
from rankctl.kinds.spec import parse_spec
from rankctl.kinds.comm_check.results import comm_check_result
from rankctl.worker.launcher.main import Launcher
from rankctl.worker.launcher.procutil import pid_alive
from rankctl.worker.runs.status import StatusTailer, read_status

KINDS_MODULE = '''
"""Job kinds for launcher tests (imported by the launcher with --import)."""
import subprocess, time
from rankctl.kinds.registry import register_kind

def sleep(ctx):
    child = subprocess.Popen(["sleep", "60"])
    ctx.status.write("running", metrics={"child_pid": child.pid})
    time.sleep(60)
    return {}

register_kind("test-sleep", sleep)

def orphan(ctx):
    """A child that leaves the rank's session, ignores SIGTERM and SIGHUP, and sleeps on."""
    import os, signal
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork():
            os._exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        ctx.status.write("running", metrics={"child_pid": os.getpid()})
        while True:
            time.sleep(1)
    os.waitpid(pid, 0)
    time.sleep(0.5)
    return {}

def burst(ctx):
    """64 MiB of numbered lines on stdout as fast as it can, then exit."""
    import sys
    line = b"x" * 1000
    for i in range(64 * 1024):
        sys.stdout.buffer.write(b"%08d " % i + line + b"\\n")
    sys.stdout.buffer.write(b"the last line\\n")
    sys.stdout.flush()
    return {}

register_kind("test-orphan", orphan)
register_kind("test-burst", burst)

def shm_probe(ctx):
    """In /dev/shm: a file written and closed, one held open, one a child holds; then exit."""
    base = "/dev/shm/rankctl-test-" + ctx.assignment.job_id
    with open(base + "-closed", "wb") as f:
        f.write(b"x" * 4096)
    held = open(base + "-held", "wb")
    child = subprocess.Popen(["sh", "-c", "exec 3>" + base + "-child; sleep 2.5"])
    time.sleep(2.5)  # the launcher looks every second
    child.wait()
    return {}

register_kind("test-shm", shm_probe)
'''


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    kinds = tmp_path_factory.mktemp("kinds")
    (kinds / "rankctl_test_kinds.py").write_text(textwrap.dedent(KINDS_MODULE))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(kinds), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def launcher(loop, env):
    launcher = loop.run_until_complete(Launcher.start(env=env, imports=["rankctl_test_kinds"]))
    yield launcher
    loop.run_until_complete(launcher.close())


def free_port() -> int:
    """A port nobody holds right now (rank 0's TCPStore binds it; acceptable for a loopback test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _typed(doc: dict[str, Any]) -> JobSpec:
    """The typed spec; a kind only the launcher loads (rankctl_test_kinds) gets the common sections here
    (the launcher validates it with the kind's own, as it does every assignment)."""
    return parse_spec(doc) if doc["kind"] in registry.kinds() else JobSpec.model_validate(doc)


def assignments(job: str, kind: str, run_dir: str, *, world: int = 1, tp: int = 1, pp: int = 1,
                spec: dict[str, Any] | None = None) -> list[RankAssignment]:
    lay = RankLayout(ParallelConfig(world_size=world, tp=tp, pp=pp))
    port = free_port() if world > 1 else 0  # one rank: its own store may take any port
    return [
        RankAssignment(job_id=job, attempt=0, rank=r, world_size=world, local_rank=r, node="n0",
                       coords=lay.coords(r), groups=lay.rank_groups(r), rendezvous=f"127.0.0.1:{port}",
                       backend="gloo", kind=kind, spec=_typed({"name": job, "kind": kind, **(spec or {})}),
                       run_dir=run_dir)
        for r in range(world)
    ]


def wait_events(loop, launcher: Launcher, job: str, event: str, count: int, timeout: float = 30.0) -> list[dict]:
    """Events of ``job`` until ``count`` of kind ``event`` arrived (others of the job are kept too)."""
    async def collect() -> list[dict]:
        seen: list[dict] = []
        while sum(e["event"] == event for e in seen) < count:
            e = await launcher.next_event(timeout)
            assert e["event"] not in ("eof", "error"), e
            if e.get("job_id") == job:
                seen.append(e)
        return seen
    return loop.run_until_complete(collect())


def wait_until(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def subreaper(loop, env):
    """A second launcher that contains ranks without cgroups (the fallback)."""
    launcher = loop.run_until_complete(Launcher.start(env=env, imports=["rankctl_test_kinds"],
                                                      containment="subreaper"))
    yield launcher
    loop.run_until_complete(launcher.close())


@pytest.fixture(scope="module")
def tracked(loop, env):
    """A launcher that leaves ranks on the host's /dev/shm and tracks what they create there."""
    launcher = loop.run_until_complete(Launcher.start(env=env, imports=["rankctl_test_kinds"],
                                                      containment="subreaper", shm="tracked"))
    yield launcher
    loop.run_until_complete(launcher.close())


def test_ready_reports_hardware(launcher) -> None:
    hw = launcher.hardware
    assert hw["cpu_count"] >= 1 and hw["memory_bytes"] > 0 and hw["hostname"]
    assert hw["gpu_count"] == len(hw["gpus"])


def test_comm_check_on_8_ranks(loop, launcher, tmp_path) -> None:
    """tp2·pp2·dp2 over gloo, a short soak: every rank exits 0, every kind's groups verified."""
    spec = {"comm_check": {"size_bytes": 4096, "warmup": 1, "iters": 2, "duration": 0.2}}
    loop.run_until_complete(launcher.launch(assignments("cc", "comm-check", str(tmp_path), world=8, tp=2, pp=2,
                                                        spec=spec), timeout_s=60))
    events = wait_events(loop, launcher, "cc", "exited", 8)
    started = {e["rank"]: e["pid"] for e in events if e["event"] == "started"}
    exited = {e["rank"]: e for e in events if e["event"] == "exited"}
    assert sorted(started) == list(range(8))
    assert {r: e["exit_code"] for r, e in exited.items()} == {r: 0 for r in range(8)}, exited
    final = {r: read_status(str(tmp_path), r)[-1] for r in range(8)}
    assert all(f.phase == "done" for f in final.values())
    rounds = {f.result["rounds"] for f in final.values()}
    assert len(rounds) == 1 and rounds.pop() >= 1  # rank 0's clock decides for everyone
    rows = {row["kind"]: row for row in comm_check_result({r: f.result for r, f in final.items()})["comm"]}
    assert {k: (rows[k]["groups"], rows[k]["size"]) for k in ("tp", "pp", "dp", "mp", "world")} == {
        "tp": (4, 2), "pp": (4, 2), "dp": (4, 2), "mp": (2, 4), "world": (1, 8)}
    phases = [rec.phase for rec in StatusTailer(str(tmp_path)).poll() if rec.rank == 5]
    assert phases[:3] == ["rendezvous", "groups", "running"] and phases[-1] == "done"
    assert set(phases[3:-1]) <= {"running"}  # one more per extra soak round (load decides how many)


def test_failing_rank_reports_exit_code_and_log_tail(loop, launcher, tmp_path) -> None:
    bad = [dataclasses.replace(a, kind="no-such-kind") for a in assignments("bad", "comm-check", str(tmp_path))]
    loop.run_until_complete(launcher.launch(bad))
    (exited,) = [e for e in wait_events(loop, launcher, "bad", "exited", 1) if e["event"] == "exited"]
    assert exited["exit_code"] == 1 and exited["signal"] is None
    assert any("unknown job kind 'no-such-kind'" in line for line in exited["log_tail"]), exited["log_tail"]
    status = read_status(str(tmp_path), 0)[-1]
    assert status.phase == "failed" and "unknown job kind" in status.error


def test_an_assignment_whose_spec_does_not_parse_here_ends_as_that_ranks_launch_failure(loop, launcher) -> None:
    """The launcher validates each assignment's spec once; one it cannot read is that rank's end, not a lost command."""
    doc = assignments("unread", "comm-check", "/tmp/never")[0].to_doc()
    doc["spec"]["kind"] = "no-such-kind"

    async def send() -> None:
        launcher.proc.stdin.write((json.dumps({"cmd": "launch", "assignments": [doc]}) + "\n").encode())
        await launcher.proc.stdin.drain()
    loop.run_until_complete(send())
    (exited,) = wait_events(loop, launcher, "unread", "exited", 1)
    assert exited["pid"] is None and exited["rank"] == 0 and "unknown job kind 'no-such-kind'" in exited["error"]


def _child_pids(run_dir: str, world: int) -> list[int]:
    out = []
    for r in range(world):
        out += [rec.metrics["child_pid"] for rec in read_status(run_dir, r) if rec.metrics.get("child_pid")]
    return out


def test_kill_stops_every_rank_of_the_job_and_their_children(loop, launcher, tmp_path) -> None:
    victim, bystander = tmp_path / "victim", tmp_path / "bystander"
    loop.run_until_complete(launcher.launch(assignments("victim", "test-sleep", str(victim), world=2)))
    loop.run_until_complete(launcher.launch(assignments("bystander", "test-sleep", str(bystander))))
    wait_until(lambda: len(_child_pids(str(victim), 2)) == 2 and len(_child_pids(str(bystander), 1)) == 1)
    children = _child_pids(str(victim), 2)

    loop.run_until_complete(launcher.kill("victim", grace_s=5))
    exited = [e for e in wait_events(loop, launcher, "victim", "exited", 2) if e["event"] == "exited"]
    assert sorted(e["signal"] for e in exited) == ["SIGTERM", "SIGTERM"]
    wait_until(lambda: not any(pid_alive(p) for p in children), timeout=5)
    assert all(pid_alive(p) for p in _child_pids(str(bystander), 1))  # another job is untouched

    loop.run_until_complete(launcher.kill("bystander", sig="SIGKILL"))
    (e,) = [e for e in wait_events(loop, launcher, "bystander", "exited", 1) if e["event"] == "exited"]
    assert e["signal"] == "SIGKILL"


def test_bad_command_reports_an_error_and_the_launcher_keeps_going(loop, launcher) -> None:
    launcher.proc.stdin.write(b'{"cmd": "dance"}\n')
    event = loop.run_until_complete(launcher.next_event(10))
    assert event["event"] == "error" and "unknown command 'dance'" in event["message"]


def test_a_burst_on_stdout_is_rotated_as_it_arrives(loop, launcher, tmp_path) -> None:
    """64 MiB in one burst, then exit, with 1 MiB generations: two generations stay on disk."""
    from rankctl.worker.runs.rankio import MIN_GENERATION_BYTES

    loop.run_until_complete(launcher.launch(assignments("burst", "test-burst", str(tmp_path)),
                                            log_bytes=MIN_GENERATION_BYTES))
    (exited,) = [e for e in wait_events(loop, launcher, "burst", "exited", 1, timeout=60) if e["event"] == "exited"]
    assert exited["exit_code"] == 0, exited["log_tail"]
    sizes = {p.name: p.stat().st_size for p in tmp_path.glob("rank-0.log*")}
    assert set(sizes) == {"rank-0.log", "rank-0.log.1"} and sum(sizes.values()) <= 2 * MIN_GENERATION_BYTES, sizes
    assert sizes["rank-0.log.1"] > MIN_GENERATION_BYTES - 1100  # cut at a line end near the size
    assert exited["log_tail"][-1] == "the last line"
    assert (tmp_path / "rank-0.log.1").read_bytes().endswith(b"\n")


# -- status files (no processes) ---------------------------------------------------------------

def test_status_tailer_returns_only_complete_new_lines(tmp_path) -> None:
    from rankctl.contract.files.rankfiles import status_path
    from rankctl.runtime.status import StatusWriter

    tailer = StatusTailer(str(tmp_path))
    assert tailer.poll() == []
    writer = StatusWriter(str(tmp_path), 2, clock=lambda: 1.0)
    writer.write("running", step=3, metrics={"loss": 2.5})
    with open(status_path(str(tmp_path), 2), "a") as f:
        f.write('{"rank": 2, "phase": "do')  # a line still being written
    (rec,) = tailer.poll()
    assert (rec.phase, rec.step, rec.metrics, rec.ts) == ("running", 3, {"loss": 2.5}, 1.0)
    assert tailer.poll() == []
    with open(status_path(str(tmp_path), 2), "a") as f:
        f.write('ne", "result": {"ok": 1}}\nnot json\n')
    done, junk = tailer.poll()
    assert done.result == {"ok": 1} and junk.phase is None and "not json" in junk.error
    with pytest.raises(ValueError, match="unknown phase"):
        writer.write("dancing")


def test_tail_lines(tmp_path) -> None:
    from rankctl.worker.runs.status import tail_lines

    path = tmp_path / "rank-0.log"
    path.write_text("".join(f"line {i}\n" for i in range(5000)))
    assert tail_lines(str(path), 3) == ["line 4997", "line 4998", "line 4999"]
    assert tail_lines(str(path), 3, block=7) == ["line 4997", "line 4998", "line 4999"]
    assert tail_lines(str(tmp_path / "missing.log")) == []


def test_on_the_hosts_dev_shm_what_a_job_created_goes_with_it(loop, tracked, tmp_path) -> None:
    job = f"shm-{os.getpid()}"
    before = f"/dev/shm/rankctl-test-{job}-before"
    own = "/dev/shm/rankctl-0123456789ab"  # a memory_base directory: rankctl's own, never taken
    with open(before, "wb"):
        pass
    time.sleep(0.2)  # older than the job by more than the file system clock's coarseness
    assert "tracked and removed (asked for)" in tracked.containment, tracked.containment
    try:
        loop.run_until_complete(tracked.launch(assignments(job, "test-shm", str(tmp_path))))
        wait_events(loop, tracked, job, "started", 1)
        os.makedirs(own, exist_ok=True)
        (exited,) = [e for e in wait_events(loop, tracked, job, "exited", 1) if e["event"] == "exited"]
        assert exited["exit_code"] == 0, exited
        left = sorted(x for x in os.listdir("/dev/shm") if x.startswith(f"rankctl-test-{job}"))
        assert left == [os.path.basename(before)], left  # closed, held and the child's went; the older stays
        assert os.path.isdir(own)
    finally:
        os.unlink(before)
        with contextlib.suppress(OSError):
            os.rmdir(own)
