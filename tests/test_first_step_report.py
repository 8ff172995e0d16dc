"""A rank's first step report is never coalesced away by the daemon: the coordinator takes the attempt's
first step from it (CI saw step 1 replaced by step 2, so the step histogram counted 39 of 40 steps)."""

from __future__ import annotations

from rankctl.contract.rankstatus import RankStatusRecord
from rankctl.worker.outbox import Outbox
from rankctl.worker.runs import Runs
from rankctl.worker.runstate import RunState


def test_the_first_step_stays_and_later_steps_coalesce() -> None:
    outbox = Outbox(maxlen=100)
    runs = Runs(node="n0", outbox=outbox, watch=None, replication=None, background=None,
                release_workdir=lambda digest: None, poll_interval=0.2, start_poll_interval=0.02, log=None)
    run = RunState(job_id="j-1", attempt=1, run_dir="/nowhere", ranks={0})
    for step in (0, 1, 2, 3):
        runs._report_record(run, RankStatusRecord(rank=0, phase="running", step=step))
    steps = [rep.status.step for rep in outbox.buffer.take(10)]
    assert steps == [0, 1, 3], steps  # 2 was replaced by 3; the first step, 1, was not
