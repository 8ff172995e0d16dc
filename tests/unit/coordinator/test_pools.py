"""Worker pools (``ctl slurm workers``) without a scheduler or a network: the core's rules (``coordinator.batch.pools``)
driven with fake nodes and the answers an ``Allocator`` would bring back. The real Slurm path is
``tests/e2e/test_e2e_slurm.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_allocations import pool_node
from test_core import World, job_yaml, world  # noqa: F401 - world: the fixture
from test_drain import exit_node, tick

from rankctl.coordinator.model.allocation import AllocationRequest, Seen
from rankctl.coordinator.batch.calls import RELEASE_GRACE_S, WATCH_S
from rankctl.coordinator.jobs.core import Coordinator
from rankctl.coordinator.model.errors import InvalidRequest, PoolNotFound
from rankctl.coordinator.batch.pools import ACTIVE, ENDED, RELEASING, pool_to_pb
from rankctl.coordinator.batch.slurm import batch_script
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.store.database import Store

S = JobState


def granted(world: World, nodes: int = 2, slots: int = 2, slurm_id: str = "91"):  # noqa: ANN201 - a PoolRecord
    pool = world.core.pools.start(AllocationRequest(partition="cpu"), nodes, slots, requested_by="ops")
    (work,) = world.core.pools.due()
    assert work.action == "request" and work.ask.general and work.ask.nodes == nodes and work.ask.slots == slots
    world.core.pools.requested(work, slurm_id, "/out/p.out")
    for i in range(nodes):
        pool_node(world, f"s{i + 1}", pool.id, slots)
    return pool


def test_a_plain_job_runs_on_a_pools_workers_and_the_pool_survives_a_restart(world: World, tmp_path: Path) -> None:
    pool = granted(world)
    assert pool.state == ACTIVE and pool.allocation.id == "91" and pool.id.startswith("workers-")
    assert world.nodes["s1"].bodies("release") == []                 # owned: not told to exit
    job = world.core.submit(job_yaml("plain", nodes=2))               # no allocation: the general queue
    assert job.state is S.STARTING and sorted(job.nodes) == ["s1", "s2"]
    world.store.close()
    again = Coordinator(Store(tmp_path), clock=world.clock)
    (loaded,) = again.pools.listing()
    assert (loaded.id, loaded.state, loaded.allocation.id, loaded.requested_by) == (pool.id, ACTIVE, "91", "ops")
    assert pool_to_pb(loaded).allocation.request.partition == "cpu"
    again.store.close()
    world.store = Store(tmp_path)   # the fixture closes it


def test_release_drains_first_then_lets_the_workers_go_then_ends_with_the_slurm_job(world: World) -> None:
    pool = granted(world)
    job = world.core.submit(job_yaml("plain", nodes=2))
    for r in range(job.world_size):
        world.report(job.id, r, "running")
    released = world.core.pools.release(pool.id, "maintenance")
    assert released.state == RELEASING and "maintenance" in released.reason
    assert sorted(world.core.nodes.draining) == ["s1", "s2"]         # drained: jobs move off them
    assert job.state is S.RESTARTING, job.reason
    (watch,) = world.core.pools.due()                                 # watched: still RUNNING
    world.core.pools.seen(watch, Seen("RUNNING", ("s1", "s2")))
    assert world.nodes["s1"].bodies("release") == []                 # its ranks still hold slots there
    for name in ("s1", "s2"):
        exit_node(world, job, name)
    assert job.state is S.PENDING                                      # nowhere to go: it waits for nodes
    world.core.pools.due()
    assert [m.reason for m in world.nodes["s1"].bodies("release")] == [f"worker pool {pool.id} is released"]
    assert pool.allocation.released and pool.state == RELEASING
    world.clock.t += RELEASE_GRACE_S
    works = {w.action: w for w in world.core.pools.due()}
    assert set(works) == {"release"}                                   # still there after the grace: scancel
    world.core.pools.released(works["release"])
    world.clock.t += WATCH_S
    (watch,) = world.core.pools.due()
    assert watch.action == "watch"
    world.core.pools.seen(watch, Seen("CANCELLED", ("s1", "s2")))
    world.core.pools.due()
    assert pool.state == ENDED and "maintenance" in pool.reason and "slurm job 91 (CANCELLED)" in pool.reason
    assert world.core.nodes.draining == {}                             # a later pool may reuse the node names
    assert world.core.pools.general(pool.id) is False


def test_the_allocation_ending_first_ends_the_pool_and_its_jobs_restart_elsewhere(world: World) -> None:
    pool = granted(world, nodes=1)
    world.clock.t += WATCH_S
    (watch,) = world.core.pools.due()
    world.core.pools.seen(watch, Seen("TIMEOUT", ("s1",)))
    world.core.pools.due()
    assert pool.state == ENDED and "slurm job 91 (TIMEOUT)" in pool.reason
    late = pool_node(world, "s9", pool.id)                             # a worker of the ended pool is sent away
    assert late.bodies("release")


def test_bad_requests_name_the_field_and_store_nothing(world: World) -> None:
    with pytest.raises(InvalidRequest) as err:
        world.core.pools.start(AllocationRequest(partition="a\nb"), 0, 2)
    assert "--nodes (got 0)" in str(err.value) and "--partition" in str(err.value)
    world.core.pools.tls = True
    with pytest.raises(InvalidRequest) as err:
        world.core.pools.start(AllocationRequest(), 2, 2)
    assert "--worker-tls-dir (got none)" in str(err.value)
    world.core.allocations.tls = True
    with pytest.raises(InvalidRequest) as err:
        world.core.submit_spec(world.core.validate(job_yaml()), allocation=AllocationRequest())
    assert "--worker-tls-dir" in str(err.value)
    assert world.core.pools.listing() == [] and world.core.list() == [] and world.store.load_pools() == []
    with pytest.raises(PoolNotFound):
        world.core.pools.release("workers-000000")


def test_a_pools_batch_script_joins_the_general_queue_with_each_nodes_identity(world: World) -> None:
    world.core.pools.address, world.core.pools.tls = "login1.cluster:7420", True
    world.core.pools.start(AllocationRequest(worker_tls_dir="/shared/rankctl/{node}"), 3, 8)
    (work,) = world.core.pools.due()
    script = batch_script(work.ask, "/out/p.out")
    assert "#SBATCH --nodes=3" in script and "general queue" in script and f"--pool {work.ask.job_id}" in script
    assert '--tls-dir "/shared/rankctl/${SLURMD_NODENAME}"' in script and "--insecure" not in script
    assert "--coordinator login1.cluster:7420" in script and "--slots 8" in script


def test_a_node_joining_a_releasing_pool_is_drained_too(world: World) -> None:
    pool = granted(world, nodes=1)
    world.core.pools.release(pool.id)
    pool_node(world, "s7", pool.id)
    assert "s7" in world.core.nodes.draining and "s7" in pool.drained
    tick(world)
