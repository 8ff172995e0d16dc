"""End to end, the coordinator-side defects of the adversarial pass (issue 10), through real
``ctl coordinator`` / ``ctl worker`` processes and the real ``ctl``:

- a node stream that registers under a name of its own cannot decide another node's ranks;
- a second coordinator on a used address or state dir exits 2 instead of splitting clients;
- a second daemon with a live node's name exits 2 and the node's job is untouched;
- a full state disk refuses submits cleanly (nothing phantom) and every job completes once
  space is freed, without a restart.

The forged stream speaks gRPC from this process, so the module runs with the in-process ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from cluster import (
    CTL, ProcCluster, ctl, rank_pids, ready_nodes, start_coordinator, start_worker, status, wait_for, wait_state,
)
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HEARTBEAT_TIMEOUT = 3.0
pytestmark = [pytest.mark.timeout(600), pytest.mark.grpc_in_process]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("defects")
    (root / "data").mkdir()   # the workers' one --data-root (besides their state dirs)
    c = ProcCluster(root, ["node-0", "node-1"], 2, HEARTBEAT_TIMEOUT, data_roots=(str(root / "data"),))
    yield c
    c.stop()


def comm_check(address: str, seconds: float, *extra: str) -> str:
    out = ctl(address, "submit", str(EXAMPLES / "comm-check.yaml"), "--set", "resources.slots_per_node=2",
              "--set", "parallel.tp=2", "--set", "parallel.pp=1", "--set", f"comm_check.duration={seconds}",
              "--set", "comm_check.size_bytes=4096", *extra)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def forge(address: str, job_id: str, world: int) -> None:
    """Register as node 'stranger' and claim every rank of ``job_id``: one failure, then success."""
    def messages():
        yield pb.NodeMessage(register=pb.Register(name="stranger", address="127.0.0.1", slots=1, session="x"))
        bad = pb.RankStatus(rank=0, node="stranger", phase="failed", exited=True, exit_code=1, error="forged failure")
        yield pb.NodeMessage(batch=pb.ReportBatch(reports=[pb.RankReport(job_id=job_id, attempt=1, status=bad, seq=1)]))
        ok = [pb.RankReport(job_id=job_id, attempt=1, seq=2 + rank, result_json=json.dumps({"loss": 0.0001}),
                            status=pb.RankStatus(rank=rank, node="stranger", phase="done", exited=True, exit_code=0))
              for rank in range(world)]
        yield pb.NodeMessage(batch=pb.ReportBatch(reports=ok))
        for request_id in range(1, 5):  # answers to log fetches it was never sent
            yield pb.NodeMessage(log_chunk=pb.LogChunk(request_id=request_id, lines=["forged line"]))
        time.sleep(1.0)  # keep the stream open while the coordinator reads

    with grpc.insecure_channel(address) as channel:
        replies = rankctl_pb2_grpc.NodeServiceStub(channel).Connect(messages())
        assert next(replies).WhichOneof("body") == "registered"
        for _ in replies:
            pass


def test_a_forged_node_stream_cannot_fail_or_finish_a_job(two: ProcCluster) -> None:
    job = comm_check(two.address, 6)
    wait_state(two.address, job, {"RUNNING"}, 60)
    forge(two.address, job, 4)
    st = status(two.address, job)   # still running, or ended by its own ranks on a loaded machine (checked below)
    assert st["state"] in ("RUNNING", "SUCCEEDED") and "forged" not in st["reason"], st
    nodes = {n["name"]: n for n in json.loads(ctl(two.address, "nodes", "--json").stdout)}
    assert nodes["stranger"]["rejected_reports"] == 5, nodes["stranger"]   # 1 + 4 reports
    assert nodes["node-0"]["rejected_reports"] == 0
    done = wait_state(two.address, job, {"SUCCEEDED", "FAILED"}, 120)
    assert done["state"] == "SUCCEEDED" and done["result"].get("loss") is None, done
    logs = ctl(two.address, "logs", job)
    assert "forged line" not in logs.stdout


def test_a_second_coordinator_on_a_used_address_or_state_dir_exits_2(two: ProcCluster, tmp_path: Path) -> None:
    other = subprocess.run(CTL + ["coordinator", "--listen", two.address, "--state-dir", str(tmp_path / "s2")],
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 2 and "address in use" in other.stderr, other.stderr
    shared = subprocess.run(CTL + ["coordinator", "--listen", "127.0.0.1:0", "--state-dir", str(two.root / "coord")],
                            capture_output=True, text=True, timeout=60)
    assert shared.returncode == 2, shared.stderr
    assert f"in use by another coordinator (pid {two.coord.pid})" in shared.stderr, shared.stderr
    assert "Traceback" not in other.stderr + shared.stderr
    counts = {len(json.loads(ctl(two.address, "jobs", "--json").stdout)) for _ in range(8)}
    assert len(counts) == 1, counts  # every client reaches the one coordinator


def test_a_second_daemon_with_a_live_nodes_name_exits_2(two: ProcCluster) -> None:
    job = comm_check(two.address, 4)
    wait_state(two.address, job, {"RUNNING"}, 60)
    twin = start_worker(two.address, "node-0", 2, two.root / "twin")
    code = twin.p.wait(timeout=120)
    assert code == 2, twin.output()[-2000:]
    assert "node name 'node-0' is held by another live daemon" in twin.output()
    assert "Traceback" not in twin.output()
    done = wait_state(two.address, job, {"SUCCEEDED", "FAILED"}, 120)
    assert done["state"] == "SUCCEEDED", done
    assert sorted(ready_nodes(two.address)) == ["node-0", "node-1"]


WAL_SUBMITS = 40   # submits a full disk may still store in the WAL's own space (a few KiB each; the WAL is
                   # checkpointed every 512 KiB)


def _fill(path: Path) -> None:
    """Write until the disk is full (the bytes a short write left buffered fail again at close: ignored too)."""
    try:
        with open(path, "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    except OSError:
        pass


@pytest.fixture
def tmpfs(tmp_path: Path):
    mount = tmp_path / "state"
    mount.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a 3 MB tmpfs here ({out.stderr.strip() or 'mount failed'})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_state_disk_refuses_submits_cleanly_and_loses_nothing(tmpfs: Path, tmp_path: Path) -> None:
    coord, address = start_coordinator(tmpfs / "coord", HEARTBEAT_TIMEOUT)  # its log file is on the full disk too
    worker = start_worker(address, "disk-0", 2, tmp_path / "workers")
    try:
        wait_for(lambda: ready_nodes(address) == ["disk-0"], 60, "the worker READY")
        # long enough to outlast the refused submits under load (a checkpointed WAL may store one more
        # transaction: a job that ended before the disk refused was stored, not held)
        running = comm_check(address, 10, "--set", "resources.nodes=1")
        wait_state(address, running, {"RUNNING"}, 60)
        _fill(tmpfs / "filler")
        # SQLite may still write a few transactions into WAL space it already holds (after a checkpoint the WAL
        # is written again from its start): those submits are stored, and must be listed; the disk refuses the
        # first one that needs a new block (one CI run's first submit was stored so)
        accepted, refused = [], None
        for _ in range(WAL_SUBMITS):
            out = ctl(address, "submit", str(EXAMPLES / "comm-check.yaml"), "--set", "resources.nodes=1",
                      "--set", "resources.slots_per_node=2", "--set", "parallel.pp=1")
            if out.returncode != 0:
                refused = out
                break
            accepted.append(out.stdout.strip())
        assert refused is not None, f"{WAL_SUBMITS} submits stored on a full disk"
        assert refused.returncode == 1, refused.stderr
        assert "could not store the new job" in refused.stderr and "full" in refused.stderr, refused.stderr
        assert f"the file system of {tmpfs / 'coord'}" in refused.stderr, refused.stderr   # where to make room
        assert "Traceback" not in refused.stderr
        listed = json.loads(ctl(address, "jobs", "--json").stdout)
        assert sorted(j["id"] for j in listed) == sorted([running, *accepted]), listed   # nothing phantom, nothing lost
        wait_for(lambda: not rank_pids(running), 60, "the running job's ranks to exit while the disk is full")
        assert status(address, running)["state"] == "RUNNING"      # its exits are held, not lost
        problem = json.loads(ctl(address, "info", "--json").stdout)["store"]["problem"] or ""
        assert "the store refuses writes" in problem and "held in memory" in problem, problem
        os.unlink(tmpfs / "filler")
        assert wait_state(address, running, {"SUCCEEDED", "FAILED"}, 30)["state"] == "SUCCEEDED"
        assert json.loads(ctl(address, "info", "--json").stdout)["store"]["problem"] is None
        for job in accepted:
            assert ctl(address, "cancel", job).returncode == 0
        later = comm_check(address, 0, "--set", "resources.nodes=1")
        assert wait_state(address, later, {"SUCCEEDED", "FAILED"}, 60)["state"] == "SUCCEEDED"
        assert coord.p.poll() is None                              # no restart happened
    finally:
        worker.stop()
        coord.stop()
        shutil.rmtree(tmp_path / "workers", ignore_errors=True)


def test_nine_thousand_jobs_list_in_pages_and_errors_stay_short(tmp_path: Path) -> None:
    """Before: one ListJobs response held every job with its ranks (4.7 MB at ~9,000 jobs, over
    gRPC's 4 MiB), and an ambiguous-name error listed every id (120 KB)."""
    from rankctl.coordinator.model.records import JobRecord
    from rankctl.kinds.spec import build_spec
    from rankctl.coordinator.model.states import JobState
    from rankctl.coordinator.store.database import Store

    spec = build_spec({"name": "same", "kind": "comm-check", "resources": {"nodes": 2, "slots_per_node": 4}})
    store = Store(tmp_path / "coord")
    with store.transaction():
        for i in range(9000):
            store.insert_job(JobRecord(id=f"same-{i:06x}", name="same", kind="comm-check", spec=spec,
                                       state=JobState.SUCCEEDED, reason="all 8 ranks exited 0 " + "x" * 300,
                                       world_size=8, slots_per_node=4, created_at=1000.0 + i,
                                       nodes=[f"node-{k}" for k in range(2)], result={"comm": []}))
    store.close()
    coord, address = start_coordinator(tmp_path / "coord", HEARTBEAT_TIMEOUT)
    try:
        listed = ctl(address, "jobs", "--json")
        assert listed.returncode == 0, listed.stderr[-2000:]
        ids = [j["id"] for j in json.loads(listed.stdout)]
        assert len(ids) == 9000 and ids[0] == "same-002327" and ids[-1] == "same-000000"  # newest first
        newest = json.loads(ctl(address, "jobs", "--json", "--limit", "3").stdout)
        assert [j["id"] for j in newest] == ["same-002327", "same-002326", "same-002325"]
        ambiguous = ctl(address, "status", "same")
        assert ambiguous.returncode == 2 and len(ambiguous.stderr) < 400, ambiguous.stderr
        assert "9000 jobs are named 'same'" in ambiguous.stderr and "8995 older" in ambiguous.stderr
    finally:
        coord.stop()


def test_a_job_larger_than_the_cluster_is_refused_or_waits_without_blocking(two: ProcCluster) -> None:
    too_big = ("--set", "resources.nodes=3")
    refused = ctl(two.address, "submit", str(EXAMPLES / "comm-check.yaml"), "--set", "resources.slots_per_node=2",
                  "--set", "parallel.tp=2", "--set", "parallel.pp=1", *too_big)
    assert refused.returncode == 2, refused.stderr
    assert "needs 3 node(s) with 2 slots each; the cluster has" in refused.stderr and "--queue-anyway" in refused.stderr
    big = comm_check(two.address, 0, *too_big, "--queue-anyway")
    small = comm_check(two.address, 0)
    assert wait_state(two.address, small, {"SUCCEEDED", "FAILED"}, 120)["state"] == "SUCCEEDED"
    st = status(two.address, big)
    assert st["state"] == "PENDING" and "waiting for capacity" in st["reason"], st
    pending = json.loads(ctl(two.address, "jobs", "--json", "--state", "pending").stdout)
    assert [j["id"] for j in pending] == [big]
    assert ctl(two.address, "cancel", big).returncode == 0


def test_a_full_node_disk_moves_the_job_to_a_ready_spare_naming_path_and_file_system(two: ProcCluster,
                                                                                    tmp_path: Path) -> None:
    """A rank's checkpoint write fails with ENOSPC on node a-full (its state dir, where checkpoints go, is a small
    tmpfs filled mid-run). Before (issue 43): the restart went in place onto the same full node while node-0 was
    READY, then "failed the same way" ended the job with restarts left, and the reason named no path."""
    state = tmp_path / "a-full"
    state.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(state)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({out.stderr.strip() or 'mount failed'})")
    worker = start_worker(two.address, "a-full", 2, tmp_path, data_roots=two.data_roots)   # placed there first
    try:
        wait_for(lambda: "a-full" in ready_nodes(two.address), 60, "a-full READY")
        job = two.submit(str(EXAMPLES / "gpt-tp-dp.yaml"), "--set", "resources.nodes=1", "--set", "train.steps=100000",
                         "--set", "train.eval_every=0", "--set", "train.checkpoint_every=3",
                         "--set", "restart.max_restarts=2")
        wait_for(lambda: (s := status(two.address, job))["state"] == "RUNNING" and s["nodes"] == ["a-full"]
                 and (s["summary"] or {}).get("min_step", 0) >= 1, 120, "the job running on a-full")
        _fill(state / "filler")
        room = (state / "filler").stat().st_size - 160 * 1024     # room for status lines, not for a shard
        os.truncate(state / "filler", max(room, 0))
        s = wait_for(lambda: (x := status(two.address, job))["attempt"] == 2 and x["state"] == "RUNNING"
                     and (x["summary"] or {}).get("min_step", 0) >= 1 and x, 180, "attempt 2 running a step")
        assert s["nodes"] != ["a-full"], s["nodes"]                  # off the full node, onto a READY one
        reason = s["attempts"][0]["reason"]
        mount = os.path.realpath(state)
        assert "No space left on device: '" + str(state) in reason or "No space left on device: '" + mount in reason, \
            reason
        assert f"(file system tmpfs mounted at {mount}: " in reason, reason
        assert ctl(two.address, "cancel", job).returncode == 0
        wait_state(two.address, job, {"CANCELLED"}, 60)
    finally:
        worker.stop()
        subprocess.run(["umount", "-l", str(state)], capture_output=True)
TRAIN = """
name: {name}
kind: train
resources: {{nodes: 1, slots_per_node: 1}}
model: {{layers: 1, hidden: 16, heads: 2, seq_len: 8, vocab: 256}}
train: {{steps: 3, global_batch: 2, micro_batch: 2, checkpoint_every: 1, checkpoint_dir: {ckpt}, data: builtin:pydoc}}
"""


def submit_train(two: ProcCluster, tmp: Path, name: str, ckpt: Path) -> subprocess.CompletedProcess:
    path = tmp / f"{name}.yaml"
    path.write_text(TRAIN.format(name=name, ckpt=ckpt))
    return ctl(two.address, "submit", str(path))


def planted(outside: Path) -> dict[str, bytes]:
    """Another job's step of rank 0 outside the data root: what a followed link would delete."""
    step = outside / "step-00000001"
    step.mkdir(parents=True)
    for name in ("rank-00000.pt", "rank-00000.done"):
        (step / name).write_bytes(b"not yours")
    return {str(p.relative_to(outside)): p.read_bytes() for p in outside.rglob("*") if p.is_file()}


def files_in(outside: Path) -> dict[str, bytes]:
    return {str(p.relative_to(outside)): p.read_bytes() for p in outside.rglob("*") if p.is_file()}


def test_a_job_dir_linked_out_of_the_data_root_is_refused_before_its_ranks_start(two: ProcCluster,
                                                                                  tmp_path: Path) -> None:
    ckpt, outside = two.root / "data" / "linked-ckpt", tmp_path / "outside"
    ckpt.mkdir()
    before = planted(outside)
    (ckpt / "linked").symlink_to(outside)   # {checkpoint_dir}/{job name} leads out of the root
    out = submit_train(two, tmp_path, "linked", ckpt)
    assert out.returncode == 0, out.stderr
    final = wait_state(two.address, out.stdout.strip(), {"SUCCEEDED", "FAILED"}, 180)
    text = json.dumps(final)
    assert final["state"] == "FAILED" and "refused the assignment" in text, text[:2000]
    assert f"passes through the symbolic link '{ckpt / 'linked'}'" in text, text[:2000]
    assert "through no symbolic link" in text   # the rule
    assert files_in(outside) == before and not list(two.root.glob("node-*/jobs/linked-*/*/rank-0.status.jsonl"))


def test_a_step_dir_linked_out_of_the_data_root_is_never_followed_by_a_rank(two: ProcCluster, tmp_path: Path) -> None:
    ckpt, outside = two.root / "data" / "stepped-ckpt", tmp_path / "outside"
    (ckpt / "stepped").mkdir(parents=True)
    before = planted(outside)
    (ckpt / "stepped" / "step-00000001").symlink_to(outside / "step-00000001")  # found by the rank's clean-up
    out = submit_train(two, tmp_path, "stepped", ckpt)
    assert out.returncode == 0, out.stderr
    final = wait_state(two.address, out.stdout.strip(), {"SUCCEEDED", "FAILED"}, 300)
    text = json.dumps(final)
    link = ckpt / "stepped" / "step-00000001"
    assert final["state"] == "FAILED" and f"passes through the symbolic link '{link}'" in text, text[:2000]
    assert files_in(outside) == before


def test_a_checkpoint_dir_outside_every_nodes_data_root_is_refused_at_submit(two: ProcCluster, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    before = json.loads(ctl(two.address, "jobs", "--json").stdout)
    out = submit_train(two, tmp_path, "elsewhere", elsewhere)
    assert out.returncode == 2, out.stderr
    assert f"train.checkpoint_dir='{elsewhere}' lies under no registered node's --data-root" in out.stderr, out.stderr
    assert str(two.root / "data") in out.stderr and "Traceback" not in out.stderr
    assert json.loads(ctl(two.address, "jobs", "--json").stdout) == before and not elsewhere.exists()
    inside = submit_train(two, tmp_path, "inside", two.root / "data" / "inside-ckpt")   # under the root: accepted
    assert inside.returncode == 0, inside.stderr
    assert ctl(two.address, "cancel", inside.stdout.strip()).returncode == 0


def tmpfs_mounts() -> set[str]:
    with open("/proc/self/mounts", encoding="utf-8") as f:
        return {p[1] for p in (line.split() for line in f) if len(p) > 2 and p[2] == "tmpfs"}


def test_a_sigkilled_workers_mounts_go_at_the_next_worker_start_on_another_state_dir(two: ProcCluster) -> None:
    from rankctl.contract.files.checkpoints import memory_base

    doomed = start_worker(two.address, "node-7", 2, two.root / "doomed", data_roots=two.data_roots)
    wait_for(lambda: "node-7" in ready_nodes(two.address), 60, "node-7 READY")
    snapshots = memory_base(str(two.root / "doomed" / "node-7"))
    job = comm_check(two.address, 600, "--set", "resources.nodes=3")
    attempt_shm = str(two.root / "doomed" / "node-7" / "jobs" / job / "1" / "shm")
    wait_for(lambda: {snapshots, attempt_shm} <= tmpfs_mounts(), 120, "node-7's snapshot and attempt tmpfs mounted")
    live = {memory_base(str(two.root / n)) for n in two.workers}
    assert live <= tmpfs_mounts()
    doomed.kill()   # SIGKILL: no clean-up of its own
    assert ctl(two.address, "cancel", job).returncode == 0   # (its mounts stay: no daemon on its state dir)
    reaper = start_worker(two.address, "node-8", 1, two.root / "reaper", data_roots=two.data_roots)
    try:
        # by node-8's start (or by any other worker starting on this host meanwhile: the same rule)
        wait_for(lambda: not {snapshots, attempt_shm} & tmpfs_mounts(), 60, "node-7's mounts unmounted by node-8")
        assert live <= tmpfs_mounts()   # the live daemons' own are untouched
    finally:
        reaper.stop()
        doomed.stop()


def test_a_peers_replica_dir_linked_out_of_its_state_dir_is_refused_and_the_job_goes_on(two: ProcCluster,
                                                                                     tmp_path: Path) -> None:
    """Issue 43 item 1: each node of a 2-node train job pushes its checkpoint steps to the other, which keeps them
    under ``{state}/replicas/{job name}``; a link planted there on both nodes used to be followed (the steps landed
    outside the state dir). Refused now, the daemon's log naming the path and the rule; the job still succeeds."""
    outside = tmp_path / "outside"
    before = planted(outside)
    links = [two.root / node / "replicas" / "relinked" for node in two.workers]
    for link in links:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(outside)
    path = tmp_path / "relinked.yaml"
    spec = TRAIN.replace("nodes: 1", "nodes: 2").replace(", checkpoint_dir: {ckpt}", "").replace("steps: 3", "steps: 6")
    path.write_text(spec.replace("global_batch: 2", "global_batch: 4").format(name="relinked"))
    job = two.submit(str(path))
    wait_for(lambda: any(f"passes through the symbolic link '{link}'" in w.output() for w in two.workers.values()
                         for link in links), 180, "a push into the linked replica dir refused")
    final = wait_state(two.address, job, {"SUCCEEDED", "FAILED"}, 180)
    assert final["state"] == "SUCCEEDED", json.dumps(final)[:2000]
    assert files_in(outside) == before and all(link.is_symlink() for link in links)
    assert any("replica refused" in w.output() and "through no symbolic link" in w.output()
               for w in two.workers.values())
