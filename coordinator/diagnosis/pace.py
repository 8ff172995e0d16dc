"""Whether a running job is hung, and how sure that is: a name at once, an action only on certainty (ADR 0031).

The daemons send, per rank whose counters stopped moving, its evidence (``worker.runs.hangwatch``): the
operation it waits in, whether it is busy (``ctx.busy``), computes, spins, whether its data to a peer is being
retransmitted; and each rank's process state (stopped, traced). ``Pace`` folds them into sets, in constant time
per report, and ``judge`` returns a ``Verdict``:

* **certain**, acted on at once:
  - *stopped*: a rank stopped (SIGSTOP; its daemon saw its CPU time still for ``STOP_CONFIRM_S``) and held so
    ``STOP_HOLD_S`` more here. Pauses are spared: a shorter stop, a rank *traced* (a debugger), every live rank
    stopped together (a suspend);
  - *deadlock*: every live rank waits inside an operation and they cannot complete (a cycle of waits, or the members
    of one group in different operations: ``hangs.blocked``), held ``DEADLOCK_HOLD_S``;
  - *link*: every live rank waits, a group has every member inside one operation on two nodes, and a member's
    daemon saw its TCP data to a peer go unacknowledged through repeated retransmissions (a cut link).
* **uncertain**, acted on at the bound (``bound``): a live rank outside collectives (asleep, blocked on I/O or a
  lock, computing, spinning in Python) while its peers wait; a group all inside one operation with no loss seen (a
  slow transfer). The bound is ``restart.hang_timeout``, raised to ``LEARN_FACTOR`` times the longest pause of the
  same kind the job already survived (``Learned``), and never reached at a step where an earlier attempt of the job
  already died for an uncertain reason (that repetition is evidence of work).

Durations come from one clock that cannot lie (``quiet_since``): the latest moment a rank moved as this
coordinator knows it (a step or phase report, a rank's evidence withdrawn, or the start of a rank's stillness that
its daemon measured), never from zero: ``None`` until this coordinator has seen the attempt move, so a resync or a
failover (which rebuilds this object) starts the clock afresh, late rather than early. Pure: the caller passes the
time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

STOP_HOLD_S = 0.6        # a stop the daemon confirmed, held this long here: stopped for good
STOP_CONFIRM_S = 0.3     # the daemon reports a stop once its CPU time was still this long (hangwatch.CPU_STILL_S)
EVIDENCE_GRACE_S = 0.5   # a certain judgement waits this long at most for the evidence that names the group
DEADLOCK_HOLD_S = 0.5    # every live rank waiting in operations that cannot complete, this long: a deadlock
ANNOUNCE_EVERY_S = 10.0  # a rank's stops are named in an event at most this often
NAMING_EVIDENCE = 1024   # a stop waits for this many ranks' evidence at most (what ``hangs`` reads of the waiting)
LEARN_FACTOR = 2.0       # an uncertain pause of a kind the job survived for X s is tolerated for this x X
NAME_EVERY_S = 0.5       # a job's stall is named again (its evidence changed) at most this often

MOVED = '{"moved":true}'     # evidence withdrawn (``worker.runs.hangwatch.MOVED_JSON``)
WAITS = '"in":true'          # a rank's evidence: it is blocked in a group (``worker.runs.hangwatch.evidence_json``)
BUSY = '"activity":'         # ... it is busy outside collectives (a checkpoint ...)
COMPUTING = '"computing":true'   # ... its CPU time advances outside any collective
SPINNING = '"spinning":true'     # ... in a Python loop (the same stack twice, holding the GIL)
LOST = '"lost":'                 # ... its data to a peer goes unacknowledged (a cut link)
_STILL = re.compile(r'"still_s":([0-9.]+)')

STOPPED, DEADLOCK, LINK, UNCERTAIN = "stopped", "deadlock", "link", "uncertain"   # a verdict's kinds


@dataclass(frozen=True)
class Verdict:
    """A hang: its ``kind`` (``STOPPED``, ``DEADLOCK``, ``LINK``: certain; ``UNCERTAIN``) and how it was judged."""

    kind: str
    rule: str

    @property
    def certain(self) -> bool:
        return self.kind != UNCERTAIN


@dataclass
class Learned:
    """What one job taught its judgement, across its attempts: the longest uncertain pause of each kind it survived
    (``pause_kind``)."""

    pauses: dict[str, float] = field(default_factory=dict)

    def bound(self, kind: str, hang_timeout: float) -> float:
        return max(hang_timeout, LEARN_FACTOR * self.pauses.get(kind, 0.0))


@dataclass
class Pace:
    """One attempt's hang evidence: which ranks wait, are busy, compute, spin, lose data or are stopped."""

    learned: Learned = field(default_factory=Learned)
    spared: set[int] | None = None   # steps at which an earlier attempt died for an uncertain reason (from the store)
    quiet_since: float | None = None   # the latest moment a rank moved, as far as this coordinator knows
    waiting: set[int] = field(default_factory=set)
    busy: set[int] = field(default_factory=set)
    computing: set[int] = field(default_factory=set)
    spinning: set[int] = field(default_factory=set)
    lossy: set[int] = field(default_factory=set)      # its daemon sees its data to a peer retransmitted
    stopped: dict[int, float] = field(default_factory=dict)   # rank -> when its stop was reported
    traced: set[int] = field(default_factory=set)             # held by a tracer (a debugger)
    suspended: bool = False   # the last judgement found every live rank stopped (a suspend)
    announced: dict[int, float] = field(default_factory=dict)  # rank -> when a stop of it was last named
    evidenced: set[int] = field(default_factory=set)  # ranks whose evidence is in (withdrawn: out again)
    reported: set[int] = field(default_factory=set)   # ... with their stack
    generation: int = 0        # bumped by every change of evidence or process state
    blocked: str = ""          # why every live rank's waits cannot complete (``hangs.blocked``), for ``analysed``
    analysed: int = -1         # the generation ``blocked`` was found for
    all_waiting_since: float | None = None   # every live rank waiting inside an operation since
    named: int = -1            # the generation last named in an event
    named_at: float = float("-inf")   # ... when (a big job's evidence arrives in bursts: named at most so often)
    episode: str | None = None   # the kind of an uncertain pause under way (learned when the job moves again)
    stall: str = ""            # the last ``stall`` event's text while the job stands still ("" once a rank moves)

    # -- updates ----------------------------------------------------------------------------
    def moved(self, now: float) -> None:
        """A rank moved (a step, a phase, its counters): the job is not still; a pause under way was survived."""
        if self.episode is not None and self.quiet_since is not None:
            kind, survived = self.episode, now - self.quiet_since
            self.learned.pauses[kind] = max(self.learned.pauses.get(kind, 0.0), survived)
        self.episode = None
        self.quiet_since = now
        self.stall = ""

    def step_completed(self, step: int, now: float) -> None:
        """Every rank finished ``step`` at ``now``."""
        self.moved(now)

    def evidence(self, rank: int, collectives: str, stack: str = "", now: float | None = None) -> None:
        """A rank's hang evidence arrived (its counters at once, then again with its ``stack``), or was
        withdrawn (``{"moved":true}``: the rank moved)."""
        self.generation += 1
        withdrawn = not collectives or collectives == MOVED
        for flag, members in ((WAITS, self.waiting), (BUSY, self.busy), (COMPUTING, self.computing),
                              (SPINNING, self.spinning), (LOST, self.lossy)):
            (members.add if not withdrawn and flag in collectives else members.discard)(rank)
        (self.evidenced.discard if withdrawn else self.evidenced.add)(rank)
        (self.reported.add if stack and not withdrawn else self.reported.discard)(rank)
        if now is None:
            return
        if collectives == MOVED:
            self.moved(now)
            return
        still = _STILL.search(collectives[:64]) if collectives else None
        if still is not None and self.quiet_since is not None:
            self.quiet_since = max(self.quiet_since, now - float(still.group(1)))

    def process(self, rank: int, state: str, now: float = 0.0) -> None:
        """The daemon saw the rank's process stop ("stopped"), traced ("traced") or go on ("") at ``now``."""
        self.generation += 1
        if state == "stopped":
            self.stopped.setdefault(rank, now)
        elif self.stopped.pop(rank, None) is not None and self.suspended:
            # a suspended job goes on, its ranks one report after another: those still stopped are no stop yet
            self.suspended = False
            for other in self.stopped:
                self.stopped[other] = now
        if state == "traced":
            self.traced.add(rank)
        else:
            self.traced.discard(rank)

    def announce(self, rank: int, now: float) -> bool:
        """The rank is stopped or traced and no stop of it was named within ``ANNOUNCE_EVERY_S`` (then it is
        now): one event a stop, at most one a rank in that time, whatever a throttle's stops and starts."""
        if (rank not in self.stopped and rank not in self.traced) or \
                now - self.announced.get(rank, float("-inf")) < ANNOUNCE_EVERY_S:
            return False
        self.announced[rank] = now
        return True

    def discount(self, lag: float) -> None:
        """The coordinator's own loop stood still ``lag`` seconds: that time counts towards no judgement."""
        for rank in self.stopped:
            self.stopped[rank] += lag
        if self.quiet_since is not None:
            self.quiet_since += lag
        if self.all_waiting_since is not None:
            self.all_waiting_since += lag

    def gone(self, rank: int) -> None:
        """The rank exited: none of its evidence holds."""
        self.generation += 1
        for members in (self.waiting, self.busy, self.computing, self.spinning, self.lossy, self.traced,
                        self.evidenced, self.reported):
            members.discard(rank)
        self.stopped.pop(rank, None)

    # -- what the evidence says -------------------------------------------------------------
    def _heard(self, ranks: set[int]) -> int:
        """How many ranks are in ``ranks`` or stopped: O(stopped ranks), no union of 65,536 each tick."""
        return len(ranks) + sum(1 for r in self.stopped if r not in ranks)

    def still(self, live: int) -> bool:
        """Every live rank is still: its evidence is in, or it is stopped."""
        return live > 0 and self._heard(self.evidenced) >= live

    def all_waiting(self, live: int) -> bool:
        """Every live rank waits inside an operation: none stopped, traced, busy, computing or outside."""
        return live > 0 and len(self.waiting) >= live and not (self.stopped or self.traced or self.busy
                                                              or self.computing or self.spinning)

    def stop_held(self, now: float) -> float | None:
        """How long the rank stopped first has been stopped for at ``now`` (None: none is)."""
        return now - min(self.stopped.values()) if self.stopped else None

    def pause_kind(self) -> str:
        """The kind of an uncertain pause, for learning: what the ranks that hold the others up do."""
        if self.busy:
            return "busy"
        if self.computing or self.spinning:
            return "computing"
        if len(self.waiting) >= len(self.evidenced) and self.waiting:
            return "inside"   # every rank inside an operation: a slow transfer, a link no loss was seen on
        return "asleep"

    def quiet_for(self, now: float) -> float:
        return 0.0 if self.quiet_since is None else max(0.0, now - self.quiet_since)

    # -- judgement --------------------------------------------------------------------------
    def judge(self, now: float, hang_timeout: float, live: int, step: int) -> Verdict | None:
        """The attempt's hang at ``now``, if it is hung (the module docstring); ``live``: ranks not exited;
        ``step``: the job's slowest step (an uncertain pause is never acted on at a step in ``spared``)."""
        self.suspended = live > 0 and len(self.stopped) >= live
        stop = self._stop(now, live)
        if stop is not None:
            return stop
        if not self.still(live):
            self.episode = None
            return None
        if self.quiet_since is None or self.traced or self.suspended:
            return None
        if self.all_waiting(live):
            self.all_waiting_since = self.all_waiting_since if self.all_waiting_since is not None else now
            certain = self._blocked(now)
            if certain is not None:
                return certain
        else:
            self.all_waiting_since = None
        kind = self.episode = self.pause_kind()
        bound = self.learned.bound(kind, hang_timeout)
        quiet = self.quiet_for(now)
        if quiet <= bound or (self.spared and step in self.spared):
            return None
        raised = f", raised from {hang_timeout:g} s by a {kind} pause of " \
                 f"{self.learned.pauses[kind]:.1f} s this job survived" if bound > hang_timeout else ""
        return Verdict(UNCERTAIN, f"uncertain: {_KIND_TEXT[kind]}; acted on at the bound, {bound:g} s{raised}; "
                                  f"restart.hang_timeout={hang_timeout:g}")

    def _stop(self, now: float, live: int) -> Verdict | None:
        if self.traced or self.suspended:
            return None   # a debugger holds a rank, or the whole job is stopped: a pause
        held = self.stop_held(now)
        if held is None or held < STOP_HOLD_S:
            return None
        heard = self._heard(self.evidenced) >= min(live, NAMING_EVIDENCE)
        if not heard and held < STOP_HOLD_S + EVIDENCE_GRACE_S:
            return None
        return Verdict(STOPPED, f"certain: a rank stopped for {held + STOP_CONFIRM_S:.1f} s; a stop of about a "
                                f"second that is not the whole job's, nor a debugger's, is for good")

    def _blocked(self, now: float) -> Verdict | None:
        """Certain when every live rank waits and ``hangs.blocked`` (``blocked``, for the current generation) found
        why none can go on: a deadlock (held ``DEADLOCK_HOLD_S``) or a group inside one operation with data lost."""
        if self.analysed != self.generation or self.all_waiting_since is None:
            return None
        if self.blocked == DEADLOCK and now - self.all_waiting_since >= DEADLOCK_HOLD_S:
            return Verdict(DEADLOCK, "certain: every rank waits inside an operation that cannot complete")
        if self.blocked == LINK and self.lossy:
            return Verdict(LINK, "certain: every rank waits and the data of a group inside one operation goes "
                                 "unacknowledged between two nodes")
        return None

    def due(self, now: float, hang_timeout: float, live: int) -> float | None:
        """Seconds until a judgement may change with time alone; None: not before new evidence."""
        held = self.stop_held(now)
        if held is not None and not self.traced:
            return max(0.05, STOP_HOLD_S - held if held < STOP_HOLD_S else STOP_HOLD_S + EVIDENCE_GRACE_S - held)
        if not self.still(live) or self.quiet_since is None:
            return None
        if self.all_waiting_since is not None and self.blocked == DEADLOCK:
            return max(0.05, DEADLOCK_HOLD_S - (now - self.all_waiting_since))
        return max(0.05, self.learned.bound(self.pause_kind(), hang_timeout) - self.quiet_for(now) + 0.01)

    def nameable(self, now: float) -> float | None:
        """Some rank waits and this evidence was not named yet: 0 (name it now) or the seconds until it may be
        (``NAME_EVERY_S`` after the last naming); None: nothing to name."""
        if not self.waiting or self.named == self.generation:
            return None
        return max(0.0, NAME_EVERY_S - (now - self.named_at))


_KIND_TEXT = {"busy": "a rank busy outside collectives (ctx.busy) while its peers wait",
              "computing": "a live rank computes outside collectives while its peers wait",
              "inside": "every rank inside an operation, no data seen lost (a slow transfer?)",
              "asleep": "a live rank outside collectives (asleep, blocked on I/O or a lock) while its peers wait"}
