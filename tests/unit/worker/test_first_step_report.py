"""A rank's first step report is never coalesced away by the daemon: the coordinator takes the attempt's
first step from it (CI saw step 1 replaced by step 2, so the step histogram counted 39 of 40 steps)."""

from __future__ import annotations

from rankctl.contract.files.rankstatus import RankStatusRecord
from rankctl.worker.uplink.outbox import Outbox
from rankctl.worker.runs.runs import Runs
from rankctl.worker.runs.runstate import RunState


def test_the_first_step_stays_and_later_steps_coalesce() -> None:
    outbox = Outbox(maxlen=100)
    runs = Runs(node="n0", outbox=outbox, watch=None, replication=None, background=None,
                release_workdir=lambda digest: None, poll_interval=0.2, start_poll_interval=0.02, log=None)
    run = RunState(job_id="j-1", attempt=1, run_dir="/nowhere", ranks={0})
    for step in (0, 1, 2, 3):
        runs._report_record(run, RankStatusRecord(rank=0, phase="running", step=step))
    steps = [rep.status.step for rep in outbox.buffer.take(10)]
    assert steps == [0, 1, 3], steps  # 2 was replaced by 3; the first step, 1, was not


def test_a_rank_ended_by_a_signal_says_so_in_its_last_error_line() -> None:
    """The log's last line is whatever the rank printed before the signal (a fragment of a step record, CI's
    outside probe saw): the exit report's last line names the signal, which the job's reason quotes."""
    import structlog

    from rankctl.coordinator.model.errortext import last_error_line

    outbox = Outbox(maxlen=100)
    runs = Runs(node="n0", outbox=outbox, watch=None, replication=None, background=None,
                release_workdir=lambda digest: None, poll_interval=0.2, start_poll_interval=0.02,
                log=structlog.get_logger("test"))
    run = RunState(job_id="j-1", attempt=1, run_dir="/nowhere", ranks={0, 1})
    runs._exited(run, 0, {"event": "exited", "rank": 0, "signal": "SIGKILL",
                          "log_tail": ['{"ts": 1.0, "metrics": {"loss": 0.9', 'm": 0.90084, "tokens_per_s": 5390.07']})
    runs._exited(run, 1, {"event": "exited", "rank": 1, "exit_code": 3, "log_tail": ["ValueError: boom"]})
    exits = {rep.status.rank: rep.status for rep in outbox.buffer.take(10)}
    assert exits[0].exit_code == -9 and last_error_line(exits[0].error) == \
        "rankctl: rank 0 ended: killed by SIGKILL (its log's last lines above)"
    assert exits[0].error.startswith('{"ts": 1.0')                 # the log's tail is kept above it
    assert last_error_line(exits[1].error) == "ValueError: boom"    # an exit code is the rank's own word
