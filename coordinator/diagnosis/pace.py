"""When a running job is hung: judged from the evidence its ranks' daemons send, in seconds, and on its own pace
only where the evidence cannot tell.

``restart.hang_timeout`` (300 s by default) is the upper bound: a RUNNING job none of whose ranks changed
step or phase for that long is hung, whatever it shows. Within it (``Pace.hung``):

* **a stopped rank** (SIGSTOP: its daemon saw the process stopped and its CPU time still for
  ``worker.runs.hangwatch.CPU_STILL_S``) is a hang once it stayed stopped ``STOP_HOLD_S`` more on this clock
  while no rank advanced: about a second after the stop. The rule for pauses: a stop shorter than that is a
  pause; so is a rank *traced* (gdb, a checkpoint/restore tool: a person or a tool holds it; judged at
  ``hang_timeout`` only), every live rank of the job stopped together (a suspend, a gang scheduler: nobody
  waits for anybody), and a rank stopped and continued in turn (a CPU throttle: its CPU time advances). A
  longer stop of some ranks while the others wait cannot be told from a rank stopped for good: it is acted
  on. The judgement waits up to ``EVIDENCE_GRACE_S`` for the peers' evidence (``NAMING_EVIDENCE`` ranks' at
  most: the reason reads no more), so that the reason names the group and the operation they wait in.
* **a blocked rank**: every live rank's daemon sent its evidence (each is still past its own stall time), none
  says it is busy with a checkpoint, a snapshot or a restore (``ctx.busy``), none computes (its CPU time advances,
  or it is runnable, outside any collective: a slow or throttled rank; the ranks waiting for it are no hang),
  and some rank waits inside a collective or point-to-point operation: hung once the job is still past
  ``limit`` (counted from when a stopped or traced rank last went on, if later: a suspended job's ranks go on
  still inside the operation they were stopped in, and a pause is none of the pace's time), which is the job's
  pace (the one thing evidence cannot see is how long a rank asleep outside collectives, a data read or a step
  that grows, is meant to be).

``limit`` adapts to the job's own recent steps (the job's step is its slowest rank's; a step in which some
rank was stopped is a pause and left out): ``PACE_FACTOR`` times the longer of its longest recent step
interval and the next one its growth trend projects (the last interval times the smallest ratio of the last
``GROWTH_STEPS`` consecutive ones, at most ``GROWTH_MAX``), at least ``PACE_FLOOR_S``; ``hang_timeout``
until ``PACE_MIN_STEPS`` intervals are known. A job whose steps take minutes, or grow to minutes, is judged in
minutes.

``Pace`` keeps one attempt's step intervals and, per rank, whether its current evidence says it waits, is busy,
computes or is stopped (and since when): constant time per report and per judgement (O(stopped ranks)),
whatever the job's size. Pure: the caller passes the time. ``due`` says when a judgement may next change, so
that the core looks again then rather than at its next tick.
"""

from __future__ import annotations

import statistics
from collections import deque
from itertools import islice
from dataclasses import dataclass, field

PACE_FLOOR_S = 1.5    # a job whose ranks wait is never hung on its pace sooner (a collection, a short read)
PACE_FACTOR = 4.0     # times the longest of its recent step intervals (or the one its growth projects)
GROWTH_STEPS = 3      # consecutive intervals whose ratio is the growth trend
GROWTH_MAX = 4.0      # a projected step grows at most this much over the last one
PACE_WINDOW = 16      # step intervals remembered
PACE_MIN_STEPS = 2    # step intervals seen before the pace is trusted (until then: restart.hang_timeout)
EVIDENCE_GRACE_S = 0.5   # past the limit, how long a judgement waits for the evidence and stacks not in yet
STOP_HOLD_S = 0.6        # a stop the daemon confirmed, held this long here: a hang
ANNOUNCE_EVERY_S = 10.0  # a rank's stops are named in an event at most this often
NAMING_EVIDENCE = 1024   # a stop waits for this many ranks' evidence at most (what ``hangs`` reads of the waiting)
STOP_CONFIRM_S = 0.3     # the daemon reports a stop once its CPU time was still this long (hangwatch.CPU_STILL_S)

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
    stopped: dict[int, float] = field(default_factory=dict)   # rank -> when its stop was reported
    traced: set[int] = field(default_factory=set)             # held by a tracer (a debugger)
    suspended: bool = False   # the last judgement found every live rank stopped (a suspend)
    announced: dict[int, float] = field(default_factory=dict)  # rank -> when a stop of it was last named
    computing: set[int] = field(default_factory=set)  # ranks whose evidence says their CPU time advances
    resumed_at: float = float("-inf")   # when a stopped or traced rank last went on (the pace's clock restarts)
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
        self.paused = bool(self.stopped) or bool(self.traced)

    def evidence(self, rank: int, collectives: str, stack: str = "") -> None:
        """A rank's hang evidence arrived (its counters at once, then again with its ``stack``), or was
        withdrawn (``{"moved":true}``)."""
        (self.waiting.add if WAITS in collectives else self.waiting.discard)(rank)
        (self.busy.add if BUSY in collectives else self.busy.discard)(rank)
        (self.computing.add if COMPUTING in collectives else self.computing.discard)(rank)
        (self.evidenced.add if collectives and collectives != MOVED else self.evidenced.discard)(rank)
        (self.reported.add if stack and collectives != MOVED else self.reported.discard)(rank)

    def process(self, rank: int, state: str, now: float = 0.0) -> None:
        """The daemon saw the rank's process stop ("stopped"), traced ("traced") or go on ("") at ``now``."""
        if state == "stopped":
            self.stopped.setdefault(rank, now)
        elif self.stopped.pop(rank, None) is not None:
            self.resumed_at = now
            if self.suspended:
                # a suspended job goes on, its ranks one report after another: those still stopped are no stop yet
                self.suspended = False
                for other in self.stopped:
                    self.stopped[other] = now
        if state == "traced":
            self.traced.add(rank)
        elif rank in self.traced:
            self.traced.discard(rank)
            self.resumed_at = now
        self.paused = self.paused or state in ("stopped", "traced")

    def announce(self, rank: int, now: float) -> bool:
        """The rank is stopped or traced and no stop of it was named within ``ANNOUNCE_EVERY_S`` (then it is
        now): one event a stop, at most one a rank in that time, whatever a throttle's stops and starts."""
        if (rank not in self.stopped and rank not in self.traced) or \
                now - self.announced.get(rank, float("-inf")) < ANNOUNCE_EVERY_S:
            return False
        self.announced[rank] = now
        return True

    def discount(self, lag: float) -> None:
        """The coordinator's own loop stood still ``lag`` seconds: that time does not count towards a stop."""
        for rank in self.stopped:
            self.stopped[rank] += lag

    def gone(self, rank: int) -> None:
        """The rank exited: none of its evidence holds."""
        self.waiting.discard(rank)
        self.busy.discard(rank)
        self.stopped.pop(rank, None)
        self.traced.discard(rank)
        self.computing.discard(rank)
        self.evidenced.discard(rank)
        self.reported.discard(rank)

    # -- judgement --------------------------------------------------------------------------
    def growth(self) -> float:
        """How much the job's steps grow a step lately: the smallest ratio of its last ``GROWTH_STEPS``
        consecutive intervals (a trend every one of them shows: one noisy step of a fast job is no growth),
        between 1 and ``GROWTH_MAX``."""
        recent = list(islice(reversed(self.intervals), GROWTH_STEPS + 1))
        ratios = [a / b if b > 0 else GROWTH_MAX for a, b in zip(recent, recent[1:])]
        return min(GROWTH_MAX, max(1.0, min(ratios, default=1.0)))

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

    def hung(self, idle: float, hang_timeout: float, live: int | None = None, now: float | None = None) -> bool:
        """Hung now (the module docstring): past ``hang_timeout``; a rank stopped for ``STOP_HOLD_S`` (at ``now``)
        while no rank advanced; or past the pace's limit while ranks wait and none computes. Every one of the
        ``live`` ranks (not exited) must have sent its evidence or be stopped (one that has not may be
        computing); while some have sent no stack yet, up to ``EVIDENCE_GRACE_S`` more, so that the reason can
        show it (a loaded node's daemon may send it a little later)."""
        if idle > hang_timeout:
            return True
        self.suspended = live is not None and len(self.stopped) >= live > 0
        if self.traced or self.suspended:
            return False   # a debugger holds a rank, or the whole job is stopped: a pause
        held = self.stop_held(now)
        if held is not None and held >= STOP_HOLD_S and idle >= STOP_HOLD_S:
            heard = live is None or self._heard(self.evidenced) >= min(live, NAMING_EVIDENCE)
            return heard or held >= STOP_HOLD_S + EVIDENCE_GRACE_S
        idle = self.paced(idle, now)
        limit = self.limit(hang_timeout)
        if idle <= limit or not self.waits():
            return False
        if live is None:
            return True
        if self._heard(self.evidenced) < live:
            return False
        return self._heard(self.reported) >= live or idle > min(hang_timeout, limit + EVIDENCE_GRACE_S)

    def paced(self, idle: float, now: float | None) -> float:
        """The part of ``idle`` the pace judges: none of the time before a stopped or traced rank last went on
        (a suspended job's ranks go on still waiting in the operation they were stopped in, and the job's first
        step after it is a pause's, not its pace's)."""
        return idle if now is None else max(0.0, min(idle, now - self.resumed_at))

    def stop_held(self, now: float | None) -> float | None:
        """How long the rank stopped first has been stopped for at ``now`` (None: none is, or no time given)."""
        if now is None or not self.stopped:
            return None
        return now - min(self.stopped.values())

    def due(self, idle: float, hang_timeout: float, now: float) -> float | None:
        """Seconds until a judgement of this attempt may change with time alone (a stop held long enough, the
        pace's limit, the evidence's grace); None: not before the upper bound's next tick."""
        if self.traced:
            return None
        held = self.stop_held(now)
        if held is not None:
            return max(0.05, min(STOP_HOLD_S, STOP_HOLD_S + EVIDENCE_GRACE_S - held)
                       if held >= STOP_HOLD_S else STOP_HOLD_S - held)
        if not self.waits():
            return None
        idle, limit = self.paced(idle, now), self.limit(hang_timeout)
        return max(0.05, (limit - idle) if idle <= limit else min(hang_timeout, limit + EVIDENCE_GRACE_S) - idle)

    def _heard(self, ranks: set[int]) -> int:
        """How many ranks are in ``ranks`` or stopped: O(stopped ranks), no union of 65,536 each tick."""
        return len(ranks) + sum(1 for r in self.stopped if r not in ranks)

    def rule(self, hang_timeout: float, now: float | None = None) -> str:
        """How the job was judged, for its hang reason."""
        held = self.stop_held(now)
        if held is not None and held >= STOP_HOLD_S:
            return (f"a rank stopped for {held + STOP_CONFIRM_S:.1f} s while no rank advanced: a stop of about a "
                    f"second is a hang, a shorter one a pause; restart.hang_timeout={hang_timeout:g}")
        limit = self.limit(hang_timeout)
        if limit >= hang_timeout:
            return f"restart.hang_timeout={hang_timeout:g}"
        median, growth = statistics.median(self.intervals), self.growth()
        trend = f", growing x{growth:.1f} a step" if growth >= 1.25 and limit > PACE_FLOOR_S else ""
        return (f"ranks wait for a peer and none computes; judged after {limit:.1f} s from the job's pace: a step "
                f"every {median:.2f} s, the longest {max(self.intervals):.2f} s{trend}; "
                f"restart.hang_timeout={hang_timeout:g}")
