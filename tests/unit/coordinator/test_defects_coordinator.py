"""Regression tests of the coordinator core for the adversarial pass (issue 10), without a network.

Each test names the defect it pins: forged reports, duplicate node names, memory and store out
of step on a refused write, jobs that can never fit, unbounded lists and errors.
"""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path

import pytest

from rankctl.coordinator.model.errors import AmbiguousJob, CapacityError, NodeNameTaken
from rankctl.coordinator.fleet.nodes import NodeStatus
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.store.database import StoreError
from test_blame import later
from test_core import World, job_yaml, make_world

S = JobState


class FullDisk:
    """A proxy of the store's SQLite connection that refuses every COMMIT while ``full``."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db, self.full = db, False

    def execute(self, sql: str, *args):  # noqa: ANN002, ANN201
        if self.full and sql.strip().upper() == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.db, name)


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    yield w
    w.store.close()


def full_disk(world: World) -> FullDisk:
    proxy = FullDisk(world.store._db)
    world.store._db = proxy
    return proxy


def test_a_node_cannot_report_for_ranks_it_does_not_run(world: World) -> None:
    n0, n1 = world.connect("n0"), world.connect("n1")
    world.connect("stranger")
    job = world.core.submit(job_yaml())            # ranks 0-1 on n0, 2-3 on n1
    assert job.nodes == ["n0", "n1"]
    assert world.report(job.id, 0, "failed", code=1, error="forged", node="n1")      # n1 claims n0's rank
    assert world.report(job.id, 2, "failed", code=1, error="forged", node="stranger")
    for r in range(4):
        world.report(job.id, r, "done", code=0, result={"loss": 0.0001}, node="stranger")
    assert job.state is S.STARTING and job.result is None
    assert world.core.rejected_reports == {"n1": 1, "stranger": 5}
    assert {r.phase for r in world.core.rank_page(job.id, 0, job.world_size)} == {"pending"}
    world.run_all(job.id, result={"x": 1})          # the real owners still decide
    assert job.state is S.SUCCEEDED
    assert n0.session.record.last_seq > 0 and n1.session.record.last_seq > 0


def test_a_second_live_daemon_cannot_take_a_node_name(world: World) -> None:
    n0 = world.connect("n0")
    job = world.core.submit(job_yaml(nodes=1, slots=2, tp=2))
    with pytest.raises(NodeNameTaken, match="node name 'n0' is held by another live daemon"):
        world.connect("n0", session="other-daemon")
    assert job.state is S.STARTING and not n0.closed  # the stray Register changed nothing
    world.connect("n0")                               # the same daemon reconnecting replaces its stream
    assert n0.sent.count(None) == 1                   # its old stream was closed
    assert job.state is S.STARTING
    world.core.disconnect(world.nodes["n0"].session)  # once its stream is gone, a new daemon may take the name
    world.connect("n0", session="other-daemon")
    assert world.core.nodes.get("n0").status is NodeStatus.READY


def test_a_refused_submit_leaves_nothing_in_memory_or_store(world: World) -> None:
    world.connect("n0"), world.connect("n1")
    disk = full_disk(world)
    disk.full = True
    with pytest.raises(StoreError, match=r"could not store the new job: database or disk is full \(the file system "
                                         rf"of {re.escape(str(world.store.path))} is full\)"):
        world.core.submit(job_yaml())
    assert world.core.list() == [] and world.store.load_jobs() == []
    disk.full = False
    job = world.core.submit(job_yaml())
    assert [j.id for j in world.core.list()] == [job.id] and job.state is S.STARTING
    assert [e.seq for e in world.core.events(job.id)] == [1, 2, 3]


def test_reports_the_store_refused_are_stored_once_it_writes_again(world: World) -> None:
    world.connect("n0"), world.connect("n1")
    job = world.core.submit(job_yaml())
    for r in range(4):
        world.report(job.id, r, "running")
    assert job.state is S.RUNNING
    disk = full_disk(world)
    disk.full = True
    for r in range(4):
        world.report(job.id, r, "done", code=0, result={"x": r})
    world.core.tick()
    assert job.state is S.RUNNING                      # memory says what the store holds
    assert world.store.load_jobs()[0].state is S.RUNNING
    assert {r.phase for r in world.core.rank_page(job.id, 0, job.world_size)} == {"running"}
    assert world.core.held_reports == 4
    disk.full = False
    world.clock.t += 2                                 # past the retry back-off
    world.core.tick()                                  # no restart needed
    assert job.state is S.SUCCEEDED and world.store.load_jobs()[0].state is S.SUCCEEDED
    assert world.core.held_reports == 0


def test_a_refused_write_does_not_show_a_running_job_back_at_step_0(world: World) -> None:
    """A rank's step lives in memory (no row per step); the resync after a refused write rebuilt the ranks from
    their rows, so ``ctl status`` showed steps 0-0 for as long as the disk stayed full (fault-injection probe)."""
    from test_scale_core import batch

    world.connect("n0", slots=8), world.connect("n1", slots=8)
    job = world.core.submit("name: big\nkind: comm-check\nresources: {nodes: 2, slots_per_node: 8}\n"
                            "parallel: {tp: 8}\n")
    for n in ("n0", "n1"):
        batch(world, job, n, "running")
    world.core.flush()                                 # the rows: running at step 0; the steps then live in memory
    for step in range(1, 6):
        for n in ("n0", "n1"):
            batch(world, job, n, "running", step, {"loss": 2.0, "step_time": 0.1})
    world.core.flush()
    assert world.core.summary(job.id).min_step == 5
    disk = full_disk(world)
    disk.full = True
    batch(world, job, "n0", "failed", 5)              # a phase change: flushed, and refused by the store
    assert not world.core.flush()                      # refused: memory back to the store
    s = world.core.summary(job.id)
    assert (s.min_step, s.max_step) == (5, 5) and s.phases == {"running": 16}, (s.min_step, s.phases)
    disk.full = False
    world.clock.t += 2
    world.core.tick()                                  # the held reports go in
    assert world.core.summary(job.id).phases == {"running": 8, "failed": 8}


def test_a_transition_the_store_refused_is_retried(world: World) -> None:
    world.connect("n0"), world.connect("n1")
    job = world.core.submit(job_yaml())
    disk = full_disk(world)
    disk.full = True
    with pytest.raises(StoreError):
        world.core.cancel(job.id)
    assert job.state is S.STARTING and world.store.load_jobs()[0].state is S.STARTING
    world.core.disconnect(world.nodes["n1"].session)   # the node is lost, failing its job cannot be stored
    assert job.state is S.STARTING
    disk.full = False
    world.core.tick()
    assert job.state is S.FAILED and job.reason.startswith("node n1 lost")


def test_a_refused_write_is_retried_by_the_tick_not_by_every_message(world: World) -> None:
    """While the store refuses, a heartbeat's turn does not retry the node loss it left (each retry reloads memory
    from the store): the tick does, once."""
    world.connect("n0"), world.connect("n1")
    job = world.core.submit(job_yaml())
    disk = full_disk(world)
    disk.full = True
    world.core.disconnect(world.nodes["n1"].session)   # failing its job cannot be stored
    resyncs, real = [], world.core._guard.resync       # noqa: SLF001 - counts the reloads a retry costs
    world.core._guard.resync = lambda: (resyncs.append(1), real())[1]   # noqa: SLF001
    for _ in range(50):
        world.core.heartbeat(world.nodes["n0"].session)
    assert resyncs == [] and job.state is S.STARTING
    world.core.tick()
    assert len(resyncs) == 1 and job.state is S.STARTING   # tried once, refused again
    disk.full = False
    world.core.tick()
    assert job.state is S.FAILED and job.reason.startswith("node n1 lost")


def test_a_job_larger_than_the_cluster_is_refused_and_never_blocks_the_queue(world: World) -> None:
    world.connect("n0", slots=2), world.connect("n1", slots=2)
    with pytest.raises(CapacityError, match=r"needs 3 node\(s\) with 2 slots each; the cluster has 2"):
        world.core.submit(job_yaml("big", nodes=3, slots=2, tp=1))
    with pytest.raises(CapacityError, match=r"with 4 slots each; the cluster has 0 such node"):
        world.core.submit(job_yaml("wide", nodes=1, slots=4, tp=1))
    assert world.core.list() == []
    big = world.core.submit(job_yaml("big", nodes=3, slots=2, tp=1), queue_anyway=True)
    small = world.core.submit(job_yaml("small", nodes=1, slots=2, tp=1))
    assert big.state is S.PENDING and small.state is S.STARTING


def test_the_head_of_the_queue_holds_others_back_for_a_bounded_time(world: World) -> None:
    world.connect("n0", slots=2), world.connect("n1", slots=2)
    first = world.core.submit(job_yaml("first", nodes=1, slots=2, tp=1))    # takes n0
    wide = world.core.submit(job_yaml("wide", nodes=2, slots=2, tp=1))      # fits the cluster, not now
    small = world.core.submit(job_yaml("small", nodes=1, slots=2, tp=1))    # would fit n1 now
    assert first.state is S.STARTING and wide.state is S.PENDING
    assert small.state is S.PENDING and small.reason == f"queued behind {wide.id}"
    world.clock.t += world.core.head_wait - 1
    world.core.schedule()
    assert small.state is S.PENDING
    world.clock.t += 2
    world.core.schedule()
    assert small.state is S.STARTING and wide.state is S.PENDING            # backfilled around the head


def test_a_job_that_fits_backfills_by_time_alone_once_the_head_waited_its_time(world: World) -> None:
    """Issue 53, item 1: the same queue, but nothing calls ``schedule()``: only heartbeats and ticks. Before, the
    small job stayed "queued behind" for good after ``head_wait`` while n1 sat free (``Scheduler.due`` looked only at
    exclusions). It starts at the first tick past ``head_wait``, and the next ticks run no more passes for it."""
    world.connect("n0", slots=2), world.connect("n1", slots=2)
    first = world.core.submit(job_yaml("first", nodes=1, slots=2, tp=1))
    wide = world.core.submit(job_yaml("wide", nodes=2, slots=2, tp=1))
    small = world.core.submit(job_yaml("small", nodes=1, slots=2, tp=1))
    assert first.state is S.STARTING and small.reason == f"queued behind {wide.id}"
    tick = 0.5
    waited = 0.0
    while waited < world.core.head_wait - tick:
        later(world, tick)
        waited += tick
        assert small.state is S.PENDING, waited
    later(world, tick)
    later(world, tick)
    assert small.state is S.STARTING and wide.state is S.PENDING
    assert not world.core._scheduler.due()


def test_job_lists_are_paged_and_errors_stay_short(world: World) -> None:
    world.connect("n0", slots=2)
    jobs = [world.core.submit(job_yaml("same", nodes=1, slots=2, tp=1), queue_anyway=True) for _ in range(30)]
    page, cursor = world.core.book.page(10)
    assert [j.id for j in page] == [j.id for j in jobs[::-1][:10]] and cursor == jobs[20].seqno
    page2, cursor2 = world.core.book.page(10, cursor)
    assert [j.id for j in page2] == [j.id for j in jobs[::-1][10:20]]
    rest, end = world.core.book.page(100, cursor2)
    assert len(rest) == 10 and end == 0
    starting, _ = world.core.book.page(100, states=[S.STARTING])
    assert [j.id for j in starting] == [jobs[0].id]
    with pytest.raises(AmbiguousJob) as err:
        world.core.get("same")
    assert len(str(err.value)) < 200 and "30 jobs are named 'same'" in str(err.value) and "25 older" in str(err.value)


def test_the_store_refuses_a_corrupt_or_newer_database_and_a_second_opener(tmp_path: Path) -> None:
    from rankctl.coordinator.store.database import StateDirInUse, Store, StoreUnusable
    from rankctl.coordinator.store.schema import SCHEMA_VERSION

    store = Store(tmp_path / "ok")
    assert store.schema_version() == SCHEMA_VERSION
    with pytest.raises(StateDirInUse, match=rf"in use by another coordinator \(pid {os.getpid()}\)"):
        Store(tmp_path / "ok")
    store._db.execute("PRAGMA user_version=99")
    store.close()
    with pytest.raises(StoreUnusable, match="schema version 99, newer than this rankctl's"):
        Store(tmp_path / "ok")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "coordinator.db").write_bytes(b"SQLite format 3\0" + b"\xff" * 5000)
    for _ in range(2):  # the lock is released when opening fails (else the second try says "in use")
        with pytest.raises(StoreUnusable, match="not a usable rankctl database|is corrupt"):
            Store(bad)
    (bad / "coordinator.db").write_bytes(b"")   # truncated to nothing: SQLite would take it for a new database
    for _ in range(2):
        with pytest.raises(StoreUnusable, match=r"coordinator.db is empty \(0 bytes\): a truncated database"):
            Store(bad)
    assert (bad / "coordinator.db").stat().st_size == 0   # left as it was
    Store(tmp_path / "new").close()                         # a new state dir still starts empty


def test_a_log_line_that_cannot_be_written_is_dropped_not_raised() -> None:
    import io

    import structlog

    from rankctl.worker.launcher.procutil import SafePrintLogger, configure_logging

    class FullDisk(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

    before = SafePrintLogger.dropped
    configure_logging(FullDisk())
    try:
        structlog.get_logger("rankctl.coordinator").warning("report.store_failed", node="n0")
    finally:
        configure_logging()
    assert SafePrintLogger.dropped == before + 1


def test_streams_that_close_because_the_coordinator_stood_still_are_waited_for(tmp_path: Path) -> None:
    """SIGSTOP of the coordinator for 20 s failed a healthy job: daemons drop a stream whose pings go unanswered
    (4 s), and on SIGCONT every closed stream read as a lost node. A stream closing while the coordinator stood
    still, or within a grace after, leaves its node DISCONNECTED; it comes back, or is lost after the grace."""
    from rankctl.coordinator.fleet.nodes import NodeStatus
    from rankctl.coordinator.model.records import RunningJob
    from test_core import job_yaml, make_world

    world = make_world(tmp_path, timeout=10.0)
    n0, n1 = world.connect("n0"), world.connect("n1")
    job = world.core.submit(job_yaml())
    for r in range(4):
        world.report(job.id, r, "running")
    world.core.tick()
    world.clock.t += 20.0                       # stopped: no tick ran
    world.core.disconnect(n1.session)           # its stream closed meanwhile
    assert n1.session.status is NodeStatus.DISCONNECTED and job.state is JobState.RUNNING
    world.core.tick(loop_lag=20.0)              # the loop's first turn after it: the stall is known
    world.core.disconnect(n0.session)           # a close read after the first tick, within the grace
    assert n0.session.status is NodeStatus.DISCONNECTED and job.state is JobState.RUNNING
    world.connect("n1", running=(RunningJob(job.id, job.attempt, (2, 3)),))   # the daemons come back
    world.connect("n0", running=(RunningJob(job.id, job.attempt, (0, 1)),))
    assert job.state is JobState.RUNNING
    assert {world.nodes[n].session.status for n in ("n0", "n1")} == {NodeStatus.READY}
    world.clock.t += 30.0                       # long after the grace: a close is a lost node again
    world.core.heartbeat(world.nodes["n0"].session)
    world.core.heartbeat(world.nodes["n1"].session)
    world.core.tick()
    world.core.disconnect(world.nodes["n1"].session)
    assert world.nodes["n1"].session.status is NodeStatus.LOST and job.state is JobState.FAILED
    world.store.close()


def test_a_node_that_does_not_come_back_after_the_coordinator_stood_still_is_lost_after_the_grace(
        tmp_path: Path) -> None:
    from rankctl.coordinator.fleet.nodes import NodeStatus
    from test_core import job_yaml, make_world

    world = make_world(tmp_path, timeout=10.0)
    n0, n1 = world.connect("n0"), world.connect("n1")
    job = world.core.submit(job_yaml())
    world.core.tick()
    world.clock.t += 20.0
    world.core.disconnect(n1.session)
    world.core.tick(loop_lag=20.0)
    world.core.heartbeat(n0.session)
    assert n1.session.status is NodeStatus.DISCONNECTED
    world.clock.t += 11.0                       # the grace (10 s) passed without it
    world.core.heartbeat(n0.session)
    world.core.tick()
    assert n1.session.status is NodeStatus.LOST and "did not reconnect within 10.0 s" in n1.session.detail
    assert job.state is JobState.FAILED and "n1" in job.reason
    world.store.close()


def test_a_refusal_is_what_the_caller_hears_even_when_memory_cannot_be_resynced(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader stepping down closes its store: the resync after a refused write then fails too (CI once answered
    a submit during an etcd outage with INTERNAL 'ProgrammingError' instead of the store's refusal)."""
    from rankctl.coordinator.jobs.book import JobBook

    world.connect("n0"), world.connect("n1")
    disk = full_disk(world)
    disk.full = True

    def closed(self) -> None:  # noqa: ANN001
        raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
    monkeypatch.setattr(JobBook, "resync", closed)
    with pytest.raises(StoreError, match="could not store the new job: database or disk is full"):
        world.core.submit(job_yaml())
