"""Stragglers by compute time (``ComputeSkew``): ranks whose compute per step exceeds their peers' median
for several steps, judged only after the warm-up. Pure: no store, no clock; a few numbers per rank.

A rank's compute is the median of its last SLOW_WINDOW step samples (one step's figure swings with
scheduling and with where a pause lands: in compute or in a collective). It is *over* when it exceeds
its peers' median by both margins: relative, so that the rule holds for any step length, and absolute,
because below ~10 ms a difference is one or two scheduler time slices or a GC pause on a loaded host,
not a slow rank.

Warm-up: the first WARMUP_STEPS step samples of each rank in an attempt (a new process each attempt:
its first steps after a start or a resume) are never counted: caches and allocators fill, and a rank
forked last computes while its peers' start-up still competes for the CPU (issue 23: a 4-rank job's
last rank flagged in its first steps, then flapping). No rank is judged before every rank of its
stage (its peers; the job's ranks when the stage has one) has passed its warm-up and given SLOW_LEAST
samples since: until then a stage's median would be that of a few of its ranks, or the job's.
"""

from __future__ import annotations

import heapq
import math
from array import array
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from rankctl.coordinator.model.records import JobRecord

SHOWN = 16                # stragglers and failing ranks in a summary
WARMUP_STEPS = 3          # step samples of each rank (per attempt) before any counts
SLOW_WINDOW = 5           # step samples per rank; judged once it has SLOW_LEAST of them
SLOW_LEAST = 3
SLOW_MARGIN = 0.3         # over: compute > median * (1 + SLOW_MARGIN) ...
SLOW_FLOOR_S = 0.010      # ... and compute - median > SLOW_FLOOR_S
SLOW_STEPS = 3            # flagged after this many consecutive over judgements
RECOVERED_MARGIN = 0.15   # a flagged rank is normal again at compute <= median * (1 + this) (or within
                          # the floor); unflagged after RECOVERED_STEPS such judgements in a row.
                          # Between the two margins it stays as it is (hysteresis: no flapping at the edge)
RECOVERED_STEPS = 5       # a whole window: a flag clears slower than it is raised (a throttled rank's
                          # compute dips for a few steps when its stops land in collectives, not in compute)
SLOW_EVENTS = SHOWN       # straggler events per completed step; more changes are counted in one more event


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

    p = job.spec.parallel
    try:
        cfg = ParallelConfig(world_size=job.world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, order=p.order)
        grid = cfg.dense_grid
        return (grid.strides[grid.tokens.index("pp")], cfg.pp) if cfg.pp > 1 else (1, 1)
    except (LayoutError, TypeError, ValueError, AttributeError):
        return 1, 1


class ComputeSkew:
    """Stragglers by compute time over one attempt's ranks (runtime.status: ``compute_s`` of a step).

    Per report (``sample``): the rank's compute_s into its window of SLOW_WINDOW and a "fresh" mark,
    O(1); its first WARMUP_STEPS samples are skipped. Daemons coalesce step
    reports (the newest step per rank per tick), so samples of one step from every rank cannot be
    relied on; each rank's recent compute (its window's median, once it holds SLOW_LEAST samples) is
    judged instead, against the median of its peers' recent compute (they step together, so these
    windows cover the same or adjacent steps).

    Judged (``judge``) when the slowest rank finishes a step and at least half of the sampled ranks
    have a fresh sample since the last judgement: each judgement scans every rank once (O(world log
    world) in numpy, a sort per pipeline stage), and is paid for by at least world/2 reports, so a
    report costs O(1) amortized. Peers are the ranks of the same pipeline stage (the last stage also
    computes the loss, the first one embeds) when that stage has at least 2 sampled ranks, else every
    rank of the job. The median is the lower one (of an even count, the lower middle value), so that
    in a pair the faster rank is the reference. Only the ranks of a stage whose every rank has passed
    its warm-up are judged (the job's, for stages of one rank).

    A rank with a fresh sample is over when compute > median·(1 + SLOW_MARGIN) and compute - median >
    SLOW_FLOOR_S; it is flagged after SLOW_STEPS over judgements in a row, and unflagged after
    RECOVERED_STEPS in a row within median·(1 + RECOVERED_MARGIN) (or the floor).
    """

    def __init__(self, world_size: int, stride: int = 1, pp: int = 1,
                 node_of: Callable[[int], str] | None = None) -> None:
        self.world_size = world_size
        if pp < 1 or stride < 1 or world_size % (stride * pp):
            stride, pp = 1, 1
        self.stride, self.pp = stride, pp
        self.node_of = node_of or (lambda rank: "")
        self._window = array("d", [math.nan]) * (world_size * SLOW_WINDOW)   # rank-major; NaN: no sample
        self._count = array("q", [0]) * world_size            # samples that count (not the warm-up ones)
        self._fresh = bytearray(world_size)                   # 1: a sample since the last judgement
        self._warming = bytearray([WARMUP_STEPS]) * world_size  # warm-up samples each rank has still to give
        self._cold = np.full(pp, world_size // pp, np.int64)  # per stage: ranks without a recent compute yet
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
        if self._warming[rank]:
            self._warming[rank] -= 1
            return
        n = self._count[rank]
        if not n:
            self.sampled += 1
        if n + 1 == SLOW_LEAST:
            self._cold[(rank // self.stride) % self.pp] -= 1
        self._window[rank * SLOW_WINDOW + n % SLOW_WINDOW] = compute_s
        self._count[rank] = n + 1
        if not self._fresh[rank]:
            self._fresh[rank] = 1
            self.fresh += 1

    def due(self) -> bool:
        return self.sampled >= 2 and 2 * self.fresh >= self.sampled

    def warm(self) -> np.ndarray:
        """Per rank: True when every rank of its stage (of the job, for one-rank stages) passed its warm-up
        and has a recent compute (SLOW_LEAST samples since)."""
        size = self.world_size // self.pp
        stage = (self._cold == 0) & ((size >= 2) | (int(self._cold.sum()) == 0))
        return self._per_rank(stage)

    def _per_rank(self, per_stage: np.ndarray) -> np.ndarray:
        pp, stride = self.pp, self.stride
        return np.broadcast_to(per_stage[None, :, None], (self.world_size // (pp * stride), pp, stride)).reshape(-1)

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
        fresh &= ~np.isnan(median) & ~np.isnan(recent) & self.warm()
        with np.errstate(invalid="ignore"):
            over = fresh & (recent > median * (1.0 + SLOW_MARGIN)) & (recent - median > SLOW_FLOOR_S)
            normal = fresh & ((recent <= median * (1.0 + RECOVERED_MARGIN)) | (recent - median <= SLOW_FLOOR_S))
        self._update_flags(fresh, over, normal, recent, median)
        self._fresh[:] = bytes(self.world_size)
        self.fresh = 0

    def _update_flags(self, fresh: np.ndarray, over: np.ndarray, normal: np.ndarray, recent: np.ndarray,
                      median: np.ndarray) -> None:
        """Count over and normal judgements in a row; flag, unflag and refresh the flagged ranks' figures."""
        flagged = self._flagged
        self._over[over] += 1
        self._over[fresh & ~over & ~flagged] = 0           # a flagged rank keeps its count until unflagged
        self._ok[fresh & flagged & normal] += 1
        self._ok[fresh & flagged & ~normal] = 0
        newly = ~flagged & (self._over >= SLOW_STEPS)
        gone = flagged & (self._ok >= RECOVERED_STEPS)
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

    def _medians(self, recent: np.ndarray) -> np.ndarray:
        """Each rank's peers' lower median of their recent compute (NaN: fewer than 2 such peers)."""
        pp, stride = self.pp, self.stride
        by_stage = recent.reshape(-1, pp, stride).transpose(1, 0, 2).reshape(pp, -1)
        whole = _lower_median(recent.reshape(1, -1))[0]
        stage = _lower_median(by_stage) if pp > 1 else np.array([whole])
        return self._per_rank(np.where(np.isnan(stage), whole, stage))

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
