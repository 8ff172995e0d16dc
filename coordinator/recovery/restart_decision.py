"""The restart decision, pure: what follows a failed attempt, and when a stopping one may run again.

``decide`` reads facts only (the job's attempt and restart budget, its stored attempts, how far the
stop of its failed attempt has come, the time) and returns a small frozen result that
``coordinator.recovery.restarts`` carries out: no store, clock or network here, so it is tested on its own.
``restart.max_restarts`` counts failures only: attempts that ended because a node was drained are free.
An attempt that fails the same way as the one before it (``faults.same_way``, over typed faults: the same rank
error at the same step, or a hang at the same step; the previous one read from the store, so it survives a
failover) ends the job instead of looping through its restarts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rankctl.coordinator.model.faults import Fault, same_way
from rankctl.coordinator.scheduling.stops import STOP_TIMEOUT_S

REASONS_SHOWN = 400      # characters of each attempt's reason in a final failure
FREE_CAUSES = ("drain", "grow")   # attempts that ended so, not by a failure, use no restart


@dataclass(frozen=True, kw_only=True)
class JobFacts:
    attempt: int          # the current attempt (1 + restarts + drained attempts)
    restarting: bool      # the current attempt failed and is stopping (RESTARTING)
    max_restarts: int


@dataclass(frozen=True)
class AttemptFacts:
    """One stored attempt: its number, why it ended and its cause ("failure" or "drain"; "" while it runs)."""

    attempt: int
    reason: str
    cause: str = "failure"


@dataclass(frozen=True)
class Failure:
    """What the current attempt's failure was (``fault``, typed); ``previous``: the fault the attempt before it
    failed with, as stored (None: it did not fail, or ended by a drain)."""

    fault: Fault
    previous: Fault | None = None

    @property
    def reason(self) -> str:
        return self.fault.reason


@dataclass(frozen=True)
class StopFacts:
    """The stop of a RESTARTING job's attempt: since when, and how many ranks are not confirmed gone."""

    since: float
    left: int


@dataclass(frozen=True)
class Restart:
    """End the failed attempt (``reason`` stored with it) and run the job again once its ranks are gone."""

    headline: str
    reason: str


@dataclass(frozen=True)
class Requeue:
    """Every rank of the stopping attempt is confirmed gone: queue the next attempt."""


@dataclass(frozen=True)
class Wait:
    """``left`` ranks of the stopping attempt are not confirmed gone yet."""

    left: int


@dataclass(frozen=True)
class Fail:
    """Fail the job. ``abandon``: its stopping ranks never confirmed their exit; their slots are reused."""

    reason: str
    abandon: bool = False


Decision = Restart | Requeue | Wait | Fail


def decide(job: JobFacts, attempts: Sequence[AttemptFacts], stop: StopFacts | None, now: float,
           failure: str | Failure = "") -> Decision:
    """What follows for ``job``: for a RESTARTING one, from its ``stop``; else from the ``failure`` of its
    current attempt (its reason, or a ``Failure`` with its step) and the ``attempts`` stored before it."""
    if job.restarting:
        return _after_stop(job, stop, now)
    fact = failure if isinstance(failure, Failure) else None
    failure = fact.reason if fact is not None else str(failure)
    drained = sum(1 for a in attempts if a.attempt < job.attempt and a.cause in FREE_CAUSES)
    if job.attempt - 1 - drained < job.max_restarts:
        if fact is not None and fact.previous is not None and same_way(fact.fault, fact.previous):
            return Fail(f"attempt {job.attempt} failed the same way as attempt {job.attempt - 1}, at step "
                        f"{fact.fault.step}; not restarting it again: {failure}")
        return Restart(f"attempt {job.attempt} failed: {failure}", failure)
    if job.max_restarts == 0:
        return Fail(failure)
    history = "; ".join(f"attempt {a.attempt}: {a.reason[:REASONS_SHOWN]}" for a in attempts if a.attempt < job.attempt)
    return Fail(f"attempt {job.attempt} failed and no restart is left (max_restarts={job.max_restarts}): "
                f"{failure}; earlier: {history}")


def _after_stop(job: JobFacts, stop: StopFacts | None, now: float) -> Decision:
    if stop is None or not stop.left:
        return Requeue()
    if now - stop.since > STOP_TIMEOUT_S:
        return Fail(f"attempt {job.attempt} did not stop: {stop.left} rank(s) on connected nodes never reported "
                    f"their exit within {STOP_TIMEOUT_S:g} s", abandon=True)
    return Wait(stop.left)
