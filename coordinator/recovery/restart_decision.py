"""The restart decision, pure: what follows a failed attempt, and when a stopping one may run again.

``decide`` reads facts only (the job's attempt and restart budget, its stored attempts, how far the
stop of its failed attempt has come, the time) and returns a small frozen result that
``coordinator.recovery.restarts`` carries out: no store, clock or network here, so it is tested on its own.
``restart.max_restarts`` counts failures only: attempts that ended because a node was drained are free.
An attempt that fails the same way as the one before it (``same_way``: the same rank error at the same
step, or a hang at the same step) ends the job instead of looping through its restarts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

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
    """What the current attempt's failure was: its reason, and the step it failed at (None: not known,
    or a failure that is no repeatable one: a lost node); ``previous``: the same of the attempt before."""

    reason: str
    step: int | None = None
    previous: tuple[str, int | None] | None = None


_NODE = re.compile(r" on node \S+")


def same_way(a: tuple[str, int | None], b: tuple[str, int | None]) -> bool:
    """Two failures (reason, step) are the same way: both at the same known step, and both the same rank's
    exit with the same code and last error line (wherever it ran), or both a hang."""
    (ra, sa), (rb, sb) = a, b
    if sa is None or sa != sb:
        return False
    if ra.startswith("hang:") and rb.startswith("hang:"):
        return True
    rank_exit = re.compile(r"^rank \d+ exited with code")
    na, nb = _NODE.sub("", ra, count=1), _NODE.sub("", rb, count=1)
    return bool(rank_exit.match(na)) and na == nb


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
    fact = failure if isinstance(failure, Failure) else Failure(failure)
    failure = fact.reason
    drained = sum(1 for a in attempts if a.attempt < job.attempt and a.cause in FREE_CAUSES)
    if job.attempt - 1 - drained < job.max_restarts:
        if fact.previous is not None and same_way((fact.reason, fact.step), fact.previous):
            return Fail(f"attempt {job.attempt} failed the same way as attempt {job.attempt - 1}, at step "
                        f"{fact.step}; not restarting it again: {failure}")
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
