"""Where a job's ranks are, kept as counters: constant time per report, whatever the job's size.

``JobProgress`` is updated by the core on every applied rank report (``moved``) and answers
what used to need a scan of every rank: are all ranks running, have all exited 0, which is
the lowest failed rank, what is the slowest rank's step, which ranks lag. Step metrics are
aggregated per step (loss, tokens/s, step-time spread) so that one job-level ``step`` event
can be written when the slowest rank finishes a step. ``ComputeSkew`` flags stragglers by
compute time (ranks whose compute per step exceeds their peers' median for several steps).
Pure: no store, no clock.
"""

from __future__ import annotations

import heapq
import json
import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from rankctl.coordinator.histogram import Histogram
from rankctl.coordinator.records import PHASE_INDEX, RUNNING_INDEX, JobRecord, RankRecord
from rankctl.parallel.placement import node_of_rank

SHOWN = 16            # stragglers and failing ranks in a summary
STEP_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)  # seconds
STEP_WINDOW = 256     # steps of metrics kept ahead of the slowest rank

# Stragglers by compute time (``ComputeSkew``). A rank's compute is the median of its last SLOW_WINDOW
# step samples (one step's figure swings with scheduling and with where a pause lands: in compute or
# in a collective). It is *over* when it exceeds its peers' median by both margins: relative, so that
# the rule holds for any step length, and absolute, because below ~10 ms a difference is one or two
# scheduler time slices or a GC pause on a loaded host, not a slow rank.
SLOW_WINDOW = 5           # step samples per rank; judged once it has SLOW_LEAST of them
SLOW_LEAST = 3
SLOW_MARGIN = 0.3         # over: compute > median * (1 + SLOW_MARGIN) ...
SLOW_FLOOR_S = 0.010      # ... and compute - median > SLOW_FLOOR_S
SLOW_STEPS = 3            # flagged after this many consecutive over judgements
RECOVERED_MARGIN = 0.15   # a flagged rank is normal again at compute <= median * (1 + this) (or within
                          # the floor); unflagged after SLOW_STEPS such judgements in a row.
                          # Between the two margins it stays as it is (hysteresis: no flapping at the edge)
SLOW_EVENTS = SHOWN       # straggler events per completed step; more changes are counted in one more event


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


def last_error_line(error: str) -> str:
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return lines[-1] if lines else "no error reported"


def failure_reason(r: RankRecord) -> str:
    return f"rank {r.rank} on node {r.node} exited with code {r.exit_code}: {last_error_line(r.error)}"


def is_failed(r: RankRecord) -> bool:
    return r.exited and (r.exit_code != 0 or r.phase == "failed")


def _number(v: Any) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


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


@dataclass(frozen=True)
class SlowRank:
    """A straggler by compute time: its recent compute (its window's median), its peers' median then, and
    its over judgements in a row."""

    rank: int
    node: str
    compute_s: float
    median_s: float
    steps: int

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "compute_s": self.compute_s, "median_s": self.median_s,
                "steps": self.steps}


def pipeline_peers(job: JobRecord) -> tuple[int, int]:
    """(stride, pp): rank r is in pipeline stage ``(r // stride) % pp`` of the job's layout; (1, 1) when
    the spec has no pipeline (or no layout the coordinator can read: then all ranks are peers)."""
    from rankctl.parallel.layout import LayoutError, ParallelConfig

    p = (job.spec or {}).get("parallel") or {}
    try:
        cfg = ParallelConfig(world_size=job.world_size, tp=p.get("tp", 1), pp=p.get("pp", 1), cp=p.get("cp", 1),
                             ep=p.get("ep", 1), etp=p.get("etp"), **({"order": p["order"]} if p.get("order") else {}))
        grid = cfg.dense_grid
        return (grid.strides[grid.tokens.index("pp")], cfg.pp) if cfg.pp > 1 else (1, 1)
    except (LayoutError, TypeError, ValueError, AttributeError):
        return 1, 1


class ComputeSkew:
    """Stragglers by compute time over one attempt's ranks (runtime.status: ``compute_s`` of a step).

    Per report (``sample``): the rank's compute_s into its window of SLOW_WINDOW and a "fresh" mark,
    O(1). A rank's first sample of the attempt (its first step: warm-up, or the step after a resume)
    is skipped. Daemons coalesce step reports (the newest step per rank per tick), so samples of one
    step from every rank cannot be relied on; each rank's recent compute (its window's median, once
    it holds SLOW_LEAST samples) is judged instead, against the median of its peers' recent compute
    (they step together, so these windows cover the same or adjacent steps).

    Judged (``judge``) when the slowest rank finishes a step and at least half of the sampled ranks
    have a fresh sample since the last judgement: each judgement scans every rank once (O(world log
    world) in numpy, a sort per pipeline stage), and is paid for by at least world/2 reports, so a
    report costs O(1) amortized; memory is a few numbers per rank. Peers are the ranks of the same
    pipeline stage (the last stage also computes the loss, the first one embeds) when that stage has
    at least 2 sampled ranks, else every rank of the job. The median is the lower one (of an even
    count, the lower middle value), so that in a pair the faster rank is the reference.

    A rank with a fresh sample is over when compute > median·(1 + SLOW_MARGIN) and compute - median >
    SLOW_FLOOR_S; it is flagged after SLOW_STEPS over judgements in a row, and unflagged after
    SLOW_STEPS in a row within median·(1 + RECOVERED_MARGIN) (or the floor).
    """

    def __init__(self, world_size: int, stride: int = 1, pp: int = 1,
                 node_of: Callable[[int], str] | None = None) -> None:
        self.world_size = world_size
        if pp < 1 or stride < 1 or world_size % (stride * pp):
            stride, pp = 1, 1
        self.stride, self.pp = stride, pp
        self.node_of = node_of or (lambda rank: "")
        self._window = array("d", [math.nan]) * (world_size * SLOW_WINDOW)   # rank-major; NaN: no sample
        self._count = array("q", [0]) * world_size            # samples that count (the warm-up one not)
        self._fresh = bytearray(world_size)                   # 1: a sample since the last judgement
        self._seen = bytearray(world_size)                    # 1: the rank's warm-up sample was skipped
        self.sampled = 0          # ranks with a sample that counts
        self.fresh = 0            # ranks with a fresh sample
        self._over = np.zeros(world_size, np.int32)           # over samples in the current run
        self._ok = np.zeros(world_size, np.int32)             # normal samples in a row of a flagged rank
        self._flagged = np.zeros(world_size, bool)
        self.slow: dict[int, SlowRank] = {}
        self.changes: list[tuple[SlowRank, bool]] = []        # (rank's figures, flagged) since the last take
        self.judged = 0           # judgements made
        self.work = 0             # ranks scanned by them (tests: stays proportional to the reports)

    def sample(self, rank: int, compute_s: float) -> None:
        """One rank's compute_s of its latest step (its window keeps the last SLOW_WINDOW)."""
        if not 0 <= rank < self.world_size or not compute_s >= 0.0 or compute_s == math.inf:
            return
        if not self._seen[rank]:
            self._seen[rank] = 1   # the rank's first step: warm-up (or resume), never judged
            return
        n = self._count[rank]
        if not n:
            self.sampled += 1
        self._window[rank * SLOW_WINDOW + n % SLOW_WINDOW] = compute_s
        self._count[rank] = n + 1
        if not self._fresh[rank]:
            self._fresh[rank] = 1
            self.fresh += 1

    def due(self) -> bool:
        return self.sampled >= 2 and 2 * self.fresh >= self.sampled

    def judge(self) -> None:
        """Judge each rank with a fresh sample against its peers (call when the slowest rank finished a step)."""
        if not self.due():
            return
        self.judged += 1
        self.work += self.world_size
        window = np.frombuffer(self._window, dtype=np.float64).reshape(self.world_size, SLOW_WINDOW)
        recent = _lower_median(window, SLOW_LEAST)   # each rank's recent compute (NaN: too few samples)
        fresh = np.frombuffer(self._fresh, dtype=np.uint8).astype(bool)
        median = self._medians(recent)
        ok = ~np.isnan(median)
        fresh &= ok & ~np.isnan(recent)
        with np.errstate(invalid="ignore"):
            over = fresh & (recent > median * (1.0 + SLOW_MARGIN)) & (recent - median > SLOW_FLOOR_S)
            normal = fresh & ((recent <= median * (1.0 + RECOVERED_MARGIN)) | (recent - median <= SLOW_FLOOR_S))
        flagged = self._flagged
        self._over[over] += 1
        self._over[fresh & ~over & ~flagged] = 0           # a flagged rank keeps its count until unflagged
        self._ok[fresh & flagged & normal] += 1
        self._ok[fresh & flagged & ~normal] = 0
        newly = ~flagged & (self._over >= SLOW_STEPS)
        gone = flagged & (self._ok >= SLOW_STEPS)
        flagged |= newly
        flagged &= ~gone
        self._ok[newly | gone] = 0
        for r in np.flatnonzero(gone).tolist():
            fig = SlowRank(r, self.slow.pop(r).node, float(recent[r]), float(median[r]), int(self._over[r]))
            self._over[r] = 0
            self.changes.append((fig, False))
        for r in np.flatnonzero(newly).tolist():
            self.slow[r] = fig = SlowRank(r, self.node_of(r), float(recent[r]), float(median[r]), int(self._over[r]))
            self.changes.append((fig, True))
        for r in np.flatnonzero(fresh & flagged & ~newly).tolist():   # the flagged ones' current figures
            self.slow[r] = SlowRank(r, self.slow[r].node, float(recent[r]), float(median[r]), int(self._over[r]))
        self._fresh[:] = bytes(self.world_size)
        self.fresh = 0

    def _medians(self, recent: np.ndarray) -> np.ndarray:
        """Each rank's peers' lower median of their recent compute (NaN: fewer than 2 such peers)."""
        pp, stride = self.pp, self.stride
        by_stage = recent.reshape(-1, pp, stride).transpose(1, 0, 2).reshape(pp, -1)
        whole = _lower_median(recent.reshape(1, -1))[0]
        stage = _lower_median(by_stage) if pp > 1 else np.array([whole])
        stage = np.where(np.isnan(stage), whole, stage)
        return np.broadcast_to(stage[None, :, None], (self.world_size // (pp * stride), pp, stride)).reshape(-1)

    def take_changes(self) -> list[tuple[SlowRank, bool]]:
        changes, self.changes = self.changes, []
        return changes

    def worst(self, n: int = SHOWN) -> list[SlowRank]:
        """The ``n`` flagged ranks with the largest compute over their median, worst first."""
        return heapq.nlargest(n, self.slow.values(),
                              key=lambda s: (s.compute_s / s.median_s if s.median_s > 0 else math.inf, -s.rank))


def _lower_median(rows: np.ndarray, least: int = 2) -> np.ndarray:
    """Per row, the lower median of its numbers (NaN ignored; NaN when a row has fewer than ``least``)."""
    ordered = np.sort(rows, axis=1)               # NaN last
    n = (~np.isnan(ordered)).sum(axis=1)
    out = ordered[np.arange(len(ordered)), np.maximum(n - 1, 0) // 2]
    return np.where(n >= least, out, np.nan)


@dataclass
class _StepAcc:
    """Metrics of one step, folded over the ranks that reported it."""

    loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float | None = None
    time_min: float | None = None
    time_max: float | None = None
    time_sum: float = 0.0     # of the ranks' step times, for their mean (metrics)
    time_n: int = 0

    def add(self, m: dict[str, Any]) -> None:
        """Fold a metrics dict (numbers only; ``step_time_s`` or ``step_time``)."""
        self.fold(*(_number(m.get(k)) for k in ("loss", "val_loss", "tokens_per_s")),
                  _number(m.get("step_time_s", m.get("step_time"))))

    def fold(self, loss: float | None, val: float | None, tps: float | None, dt: float | None) -> None:
        if self.loss is None and loss is not None:
            self.loss = float(loss)
        if self.val_loss is None and val is not None:
            self.val_loss = float(val)
        if tps is not None:
            self.tokens_per_s = tps if self.tokens_per_s is None else min(self.tokens_per_s, tps)
        if dt is not None:
            self.time_min = dt if self.time_min is None or dt < self.time_min else self.time_min
            self.time_max = dt if self.time_max is None or dt > self.time_max else self.time_max
            self.time_sum += dt
            self.time_n += 1

    @property
    def time_mean(self) -> float | None:
        return self.time_sum / self.time_n if self.time_n else None

    def as_dict(self) -> dict[str, Any]:
        out = {"loss": self.loss, "tokens_per_s": self.tokens_per_s,
               "step_time_min": self.time_min, "step_time_max": self.time_max}
        if self.val_loss is not None:
            out["val_loss"] = self.val_loss
        return {k: v for k, v in out.items() if v is not None}


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
    at_step: dict[int, set[int]] = field(default_factory=dict)   # step -> ranks whose latest step it is
    min_step: int = 0
    max_step: int = 0
    _acc: dict[int, _StepAcc] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)        # of the last job-level step event
    last_step: _StepAcc | None = None                            # the figures behind ``metrics``
    val_loss: float | None = None                                # the latest step's that had one
    step_times: Histogram = field(default_factory=lambda: Histogram(STEP_TIME_BUCKETS))  # completed steps' durations
    emitted_step: int = 0     # the last step a job-level event was written for (survives restarts)
    advanced_at: float = 0.0  # when a rank last changed phase or step (the hang detector's clock)
    skew: ComputeSkew | None = None   # stragglers by compute time; made at the first compute_s reported
    peers: tuple[int, int, Callable[[int], str]] | None = None  # (stride, pp, node_of): see ``bind``

    def __post_init__(self) -> None:
        self.phases["pending"] = self.world_size
        self.at_step[0] = set(range(self.world_size)) if self.world_size <= 1 << 20 else set()

    # -- updates --------------------------------------------------------------
    def bind(self, job: JobRecord) -> None:
        """Learn the job's pipeline stages and rank -> node (once per attempt; the report path calls it
        for every run of reports, so it returns at once after the first)."""
        if self.peers is None:
            stride, pp = pipeline_peers(job)
            nodes, slots = list(job.nodes), job.slots_per_node
            self.peers = (stride, pp, lambda r: nodes[node_of_rank(r, slots)]
                          if slots and node_of_rank(r, slots) < len(nodes) else "")

    def compute_sample(self, rank: int, compute_s: float) -> None:
        """One rank's compute time of its latest step (``RankStatus.compute_s``)."""
        if self.skew is None:
            stride, pp, node_of = self.peers or (1, 1, None)
            self.skew = ComputeSkew(self.world_size, stride, pp, node_of)
        self.skew.sample(rank, compute_s)

    def moved(self, old: RankRecord | None, new: RankRecord) -> int | None:
        """Account for one rank going from ``old`` (None: never reported) to ``new``.

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
            if is_failed(new):
                self.failed[new.rank] = new
                heapq.heappush(self._failed_heap, new.rank)
            else:
                self.exited_ok += 1
        if new.step != o_step:
            return self.moved_step(new.rank, o_step, new.step)
        return None

    def step_figures(self, step: int, st: Any) -> None:
        """Fold one rank's figures of ``step`` into that step's aggregate (kept for a window of steps).

        ``st`` is a wire ``RankStatus`` (typed ``loss``/``val_loss``/``tokens_per_s``/``step_time_s``,
        set by the daemon) or anything with a ``metrics_json`` (parsed only then).
        """
        has = getattr(st, "HasField", None)
        if has is not None and has("compute_s"):
            self.compute_sample(st.rank, st.compute_s)
        if step < self.min_step or step > self.min_step + STEP_WINDOW:
            return
        if has is not None and (has("step_time_s") or has("tokens_per_s") or has("loss")):
            acc = self._acc.get(step)
            if acc is None:
                acc = self._acc[step] = _StepAcc()
            acc.fold(st.loss if has("loss") else None, st.val_loss if has("val_loss") else None,
                     st.tokens_per_s if has("tokens_per_s") else None,
                     st.step_time_s if has("step_time_s") else None)
            return
        self.step_metrics(step, st.metrics_json)

    def step_metrics(self, step: int, metrics_json: str) -> None:
        """Fold one rank's metrics (JSON text) of ``step`` into that step's aggregate."""
        if step < self.min_step or step > self.min_step + STEP_WINDOW or len(metrics_json) < 3:
            return
        try:
            m = json.loads(metrics_json)
        except ValueError:
            return
        if isinstance(m, dict):
            acc = self._acc.get(step)
            if acc is None:
                acc = self._acc[step] = _StepAcc()
            acc.add(m)

    def moved_step(self, rank: int, old: int, new: int) -> int | None:
        """A rank's latest step went from ``old`` to ``new``; the new slowest step when it advanced."""
        ranks = self.at_step.get(old)
        if ranks is not None:
            ranks.discard(rank)
            if not ranks:
                del self.at_step[old]
        self.at_step.setdefault(new, set()).add(rank)
        if new > self.max_step:
            self.max_step = new
        if old == self.min_step and old not in self.at_step:
            before = self.min_step
            self.min_step = min(self.at_step)
            if self.min_step > before:
                acc = self.last_step = self._acc.get(self.min_step)
                if acc is not None and acc.val_loss is not None:
                    self.val_loss = acc.val_loss
                if acc is not None and acc.time_max is not None:
                    self.step_times.observe(acc.time_max)
                self.metrics = {"step": self.min_step, **(acc.as_dict() if acc else {})}
                for s in [s for s in self._acc if s <= self.min_step]:
                    del self._acc[s]
                if self.skew is not None:
                    self.skew.judge()
                return self.min_step
        return None

    # -- questions ------------------------------------------------------------
    def lowest_failed(self) -> RankRecord | None:
        return self.failed[self._failed_heap[0]] if self._failed_heap else None

    def all_running(self) -> bool:
        return self.passed_running == self.world_size

    def all_succeeded(self) -> bool:
        return self.exited_ok == self.world_size

    def summary(self) -> JobSummary:
        stragglers: list[int] = []
        if self.max_step > self.min_step:
            stragglers = heapq.nsmallest(SHOWN, self.at_step.get(self.min_step, ()))
        failing = [self.failed[r] for r in heapq.nsmallest(SHOWN, self._failed_heap)]
        return JobSummary(
            phases=dict(self.phases), running=self.running, exited=self.exited, failed=len(self.failed),
            min_step=self.min_step, max_step=self.max_step, stragglers=stragglers, failing=failing,
            metrics=dict(self.metrics), reports=self.reports,
            slow=self.skew.worst() if self.skew is not None else [],
        )

    def slow_changes(self) -> list[tuple[SlowRank, bool]]:
        """Ranks flagged (True) or unflagged (False) as stragglers by compute time since the last call."""
        return self.skew.take_changes() if self.skew is not None and self.skew.changes else []
