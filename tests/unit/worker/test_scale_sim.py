"""The simulated daemons of ``bench/scale.py`` send what a real daemon sends: the restart batch they build directly
is what ``worker.uplink.reportfold.fold`` makes of the phase reports a daemon would fold (pure, no processes)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.uplink.reportfold import fold

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from scale_sim import Daemon, Sim  # noqa: E402 - bench/ is no package


def daemon(index: int) -> Daemon:
    sim = Sim(argparse.Namespace(step_rate=1.0, total=8, slots=4, steps=3, streams_per_channel=32))
    d = Daemon(sim, index, channels=[])
    d.folds = True
    return d


def timeless(reports: list[pb.RankReport]) -> list[bytes]:
    out = []
    for rep in reports:
        copy = pb.RankReport()
        copy.CopyFrom(rep)
        copy.status.ClearField("update_time")
        out.append(copy.SerializeToString(deterministic=True))
    return out


def first_steps(d: Daemon, ranks: list[int]) -> list[pb.RankReport]:
    return [d.report("job-1", 2, r, "running", 1, d.sim.metrics(1, r == ranks[0], r - ranks[0]), first_step=True)
            for r in ranks]


def test_the_restart_batch_is_the_daemons_folded_batch() -> None:
    ranks = [4, 5, 6, 7]
    built, folded = daemon(1), daemon(1)
    direct = built.restart_batch("job-1", 2, ranks) + first_steps(built, ranks)
    phases = [folded.report("job-1", 2, r, p, 0) for p in ("rendezvous", "groups", "running") for r in ranks]
    wire = fold(phases + first_steps(folded, ranks))
    assert len(direct) == 1 + len(ranks) and direct[0].status.ranks == len(ranks)
    assert timeless(direct) == timeless(wire)
    assert built.seq == folded.seq == 4 * len(ranks)


def test_a_daemon_that_does_not_fold_sends_every_phase_report() -> None:
    d = daemon(0)
    d.folds = False   # an older coordinator (--coordinator-pythonpath)
    batch = d.restart_batch("job-1", 2, [0, 1])
    assert [(r.status.rank, r.status.phase, r.seq) for r in batch] == [
        (0, "rendezvous", 1), (1, "rendezvous", 2), (0, "groups", 3), (1, "groups", 4), (0, "running", 5),
        (1, "running", 6)]


def test_step_batches_go_unfolded_because_fold_leaves_them_as_they_are() -> None:
    d = daemon(0)
    step = [d.report("job-1", 1, r, "running", 5, d.sim.metrics(5, r == 0, r)) for r in range(4)]
    assert timeless(fold(step)) == timeless(step)
