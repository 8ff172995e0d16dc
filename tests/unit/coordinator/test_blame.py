"""Whom an attempt's failure is blamed on (issue 43): a lost node over its victims' errors on every path, a full
disk as its node's fault, and exclusions that never leave a job waiting for ever. The typed rules
(``coordinator.model.faults``) on their own, then the core without a network: a fake clock, fake nodes, a real store."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankctl.coordinator.recovery.reconcile import ATTRIBUTION_S
from rankctl.coordinator.model.allocation import AllocationRequest, Seen
from rankctl.coordinator.batch.allocations import GATHER_S, LOSS_GRACE_S
from rankctl.coordinator.model.faults import Cause, Failed, Fault, outranks, rank_fault, reattributed
from rankctl.coordinator.model.records import RankRecord
from rankctl.coordinator.model.states import JobState
from test_allocations import answer_request, pool_node
from test_core import World, job_yaml, make_world

S = JobState
RESET = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:4021: Connection reset by peer"
ENOSPC = ("OSError: [Errno 28] No space left on device: '/data/ckpt/tr/step-4/rank-0.pt.tmp-7' (file system tmpfs "
          "mounted at /data: 0 B of 48 MiB free)")


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    yield w
    w.store.close()


def failed(rank: int, node: str, error: str, code: int = 1, step: int = 4) -> RankRecord:
    return RankRecord(rank, node, "failed", step, exited=True, exit_code=code, error=error)


def test_a_rank_error_is_read_once_into_a_typed_fault() -> None:
    assert rank_fault(failed(1, "n1", "x", code=-9)).cause is Cause.RANK_EXIT
    assert rank_fault(failed(1, "n1", "ValueError: boom")).cause is Cause.RANK_EXIT
    victim, full = rank_fault(failed(2, "n2", RESET)), rank_fault(failed(0, "n1", ENOSPC))
    assert victim.cause is Cause.PEER_ERROR and not victim.blames_node and victim.repeatable
    assert full.cause is Cause.DISK_FULL and full.blames_node and full.moves_off_node and not full.repeatable
    assert (full.node, full.rank, full.code, full.step) == ("n1", 0, 1, 4)
    loss = Fault(cause=Cause.NODE_LOST, reason="node n1 lost", node="n1")
    assert outranks(loss, victim) and outranks(loss, full) and outranks(full, victim) and not outranks(victim, loss)


def test_a_loss_that_came_after_its_victims_error_takes_the_blame() -> None:
    victim = rank_fault(failed(2, "n2", RESET))
    last = Failed(1, victim, 4, at=100.0, nodes=("n1", "n2"))
    loss = reattributed(last, "n1", "stream closed", last_heard=99.0)
    assert loss is not None and loss.cause is Cause.NODE_LOST and loss.node == "n1"
    assert loss.reason.startswith("node n1 lost (stream closed); before it: rank 2 on node n2")
    assert reattributed(last, "n1", "stream closed", last_heard=101.0) is None   # it beat after: unrelated
    assert reattributed(last, "n3", "stream closed", last_heard=99.0) is None    # not a node of that attempt
    own = Failed(1, rank_fault(failed(2, "n2", "ValueError: boom")), 4, at=100.0, nodes=("n1", "n2"))
    assert reattributed(own, "n1", "stream closed", last_heard=99.0) is None     # a rank's own error stands


def running_pool_job(world: World, restarts: int = 3):  # noqa: ANN201 - a JobRecord
    spec = world.core.validate(job_yaml() + f"restart: {{max_restarts: {restarts}}}\n")
    job = world.core.submit_spec(spec, allocation=AllocationRequest(spares=1))
    answer_request(world, job)
    for n in ("n1", "n2", "n3"):
        pool_node(world, n, job.pool)
    for r in range(job.world_size):
        world.report(job.id, r, "running")
    assert job.state is S.RUNNING and job.nodes == ["n1", "n2"]
    return job


def test_a_lost_pool_node_is_blamed_not_its_survivor_and_its_ranks_are_gone(world: World) -> None:
    """A Slurm node of a job is killed: its survivor's rank fails on the broken collective while the loss waits
    for the allocation's state. Before: the survivor's error was blamed after 1 s, the loss dropped, and the lost
    node's ranks showed ``running`` for good."""
    job = running_pool_job(world)
    world.core.disconnect(world.nodes["n1"].session, "stream closed")
    world.report(job.id, 2, "failed", code=1, error=RESET)             # the survivor n2's victim
    world.clock.t += ATTRIBUTION_S + 0.5
    world.core.tick()
    assert job.state is S.RUNNING                                       # held: a node of the attempt is lost
    world.clock.t += LOSS_GRACE_S
    (work,) = world.core.allocations.due()
    world.core.allocations.seen(work, Seen("RUNNING", ("n1", "n2", "n3")))
    (attempt,) = world.core.attempts(job.id)
    assert attempt["reason"].startswith("node n1 lost (stream closed)"), attempt["reason"]
    assert world.store.attempts.blamed(job.id, 1) == "n1"
    ranks = {r.rank: r for r in world.core.rank_page(job.id, 0, job.world_size)}
    assert [ranks[r].exited for r in (0, 1)] == [True, True], ranks    # gone with n1, not running


def test_a_failed_jobs_final_status_shows_its_lost_nodes_ranks_gone(world: World) -> None:
    """No restart left: the held loss fails the job; n1's ranks were listed ``running`` in its final status."""
    job = running_pool_job(world, restarts=0)
    world.core.disconnect(world.nodes["n1"].session, "stream closed")
    world.clock.t += LOSS_GRACE_S
    (work,) = world.core.allocations.due()
    world.core.allocations.seen(work, Seen("RUNNING", ("n1", "n2", "n3")))
    assert job.state is S.FAILED and job.reason.startswith("node n1 lost"), job.reason
    ranks = {r.rank: r for r in world.core.rank_page(job.id, 0, job.world_size)}
    assert [ranks[r].phase for r in (0, 1)] == ["exited", "exited"], ranks
    assert "gone with node n1" in ranks[0].error


def test_a_victims_error_stored_before_its_nodes_loss_was_known_is_reattributed(world: World) -> None:
    """Plain cluster, the loss known only after the victim's held error failed the attempt: the stored reason
    and blame become the loss, and the survivor is never excluded."""
    for n in ("n1", "n2", "n3"):
        world.connect(n)
    job = world.core.submit(job_yaml() + "restart: {max_restarts: 3}\n")
    for r in range(job.world_size):
        world.report(job.id, r, "running")
    world.report(job.id, 2, "failed", code=1, error=RESET)             # n2's victim, its cause not heard yet
    world.clock.t += ATTRIBUTION_S + 0.5
    world.core.tick()
    assert job.state is S.RESTARTING and world.store.attempts.blamed(job.id, 1) == ""   # a victim is not blamed
    world.core.disconnect(world.nodes["n1"].session, "stream closed")
    (attempt, *_) = world.core.attempts(job.id)
    assert attempt["reason"].startswith("node n1 lost (stream closed); before it: rank 2"), attempt["reason"]
    assert world.store.attempts.blamed(job.id, 1) == "n1" and not world.core.nodes.excluded


def test_victims_errors_twice_in_a_row_never_exclude_their_node(world: World) -> None:
    for n in ("n1", "n2"):
        world.connect(n)
    job = world.core.submit(job_yaml() + "restart: {max_restarts: 5}\n")
    for attempt in (1, 2):
        for r in range(job.world_size):
            world.report(job.id, r, "running")
        world.report(job.id, 2, "failed", code=1, error=f"{RESET} ({attempt})")   # (not the same way)
        world.clock.t += ATTRIBUTION_S + 0.5
        world.core.tick()
        for r in range(job.world_size):
            world.report(job.id, r, "exited", code=1)
    assert job.attempt == 3 and not world.core.nodes.excluded and job.state is S.STARTING


def later(world: World, seconds: float) -> None:
    """``seconds`` pass, every connected node beating, and the core ticks."""
    world.clock.t += seconds
    for node in world.nodes.values():
        if node.session is not None and not node.closed:
            world.core.heartbeat(node.session)
    world.core.tick()


def stop_all(world: World, job) -> None:  # noqa: ANN001 - a JobRecord
    for r in range(job.world_size):
        world.report(job.id, r, "exited", code=1)


def test_a_full_disk_moves_the_next_attempt_off_its_node_and_keeps_the_restarts(world: World) -> None:
    """Before: the restart went in place onto the full node, then "failed the same way" ended the job."""
    for n in ("n1", "n2", "n3"):
        world.connect(n, replaces=True)
    job = world.core.submit(job_yaml() + "restart: {max_restarts: 3}\n")
    for r in range(job.world_size):
        world.report(job.id, r, "running")
    world.report(job.id, 0, "failed", code=1, error=ENOSPC)
    assert job.state is S.RESTARTING and world.store.attempts.blamed(job.id, 1) == "n1"   # not in place on n1
    stop_all(world, job)
    assert job.attempt == 2 and job.nodes == ["n3", "n2"], (job.state, job.nodes, job.reason)   # off n1
    why = world.core.nodes.excluded[job.id]["n1"]
    assert "No space left on device: '/data/ckpt/tr/step-4/rank-0.pt.tmp-7' (file system tmpfs" in why, why
    for r in range(job.world_size):
        world.report(job.id, r, "running")
    world.report(job.id, 0, "failed", code=1, error=ENOSPC, node="n3")  # n3 full too, at the same step
    assert job.state is S.RESTARTING, job.reason                       # no "failed the same way": restarts kept


def test_exclusions_yield_rather_than_leave_a_job_waiting_for_ever(world: World) -> None:
    """A pool job whose allocation's other nodes are excluded (full disks) is placed on them again at once, a
    general one after ``head_wait``; each with an event. Before: PENDING for good with READY nodes free."""
    job = running_pool_job(world)
    later(world, GATHER_S)                                                     # the allocation's workers are in
    world.report(job.id, 0, "failed", code=1, error=ENOSPC)                  # n1 full
    stop_all(world, job)
    assert job.attempt == 2 and job.nodes == ["n3", "n2"], (job.state, job.reason)
    world.report(job.id, 0, "failed", code=1, error=ENOSPC)                  # the spare n3 full too
    stop_all(world, job)
    assert job.attempt == 3 and job.state is S.STARTING and sorted(job.nodes) in (["n1", "n2"], ["n2", "n3"])
    events = [e.message for e in world.core.events(job.id) if e.kind == "node"]
    assert any("n1, n3 placed for this job again" in m for m in events), events

    for n in ("g1", "g2"):
        world.connect(n)
    plain = world.core.submit(job_yaml("plain") + "restart: {max_restarts: 3}\n")
    world.report(plain.id, 0, "failed", code=1, error=ENOSPC)               # g1 full: nothing else to go to
    stop_all(world, plain)
    assert plain.state is S.PENDING and "not placed: g1 excluded for this job" in plain.reason, plain.reason
    later(world, world.core.head_wait)
    assert plain.state is S.STARTING and plain.attempt == 2 and plain.nodes == ["g1", "g2"], plain.reason


def test_a_full_disk_error_names_its_path_and_file_system(tmp_path: Path) -> None:
    """torch.save turns ENOSPC into "unexpected pos"; the rank's last line names the file and its file system."""
    import errno

    from rankctl.contract.files.diskspace import disk_full_line, file_system_of

    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\ntmpfs {tmp_path} tmpfs rw 0 0\n")
    assert file_system_of(str(tmp_path / "ckpt" / "x"), str(mounts)) == ("tmpfs", str(tmp_path))
    assert file_system_of("/elsewhere", str(mounts)) == ("ext4", "/")
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "rank-0.pt.tmp-1"))
        except OSError as full:
            raise RuntimeError("unexpected pos") from full
    except RuntimeError as exc:
        line = disk_full_line(exc)
    assert line is not None and line.startswith(f"OSError: [Errno 28] No space left on device: "
                                                f"'{tmp_path}/rank-0.pt.tmp-1' (file system "), line
    assert " free)" in line and rank_fault(failed(0, "n1", line)).cause is Cause.DISK_FULL
    assert disk_full_line(ValueError("x")) is None
