"""Where a job's ranks are, kept as counters: constant time per report, whatever the job's size.

``JobProgress`` is updated by the core on every applied rank report (``moved``) and answers
what used to need a scan of every rank: are all ranks running, have all exited 0, which is
the lowest failed rank, what is the slowest rank's step, which ranks lag. Step metrics are
aggregated per step (the figures the job's kind names, ``JobKind.figures``, and the step-time spread) so that one job-level ``step`` event
can be written when the slowest rank finishes a step, and every completed step's duration
goes into a histogram once. Stragglers by compute time: ``coordinator.diagnosis.skew``. Pure: no store, no clock.
"""

from __future__ import annotations

import heapq
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from rankctl.contract.files.rankstatus import STOPPED
from rankctl.coordinator.model.faults import Cause, rank_fault
from rankctl.coordinator.model.histogram import Histogram, RunTimes, exponential_bounds
from rankctl.coordinator.diagnosis.pace import Learned, Pace
from rankctl.coordinator.diagnosis.preflight import Preflight
from rankctl.coordinator.model.records import PHASE_INDEX, RUNNING_INDEX, JobRecord, RankRecord
from rankctl.coordinator.diagnosis.skew import SHOWN, ComputeSkew, SlowRank, pipeline_peers
from rankctl.kinds import registry
from rankctl.kinds.figures import folds_of
from rankctl.parallel.placement import node_of_rank
from rankctl.proto import rankctl_pb2 as pb

STEP_TIME_BUCKETS = exponential_bounds(0.001, 600.0, per_doubling=3)   # seconds: 1 ms .. ~10 min, ~26% wide
STEP_WINDOW = 256     # steps of metrics kept ahead of the slowest rank
SHOWN_KEEP_S = 1.0    # how long a summary's stragglers and failing ranks are kept at most (``_shown_ranks``)

def rank_span(ranks: list[int]) -> str:
    """[4, 5, 6, 7] -> "ranks 4-7"; [3] -> "rank 3"; [1, 2, 5] -> "ranks 1-2, 5"."""
    if not ranks:
        return "no ranks"
    ranks = sorted(ranks)
    parts, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


SIGNALLED, FAILED_ITSELF, PEER_FAILED = 0, 1, 2   # how likely a failed rank is the cause (lowest: most likely)


def failure_weight(r: RankRecord) -> int:
    """A rank killed by a signal is the likeliest cause of its attempt's failure, one that failed with its own
    error next, one whose error says a peer failed (a collective broke) the least (``faults.rank_fault``)."""
    if r.exit_code < 0:
        return SIGNALLED
    return PEER_FAILED if rank_fault(r).cause is Cause.PEER_ERROR else FAILED_ITSELF


def is_failed(r: RankRecord) -> bool:
    return r.exited and (r.exit_code != 0 or r.phase == "failed")


def stopped_on_request(r: RankRecord) -> bool:
    """Its exit is its daemon's stop on the coordinator's request (an ended attempt's, a cancel's: "stopped: ..."):
    a victim of the end, not a failure of its own."""
    return r.exited and r.error.startswith(STOPPED)


def _passed_running(phase: str, exited: bool) -> bool:
    return exited or PHASE_INDEX.get(phase, -1) >= RUNNING_INDEX


@dataclass
class JobSummary:
    """What GetJob says about a job's ranks, without listing them."""

    phases: dict[str, int]
    running: int
    exited: int
    failed: int
    min_step: int
    max_step: int
    stragglers: list[int]
    failing: list[RankRecord]
    metrics: dict[str, Any]
    reports: int
    slow: list["SlowRank"] = field(default_factory=list)   # stragglers by compute time, worst first
    preflight: "Preflight | None" = None                    # the attempt's pre-flight (``coordinator.diagnosis.preflight``)
    hang: list[int] = field(default_factory=list)           # the ranks the attempt's hang reason points at
    stall: str = ""                                          # whom the still job's ranks wait for (``Pace.stall``)


@dataclass
class _StepAcc:
    """The figures of one step, folded over the ranks that reported it (``JobKind.figures``)."""

    figures: dict[str, float] = field(default_factory=dict)
    time_min: float | None = None
    time_max: float | None = None
    time_sum: float = 0.0     # of the ranks' step times, for their mean (metrics)
    time_n: int = 0

    def fold(self, figures: Mapping[str, float], folds: Mapping[str, str], dt: float | None) -> None:
        """One rank's figures (those its kind folds, each by its rule) and step time."""
        mine = self.figures
        for name, how in folds.items():
            v = figures.get(name)
            if v is None:
                continue
            old = mine.get(name)
            if old is None or (how == "min" and v < old) or (how == "max" and v > old):
                mine[name] = v
        if dt is not None:
            self.time_min = dt if self.time_min is None or dt < self.time_min else self.time_min
            self.time_max = dt if self.time_max is None or dt > self.time_max else self.time_max
            self.time_sum += dt
            self.time_n += 1

    @property
    def time_mean(self) -> float | None:
        return self.time_sum / self.time_n if self.time_n else None

    def as_dict(self) -> dict[str, Any]:
        out = {**self.figures, "step_time_min": self.time_min, "step_time_max": self.time_max}
        return {k: v for k, v in out.items() if v is not None}


def _numbers(metrics_json: str, folds: Mapping[str, str]) -> dict[str, float]:
    """The numbers among a metrics JSON object that ``folds`` names."""
    if not folds or not metrics_json or metrics_json == "{}":
        return {}
    try:
        doc = json.loads(metrics_json)
    except ValueError:
        return {}
    return {k: float(v) for k, v in doc.items() if k in folds and isinstance(v, (int, float))
            and not isinstance(v, bool)} if isinstance(doc, dict) else {}


@dataclass
class JobProgress:
    """Counters over one attempt's ranks; ``moved(old, new)`` for every change of a rank record."""

    world_size: int
    phases: Counter = field(default_factory=Counter)
    running: int = 0          # passed "running" and not exited
    exited: int = 0
    exited_ok: int = 0
    passed_running: int = 0   # passed "running" (exited ones included)
    reports: int = 0
    failed: dict[int, RankRecord] = field(default_factory=dict)
    _failed_heap: list[int] = field(default_factory=list)
    _causes: list[tuple[int, int]] = field(default_factory=list)  # (failure_weight, rank) of the failed ranks
    at_step: dict[int, set[int]] = field(default_factory=dict)   # step -> ranks whose latest step it is
    min_step: int = 0
    max_step: int = 0
    _acc: dict[int, _StepAcc] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)        # of the last job-level step event
    last_step: _StepAcc | None = None                            # the newest completed step's figures (gauges)
    latest: dict[str, float] = field(default_factory=dict)       # each figure's newest value (val_loss: not every step)
    folds: Mapping[str, str] = field(default_factory=dict)       # the job's kind's figures (``JobKind.figures``)
    step_times: Histogram = field(default_factory=lambda: Histogram(STEP_TIME_BUCKETS))  # completed steps' durations
    run_times: RunTimes = field(default_factory=RunTimes)   # ... their median and range, for the summary
    _last_time: float | None = None   # the last duration observed (fills a jump that knows none)
    _owed: int = 0                    # completed steps with no duration known yet (observed with the first one)
    first_step: int = 1 << 62  # the lowest step a rank first reported in this attempt (> 1 after a resume)
    emitted_step: int = 0     # the last step a job-level event was written for (survives restarts)
    advanced_at: float | None = None  # when a rank last changed phase or step here (None: not seen yet)
    failing_since: float | None = None   # when a failed rank was first seen (a peer error waits for its cause)
    pace: Pace = field(default_factory=Pace)   # step intervals and hang evidence (``coordinator.diagnosis.pace``)
    preflight: Preflight | None = None         # rank 0's pre-flight outcome (``coordinator.diagnosis.preflight``)
    hang: list[int] = field(default_factory=list)   # the ranks the attempt's hang pointed at (``coordinator.diagnosis.hangs``)
    skew: ComputeSkew | None = None   # stragglers by compute time; made at the first compute_s reported
    straggler_told: dict[int, int] = field(default_factory=dict)   # rank -> 1: its flag told, 2: its clearing too
    peers: tuple[int, int, Callable[[int], str]] | None = None  # (stride, pp, node_of): see ``bind``
    _shown: tuple | None = None   # (key, when, stragglers, failing) of the last summary (``_shown_ranks``)

    def __post_init__(self) -> None:
        self.phases["pending"] = self.world_size
        self.at_step[0] = set(range(self.world_size)) if self.world_size <= 1 << 20 else set()

    @classmethod
    def taught(cls, world_size: int, learned: Learned) -> "JobProgress":
        """A new attempt's counters, its hang judgement sharing what the job's earlier attempts taught it."""
        progress = cls(world_size)
        progress.pace.learned = learned
        return progress

    # -- updates --------------------------------------------------------------
    def advance(self, now: float) -> None:
        """A rank changed phase or step at ``now``: the job moved (the hang judgement's clock)."""
        self.advanced_at = now
        self.pace.moved(now)

    def refeed(self, ranks: Iterable[RankRecord], now: float) -> None:
        """After a resync: the hang evidence the kept records hold goes back into the rebuilt judgement."""
        for r in ranks:
            if not r.exited and r.process:
                self.pace.process(r.rank, r.process, now)
            if not r.exited and r.collectives:
                self.pace.evidence(r.rank, r.collectives, r.stack)

    def bind(self, job: JobRecord) -> None:
        """Learn the job's pipeline stages, rank -> node and its kind's figures (once per attempt; the report
        path calls it for every run of reports, so it returns at once after the first)."""
        if self.peers is None:
            stride, pp = pipeline_peers(job)
            nodes, slots = list(job.nodes), job.slots_per_node
            self.peers = (stride, pp, lambda r: nodes[node_of_rank(r, slots)]
                          if slots and node_of_rank(r, slots) < len(nodes) else "")
            kind = registry.kinds().get(job.spec.kind)
            self.folds = folds_of(kind.figures) if kind is not None else {}

    def compute_sample(self, rank: int, compute_s: float) -> None:
        """One rank's compute time of its latest step (``RankStatus.compute_s``)."""
        if self.skew is None:
            stride, pp, node_of = self.peers or (1, 1, None)
            self.skew = ComputeSkew(self.world_size, stride, pp, node_of)
        self.skew.sample(rank, compute_s)

    def moved(self, old: RankRecord | None, new: RankRecord, stopped: bool = False) -> int | None:
        """Account for one rank going from ``old`` (None: never reported) to ``new``; ``stopped``: its exit is its
        daemon's stop on the coordinator's request after the attempt ended (a cancel): counted neither failed nor
        exited 0.

        Returns the new slowest step when it advanced (a job-level step event is due), else None.
        """
        self.reports += 1
        o_phase, o_exited, o_step = (old.phase, old.exited, old.step) if old else ("pending", False, 0)
        if o_phase != new.phase:
            self.phases[o_phase] -= 1
            if not self.phases[o_phase]:
                del self.phases[o_phase]
            self.phases[new.phase] += 1
        o_run = _passed_running(o_phase, o_exited)
        n_run = _passed_running(new.phase, new.exited)
        self.passed_running += n_run - o_run
        self.running += (n_run and not new.exited) - (o_run and not o_exited)
        if new.exited and not o_exited:
            self.exited += 1
            if stopped:
                pass
            elif is_failed(new):
                self.failed[new.rank] = new
                heapq.heappush(self._failed_heap, new.rank)
                heapq.heappush(self._causes, (failure_weight(new), new.rank))
            else:
                self.exited_ok += 1
        if new.step != o_step:
            return self.moved_step(new.rank, o_step, new.step)
        return None

    def started(self, count: int, phase: str) -> None:
        """``count`` ranks never heard in this attempt reported ``phase``, alive at step 0: ``moved(None, new)``
        for each of them at once."""
        self.reports += count
        if phase != "pending":
            self.phases["pending"] -= count
            if not self.phases["pending"]:
                del self.phases["pending"]
            self.phases[phase] += count
        if _passed_running(phase, False):
            self.passed_running += count
            self.running += count

    def step_figures(self, step: int, st: pb.RankStatus | RankRecord, rank: int | None = None) -> None:
        """Fold rank ``rank``'s (default: ``st.rank``'s) figures of ``step`` into that step's aggregate (kept
        for a window of steps).

        ``st`` is a wire ``RankStatus``: its ``figures`` map and ``step_time_s``/``compute_s``, set by the
        daemon (``worker.uplink.reporting.step_figures``); a ``RankRecord`` (in-process reports) its ``metrics_json``'s
        numbers the kind folds, and no time. A status that stands for several ranks (``RankStatus.ranks``) is
        folded once for each.
        """
        if isinstance(st, RankRecord):
            figures = _numbers(st.metrics_json, self.folds)
            if figures and self.min_step <= step <= self.min_step + STEP_WINDOW:
                self._acc.setdefault(step, _StepAcc()).fold(figures, self.folds, None)
            return
        if st.HasField("compute_s"):
            self.compute_sample(st.rank if rank is None else rank, st.compute_s)
        if step < self.min_step or step > self.min_step + STEP_WINDOW:
            return
        has_time = st.HasField("step_time_s")
        if has_time or st.figures:
            acc = self._acc.get(step)
            if acc is None:
                acc = self._acc[step] = _StepAcc()
            acc.fold(st.figures, self.folds, st.step_time_s if has_time else None)

    def moved_step(self, rank: int, old: int, new: int) -> int | None:
        """A rank's latest step went from ``old`` to ``new``; the new slowest step when it advanced."""
        ranks = self.at_step.get(old)
        if ranks is not None:
            ranks.discard(rank)
            if not ranks:
                del self.at_step[old]
        self.at_step.setdefault(new, set()).add(rank)
        if old == 0 and 0 < new < self.first_step:
            self.first_step = new
        if new > self.max_step:
            self.max_step = new
        if old == self.min_step and old not in self.at_step:
            before = self.min_step
            self.min_step = min(self.at_step)
            if self.min_step > before:
                self._completed(before)
                if self.skew is not None:
                    self.skew.judge()
                return self.min_step
        return None

    def _completed(self, before: int) -> None:
        """Steps ``before + 1 .. min_step`` are complete: each one's duration into ``step_times`` once, the
        slowest step's figures and the newest validation loss kept, their aggregates dropped. A step with
        no duration (every rank's report of it coalesced away by its daemon) is observed with the mean of
        the durations known in this jump, or the last one observed; steps that arrive before any duration is known
        are owed and observed with the first one. Steps before the attempt's first reported one (a resume)
        are not its own. O(steps of metrics kept)."""
        before = max(before, self.first_step - 1)   # an attempt that resumed ran no step before its first
        done = sorted(s for s in self._acc if s <= self.min_step)
        accs = [self._acc.pop(s) for s in done]
        known = [a.time_max for s, a in zip(done, accs) if s > before and a.time_max is not None]
        for dt in known:
            self.step_times.observe(dt)
            self.run_times.observe(dt)
        missing = self.min_step - before - len(known) + self._owed
        fill = sum(known) / len(known) if known else self._last_time
        self._owed = 0
        if missing > 0 and fill is not None:
            self.step_times.observe(fill, missing)
        elif missing > 0:
            self._owed = missing  # no duration known yet: observed with the first one that arrives
        self._last_time = known[-1] if known else self._last_time
        for acc in accs:
            self.latest.update(acc.figures)
        if accs:  # the gauges (loss, tokens/s, step time) hold the newest step that reported figures: a step
            self.last_step = accs[-1]  # whose reports a loaded daemon coalesced away leaves no gap in them
        acc = accs[-1] if done and done[-1] == self.min_step else None
        self.metrics = {"step": self.min_step, **(acc.as_dict() if acc else {})}  # this step's own, or none

    # -- questions ------------------------------------------------------------
    def likely_cause(self) -> RankRecord | None:
        """The failed rank most likely to have caused the others' failures (``failure_weight``, then the lowest)."""
        return self.failed[self._causes[0][1]] if self._causes else None

    def all_running(self) -> bool:
        return self.passed_running == self.world_size

    def all_succeeded(self) -> bool:
        return self.exited_ok == self.world_size

    def summary(self) -> JobSummary:
        stragglers, failing = self._shown_ranks()
        return JobSummary(
            phases=dict(self.phases), running=self.running, exited=self.exited, failed=len(self.failed),
            min_step=self.min_step, max_step=self.max_step, stragglers=stragglers, failing=failing,
            metrics={**self.metrics, **self.run_times.figures()} if self.metrics else {}, reports=self.reports,
            slow=self.skew.worst() if self.skew is not None else [], preflight=self.preflight, hang=list(self.hang),
            stall=self.pace.stall,
        )

    def _shown_ranks(self) -> tuple[list[int], list[RankRecord]]:
        """The lowest ranks at the slowest step (when others are ahead) and the lowest failed ones, at most
        ``SHOWN`` each. Picking them is O(ranks at that step): while a big attempt starts, that is every rank, and a
        ``ctl watch`` polling GetJob each 0.1 s at 65,536 ranks cost the coordinator ~5 ms a poll. So they are
        kept until the slowest step, its number of ranks or the number failed changes (at a given slowest step its
        set only shrinks; a failed rank stays failed), and for at most ``SHOWN_KEEP_S``."""
        lagging = self.at_step.get(self.min_step, ()) if self.max_step > self.min_step else ()
        key = (self.min_step, self.max_step > self.min_step, len(lagging), len(self._failed_heap))
        now = time.monotonic()
        kept = self._shown
        if kept is None or kept[0] != key or now - kept[1] > SHOWN_KEEP_S:
            kept = self._shown = (key, now, heapq.nsmallest(SHOWN, lagging),
                                  [self.failed[r] for r in heapq.nsmallest(SHOWN, self._failed_heap)])
        return list(kept[2]), list(kept[3])

    def slow_changes(self) -> list[tuple[SlowRank, bool]]:
        """Ranks flagged (True) or unflagged (False) as stragglers by compute time since the last call."""
        return self.skew.take_changes() if self.skew is not None and self.skew.changes else []
