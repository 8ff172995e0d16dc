"""The job state machine: states, the allowed transitions, and a checked step.

PENDING -> PLACED -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED.
Every transition carries a non-empty reason; anything not in ``TRANSITIONS`` raises.
A failed or drained attempt of a STARTING or RUNNING job enters RESTARTING while its ranks stop,
then the job is PENDING again as its next attempt (``coordinator.recovery.restarts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class JobState(str, Enum):
    """Job states; the values equal the names of the protobuf ``JobState`` enum."""

    PENDING = "PENDING"
    PLACED = "PLACED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    RESTARTING = "RESTARTING"


S = JobState
TERMINAL: frozenset[JobState] = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})

# state -> states it may move to
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.PENDING: frozenset({S.PLACED, S.FAILED, S.CANCELLED}),
    S.PLACED: frozenset({S.STARTING, S.FAILED, S.CANCELLED}),
    S.STARTING: frozenset({S.RUNNING, S.FAILED, S.CANCELLED, S.RESTARTING}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.RESTARTING}),
    S.RESTARTING: frozenset({S.PENDING, S.PLACED, S.FAILED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}

# states in which a job holds slots on its nodes
ACTIVE: frozenset[JobState] = frozenset({S.PLACED, S.STARTING, S.RUNNING, S.RESTARTING})
LIVE: frozenset[JobState] = ACTIVE - {S.RESTARTING}   # an attempt under way: its ranks' exits and failures are news


class IllegalTransition(ValueError):
    """A transition that the table does not allow, or one without a reason."""


@dataclass(frozen=True)
class Transition:
    src: JobState
    dst: JobState
    reason: str


def is_terminal(state: JobState) -> bool:
    """True for SUCCEEDED, FAILED and CANCELLED: nothing follows them."""
    return JobState(state) in TERMINAL


def is_active(state: JobState) -> bool:
    """True while a job holds slots (placed and not yet terminal)."""
    return JobState(state) in ACTIVE


def can_transition(src: JobState, dst: JobState) -> bool:
    return JobState(dst) in TRANSITIONS[JobState(src)]


def transition(src: JobState, dst: JobState, reason: str) -> Transition:
    """Check one step of the state machine; raise IllegalTransition when it is not allowed."""
    src, dst = JobState(src), JobState(dst)
    if not reason or not reason.strip():
        raise IllegalTransition(f"transition {src.value} -> {dst.value} needs a reason")
    if not can_transition(src, dst):
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[src])) or "nothing (terminal)"
        raise IllegalTransition(f"illegal transition {src.value} -> {dst.value} (allowed: {allowed})")
    return Transition(src, dst, reason)
