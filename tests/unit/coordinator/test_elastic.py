"""Elastic jobs (``resources.min_nodes``) in the coordinator core, without processes: an attempt on fewer nodes
when a node is lost and no spare is free, its Assigns for the smaller world, growth back to the full size when
nodes are free again (a planned restart that uses no restart), and the submit-time refusal of a layout that
cannot shrink."""

from __future__ import annotations

import json

import pytest

from rankctl.contract.jobfile import SpecError
from rankctl.coordinator.api import convert
from rankctl.coordinator.model.states import JobState
from test_core import World, world  # noqa: F401 - the fixture

S = JobState


def elastic(nodes: int = 3, min_nodes: int = 2, tp: int = 2, restarts: int = 2) -> str:
    return (f"name: el\nkind: comm-check\nresources: {{nodes: {nodes}, slots_per_node: 2, min_nodes: {min_nodes}}}\n"
            f"parallel: {{tp: {tp}}}\nrestart: {{max_restarts: {restarts}}}\n")


def assigned(world: World, job) -> dict[str, tuple[int, int]]:
    """node -> (world size, spec nodes) of the job's newest Assign there."""
    out = {}
    for name, node in world.nodes.items():
        mine = [a for a in node.bodies("assign") if a.job_id == job.id and a.attempt == job.attempt]
        if mine:
            out[name] = (mine[-1].world_size, json.loads(mine[-1].spec_json)["resources"]["nodes"])
    return out


def run(world: World, job) -> None:
    for r in range(job.world_size):
        world.report(job.id, r, "running")


def stop(world: World, job) -> None:
    """The stopping attempt's ranks on live nodes exit (the next attempt may be placed before the last does)."""
    attempt, nodes, ranks = job.attempt, list(job.nodes), job.world_size
    for r in range(ranks):
        if job.attempt == attempt and world.nodes[nodes[r // 2]].session.status.name == "READY":
            world.report(job.id, r, "exited", code=-15)


def test_a_lost_node_without_a_spare_runs_on_fewer_nodes_then_grows_back(world: World) -> None:
    for n in ("n0", "n1", "n2"):
        world.connect(n)
    job = world.core.submit(elastic())
    assert job.world_size == 6 and sorted(assigned(world, job).values()) == [(6, 3)] * 3
    run(world, job)
    world.core.disconnect(world.nodes["n2"].session)          # lost; no spare
    stop(world, job)
    assert job.attempt == 2 and job.state is S.STARTING, job.reason
    assert job.nodes == ["n0", "n1"] and job.world_size == 4
    assert assigned(world, job) == {"n0": (4, 2), "n1": (4, 2)}   # the smaller world: tp2 dp2
    run(world, job)
    assert job.state is S.RUNNING
    world.core.tick()
    assert job.attempt == 2                                  # nothing free: it stays small
    world.connect("n2")                                      # the node is back
    world.core.tick()
    assert job.state is S.RESTARTING and "grow back to 3 nodes" in job.reason, job.reason
    stop(world, job)
    assert job.attempt == 3 and job.world_size == 6 and job.nodes[:2] == ["n0", "n1"], (job.nodes, job.reason)
    assert sorted(assigned(world, job).values()) == [(6, 3)] * 3
    restarts = [a["cause"] for a in world.store.attempts.listed(job.id)]
    assert restarts == ["failure", "grow", ""], restarts       # growing used no restart
    shown = convert.attempts_to_pb(world.core.attempts(job.id), job)   # what ctl status shows of each attempt
    assert [(a.nodes, a.world_size, a.layout) for a in shown] == [(3, 6, "tp2 dp3"), (2, 4, "tp2 dp2"),
                                                                  (3, 6, "tp2 dp3")]


def test_an_elastic_job_starts_on_the_nodes_there_are_and_is_refused_below_min_nodes(world: World) -> None:
    from rankctl.coordinator.model.errors import CapacityError

    world.connect("n0")
    with pytest.raises(CapacityError):
        world.core.submit(elastic())                         # 1 node < min_nodes 2
    world.connect("n1")
    job = world.core.submit(elastic())
    assert job.state is S.STARTING and job.world_size == 4 and job.nodes == ["n0", "n1"]


def test_a_layout_that_cannot_shrink_is_refused_naming_the_world_size(world: World) -> None:
    for n in ("n0", "n1", "n2"):
        world.connect(n)
    with pytest.raises(SpecError, match=r"resources.min_nodes=2: on 2 node\(s\) \(4 ranks\) the job cannot run: "
                                        r"parallel: .*pp"):
        world.core.submit(elastic(tp=1).replace("parallel: {tp: 1}", "parallel: {tp: 1, pp: 3}"))
    with pytest.raises(SpecError, match="min_nodes=4 exceeds nodes=3"):
        world.core.submit(elastic(min_nodes=4))
    assert world.core.list() == []
