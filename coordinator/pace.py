"""When a running job is hung: judged on its own pace from the evidence its ranks hold, in seconds.

``restart.hang_timeout`` (300 s by default) is the upper bound: a RUNNING job none of whose ranks changed
step or phase for that long is hung, whatever it shows. Within it, a job is hung much sooner when its
ranks say they wait: once ``PACE_MIN_STEPS`` steps of the attempt completed, a job still for ``limit``
seconds (``PACE_FACTOR`` times the median of its recent step intervals, at least ``PACE_FLOOR_S``) is hung
when some rank is stopped (SIGSTOP, a debugger) or waits inside a collective or point-to-point operation
(its daemon's evidence, ``worker.hangwatch``), and no rank says it is busy with a checkpoint, a snapshot
or a restore (``ctx.busy``: a save may hold its peers for as long as it takes). A pause shorter than the
floor never counts, and a job whose steps take minutes is judged in minutes.

``Pace`` keeps one attempt's step intervals and, per rank, whether its current evidence says it waits,
is busy or is stopped: constant time per report and per judgement, whatever the job's size. Pure: the
caller passes the time.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

PACE_FLOOR_S = 6.0    # a job still for less is never hung (a pause of 3 s, a slow read, a collection)
PACE_FACTOR = 4.0     # times the median of its recent step intervals
PACE_WINDOW = 16      # step intervals remembered
PACE_MIN_STEPS = 2    # step intervals known before the pace is trusted (until then: restart.hang_timeout)
EVIDENCE_GRACE_S = 3.0   # past the limit, how long a judgement waits for ranks that have sent no evidence yet

MOVED = '{"moved":true}'     # evidence withdrawn (``worker.hangwatch.MOVED_JSON``)
WAITS = '"in":true'          # a rank's evidence: it is blocked in a group (``worker.hangwatch.evidence_json``)
BUSY = '"activity":'         # ... it is busy outside collectives (a checkpoint ...)


@dataclass
class Pace:
    """One attempt's step intervals and the ranks whose evidence says they wait, are busy or are stopped."""

    intervals: deque = field(default_factory=lambda: deque(maxlen=PACE_WINDOW))
    last_step_at: float | None = None
    last_step: int = 0
    waiting: set[int] = field(default_factory=set)
    busy: set[int] = field(default_factory=set)
    stopped: set[int] = field(default_factory=set)
    reported: set[int] = field(default_factory=set)   # ranks whose evidence and stack are in (withdrawn: out again)

    # -- updates ----------------------------------------------------------------------------
    def step_completed(self, step: int, now: float) -> None:
        """Every rank finished ``step`` (the job-level step) at ``now``; a jump of several steps (reports
        coalesced) counts as that many intervals of its mean."""
        if self.last_step_at is not None and step > self.last_step:
            self.intervals.append(max(0.0, now - self.last_step_at) / (step - self.last_step))
        self.last_step_at, self.last_step = now, step

    def evidence(self, rank: int, collectives: str, stack: str = "") -> None:
        """A rank's hang evidence arrived (its counters at once, then again with its ``stack``), or was
        withdrawn (``{"moved":true}``)."""
        (self.waiting.add if WAITS in collectives else self.waiting.discard)(rank)
        (self.busy.add if BUSY in collectives else self.busy.discard)(rank)
        (self.reported.add if stack and collectives != MOVED else self.reported.discard)(rank)

    def process(self, rank: int, state: str) -> None:
        """The daemon saw the rank's process stop ("stopped") or go on ("")."""
        (self.stopped.add if state == "stopped" else self.stopped.discard)(rank)

    def gone(self, rank: int) -> None:
        """The rank exited: none of its evidence holds."""
        self.waiting.discard(rank)
        self.busy.discard(rank)
        self.stopped.discard(rank)
        self.reported.discard(rank)

    # -- judgement --------------------------------------------------------------------------
    def limit(self, hang_timeout: float) -> float:
        """Seconds of stillness after which a job whose ranks wait is hung (``hang_timeout`` until the pace
        is known)."""
        if len(self.intervals) < PACE_MIN_STEPS:
            return hang_timeout
        return min(hang_timeout, max(PACE_FLOOR_S, PACE_FACTOR * statistics.median(self.intervals)))

    def waits(self) -> bool:
        """Some rank is stopped, or waits in an operation while none is busy with a save or a restore."""
        return bool(self.stopped) or (bool(self.waiting) and not self.busy)

    def hung(self, idle: float, hang_timeout: float, live: int | None = None) -> bool:
        """Hung now: past ``hang_timeout``, or past the pace's limit while ranks wait; in the second case, while
        some of the ``live`` ranks (not exited) have sent no evidence or no stack yet, up to ``EVIDENCE_GRACE_S``
        more, so that the reason can name the rank they wait for and show its stack (a loaded node's daemon may
        send them a little later)."""
        if idle > hang_timeout:
            return True
        limit = self.limit(hang_timeout)
        if idle <= limit or not self.waits():
            return False
        missing = live is not None and len(self.reported | self.stopped) < live
        return not missing or idle > min(hang_timeout, limit + EVIDENCE_GRACE_S)

    def rule(self, hang_timeout: float) -> str:
        """How the job was judged, for its hang reason."""
        limit = self.limit(hang_timeout)
        if limit >= hang_timeout:
            return f"restart.hang_timeout={hang_timeout:g}"
        median = statistics.median(self.intervals)
        return (f"ranks wait for a peer; judged after {limit:.0f} s from the job's pace: a step every "
                f"{median:.2f} s; restart.hang_timeout={hang_timeout:g}")
