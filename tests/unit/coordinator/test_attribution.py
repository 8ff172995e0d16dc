"""Which rank an attempt's failure names (``coordinator.recovery.reconciler``): a rank SIGKILLed mid-step makes its peers fail
too, with errors that only say a peer went away; their reports may reach the coordinator first (another node, a
loaded machine). The reason, and the node blamed, must be the killed rank's."""

from __future__ import annotations

from test_core import World, job_yaml, world  # noqa: F401 - world: the fixture
from test_drain import tick

from rankctl.coordinator.recovery.reconcile import ATTRIBUTION_S
from rankctl.coordinator.diagnosis.progress import FAILED_ITSELF, PEER_FAILED, SIGNALLED, failure_weight
from rankctl.coordinator.model.records import RankRecord
from rankctl.coordinator.model.states import JobState

S = JobState
GLOO = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
        "[127.0.0.1]:41211: Connection reset by peer")


def running(world: World):  # noqa: ANN201 - a JobRecord
    for name in ("n0", "n1"):
        world.connect(name, 2)
    job = world.core.submit(job_yaml("victim", nodes=2, slots=2) + "restart: {max_restarts: 1}\n")
    for r in range(job.world_size):
        world.report(job.id, r, "running")
    assert job.state is S.RUNNING
    return job


def test_a_peer_failure_reported_first_waits_for_the_killed_rank_and_the_reason_names_it(world: World) -> None:
    job = running(world)
    world.report(job.id, 2, "failed", code=1, error=GLOO)        # rank 2 on n1: its collective broke
    assert job.state is S.RUNNING                                  # held: its cause may come next
    world.report(job.id, 0, "exited", code=-9)                    # rank 0 on n0, SIGKILLed
    assert job.state is S.RESTARTING, job.reason
    assert job.reason.startswith("attempt 1 failed: rank 0 on node n0 exited with code -9"), job.reason


def test_a_peer_failure_alone_fails_the_attempt_after_the_wait(world: World) -> None:
    job = running(world)
    world.report(job.id, 3, "failed", code=1, error=GLOO)
    tick(world, ATTRIBUTION_S / 2)
    assert job.state is S.RUNNING
    tick(world, ATTRIBUTION_S / 2)
    assert job.state is S.RESTARTING and "rank 3 on node n1 exited with code 1" in job.reason, job.reason


def test_a_rank_that_fails_with_its_own_error_fails_the_attempt_at_once(world: World) -> None:
    job = running(world)
    world.report(job.id, 3, "failed", code=1, error="ValueError: boom")
    assert job.state is S.RESTARTING and "rank 3 on node n1 exited with code 1: ValueError: boom" in job.reason


def test_the_weights() -> None:
    def rec(code: int, error: str = "") -> RankRecord:
        return RankRecord(0, "n0", "failed", exited=True, exit_code=code, error=error)

    assert failure_weight(rec(-9)) == SIGNALLED
    assert failure_weight(rec(1, "Traceback ...\nValueError: boom")) == FAILED_ITSELF
    assert failure_weight(rec(1, GLOO)) == PEER_FAILED
    assert failure_weight(rec(1, "torch.distributed.DistNetworkError: Connection closed by peer")) == PEER_FAILED
