"""Start-up latency (issue 23, item 1): phase changes never wait for a batching tick.

The daemon's writer sends a phase change, exit or error at once and lets only step reports wait for
``report_interval``; the coordinator stores a batch holding one on the event loop's next turn (one
transaction for all that came in that turn) and keeps the group commit for step reports; WatchJobBatches
sends a job's end at once, whatever ``min_interval``. Each test sets its tick to an hour: waiting for it
hangs the test instead of passing slowly.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rankctl.coordinator.model.records import RankRecord, RankUpdate
from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.daemon.daemon import DaemonConfig, WorkerDaemon
from rankctl.worker.uplink.reportbuf import ReportBuffer
from test_core import job_yaml, make_world
from test_read_side import Cluster, read_all, run
from figured import figured_kind  # noqa: F401 - the module's autouse fixture (its jobs fold a loss)

HOUR = 3600.0


def test_only_a_report_that_is_more_than_a_step_makes_the_buffer_urgent() -> None:
    buf = ReportBuffer()
    buf.add("j", 1, pb.RankStatus(rank=0, phase="running"))
    assert buf.urgent
    buf.take(10)
    assert not buf.urgent
    buf.add("j", 1, pb.RankStatus(rank=0, phase="running", step=1), step_only=True)
    assert not buf.urgent and buf.unsent == 1
    buf.add("j", 1, pb.RankStatus(rank=0, phase="done", step=1))
    assert buf.urgent
    assert [r.status.phase for r in buf.take(1)] == ["running"]  # a step still queued before the phase change
    assert buf.urgent
    buf.take(10)
    assert not buf.urgent
    assert buf.rewind(0) == 3 and buf.urgent                     # a replay goes out at once


class Call:
    """The writer's side of a Connect stream: what it wrote."""

    def __init__(self) -> None:
        self.batches: list[list[pb.RankReport]] = []

    async def write(self, msg: pb.NodeMessage) -> None:
        if msg.WhichOneof("body") == "batch":
            self.batches.append(list(msg.batch.reports))


async def _until(predicate, what: str) -> None:
    for _ in range(10_000):  # turns of the loop, not a clock: the writer needs a few
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never: {what}")


def test_the_daemon_sends_a_phase_change_at_once_and_holds_step_reports_for_the_tick(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = DaemonConfig(coordinator="127.0.0.1:1", name="n0", slots=2, state_dir=tmp_path, report_interval=HOUR)
        daemon, call = WorkerDaemon(cfg, launcher=None), Call()
        daemon.session.heartbeat_interval = HOUR
        writer = asyncio.create_task(daemon.session._write(call))
        try:
            daemon.outbox.report("j", 1, pb.RankStatus(rank=0, phase="groups"))
            await _until(lambda: len(call.batches) == 1, "the first batch")
            daemon.outbox.report("j", 1, pb.RankStatus(rank=0, phase="running"))
            await _until(lambda: len(call.batches) == 2, "a phase change within the tick")
            for step in (1, 2, 3):
                daemon.outbox.report("j", 1, pb.RankStatus(rank=0, phase="running", step=step), step_only=True)
            for _ in range(200):
                await asyncio.sleep(0)
            assert len(call.batches) == 2  # step reports wait for the tick (an hour here)
            daemon.outbox.report("j", 1, pb.RankStatus(rank=0, phase="done", step=3))
            await _until(lambda: len(call.batches) == 3, "an exit within the tick")
            assert [(r.status.phase, r.status.step) for r in call.batches[2]] == [("running", 3), ("done", 3)]
        finally:
            writer.cancel()
    asyncio.run(main())


def _updates(job, ranks, phase: str, step: int = 0, code: int | None = None) -> list[RankUpdate]:
    return [RankUpdate(job.id, job.attempt, RankRecord(r, job.nodes[r // job.slots_per_node], phase, step=step,
                                                       exited=code is not None, exit_code=code or 0))
            for r in ranks]


def test_the_coordinator_stores_phase_changes_on_the_next_loop_turn_in_one_transaction(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    world.connect("n0"), world.connect("n1")
    job = world.core.submit(job_yaml())
    sessions = [world.nodes[n].session for n in job.nodes]
    commits = []
    real = world.store.transaction

    def counted(*args, **kw):
        commits.append(args[0] if args else "")
        return real(*args, **kw)

    async def main() -> None:
        world.store.transaction = counted
        for k, session in enumerate(sessions):  # two nodes' batches in one turn of the loop
            world.core.rank_reports(session, _updates(job, range(2 * k, 2 * k + 2), "running"))
        assert world.core.pending_work()
        await asyncio.sleep(0)
        assert not world.core.pending_work() and job.state.value == "RUNNING"
        assert commits.count("rank reports") == 1
        for k, session in enumerate(sessions):
            world.core.rank_reports(session, _updates(job, range(2 * k, 2 * k + 2), "running", step=1))
        for _ in range(10):
            await asyncio.sleep(0)
        assert world.core.pending_work()  # step reports alone wait for the group commit (the server's FLUSH_S)
        world.core.flush()
        for k, session in enumerate(sessions):
            world.core.rank_reports(session, _updates(job, range(2 * k, 2 * k + 2), "done", step=1, code=0))
        await asyncio.sleep(0)
        assert job.state.value == "SUCCEEDED"
    try:
        asyncio.run(main())
    finally:
        world.store.close()


def test_a_jobs_end_is_sent_at_once_whatever_min_interval(tmp_path: Path) -> None:
    async def test(c: Cluster) -> None:
        job = await c.submit(2, 4)
        call = c.client.WatchJobBatches(pb.WatchJobRequest(job_id=job.id, min_interval=HOUR))
        await call.read()                   # the first batch: the job as it is
        c.report(job.id, range(8))
        c.finish(job.id, 8)                 # within the interval of the first batch
        batches = await read_all(call)      # ends with the job (an hour's wait would time the test out)
        assert batches[-1].state == pb.JOB_STATE_SUCCEEDED
        assert "transition" in [e.kind for e in batches[-1].events]
    run(test, tmp_path, timeout=60.0)


def test_a_run_counts_as_starting_until_every_rank_runs_or_ended_and_at_most_fast_poll_s() -> None:
    from rankctl.worker.runs.runstate import FAST_POLL_S, RunState

    run = RunState(job_id="j", attempt=1, run_dir="", ranks={0, 1, 2}, alive={0, 1, 2})
    run.phase.update({0: "running", 1: "groups"})
    assert run.starting()
    run.alive.discard(2)                 # rank 2 exited before it ran
    run.phase[1] = "running"
    assert not run.starting()
    late = RunState(job_id="j", attempt=1, run_dir="", ranks={0}, alive={0})
    late.phase[0] = "rendezvous"         # waiting for other nodes: polled at the usual pace after a while
    assert late.starting()
    late.assigned_at -= FAST_POLL_S + 1
    assert not late.starting()
