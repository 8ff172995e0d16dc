"""Checkpoints on request: every rank saves at the same step even when the daemon's request reached one late."""

from __future__ import annotations

from pathlib import Path

from rankctl.contract.files.rankfiles import write_control
from rankctl.contract.files.rankfiles import CheckpointRequests


def test_ranks_that_saw_the_request_late_save_at_the_step_the_others_save_at(tmp_path: Path) -> None:
    run = str(tmp_path)
    early, late = CheckpointRequests(run, 0), CheckpointRequests(run, 1)
    write_control(run, 0, {"checkpoint_at": 7})          # rank 1's request is still on its way
    saved: dict[int, int] = {}
    for step in range(5, 12):
        if step == 9:
            write_control(run, 1, {"checkpoint_at": 7})  # it arrives after the step asked for
        mine = early.poll()
        theirs = late.poll()
        top = max(-1 if mine is None else mine, -1 if theirs is None else theirs)   # the world all-reduce (max)
        for rank, req in ((0, early), (1, late)):
            at = req.agreed(step, lambda _v: top)
            if at is not None:
                saved.setdefault(rank, step)
                req.saved(at)
    assert saved == {0: 7, 1: 7}                           # without agreement rank 1 saved alone at step 9


def test_a_request_already_served_is_not_saved_again(tmp_path: Path) -> None:
    run = str(tmp_path)
    req = CheckpointRequests(run, 0)
    write_control(run, 0, {"checkpoint_at": 3})
    assert req.agreed(3, None) == 3
    req.saved(3)
    write_control(run, 0, {"checkpoint_at": 3})          # a resend after a reconnect
    assert req.agreed(4, None) is None and req.agreed(5, lambda v: v) is None
    write_control(run, 0, {"checkpoint_at": 9})          # the next drain's
    assert req.agreed(8, lambda v: v) is None and req.agreed(9, lambda v: v) == 9
