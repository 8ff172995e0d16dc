"""Fan-outs (coordinator.fanout): a decision's messages to many nodes, timed until gRPC took the last one."""

from __future__ import annotations

from rankctl.coordinator.scheduling.fanout import KEPT, Fanouts
from rankctl.proto import rankctl_pb2 as pb
from test_core import World, world  # noqa: F401 - the fixture
from test_metrics import get, job_yaml, scrape


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_fan_out_ends_when_its_last_message_is_handed_and_only_then() -> None:
    clock = Clock()
    fans = Fanouts(clock, lambda: 5000.0 + clock.t)
    cancel = pb.CoordinatorMessage(cancel=pb.Cancel(job_id="j", attempt=1))
    fan = fans.begin("cancel")
    for _ in range(3):                       # one message object to three nodes
        fans.sent(fan, cancel)
    clock.t += 1.5
    fans.handed(cancel)
    fans.handed(cancel)
    assert "cancel" not in fans.last
    clock.t += 0.5
    fans.handed(cancel)
    done = fans.last["cancel"]
    assert (done.seconds, done.ended_at, done.nodes) == (2.0, 5102.0, 3)
    fans.handed(cancel)                      # after its end: nothing (no longer tracked)
    assert fans.last["cancel"] == done
    other = pb.CoordinatorMessage(cancel=pb.Cancel(job_id="k", attempt=1))
    fans.handed(other)                       # never part of a fan-out
    assert fans.last == {"cancel": done}


def test_fan_outs_that_never_end_are_bounded() -> None:
    fans = Fanouts(Clock(), Clock())
    msgs = [pb.CoordinatorMessage(cancel=pb.Cancel(job_id=str(i))) for i in range(KEPT + 10)]
    for m in msgs:
        fans.sent(fans.begin("assign"), m)   # their streams close before gRPC takes them
    assert len(fans._open) == KEPT and len(fans._by_msg) == KEPT
    fans.handed(msgs[0])                     # the oldest was dropped: no end
    assert "assign" not in fans.last
    fans.handed(msgs[-1])
    assert fans.last["assign"].nodes == 1


def test_a_restart_times_its_cancels_and_the_placement_its_assigns(world: World) -> None:
    for n in ("n0", "n1"):
        world.connect(n)
    job = world.core.submit(job_yaml(restarts=1))
    for n in ("n0", "n1"):                   # the node streams hand what they were sent to gRPC
        for m in world.nodes[n].sent:
            world.core.fanouts.handed(m)
    assert world.core.fanouts.last["assign"].nodes == 2
    world.report(job.id, 3, "failed", code=1, error="boom")
    for n in ("n0", "n1"):
        cancels = [m for m in world.nodes[n].sent if m.WhichOneof("body") == "cancel"]
        assert len(cancels) == 1
        world.core.fanouts.handed(cancels[0])
    assert world.core.fanouts.last["cancel"].nodes == 2
    s = scrape(world)
    took = get(s, "rankctl_coordinator_fanout_seconds", message="cancel")   # (was ">= 0": never false)
    assert 0 < took < 30, took     # the real time from the decision to the last hand-over: some, and bounded
    assert get(s, "rankctl_coordinator_fanout_end_time_seconds", message="assign") > 0
