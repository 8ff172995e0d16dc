"""The pure restart decision (coordinator.restart_decision): facts in, a frozen result out; no store,
clock or network."""

from __future__ import annotations

import dataclasses

import pytest

from rankctl.coordinator.recovery.restart_decision import (
    REASONS_SHOWN, AttemptFacts, Fail, JobFacts, Requeue, Restart, StopFacts, Wait, decide,
)
from rankctl.coordinator.scheduling.stops import STOP_TIMEOUT_S


def running(attempt: int, max_restarts: int) -> JobFacts:
    return JobFacts(attempt=attempt, restarting=False, max_restarts=max_restarts)


def test_a_failure_with_restarts_left_restarts_with_its_reason() -> None:
    assert decide(running(1, 2), [], None, 0.0, "rank 3 exited with code 1") == \
        Restart("attempt 1 failed: rank 3 exited with code 1", "rank 3 exited with code 1")


def test_without_restarts_a_failure_fails_with_its_own_reason_only() -> None:
    assert decide(running(1, 0), [], None, 0.0, "boom") == Fail("boom")


def test_the_last_restart_used_fails_the_job_with_every_earlier_attempts_reason() -> None:
    attempts = [AttemptFacts(1, "node n0 lost"), AttemptFacts(2, "x" * (REASONS_SHOWN + 50)), AttemptFacts(3, "", "")]
    decision = decide(running(3, 2), attempts, None, 0.0, "rank 0 exited with code 2")
    assert isinstance(decision, Fail) and not decision.abandon
    assert decision.reason == ("attempt 3 failed and no restart is left (max_restarts=2): rank 0 exited with code 2; "
                               f"earlier: attempt 1: node n0 lost; attempt 2: {'x' * REASONS_SHOWN}")


def test_drained_attempts_use_no_restart() -> None:
    attempts = [AttemptFacts(1, "node n1 drained", "drain"), AttemptFacts(2, "node n2 drained", "drain")]
    assert isinstance(decide(running(3, 1), attempts, None, 0.0, "boom"), Restart)   # 2 drains, no failure yet
    attempts.append(AttemptFacts(3, "boom", "failure"))
    assert isinstance(decide(running(4, 1), attempts, None, 0.0, "again"), Fail)     # the one restart is used


def test_only_attempts_before_the_current_one_count() -> None:
    current = [AttemptFacts(2, "", "drain")]    # the running attempt's own row says nothing yet
    assert isinstance(decide(running(2, 0), current, None, 0.0, "boom"), Fail)


@pytest.mark.parametrize("left,waited,expected", [
    (0, 5.0, Requeue()),
    (0, STOP_TIMEOUT_S + 1, Requeue()),          # gone, however late
    (3, 5.0, Wait(3)),
    (3, STOP_TIMEOUT_S, Wait(3)),                # the timeout itself still waits
])
def test_a_restarting_job_is_queued_again_once_its_ranks_are_gone(left: int, waited: float, expected) -> None:
    job = JobFacts(attempt=2, restarting=True, max_restarts=1)
    assert decide(job, [], StopFacts(since=100.0, left=left), 100.0 + waited, "ignored while stopping") == expected


def test_a_stop_that_never_completes_fails_the_job_and_gives_up_its_ranks() -> None:
    job = JobFacts(attempt=2, restarting=True, max_restarts=5)
    decision = decide(job, [], StopFacts(since=0.0, left=4), STOP_TIMEOUT_S + 0.5)
    assert decision == Fail(f"attempt 2 did not stop: 4 rank(s) on connected nodes never reported their exit "
                            f"within {STOP_TIMEOUT_S:g} s", abandon=True)


def test_a_restarting_job_without_a_stop_has_nothing_to_wait_for() -> None:
    assert decide(JobFacts(attempt=1, restarting=True, max_restarts=1), [], None, 0.0) == Requeue()


def test_results_are_frozen_values() -> None:
    for result in (Restart("h", "r"), Requeue(), Wait(1), Fail("r")):
        assert dataclasses.is_dataclass(result) and result == dataclasses.replace(result)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(result, "x", 1)


def test_an_attempt_that_fails_the_same_way_at_the_same_step_ends_the_job() -> None:
    from rankctl.coordinator.model.faults import Cause, Fault, same_way
    from rankctl.coordinator.recovery.restart_decision import Failure

    line = "_pickle.UnpicklingError: invalid load key, 'x'."

    def exit_(node: str, step: int | None, code: int = 1, rank: int = 0, cause: Cause = Cause.RANK_EXIT) -> Fault:
        return Fault(cause=cause, reason=f"rank {rank} on node {node} exited with code {code}: {line}", node=node,
                     rank=rank, code=code, step=step, detail=line)

    def hang(step: int, why: str) -> Fault:
        return Fault(cause=Cause.HANG, reason=f"hang: no rank advanced for {why}", step=step)

    boom, again = exit_("n1", 0), exit_("n2", 0)          # the same error after a restart on a spare
    assert same_way(boom, again)
    assert not same_way(boom, exit_("n2", 40))            # another step
    assert not same_way(exit_("n1", None), exit_("n2", None))   # no step known: never
    assert not same_way(exit_("n1", 3), exit_("n1", 3, code=2))
    assert not same_way(exit_("n1", 3), exit_("n1", 3, rank=1))
    assert not same_way(exit_("n1", 3), exit_("n1", 3, cause=Cause.PEER_ERROR))
    lost = Fault(cause=Cause.NODE_LOST, reason="node n1 lost (heartbeat timeout)", node="n1", step=3)
    assert not same_way(lost, lost)                       # a lost node is no failure that repeats
    assert same_way(hang(12, "7 s (...)"), hang(12, "9 s (x)"))
    assert not same_way(hang(12, "7 s"), exit_("n1", 12))
    assert Fault.from_json(boom.to_json()) == boom        # stored with its attempt: it survives a failover
    assert Fault.from_json("") is None and Fault.from_json('{"cause": "from-a-newer-rankctl"}') is None

    first = decide(running(1, 3), [], None, 0.0, Failure(boom))
    assert isinstance(first, Restart)
    second = decide(running(2, 3), [AttemptFacts(1, boom.reason)], None, 0.0, Failure(again, boom))
    assert isinstance(second, Fail) and second.reason.startswith(
        "attempt 2 failed the same way as attempt 1, at step 0; not restarting it again: rank 0 on node n2"), second
    other_step = decide(running(2, 3), [AttemptFacts(1, boom.reason)], None, 0.0, Failure(exit_("n2", 7), boom))
    assert isinstance(other_step, Restart)
