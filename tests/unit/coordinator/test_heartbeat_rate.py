"""A fleet's heartbeats a second stay bounded: a bigger fleet is asked to beat less often, and judged on that pace.

Pure: the core in process (``test_core.World``), a fake clock, no gRPC. The transport's keepalive that still finds a
stopped daemon within the heartbeat timeout is checked end to end in ``test_e2e_keepalive.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rankctl.coordinator.jobs.core import Coordinator
from rankctl.coordinator.fleet.nodes import NodeStatus
from rankctl.coordinator.fleet.sessions import beat_interval
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.store.database import Store
from test_core import Clock, World, job_yaml


@pytest.mark.parametrize("nodes, want", [(1, 2.0), (2000, 2.0), (2001, 4.0), (4000, 4.0), (8192, 16.0),
                                         (65536, 128.0)])
def test_the_interval_doubles_until_the_fleet_fits_the_rate(nodes: int, want: float) -> None:
    assert beat_interval(2.0, 2.0, nodes, 1000.0) == want
    assert nodes / want <= 1000.0


def test_a_fleet_hovering_at_a_step_is_not_retuned_back_and_forth() -> None:
    assert beat_interval(4.0, 2.0, 2000, 1000.0) == 4.0    # shrank back to the step: stays
    assert beat_interval(4.0, 2.0, 1501, 1000.0) == 4.0
    assert beat_interval(4.0, 2.0, 1500, 1000.0) == 2.0    # at half the interval it sends 3/4 of the rate: back
    assert beat_interval(16.0, 2.0, 10, 1000.0) == 2.0     # never below the base
    assert beat_interval(2.0, 0.5, 3, 1.0) == 4.0          # a base under 2 s (a short heartbeat timeout) doubles too


@pytest.mark.parametrize("rate", [0.0, -5.0, float("nan")])
def test_a_rate_that_is_not_positive_is_refused_naming_it(tmp_path: Path, rate: float) -> None:
    store = Store(tmp_path)
    try:
        with pytest.raises(ValueError, match=r"max_heartbeat_rate=.*must be more than 0"):
            Coordinator(store, clock=Clock(), heartbeat_timeout=10.0, max_heartbeat_rate=rate)
    finally:
        store.close()


def make_world(path: Path, rate: float) -> World:
    clock, store = Clock(), Store(path)
    return World(Coordinator(store, clock=clock, heartbeat_timeout=10.0, max_heartbeat_rate=rate), clock, store)


def intervals(node) -> list[float]:  # noqa: ANN001 - test_core.FakeNode
    """The intervals the node was asked for: its Registered's, then every retuning Ack's."""
    return ([r.heartbeat_interval for r in node.bodies("registered")]
            + [a.heartbeat_interval for a in node.bodies("ack") if a.heartbeat_interval > 0])


def test_a_growing_fleet_is_retuned_at_its_next_heartbeat_and_judged_on_its_pace(tmp_path: Path) -> None:
    world = make_world(tmp_path, rate=1.0)   # one heartbeat a second from all nodes together
    n0 = world.connect("n0", slots=4)
    assert intervals(n0) == [2.0]            # one node beating every 2 s fits
    n1, n2 = world.connect("n1", slots=4), world.connect("n2", slots=4)
    world.core.tick()                        # three nodes: 1.5 a second at 2 s, 0.75 at 4 s
    assert world.core.heartbeat_interval == 4.0
    n3 = world.connect("n3", slots=4)
    assert intervals(n3) == [4.0]            # a node registering now is told at once
    world.core.heartbeat(n0.session, [29500])
    assert intervals(n0) == [2.0, 4.0]       # one told before, at its next heartbeat
    assert [a.last_seq for a in n0.bodies("ack")] == [0]   # the retuning Ack acknowledges no report
    world.core.heartbeat(n0.session, [29500])
    assert intervals(n0) == [2.0, 4.0]       # told once
    job = world.core.submit(job_yaml(nodes=4, slots=4))
    world.clock.t += 12                      # past the 10 s timeout, within 4 x 4 s
    for n in (n0, n1, n2):
        world.core.heartbeat(n.session, [29500])
    world.core.tick()
    assert n3.session.status is NodeStatus.READY and job.state is JobState.STARTING
    world.clock.t += 5                       # n3 silent for 17 s > 16 s
    for n in (n0, n1, n2):
        world.core.heartbeat(n.session, [29500])
    world.core.tick()
    assert n3.session.status is NodeStatus.LOST
    assert job.reason == "node n3 lost (no heartbeat for 16.0 s); ranks 12-15 are gone"
    world.store.close()


def test_a_shrunk_fleet_beats_faster_again_and_a_node_told_the_slow_pace_keeps_it_until_told(tmp_path: Path) -> None:
    world = make_world(tmp_path, rate=1.0)
    nodes = [world.connect(f"n{i}", slots=2) for i in range(6)]
    world.core.tick()
    assert world.core.heartbeat_interval == 8.0   # 6 nodes: 0.75 a second at 8 s
    for n in nodes:
        world.core.heartbeat(n.session, [29500])
    for n in nodes[1:]:
        world.core.disconnect(n.session)          # LOST: they no longer count
    world.core.tick()
    assert world.core.heartbeat_interval == 2.0
    world.clock.t += 20                           # n0 was told 8 s: lost only after 32 s of silence
    world.core.tick()
    assert nodes[0].session.status is NodeStatus.READY
    world.core.heartbeat(nodes[0].session, [29500])
    assert intervals(nodes[0])[-1] == 2.0         # now it is told the faster pace; until its next beat (its daemon
    world.clock.t += 11                           # still sleeps the 8 s) it is judged on 8 s + the timeout
    world.core.tick()
    assert nodes[0].session.status is NodeStatus.READY
    world.clock.t += 8
    world.core.tick()
    assert nodes[0].session.status is NodeStatus.LOST and "no heartbeat for 18.0 s" in nodes[0].session.detail
    world.store.close()


def test_a_node_told_a_much_shorter_interval_is_judged_on_the_old_one_until_it_beats_again(tmp_path: Path) -> None:
    world = make_world(tmp_path, rate=1.0)
    nodes = [world.connect(f"n{i}", slots=2) for i in range(20)]
    world.core.tick()
    assert world.core.heartbeat_interval == 32.0
    world.core.heartbeat(nodes[0].session, [29500])
    for n in nodes[1:]:
        world.core.disconnect(n.session)
    world.core.tick()
    assert world.core.heartbeat_interval == 2.0
    world.core.heartbeat(nodes[0].session, [29500])   # told 2 s now, but its daemon sleeps the 32 s it was told
    assert intervals(nodes[0])[-1] == 2.0
    world.clock.t += 35
    world.core.tick()
    assert nodes[0].session.status is NodeStatus.READY   # within 32 s + the 10 s timeout
    world.clock.t += 8
    world.core.tick()
    assert nodes[0].session.status is NodeStatus.LOST
    world.store.close()
