"""``reconcile(view) -> Plan`` as pure values: no processes, no SQLite, no clock. Node loss, hang, full disk, drain
and failover, and the rule that a node's loss outranks its victims' errors."""

from __future__ import annotations

from rankctl.coordinator.model.faults import Cause, Fault
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.recovery.reconcile import (
    ATTRIBUTION_S, AskCheckpoint, Continue, EndAttempt, Grow, Hold, JobView, MoveOff, Nothing, Running, Succeed,
    reconcile,
)
from rankctl.coordinator.recovery.restart_decision import AttemptFacts, Fail, Requeue, Restart, StopFacts, Wait
from rankctl.coordinator.scheduling.stops import STOP_TIMEOUT_S

S = JobState
RESET = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:29500"


def view(**facts) -> JobView:
    return JobView(**{"state": S.RUNNING, "attempt": 1, "max_restarts": 2, "now": 100.0, **facts})


def lost(node: str) -> Fault:
    return Fault(cause=Cause.NODE_LOST, reason=f"node {node} lost (heartbeat timeout); ranks 2-3 are gone", node=node)


def victim(rank: int, node: str) -> Fault:
    return Fault(cause=Cause.PEER_ERROR, reason=f"rank {rank} on node {node} exited with code 1: {RESET}", node=node,
                 rank=rank, code=1, step=7, detail=RESET)


def own(rank: int, node: str, step: int = 7, line: str = "ValueError: boom") -> Fault:
    return Fault(cause=Cause.RANK_EXIT, reason=f"rank {rank} on node {node} exited with code 1: {line}", node=node,
                 rank=rank, code=1, step=step, detail=line)


def hang(step: int) -> Fault:
    return Fault(cause=Cause.HANG, reason=f"hang: no rank advanced for 6 s; every rank at step {step}", step=step)


def test_the_node_loss_outranks_the_victims_errors() -> None:
    plan = reconcile(view(lost=(lost("n1"),), failed=victim(0, "n0"), failed_since=99.9))
    assert isinstance(plan, EndAttempt) and plan.fault.cause is Cause.NODE_LOST and plan.fault.node == "n1"
    assert isinstance(plan.decision, Restart) and plan.decision.reason.startswith("node n1 lost")
    assert plan.fault.blames_node and not victim(0, "n0").blames_node   # the survivor is never blamed


def test_a_victims_error_waits_for_its_cause_then_ends_the_attempt_alone() -> None:
    assert isinstance(reconcile(view(failed=victim(0, "n0"), failed_since=99.5)), Hold)
    plan = reconcile(view(failed=victim(0, "n0"), failed_since=100.0 - ATTRIBUTION_S))
    assert isinstance(plan, EndAttempt) and plan.fault.cause is Cause.PEER_ERROR
    # a rank's own error does not wait; a held loss (its allocation decides) holds every victim with it
    assert isinstance(reconcile(view(failed=own(3, "n1"), failed_since=100.0)), EndAttempt)
    assert isinstance(reconcile(view(failed=own(3, "n1"), failed_since=0.0, loss_held=True)), Hold)


def test_a_hang_restarts_and_the_same_hang_at_the_same_step_ends_the_job() -> None:
    first = reconcile(view(hang=hang(14)))
    assert isinstance(first, EndAttempt) and isinstance(first.decision, Restart)
    again = reconcile(view(attempt=2, hang=hang(14), previous=hang(14), attempts=[AttemptFacts(1, hang(14).reason)]))
    assert isinstance(again.decision, Fail) and "failed the same way as attempt 1, at step 14" in again.decision.reason
    later = reconcile(view(attempt=2, hang=hang(20), previous=hang(14), attempts=[AttemptFacts(1, hang(14).reason)]))
    assert isinstance(later.decision, Restart)
    # a rank's failure outranks a hang judged at the same moment
    both = reconcile(view(hang=hang(14), failed=own(1, "n0")))
    assert both.fault.cause is Cause.RANK_EXIT


def test_a_full_disk_moves_off_its_node_and_never_counts_as_the_same_failure() -> None:
    line = "OSError: [Errno 28] No space left on device: '/data/ckpt/step-00010/rank-00001.pt'"
    full = Fault(cause=Cause.DISK_FULL, reason=f"rank 1 on node n0 exited with code 1: {line}", node="n0", rank=1,
                 code=1, step=10, detail=line)
    plan = reconcile(view(attempt=2, failed=full, previous=full, attempts=[AttemptFacts(1, full.reason)]))
    assert isinstance(plan, EndAttempt) and isinstance(plan.decision, Restart)   # restarts kept: not "the same way"
    assert plan.fault.moves_off_node and plan.fault.blames_node


def test_a_drained_job_moves_without_a_failure_even_when_its_node_is_then_lost() -> None:
    assert reconcile(view(drain_due=(("n0",), "every rank passed step 12"))) == \
        MoveOff(("n0",), "every rank passed step 12")
    gone = reconcile(view(draining_lost=(("n0",), "then lost (stream closed)"), lost=(lost("n0"),)))
    assert gone == MoveOff(("n0",), "then lost (stream closed)")
    # a failure that came first is the attempt's end, not the drain
    assert isinstance(reconcile(view(failed=own(0, "n1"), drain_due=(("n0",), "x"))), EndAttempt)


def test_after_a_failover_the_stored_fault_still_says_the_same_way() -> None:
    """A new leader reads the previous attempt's fault from the store (``attempts.fault_json``): the memory of
    the old leader is gone, the decision is the same."""
    stored = own(0, "n1", step=3, line="_pickle.UnpicklingError: invalid load key, 'x'.").to_json()
    previous = Fault.from_json(stored)
    plan = reconcile(view(attempt=2, failed=own(0, "n2", step=3, line="_pickle.UnpicklingError: invalid load key, "
                                                                       "'x'."),
                          previous=previous, attempts=[AttemptFacts(1, previous.reason)]))
    assert isinstance(plan.decision, Fail) and "failed the same way as attempt 1, at step 3" in plan.decision.reason
    no_memory = reconcile(view(attempt=2, failed=own(0, "n2", step=3), attempts=[AttemptFacts(1, "x")]))
    assert isinstance(no_memory.decision, Restart)


def test_no_restart_left_fails_the_job_with_every_attempts_reason() -> None:
    plan = reconcile(view(attempt=3, max_restarts=2, lost=(lost("n1"),),
                          attempts=[AttemptFacts(1, "rank 0 exited"), AttemptFacts(2, "node n0 lost")]))
    assert isinstance(plan.decision, Fail) and "no restart is left (max_restarts=2)" in plan.decision.reason
    assert "attempt 1: rank 0 exited; attempt 2: node n0 lost" in plan.decision.reason
    drained = reconcile(view(attempt=3, max_restarts=2, lost=(lost("n1"),),
                             attempts=[AttemptFacts(1, "n0 drained", "drain"), AttemptFacts(2, "x")]))
    assert isinstance(drained.decision, Restart)   # a drained attempt used no restart


def test_a_restarting_jobs_stop_waits_requeues_or_gives_up() -> None:
    restarting = {"state": S.RESTARTING, "attempt": 2}
    assert reconcile(view(**restarting, stop=StopFacts(99.0, 3))) == Continue(Wait(3))
    assert reconcile(view(**restarting, stop=StopFacts(99.0, 0))) == Continue(Requeue())
    overdue = reconcile(view(**restarting, stop=StopFacts(100.0 - STOP_TIMEOUT_S - 1, 2)))
    assert isinstance(overdue.decision, Fail) and overdue.decision.abandon


def test_running_succeeded_or_nothing() -> None:
    assert reconcile(view(state=S.STARTING, all_running=True)) == Running()
    assert reconcile(view(all_running=True, all_succeeded=True)) == Succeed()
    assert reconcile(view(all_running=True)) == Nothing()


def test_a_shrunk_elastic_job_grows_back_after_its_checkpoint_and_a_failure_outranks_growth() -> None:
    """Growth is a plan too: a full size that fits asks for a checkpoint (or restarts at once when the kind saves
    none on request), a complete one restarts at the full size; a failure, a hang, a drain or the job's success
    come first."""
    assert reconcile(view(grow_fits=True, saves_on_request=True)) == AskCheckpoint()
    assert reconcile(view(grow_fits=True)) == Grow("")
    assert reconcile(view(grow_due="every rank passed step 12")) == Grow("every rank passed step 12")
    assert isinstance(reconcile(view(grow_fits=True, failed=own(0, "n0"))), EndAttempt)
    assert isinstance(reconcile(view(grow_due="x", hang=hang(4))), EndAttempt)
    assert reconcile(view(grow_due="x", drain_due=(("n1",), "saved"))) == MoveOff(("n1",), "saved")
    assert reconcile(view(grow_fits=True, all_succeeded=True)) == Succeed()
    assert reconcile(view(state=S.STARTING, grow_fits=True, all_running=True)) == Running()
