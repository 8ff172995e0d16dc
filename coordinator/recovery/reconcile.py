"""What should happen to one active job now, from its level state, as a value: ``reconcile(view) -> Plan``.

Pure: a ``JobView`` holds plain values (the job's state and attempt, its restart budget and stored attempts, the
typed faults at hand: its nodes' losses, its likeliest failed rank, a hang; a drain whose checkpoint is complete;
the stop of an ended attempt; the time), and the ``Plan`` says what follows: nothing, hold, end the attempt with
one fault (and what the restart decision says of it), move off drained nodes, grow back to the full size (after a
checkpoint where the kind saves one on request), requeue, fail, running, succeeded. ``coordinator.recovery.reconciler``
builds the view once per turn for each job marked dirty (``coordinator.jobs.dirty``) and carries the plan out with
``coordinator.recovery.restarts`` ("persist, then send"); nothing here reads a store, a clock or the network.

The order is the blame rule: a node's loss outranks every error its victims report (their broken collectives),
a rank's own failure outranks a peer error (which waits ``ATTRIBUTION_S`` for its cause), a hang comes after both,
and a drained node's move is no failure at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rankctl.coordinator.model.faults import Cause, Fault
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.recovery.restart_decision import (
    AttemptFacts, Decision, Failure, JobFacts, StopFacts, decide,
)

S = JobState
ATTRIBUTION_S = 1.0   # how long a failure whose error names a peer's (a broken collective) waits for its cause


@dataclass(frozen=True, kw_only=True)
class JobView:
    """One job's level state, as values."""

    state: JobState
    attempt: int
    max_restarts: int
    attempts: Sequence[AttemptFacts] = ()   # the stored attempts (reason and cause of each ended one)
    previous: Fault | None = None           # the fault the attempt before this one failed with, as stored
    lost: Sequence[Fault] = ()              # losses of the attempt's nodes that are not held (node-lost faults)
    draining_lost: tuple[tuple[str, ...], str] | None = None   # (lost nodes being drained, why): a move, no failure
    loss_held: bool = False                 # a lost node's failure waits for its allocation's word
    failed: Fault | None = None             # the likeliest cause among the attempt's failed ranks
    failed_since: float | None = None       # when that failure was first seen
    hang: Fault | None = None               # the attempt is hung (judged on its pace)
    drain_due: tuple[tuple[str, ...], str] | None = None   # (drained nodes, why now): the checkpoint is complete
    grow_due: str | None = None             # why a shrunk elastic job restarts at its full size now (its checkpoint)
    grow_fits: bool = False                 # a shrunk elastic job's full size fits on the nodes now
    saves_on_request: bool = False          # the job's kind saves a checkpoint at a step asked for (drains wait)
    stop: StopFacts | None = None           # a RESTARTING job's stop
    all_running: bool = False
    all_succeeded: bool = False
    now: float = 0.0


@dataclass(frozen=True)
class Nothing:
    """Nothing to do now."""


@dataclass(frozen=True)
class Hold:
    """A failure waits for its cause (a peer error for its killer's report, a victim for a held loss)."""

    why: str


@dataclass(frozen=True)
class EndAttempt:
    """The attempt failed with ``fault``; ``decision`` (restart, or fail) is the restart decision's word on it."""

    fault: Fault
    decision: Decision


@dataclass(frozen=True)
class MoveOff:
    """End the attempt without a failure: its ``nodes`` are drained (``why``)."""

    nodes: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Grow:
    """End the attempt without a failure to restart at the job's full size (``why``: its checkpoint; "": none asked)."""

    why: str


@dataclass(frozen=True)
class AskCheckpoint:
    """Ask the ranks for a checkpoint before the job grows back to its full size (``Grow`` follows once it is saved)."""


@dataclass(frozen=True)
class Continue:
    """A RESTARTING job's stop: ``decision`` is Requeue, Wait or Fail (it never confirmed)."""

    decision: Decision


@dataclass(frozen=True)
class Running:
    """Every rank is running."""


@dataclass(frozen=True)
class Succeed:
    """Every rank exited 0."""


Plan = Nothing | Hold | EndAttempt | MoveOff | Grow | AskCheckpoint | Continue | Running | Succeed


def reconcile(view: JobView) -> Plan:
    """What follows for an active job (module docstring for the order)."""
    if view.state is S.RESTARTING:
        return Continue(decide(_facts(view), (), view.stop, view.now))
    if view.draining_lost is not None:
        return MoveOff(*view.draining_lost)
    if view.lost:
        return _end(view, view.lost[0])
    if view.failed is not None:
        if view.loss_held:
            return Hold("a lost node's failure waits for its allocation: its victims' errors wait with it")
        if view.failed.cause is Cause.PEER_ERROR and view.failed_since is not None \
                and view.now - view.failed_since < ATTRIBUTION_S:
            return Hold(f"rank {view.failed.rank}'s error names a peer's failure: waiting for its cause")
        return _end(view, view.failed)
    if view.hang is not None:
        return _end(view, view.hang)
    if view.drain_due is not None:
        return MoveOff(*view.drain_due)
    if view.state is S.STARTING and view.all_running:
        return Running()
    if view.state is S.RUNNING and view.all_succeeded:
        return Succeed()
    if view.grow_due is not None:
        return Grow(view.grow_due)
    if view.grow_fits:
        return AskCheckpoint() if view.saves_on_request else Grow("")
    return Nothing()


def _facts(view: JobView) -> JobFacts:
    return JobFacts(attempt=view.attempt, restarting=view.state is S.RESTARTING, max_restarts=view.max_restarts)


def _end(view: JobView, fault: Fault) -> EndAttempt:
    return EndAttempt(fault, decide(_facts(view), view.attempts, None, view.now, Failure(fault, view.previous)))
