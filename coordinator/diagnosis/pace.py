"""When a running job is hung: judged on its own pace from the evidence its ranks hold, in seconds.

``restart.hang_timeout`` (300 s by default) is the upper bound: a RUNNING job none of whose ranks changed
step or phase for that long is hung, whatever it shows. The pace is a last resort within it, for a job
whose ranks say they wait and none of which makes progress: once ``PACE_MIN_STEPS`` steps of the attempt
completed, a job still for ``limit`` seconds is hung when

* some rank is stopped (SIGSTOP, a debugger: its daemon saw its process stopped and its CPU time still for
  ``worker.runs.hangwatch.CPU_STILL_S``) or waits inside a collective or point-to-point operation (its daemon's
  evidence, ``worker.runs.hangwatch``), and no rank says it is busy with a checkpoint, a snapshot or a restore
  (``ctx.busy``: a save may hold its peers for as long as it takes);
* every live rank's daemon sent its evidence (a rank without any moved within its own stall time), and no
  rank's evidence says its CPU time advances outside any collective (``"computing":true``: a slow or
  throttled rank computes; the ranks waiting for it are no hang).

``limit`` adapts to the job's own recent steps (the job's step is its slowest rank's; a step in which some
rank was stopped is a pause and left out): ``PACE_FACTOR`` times the longer of its longest recent step
interval and the next one its growth trend projects (the last
interval times the largest ratio of the last ``GROWTH_STEPS`` consecutive ones, at most ``GROWTH_MAX``), at
least ``PACE_FLOOR_S``. A pause shorter than the floor never counts; a job whose steps take minutes, or grow
to minutes, is judged in minutes.

``Pace`` keeps one attempt's step intervals and, per rank, whether its current evidence says it waits,
is busy, computes or is stopped: constant time per report and per judgement, whatever the job's size.
Pure: the caller passes the time.
"""

from __future__ import annotations

import statistics
from collections import deque
from itertools import islice
from dataclasses import dataclass, field

PACE_FLOOR_S = 6.0    # a job still for less is never hung (a pause of 3 s, a slow read, a collection)
PACE_FACTOR = 4.0     # times the longest of its recent step intervals (or the one its growth projects)
GROWTH_STEPS = 3      # consecutive intervals whose ratio is the growth trend
GROWTH_MAX = 4.0      # a projected step grows at most this much over the last one
PACE_WINDOW = 16      # step intervals remembered
PACE_MIN_STEPS = 2    # step intervals seen before the pace is trusted (until then: restart.hang_timeout)
EVIDENCE_GRACE_S = 3.0   # past the limit, how long a judgement waits for ranks that have sent no evidence yet

MOVED = '{"moved":true}'     # evidence withdrawn (``worker.runs.hangwatch.MOVED_JSON``)
WAITS = '"in":true'          # a rank's evidence: it is blocked in a group (``worker.runs.hangwatch.evidence_json``)
BUSY = '"activity":'         # ... it is busy outside collectives (a checkpoint ...)
COMPUTING = '"computing":true'   # ... its CPU time advances outside any collective


@dataclass
class Pace:
    """One attempt's step intervals and the ranks whose evidence says they wait, are busy or are stopped."""

    intervals: deque = field(default_factory=lambda: deque(maxlen=PACE_WINDOW))
    last_step_at: float | None = None
    last_step: int = 0
    known: int = 0          # step intervals seen (a jump of several steps counts as that many)
    paused: bool = False    # some rank was stopped since the last step
    waiting: set[int] = field(default_factory=set)
    busy: set[int] = field(default_factory=set)
    stopped: set[int] = field(default_factory=set)
    computing: set[int] = field(default_factory=set)  # ranks whose evidence says their CPU time advances
    evidenced: set[int] = field(default_factory=set)  # ranks whose evidence is in (withdrawn: out again)
    reported: set[int] = field(default_factory=set)   # ... with their stack

    # -- updates ----------------------------------------------------------------------------
    def step_completed(self, step: int, now: float) -> None:
        """Every rank finished ``step`` (the job-level step) at ``now``; a jump of several steps (reports
        coalesced) is one interval of its mean that counts as that many towards trusting the pace (a loaded
        daemon that coalesced a fast job's first steps must not leave it judged on ``hang_timeout`` alone);
        one in which some rank was stopped is a pause, not the job's pace, and is left out."""
        if self.last_step_at is not None and step > self.last_step and not self.paused:
            self.intervals.append(max(0.0, now - self.last_step_at) / (step - self.last_step))
            self.known += step - self.last_step
        self.last_step_at, self.last_step = now, step
        self.paused = bool(self.stopped)

    def evidence(self, rank: int, collectives: str, stack: str = "") -> None:
        """A rank's hang evidence arrived (its counters at once, then again with its ``stack``), or was
        withdrawn (``{"moved":true}``)."""
        (self.waiting.add if WAITS in collectives else self.waiting.discard)(rank)
        (self.busy.add if BUSY in collectives else self.busy.discard)(rank)
        (self.computing.add if COMPUTING in collectives else self.computing.discard)(rank)
        (self.evidenced.add if collectives and collectives != MOVED else self.evidenced.discard)(rank)
        (self.reported.add if stack and collectives != MOVED else self.reported.discard)(rank)

    def process(self, rank: int, state: str) -> None:
        """The daemon saw the rank's process stop ("stopped") or go on ("")."""
        (self.stopped.add if state == "stopped" else self.stopped.discard)(rank)
        self.paused = self.paused or state == "stopped"

    def gone(self, rank: int) -> None:
        """The rank exited: none of its evidence holds."""
        self.waiting.discard(rank)
        self.busy.discard(rank)
        self.stopped.discard(rank)
        self.computing.discard(rank)
        self.evidenced.discard(rank)
        self.reported.discard(rank)

    # -- judgement --------------------------------------------------------------------------
    def growth(self) -> float:
        """How much the job's steps grow a step lately: the largest ratio of its last ``GROWTH_STEPS``
        consecutive intervals, between 1 and ``GROWTH_MAX``."""
        recent = list(islice(reversed(self.intervals), GROWTH_STEPS + 1))
        ratios = [a / b for a, b in zip(recent, recent[1:]) if b > 0]
        return min(GROWTH_MAX, max([1.0, *ratios]))

    def expected(self) -> float:
        """The longest step the job's recent pace allows for: its longest recent interval, or the next one its
        growth trend projects."""
        return max(max(self.intervals), self.intervals[-1] * self.growth())

    def limit(self, hang_timeout: float) -> float:
        """Seconds of stillness after which a job whose ranks wait is hung (``hang_timeout`` until the pace
        is known)."""
        if self.known < PACE_MIN_STEPS:
            return hang_timeout
        return min(hang_timeout, max(PACE_FLOOR_S, PACE_FACTOR * self.expected()))

    def waits(self) -> bool:
        """Some rank is stopped, or waits in an operation while none is busy with a save or a restore; and no
        rank computes."""
        return not self.computing and (bool(self.stopped) or (bool(self.waiting) and not self.busy))

    def hung(self, idle: float, hang_timeout: float, live: int | None = None) -> bool:
        """Hung now: past ``hang_timeout``, or past the pace's limit while ranks wait and none computes. In the
        second case every one of the ``live`` ranks (not exited) must have sent its evidence or be stopped (one
        that has not may be computing); while some have sent no stack yet, up to ``EVIDENCE_GRACE_S`` more, so
        that the reason can show it (a loaded node's daemon may send it a little later)."""
        if idle > hang_timeout:
            return True
        limit = self.limit(hang_timeout)
        if idle <= limit or not self.waits():
            return False
        if live is None:
            return True
        if self._heard(self.evidenced) < live:
            return False
        return self._heard(self.reported) >= live or idle > min(hang_timeout, limit + EVIDENCE_GRACE_S)

    def _heard(self, ranks: set[int]) -> int:
        """How many ranks are in ``ranks`` or stopped: O(stopped ranks), no union of 65,536 each tick."""
        return len(ranks) + sum(1 for r in self.stopped if r not in ranks)

    def rule(self, hang_timeout: float) -> str:
        """How the job was judged, for its hang reason."""
        limit = self.limit(hang_timeout)
        if limit >= hang_timeout:
            return f"restart.hang_timeout={hang_timeout:g}"
        median, growth = statistics.median(self.intervals), self.growth()
        trend = f", growing x{growth:.1f} a step" if growth >= 1.25 and limit > PACE_FLOOR_S else ""
        return (f"ranks wait for a peer and none computes; judged after {limit:.0f} s from the job's pace: a step "
                f"every {median:.2f} s, the longest {max(self.intervals):.2f} s{trend}; "
                f"restart.hang_timeout={hang_timeout:g}")
