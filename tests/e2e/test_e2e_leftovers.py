"""What a job leaves on its node and what it may take (issue 24 items 1-3), through a real
coordinator, a real worker daemon and ``ctl``: a setsid child that ignores SIGTERM, a 3 GiB file in
/dev/shm, a 1 GiB burst on stdout, a rank past ``resources.memory_mb`` or ``resources.pids_max``.
Each job ends; then nothing of it may be left but a bounded log."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cluster import ProcCluster, ctl, wait_for
from rankctl.worker.launcher.procutil import pid_alive
from rankctl.worker.runs.rankio import GENERATION_BYTES

pytestmark = pytest.mark.timeout(600)
JOB = """
name: {name}
kind: python
resources: {{nodes: 1, slots_per_node: 1}}
python: {{entrypoint: {entry}, workdir: {workdir}}}
"""
ORPHAN = """import os, signal, sys, time
pid = os.fork()
if pid == 0:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(1)
while not os.path.exists(sys.argv[1]) or not open(sys.argv[1]).read():
    time.sleep(0.05)
print("the rank ends; its child sleeps on")
"""
SHM = """import os, sys
path = "/dev/shm/" + sys.argv[1]
with open(path, "wb") as f:
    f.truncate(3 << 30)  # 3 GiB, sparse
    f.seek((3 << 30) - 4096)
    f.write(b"x" * 4096)
assert os.path.getsize(path) == 3 << 30
print("wrote", path)
"""
BURST = """import sys
out = sys.stdout.buffer
line = b"y" * 1015 + b"\\n"
block = line * 1024  # 1 MiB
for i in range(1024):
    out.write(block)
out.write(b"the last line of the burst\\n")
"""

HOG = """import sys
chunks = []
print("allocating", flush=True)
for i in range(64):  # 2 GiB in 32 MiB steps, each page touched
    chunks.append(bytearray(32 << 20))
    print("held", (i + 1) * 32, "MiB", flush=True)
print("never here: the limit did not hold")
"""
FORKS = """import os, sys, time
children = []
try:
    for _ in range(200):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        children.append(pid)
except BlockingIOError as exc:
    print("fork refused after", len(children), "children:", exc, flush=True)
for pid in children:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print("children started:", len(children))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = ProcCluster(tmp_path_factory.mktemp("leftovers"), ["w0"], 2)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("scripts")
    for name, text in (("orphan.py", ORPHAN), ("shm.py", SHM), ("burst.py", BURST), ("hog.py", HOG), ("forks.py", FORKS)):
        (d / name).write_text(text)
    return d


def run(cluster: ProcCluster, scripts: Path, name: str, *args: str, sets: tuple[str, ...] = ()) -> dict:
    path = scripts / f"{name}.yaml"
    path.write_text(JOB.format(name=name, entry=f"{name}.py", workdir=scripts))
    flags = [arg for s in sets for arg in ("--set", s)]
    if args:
        flags += ["--set", f"python.args={list(args)!r}"]
    job = cluster.submit(str(path), *flags)
    return cluster.wait_state(job, {"SUCCEEDED", "FAILED", "CANCELLED"}, 300)


def test_a_setsid_child_that_ignores_sigterm_is_killed_with_its_job(cluster, scripts, tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    st = run(cluster, scripts, "orphan", str(pid_file))
    assert st["state"] == "SUCCEEDED", st["reason"]
    child = int(pid_file.read_text())
    ended = time.monotonic()
    wait_for(lambda: not pid_alive(child), 15, "the rank's setsid child gone")
    print(f"child {child} gone {time.monotonic() - ended:.2f} s after the job's end")
    (rank,) = st["ranks"]  # ctl status --json
    assert "1 leftover process(es) of rank 0" in rank["error"], rank
    text = ctl(cluster.address, "status", st["id"])  # and a person reading ctl status sees it too
    assert text.returncode == 0 and "rank 0 on w0: rankctl: 1 leftover process(es)" in text.stdout, text.stdout


def test_a_3_gib_file_in_dev_shm_goes_with_its_job(cluster, scripts) -> None:
    name = f"rankctl-probe-{os.getpid()}"
    st = run(cluster, scripts, "shm", name, sets=(os.environ.get("SHM_SET", "resources.shm_mb=4096"),))
    assert st["state"] == "SUCCEEDED", st["reason"]
    assert not os.path.exists(f"/dev/shm/{name}")
    with open("/proc/self/mounts") as f:
        assert not [line for line in f if f"/jobs/{st['id']}/" in line]  # the job's tmpfs is unmounted


def test_a_1_gib_burst_then_exit_leaves_at_most_the_cap(cluster, scripts) -> None:
    st = run(cluster, scripts, "burst")
    assert st["state"] == "SUCCEEDED", st["reason"]
    logs = list(cluster.root.glob(f"w0/jobs/{st['id']}/*/rank-0.log*"))
    total = sum(p.stat().st_size for p in logs)
    print(f"rank-0 logs on disk after a 1 GiB burst: {total} bytes in {sorted(p.name for p in logs)}")
    assert logs and total <= 2 * GENERATION_BYTES, total
    tail = ctl(cluster.address, "logs", st["id"], "--rank", "0", "--tail", "3")
    assert tail.returncode == 0, tail.stderr
    assert tail.stdout.strip().splitlines()[-1].endswith("the last line of the burst"), tail.stdout[-300:]


def test_a_rank_past_its_memory_limit_is_oom_killed_and_told_so(cluster, scripts) -> None:
    st = run(cluster, scripts, "hog", sets=("resources.memory_mb=256",))
    assert st["state"] == "FAILED", st
    (rank,) = st["ranks"]
    print("reason:", st["reason"][:300], "| rank 0:", rank["error"][-200:])
    assert "OOM killer" in rank["error"] and "resources.memory_mb=256" in rank["error"], rank
    logs = ctl(cluster.address, "logs", st["id"], "--rank", "0").stdout
    held = [int(x.split()[1]) for x in logs.splitlines() if x.startswith("held ")]
    assert held and max(held) < 256 and "never here" not in logs, logs[-500:]


def test_a_rank_cannot_pass_its_pids_limit(cluster, scripts) -> None:
    st = run(cluster, scripts, "forks", sets=("resources.pids_max=64",))
    assert st["state"] == "SUCCEEDED", st["reason"]
    logs = ctl(cluster.address, "logs", st["id"], "--rank", "0").stdout
    started = int(logs.rsplit("children started:", 1)[1].split()[0])
    print(logs.strip().splitlines()[-2:])
    assert "fork refused after" in logs and started < 64, logs[-500:]


def test_a_limit_out_of_range_is_refused_naming_it_and_creates_nothing(cluster, scripts) -> None:
    before = ctl(cluster.address, "jobs", "--json").stdout
    path = scripts / "bad.yaml"
    path.write_text(JOB.format(name="bad-limit", entry="hog.py", workdir=scripts))
    out = ctl(cluster.address, "submit", str(path), "--set", "resources.memory_mb=1")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "resources.memory_mb" in out.stderr and "64" in out.stderr, out.stderr
    assert ctl(cluster.address, "jobs", "--json").stdout == before
