"""End to end: a train job restarts by itself onto a spare node after one of its daemons is SIGKILLed
(issue 13, first part), through a real coordinator and three real worker daemons (separate processes).

The restarted run's losses equal an uninterrupted run's, step for step. The lost node's shards were
copied to its peer node (checkpoint replication), so the replacement fetches them and the new attempt
resumes from the newest common checkpoint; it prints how long detection and recovery took and how many
steps were lost.
"""

from __future__ import annotations

import os
import re
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from cluster import ProcCluster, alive, ctl, highest_step, rank_pids, status, stepping, wait_for

pytestmark = pytest.mark.timeout(600)
HEARTBEAT_TIMEOUT = 3.0
JOB = """
name: {name}
kind: train
resources: {{nodes: 2, slots_per_node: 2}}
parallel: {{tp: 2}}
restart: {{max_restarts: {restarts}}}
model: {{layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256}}
train: {{steps: 40, global_batch: 8, micro_batch: 2, lr: 1.0e-2, warmup: 2, seed: 11, checkpoint_every: 5,
         data: builtin:pydoc}}
"""


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory):
    c = ProcCluster(tmp_path_factory.mktemp("restart"), ["node-0", "node-1", "node-2"], 2, HEARTBEAT_TIMEOUT)
    yield c
    c.stop()


SNAPSHOTS_EVERY = 2
SNAPSHOT_JOB = JOB.replace("checkpoint_every: 5", f"checkpoint_every: 0, snapshot_every: {SNAPSHOTS_EVERY}")


@pytest.fixture(scope="module")
def reference(three: ProcCluster, tmp_path_factory: pytest.TempPathFactory) -> dict:
    ref = three.wait_state(submit(three, tmp_path_factory.mktemp("ref"), "uninterrupted", 0), {"SUCCEEDED", "FAILED"},
                           300)
    assert ref["state"] == "SUCCEEDED", ref["reason"]
    return ref


def submit(c: ProcCluster, tmp: Path, name: str, restarts: int, template: str = JOB) -> str:
    path = tmp / f"{name}.yaml"
    path.write_text(template.format(name=name, restarts=restarts))
    return c.submit(str(path))


def assert_same_losses(done: dict, ref: dict) -> None:
    assert [s for s, _ in losses(done)] == list(range(1, 41))
    for (step, ours), (_, theirs) in zip(losses(done), losses(ref)):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (step, ours, theirs)


def losses(done: dict) -> list[tuple[int, float]]:
    return [(x["step"], x["loss"]) for x in done["result"]["losses"]]


@contextmanager
def killed(cluster: ProcCluster, name: str) -> Iterator[None]:
    """SIGKILL node ``name``'s daemon; it starts again afterwards whatever the test found, so that the module's
    later tests keep their spare node."""
    cluster.workers[name].kill(signal.SIGKILL)
    try:
        yield
    finally:
        cluster.restart_worker(name)


def test_a_killed_daemon_is_replaced_by_a_spare_and_the_losses_equal_an_uninterrupted_run(
        three: ProcCluster, reference: dict, tmp_path: Path) -> None:
    ref = reference
    job = submit(three, tmp_path, "faulted", 2)
    st = stepping(three.root, job, 4, 5)   # the ranks' own files: a short job is still running at the fault
    victim, keeper = st["nodes"][1], st["nodes"][0]
    # a checkpoint of the victim's ranks (2, 3) is copied to the other job node before the fault
    copies = three.root / keeper / "replicas" / "faulted"
    wait_for(lambda: any(all((d / f"rank-{r:05d}.done").exists() for r in (2, 3)) for d in copies.glob("step-*")),
             60, "a checkpoint of the victim's ranks replicated to its peer")
    spare = ({"node-0", "node-1", "node-2"} - set(st["nodes"])).pop()
    fault_step, t_fault = st["summary"]["min_step"], time.monotonic()
    with killed(three, victim):
        # a restart may pass RESTARTING..STARTING between two polls: attempt 2 says it came too
        restarting = wait_for(lambda: ((s := status(three.address, job))["attempt"] >= 2 or s["state"] in (
            "RESTARTING", "PENDING", "PLACED", "STARTING")) and s, 60, "a restart")
        t_detect = time.monotonic() - t_fault
        assert f"node {victim} lost" in restarting["reason"] or restarting["attempt"] == 2, restarting
        wait_for(lambda: (s := status(three.address, job))["attempt"] == 2 and s["state"] in ("RUNNING", "SUCCEEDED")
                 and s["summary"]["min_step"] >= 1, 180, "attempt 2 completing a step")
        t_step = time.monotonic() - t_fault
        done = three.wait_state(job, {"SUCCEEDED", "FAILED"}, 300)
        assert done["state"] == "SUCCEEDED" and done["attempt"] == 2, done["reason"]
        assert spare in done["nodes"] and victim not in done["nodes"], done["nodes"]
        assert_same_losses(done, ref)
        resumed = done["result"].get("resumed_from") or 0
        reached = highest_step(three.root, job, 1)  # the status taken before the kill lags behind the ranks
        assert 5 <= resumed <= reached, (resumed, reached)  # resumed from the replicated checkpoint, not over
        print(f"\nfault: SIGKILL of {victim}'s daemon (every rank past step {fault_step} when it came, ranks reached {reached}); "
              f"detected (RESTARTING) after {t_detect:.1f} s; first completed step of attempt 2 after {t_step:.1f} s; "
              f"steps lost {reached - resumed} (attempt 2 resumed from step {resumed})")
        for pid in rank_pids(job):
            assert False, f"rank process {pid} of {job} is still alive"


def test_in_memory_snapshots_survive_a_killed_node_on_its_peer(three: ProcCluster, reference: dict,
                                                              tmp_path: Path) -> None:
    """No checkpoint at all (checkpoint_every 0), a snapshot every 2 steps in the nodes' memory, copied to the
    job's other node: after SIGKILL of one job daemon the spare fetches the lost ranks' snapshots from that
    peer and attempt 2 resumes from one, losing few steps; the losses equal the uninterrupted run's, and
    once the job succeeded no snapshot of it is left in any node's memory."""
    from rankctl.contract.checkpoints import snapshot_replica_root, snapshot_root

    job = submit(three, tmp_path, "snapped", 2, SNAPSHOT_JOB)
    st = stepping(three.root, job, 4, 6)
    victim, keeper = st["nodes"][1], st["nodes"][0]
    copies = Path(snapshot_replica_root(str(three.root / keeper), "snapped"))
    wait_for(lambda: any(all((d / f"rank-{r:05d}.done").exists() for r in (2, 3)) for d in copies.glob("step-*")),
             60, "a snapshot of the victim's ranks kept in its peer's memory")
    assert not (three.root / keeper / "checkpoints" / "snapped").exists()   # snapshots only: nothing on disk
    with killed(three, victim):
        done = three.wait_state(job, {"SUCCEEDED", "FAILED"}, 300)
        assert done["state"] == "SUCCEEDED" and done["attempt"] == 2, done["reason"]
        assert victim not in done["nodes"], done["nodes"]
        assert_same_losses(done, reference)
        resumed = done["result"].get("resumed_from") or 0
        reached = highest_step(three.root, job, 1)
        assert resumed >= 2 and resumed % SNAPSHOTS_EVERY == 0 and resumed <= reached, (resumed, reached)
        print(f"\nsnapshot_every {SNAPSHOTS_EVERY}, no checkpoint: ranks had reached step {reached}, attempt 2 resumed "
              f"from the snapshot of step {resumed}: {reached - resumed} step(s) lost")
        # a finished job's snapshots go from its nodes' memory (their own and the copies kept for their peer;
        # the killed node's stay where its daemon died)
        def left() -> list[str]:
            return [str(p) for n in done["nodes"] for root in (snapshot_root(str(three.root / n), "snapped"),
                    snapshot_replica_root(str(three.root / n), "snapped")) for p in Path(root).rglob("*.pt")]
        wait_for(lambda: not left(), 30, "the finished job's snapshots removed")


FAILING = """
name: {name}
kind: python
resources: {{nodes: 2, slots_per_node: 2}}
backend: gloo
restart: {{max_restarts: 1}}
python: {{entrypoint: fail.py, workdir: {workdir}}}
"""
SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"attempt rank {{rank}} up", flush=True)
if rank == {bad} and not ({once} and os.path.exists({marker!r})):
    open({marker!r}, "w").close()
    sys.exit("rank {bad} gives up")
time.sleep({sleep})
"""


def python_job(c: ProcCluster, tmp: Path, name: str, bad: int, sleep: float, once: bool = False) -> str:
    """Rank ``bad`` exits 1 (only in the first attempt when ``once``); the others sleep ``sleep`` s."""
    work = tmp / name
    work.mkdir()
    (work / "fail.py").write_text(SCRIPT.format(bad=bad, sleep=sleep, once=once, marker=str(tmp / f"{name}.failed")))
    path = tmp / f"{name}.yaml"
    path.write_text(FAILING.format(name=name, workdir=work))
    return c.submit(str(path))


def test_out_of_restarts_fails_with_every_attempts_reason_and_leaves_no_rank(
        three: ProcCluster, tmp_path: Path) -> None:
    """A python job whose rank 3 always exits 1: two attempts (max_restarts 1), then FAILED naming both."""
    job = python_job(three, tmp_path, "always-fails", bad=3, sleep=0)
    done = three.wait_state(job, {"SUCCEEDED", "FAILED", "CANCELLED"}, 240)
    assert done["state"] == "FAILED" and done["attempt"] == 2, done
    reason = done["reason"]
    assert "attempt 2 failed and no restart is left (max_restarts=1)" in reason, reason
    assert "earlier: attempt 1: rank 3" in reason and reason.count("fail.py exited with code 1") == 2, reason
    attempts = done["attempts"]
    assert [(a["attempt"], a["state"]) for a in attempts] == [(1, "RESTARTING"), (2, "FAILED")], attempts
    assert attempts[0]["reason"].startswith("rank 3 on node"), attempts
    human = ctl(three.address, "status", job)
    assert "attempts" in human.stdout and "RESTARTING" in human.stdout, human.stdout
    wait_for(lambda: not rank_pids(job), 30, "every rank of every attempt to exit")


def test_cancel_after_a_restart_leaves_no_rank_of_any_attempt(three: ProcCluster, tmp_path: Path) -> None:
    """Rank 0 fails in attempt 1 while the others sleep; attempt 2 runs; a cancel then leaves nothing."""
    job = python_job(three, tmp_path, "cancelled", bad=0, sleep=600, once=True)
    wait_for(lambda: (s := status(three.address, job))["attempt"] == 2 and s["state"] == "RUNNING", 120,
             "attempt 2 running")
    out = ctl(three.address, "cancel", job)
    assert out.returncode == 0, out.stderr
    assert three.wait_state(job, {"CANCELLED", "FAILED", "SUCCEEDED"}, 60)["state"] == "CANCELLED"
    wait_for(lambda: not rank_pids(job), 30, "every rank of every attempt to exit")


HANG_TIMEOUT = 10
HUNG = f"""
name: hung
kind: train
resources: {{nodes: 2, slots_per_node: 2}}
parallel: {{tp: 2, pp: 2}}
restart: {{max_restarts: 1, hang_timeout: {HANG_TIMEOUT}}}
model: {{layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256}}
train: {{steps: 120, global_batch: 8, micro_batch: 2, lr: 1.0e-2, warmup: 2, seed: 5, checkpoint_every: 20,
        data: builtin:pydoc}}
"""
VICTIM = 3  # the last pipeline stage's second tp rank: its tp peer is rank 2, its pp peer rank 1


def rank_of(pid: int) -> int:
    """A rank process's rank, from its stdout (the rank's log file ``rank-R.log``)."""
    return int(re.search(r"rank-(\d+)\.log", os.readlink(f"/proc/{pid}/fd/1")).group(1))


def test_a_stopped_rank_is_named_with_the_group_it_was_due_in_and_the_job_restarts(
        three: ProcCluster, tmp_path: Path) -> None:
    """SIGSTOP of one rank of a tp2·pp2 job: the daemons send the counters and stacks of the ranks whose
    collectives stopped moving; after ``hang_timeout`` the reason names the stopped rank, the group
    it was due in (its tp or pp group where a peer waits, or a combined group whose collective it stopped
    inside) and where it was last seen; the attempt is
    stopped (the stopped rank included) and the job succeeds on attempt 2."""
    (tmp_path / "hung.yaml").write_text(HUNG)
    job = three.submit(str(tmp_path / "hung.yaml"))
    wait_for(lambda: (s := status(three.address, job))["state"] == "RUNNING" and s["summary"]["min_step"] >= 3,
             240, "the job running")
    pids = {rank_of(p): p for p in rank_pids(job)}
    assert sorted(pids) == [0, 1, 2, 3], pids
    t0 = time.monotonic()
    os.kill(pids[VICTIM], signal.SIGSTOP)
    ended = wait_for(lambda: (s := status(three.address, job))["attempts"] and s["attempts"][0].get("reason") and s,
                     HANG_TIMEOUT + 120, "attempt 1 to end")
    detected = time.monotonic() - t0
    reason = ended["attempts"][0]["reason"]
    print(f"\nrank {VICTIM} SIGSTOPped; attempt 1 ended after {detected:.1f} s (hang_timeout {HANG_TIMEOUT} s)"
          f"\nreason: {reason}")
    assert reason.startswith("hang: no rank advanced for"), reason
    assert f"rank {VICTIM} stopped (SIGSTOP or a debugger) on node-" in reason, reason
    # the group it was due in, where a peer waits for it: its tp group [2, 3], its pp group [1, 3], or a combined
    # one it belongs to when the stop lands in that group's collective (CI saw "mp group [0, 1, 2, 3] waits in
    # all_reduce #14 (ranks 0-3 entered it): rank 3 stopped inside it": the grad-norm all-reduce)
    due = re.search(rf"(\w+) group \[([\d, ]+)\] waits in \w+ #\d+ \([^)]*\): "
                    rf"rank {VICTIM} (never entered it|not in it|stopped inside it)", reason)
    assert due and VICTIM in [int(r) for r in due.group(2).split(", ")], reason
    assert due.group(1) in ("tp", "pp") or due.group(3) == "stopped inside it", reason
    assert f"rank {VICTIM} last seen on node-" in reason and "stack: " in reason, reason

    done = three.wait_state(job, {"SUCCEEDED", "FAILED", "CANCELLED"}, 400)
    assert done["state"] == "SUCCEEDED" and done["attempt"] == 2, done["reason"]
    assert [(a["attempt"], a["state"]) for a in done["attempts"]][0] == (1, "RESTARTING"), done["attempts"]
    wait_for(lambda: not any(alive(p) for p in pids.values()), 30, "every rank of attempt 1 to exit")
    print(f"attempt 2 resumed from step {done['result'].get('resumed_from')} and succeeded")
