"""Allocations without a scheduler or a network: the core's rules (``coordinator.batch.allocations``) driven with fake
nodes and the answers an ``Allocator`` would bring back, and the Slurm adapter's pure parts (the batch script)."""

from __future__ import annotations

import re

from pathlib import Path

import pytest

from rankctl.coordinator.model.allocation import AllocationRequest, Ask, Seen
from rankctl.coordinator.batch.allocations import GATHER_S, LOSS_GRACE_S
from rankctl.coordinator.model.errors import InvalidRequest
from rankctl.coordinator.model.records import NodeHello
from rankctl.coordinator.batch.slurm import batch_script
from rankctl.coordinator.model.states import JobState
from test_core import FakeNode, World, job_yaml, make_world

S = JobState


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    yield w
    w.store.close()


def pool_node(world: World, name: str, pool: str, slots: int = 2):  # noqa: ANN201 - a FakeNode
    node = world.nodes.setdefault(name, FakeNode(name))
    node.session = world.core.register(NodeHello(name, f"{name}.lan", slots, {}, (29500,), (), "s2", pool=pool),
                                       node.sent.append)
    return node


def submitted(world: World, spares: int = 1, restarts: int = 0):  # noqa: ANN201 - a JobRecord
    spec = world.core.validate(job_yaml() + f"restart: {{max_restarts: {restarts}}}\n")
    return world.core.submit_spec(spec, allocation=AllocationRequest(spares=spares))


def answer_request(world: World, job, slurm_id: str = "77") -> None:  # noqa: ANN001
    (work,) = world.core.allocations.due()
    assert work.action == "request" and work.ask.nodes == job.nodes_needed + job.allocation.request.spares
    world.core.allocations.requested(work, slurm_id, "/out/x.out")


def test_a_request_names_each_bad_field_and_stores_nothing(world: World) -> None:
    bad = AllocationRequest(spares=-1, partition="a\nb", worker_state_dir="/x/$(rm -rf /)")
    spec = world.core.validate(job_yaml())
    with pytest.raises(InvalidRequest) as err:
        world.core.submit_spec(spec, allocation=bad)
    text = str(err.value)
    assert "--spares (got -1)" in text and "--partition" in text and "--worker-state-dir" in text, text
    assert world.core.list() == []
    # sbatch refused these only once the job was stored (an outside probe): refused at submit, naming the rule
    for bad, words in ((AllocationRequest(partition="a b"), "--partition (got 'a b'): a Slurm partition name holds "
                                                            "no spaces"),
                       (AllocationRequest(time="two hours"), "--time (got 'two hours'): a Slurm time limit"),
                       (AllocationRequest(time="1:00:00:00"), "--time (got '1:00:00:00')"),
                       (AllocationRequest(extra_args=("--comment=a b",)), "--sbatch-arg (got '--comment=a b'): one "
                                                                          "sbatch option with no spaces")):
        with pytest.raises(InvalidRequest, match=re.escape(words)):
            world.core.submit_spec(spec, allocation=bad)
    for good in ("30", "30:00", "1:00:00", "2-0", "2-12:30", "2-12:30:00", "UNLIMITED"):
        assert not AllocationRequest(time=good, partition="gpu,cpu").problems(), good
    assert world.core.list() == []


def test_the_job_runs_on_its_pool_only_and_no_other_job_there(world: World) -> None:
    world.connect("general", 2)
    job = submitted(world)                                 # no capacity check: its nodes come with the allocation
    assert job.state is S.PENDING and "waiting for the workers of its allocation" in job.reason, job.reason
    answer_request(world, job)
    assert job.allocation.id == "77" and job.allocation.state == "PENDING"
    other = world.core.submit(job_yaml("other", nodes=2), queue_anyway=True)
    for name in ("n1", "n2", "n3"):
        pool_node(world, name, job.pool)
    assert job.state is S.STARTING and sorted(job.nodes) == ["n1", "n2"]   # in name order; n3 is the spare
    assert other.state is S.PENDING                        # the spare n3 is free, but not for the general queue
    world.connect("general2", 2)
    assert other.state is S.STARTING and other.nodes == ["general", "general2"]


def test_a_new_allocations_workers_are_gathered_before_placement(world: World) -> None:
    job = submitted(world, spares=1)
    answer_request(world, job)
    pool_node(world, "n1", job.pool)
    pool_node(world, "n2", job.pool)
    assert job.state is S.PENDING and "2 of 3 registered" in job.reason
    world.clock.t += GATHER_S + 0.5
    world.core.allocations.due()                           # the gathering time is over: placed on those that came
    world.core.turn()                                      # (the server's loop: the turn a mark asks for)
    assert job.state is S.STARTING and job.nodes == ["n1", "n2"]


def test_the_end_of_the_job_releases_the_pools_workers(world: World) -> None:
    job = submitted(world, spares=0)
    answer_request(world, job)
    nodes = [pool_node(world, n, job.pool) for n in ("n1", "n2")]
    world.run_all(job.id)
    assert job.state is S.SUCCEEDED
    works = world.core.allocations.due()
    assert [w.action for w in works] == ["archive", "watch"]   # its ranks' logs are kept first (logarchive)
    assert [len(n.bodies("release")) for n in nodes] == [0, 0] and not job.allocation.released
    world.core.allocations.archived(works[0])
    world.core.allocations.seen(works[1], Seen("RUNNING", ("n1", "n2")))
    assert world.core.allocations.due() == []              # no scancel: the workers were told to exit
    assert [len(n.bodies("release")) for n in nodes] == [1, 1] and job.allocation.released
    late = pool_node(world, "n3", job.pool)                 # a worker that comes after the end is released at once
    assert late.bodies("release")[0].reason == f"job {job.id} has ended"
    stray = pool_node(world, "n4", "nobody-a1")
    assert stray.bodies("release")[0].reason == "no active job owns pool nobody-a1"


def test_an_allocation_that_ends_first_fails_the_job_naming_it(world: World) -> None:
    job = submitted(world, spares=0)
    answer_request(world, job)
    for n in ("n1", "n2"):
        pool_node(world, n, job.pool)
    for r in range(job.world_size):
        world.report(job.id, r, "running")
    assert job.state is S.RUNNING
    world.core.disconnect(world.nodes["n1"].session, "stream closed")   # Slurm ended the workers first
    assert job.state is S.RUNNING                                        # held: is it the node, or the allocation?
    world.clock.t += 5
    (work,) = world.core.allocations.due()
    assert work.action == "watch"
    world.core.allocations.seen(work, Seen("CANCELLED", ("n1", "n2")))
    assert job.state is S.FAILED and "its allocation ended: slurm job 77 (CANCELLED)" in job.reason, job.reason


def test_a_lost_node_of_a_live_allocation_is_a_lost_node(world: World) -> None:
    job = submitted(world, spares=1, restarts=1)
    answer_request(world, job)
    for n in ("n1", "n2", "n3"):
        pool_node(world, n, job.pool)
    for r in range(job.world_size):
        world.report(job.id, r, "running")
    world.core.disconnect(world.nodes["n2"].session, "stream closed")
    (work,) = world.core.allocations.due()
    world.core.allocations.seen(work, Seen("RUNNING", ("n1", "n2", "n3")))
    assert job.state is S.RUNNING                                        # asked again within the grace
    world.clock.t += LOSS_GRACE_S
    (work,) = world.core.allocations.due()
    world.core.allocations.seen(work, Seen("RUNNING", ("n1", "n2", "n3")))
    assert job.state is S.RESTARTING and "node n2 lost (stream closed)" in world.core.attempts(job.id)[0]["reason"]


def test_a_job_queued_again_after_its_allocation_ended_gets_a_new_one(world: World) -> None:
    job = submitted(world, spares=0, restarts=1)
    answer_request(world, job)
    for n in ("n1", "n2"):
        pool_node(world, n, job.pool)
    for r in range(job.world_size):
        world.report(job.id, r, "running")
    world.clock.t += 5
    (work,) = world.core.allocations.due()
    world.core.allocations.seen(work, Seen("TIMEOUT", ("n1", "n2")))
    assert job.state is S.RESTARTING
    for n in ("n1", "n2"):
        world.core.disconnect(world.nodes[n].session, "stream closed")
    world.clock.t += 60
    world.core.tick()
    assert job.state is S.PENDING and job.attempt == 2
    world.core.allocations.due()                                          # the old one ended: a new pool
    assert job.allocation.number == 2 and job.pool == f"{job.id}-a2" and job.allocation.id == ""
    (work,) = world.core.allocations.due()
    assert work.action == "request"


def test_refused_by_the_scheduler_fails_the_job_with_its_words(world: World) -> None:
    job = submitted(world)
    (work,) = world.core.allocations.due()
    world.core.allocations.refused(work, "sbatch exited 1: invalid partition specified: gpu")
    assert job.state is S.FAILED and "invalid partition specified: gpu" in job.reason


def test_the_batch_script_runs_one_named_worker_per_node_and_quotes_what_it_is_given() -> None:
    from rankctl.coordinator.model.allocation import Allocation

    req = AllocationRequest(spares=1, partition="gpu", time="1:00:00", extra_args=("--exclusive",),
                            worker_state_dir="/scratch/$USER/rk-{jobid}-{node}", worker_args=("--data-root", "/d e"))
    ask = Ask("j-1", "j", Allocation(request=req, pool="j-1-a1"), 3, 8, "head:7420")
    text = batch_script(ask, "/o/j.out")
    for line in ("#SBATCH --job-name=j-1", "#SBATCH --nodes=3", "#SBATCH --no-kill", "#SBATCH --partition=gpu",
                 "#SBATCH --time=1:00:00", "#SBATCH --exclusive", "#SBATCH --output=/o/j.out"):
        assert line + "\n" in text, text
    assert '"/scratch/$USER/rk-${SLURM_JOB_ID}-${SLURMD_NODENAME}"' in text
    assert "--slots 8 --pool j-1-a1" in text and "'\"'\"'/d e'\"'\"'" in text, text


def test_an_ended_jobs_rank_logs_are_kept_and_read_back_as_a_node_would_answer(world: World, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``logarchive``: the last lines of each rank, before the allocation's nodes leave; a rank whose node
    cannot answer is skipped, and a job's archive stays within its byte budget."""
    import asyncio

    from rankctl.contract.files.logrecords import RECORD_MARK
    from rankctl.coordinator.logs import logarchive
    from rankctl.coordinator.logs.logarchive import LogArchive
    from rankctl.coordinator.logs.logfetch import LogsUnavailable
    from rankctl.proto import rankctl_pb2 as pb

    class Fetcher:
        async def fetch(self, node, job_id, attempt, rank, *, tail, max_lines, records):  # noqa: ANN001, ANN202
            if node == "n2":
                raise LogsUnavailable("node n2 is LOST")
            assert records                     # kept whole: ctl logs --records reads them too
            lines = [f"{node} rank {rank} line {i}" for i in range(tail + 5)]
            return pb.LogChunk(lines=[RECORD_MARK + '{"event": "start"}', *lines[-tail + 1:]])

    job = submitted(world, spares=0)
    answer_request(world, job)
    for n in ("n1", "n2"):
        pool_node(world, n, job.pool)
    archive = LogArchive(tmp_path / "coord")
    assert asyncio.run(archive.take(Fetcher(), job, world.clock)) == 2        # n1's two ranks; n2 is gone
    chunk = archive.chunk(job.id, job.attempt, 1, 0, 0)
    assert chunk.lines[0].startswith("[rankctl: the node of rank 1 has left; its last 999 line(s)")
    assert chunk.lines[-1] == "n1 rank 1 line 1004" and chunk.next_offset == 999
    assert archive.chunk(job.id, job.attempt, 1, 999, 0).lines == []         # read to its end: nothing more
    assert archive.chunk(job.id, job.attempt, 1, 0, 0, records=True).lines[1] == RECORD_MARK + '{"event": "start"}'
    assert archive.chunk(job.id, job.attempt, 0, 0, 3).lines == [f"n1 rank 0 line {i}" for i in (1002, 1003, 1004)]
    assert archive.chunk(job.id, job.attempt, 2, 0, 0) is None                # its node could not be asked
    monkeypatch.setattr(logarchive, "JOB_BYTES", 30_000)
    assert asyncio.run(LogArchive(tmp_path / "small").take(Fetcher(), job, world.clock)) == 1   # past the budget


def test_a_pending_allocation_shows_the_schedulers_reason_in_the_jobs(world: World) -> None:
    """A request the partition cannot hold stays PENDING in Slurm (PartitionNodeLimit): the job read "waiting for the
    workers of its allocation, slurm job (not yet submitted) (REQUESTING)" for minutes (an outside probe)."""
    job = submitted(world, spares=5)
    answer_request(world, job)
    world.clock.t += 10
    (work,) = world.core.allocations.due()
    world.core.allocations.seen(work, Seen("PENDING", (), "PartitionNodeLimit"))
    world.core.turn()
    assert job.state is S.PENDING
    assert "slurm job 77 (PENDING: PartitionNodeLimit): 0 of 2 node(s) ready" in job.reason, job.reason


def test_a_controller_that_cannot_be_reached_is_asked_again_not_taken_for_a_refusal(world: World) -> None:
    """slurmctld down for a moment failed the job for good: "slurm refused its allocation: ... Unable to contact slurm
    controller" (an outside probe). Such words are an unanswered call: the request is made again every WATCH_S."""
    from rankctl.coordinator.batch.calls import WATCH_S
    from rankctl.coordinator.batch.slurm import unreachable

    assert unreachable("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect "
                       "failure)") and unreachable("sbatch: error: Slurm temporarily unable to accept job, sleeping")
    assert not unreachable("sbatch: error: Batch job submission failed: Invalid partition name specified")
    job = submitted(world)
    (work,) = world.core.allocations.due()
    world.core.allocations.failed_call(work, "OSError: sbatch could not reach the Slurm controller: Unable to "
                                             "contact slurm controller (connect failure)")
    world.core.turn()
    assert job.state is S.PENDING
    assert "(REQUESTING: OSError: sbatch could not reach the Slurm controller" in job.reason, job.reason
    assert world.core.allocations.due() == []                        # not again at once
    world.clock.t += WATCH_S
    answer_request(world, job)                                       # asked again, and answered this time
    assert job.state is S.PENDING and job.allocation.id == "77" and job.allocation.detail == ""


def test_spares_bring_one_restart_each_unless_the_file_sets_max_restarts(world: World) -> None:
    """``ctl slurm submit --spares 1`` of a file without ``restart.max_restarts`` ended FAILED with its spare idle
    (issue 43): asking for spares is asking for restarts onto them (``restarts_for_spares``)."""
    from rankctl.contract.spec import restarts_for_spares

    plain, zero = world.core.validate(job_yaml()), world.core.validate(job_yaml() + "restart: {max_restarts: 0}\n")
    assert [restarts_for_spares(plain, n) for n in (0, 1, 3)] == [0, 1, 3]
    assert restarts_for_spares(zero, 2) == 0 and plain.with_spares(2).restart.max_restarts == 2
    job = world.core.submit_spec(plain, allocation=AllocationRequest(spares=1))
    assert job.spec.restart.max_restarts == 1
    answer_request(world, job)
    for n in ("n1", "n2", "n3"):
        pool_node(world, n, job.pool)
    for r in range(job.world_size):
        world.report(job.id, r, "running")
    world.report(job.id, 2, "failed", code=1, error="RuntimeError: bad")   # n2's own error
    for r in range(job.world_size):
        world.report(job.id, r, "exited", code=1)
    assert job.state is S.STARTING and job.attempt == 2, (job.state, job.reason)     # was: FAILED, spare idle
    assert world.core.get(job.id).spec.restart.max_restarts == 1      # stored so: a coordinator restart keeps it
