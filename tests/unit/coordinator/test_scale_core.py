"""The coordinator core at cluster scale, without a network: per-node Assigns that do not grow with
the job, batched reports in one transaction per flush, per-job counters that equal a full scan,
one job-level event per step, and a failure detector that discounts its own stalls."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path

import pytest

from rankctl.coordinator.diagnosis.progress import JobProgress, is_failed
from rankctl.coordinator.diagnosis.skew import SHOWN
from rankctl.coordinator.model.records import RankRecord, RunningJob
from rankctl.coordinator.fleet.nodes import NodeStatus
from rankctl.coordinator.model.states import JobState
from rankctl.kinds.common import TRAINING_FIGURES
from rankctl.parallel.layout import ParallelConfig, RankLayout
from rankctl.worker.uplink.reportbuf import ReportBuffer
from rankctl.worker.uplink.reporting import step_figures
from rankctl.proto import rankctl_pb2 as pb
from test_core import World, make_world

S = JobState


def big_yaml(nodes: int, slots: int = 8, tp: int = 8, pp: int = 1) -> str:
    return (f"name: big\nkind: comm-check\nresources: {{nodes: {nodes}, slots_per_node: {slots}}}\n"
            f"parallel: {{tp: {tp}, pp: {pp}}}\n")


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    yield w
    w.store.close()


class CountingDb:
    """A proxy of the store's SQLite connection that counts COMMITs."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db, self.commits = db, 0

    def execute(self, sql: str, *args):  # noqa: ANN002, ANN201
        if sql.strip().upper() == "COMMIT":
            self.commits += 1
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.db, name)


def start(world: World, nodes: int, **kw) -> tuple[object, list[str]]:
    names = [f"n{i:04d}" for i in range(nodes)]
    for name in names:
        world.connect(name, slots=8)
    job = world.core.submit(big_yaml(nodes, **kw))
    assert job.state is S.STARTING
    return job, names


def batch(world: World, job, node: str, phase: str, step: int = 0, metrics: dict | None = None,
          **status) -> int:
    fake = world.nodes[node]
    k = job.nodes.index(node)
    updates = []
    for r in range(k * 8, k * 8 + 8):
        fake.seq += 1
        st = pb.RankStatus(rank=r, node=node, phase=phase, step=step, metrics_json=json.dumps(metrics or {}), **status)
        step_figures(st, metrics)     # as the daemon sends it
        updates.append(pb.RankReport(job_id=job.id, attempt=job.attempt, status=st, seq=fake.seq))
    return world.core.rank_reports(fake.session, updates)


def test_assign_size_does_not_grow_with_the_job_and_ranks_get_megatron_groups(world: World) -> None:
    job, names = start(world, 256, tp=4, pp=2)
    sizes = {len(world.nodes[n].bodies("assign")[0].SerializeToString()) for n in names}
    assert max(sizes) - min(sizes) <= 8        # only the rank numbers differ
    assert max(sizes) < 2048                   # the spec once, no per-rank groups
    layout = RankLayout(ParallelConfig(tp=4, pp=2, world_size=2048))
    for n in (names[0], names[77], names[-1]):
        for a in world.nodes[n].assignments(job.id):
            assert a.groups == layout.rank_groups(a.rank) and a.coords == layout.coords(a.rank)
            assert a.node == n and a.rank // 8 == job.nodes.index(n)


def test_batched_reports_commit_once_per_flush_and_write_one_event_per_step(world: World) -> None:
    job, names = start(world, 128)
    for phase in ("rendezvous", "groups", "running"):
        for n in names:
            batch(world, job, n, phase)
        world.core.flush()
    assert job.state is S.RUNNING
    before = len(world.core.events(job.id))
    proxy = CountingDb(world.store._db)
    world.store._db = proxy
    for step in (1, 2, 3):
        for n in names:
            batch(world, job, n, "running", step, {"loss": 3.0 - step, "tokens_per_s": 100.0 + step,
                                                    "step_time_s": 0.5})
        assert world.core.flush()
    assert proxy.commits == 3                        # one transaction per flush, whatever the rank count
    new = world.core.events(job.id)[before:]
    assert [(e.kind, e.step) for e in new] == [("step", 1), ("step", 2), ("step", 3)]
    assert new[-1].metrics == {"step": 3, "step_time_min": 0.5, "step_time_max": 0.5}  # comm-check folds no loss
    summary = world.core.summary(job.id)
    assert summary.min_step == summary.max_step == 3 and summary.phases == {"running": 1024}
    assert summary.stragglers == [] and summary.failed == 0


def test_a_straggler_holds_the_job_step_and_is_named(world: World) -> None:
    job, names = start(world, 16)
    for n in names:
        batch(world, job, n, "running")
    for step in (1, 2):
        for n in names[1:]:
            batch(world, job, n, "running", step, {"loss": 1.0})
        world.core.flush()
    summary = world.core.summary(job.id)
    assert (summary.min_step, summary.max_step) == (0, 2)
    assert summary.stragglers == list(range(8))     # node 0's ranks
    assert not [e for e in world.core.events(job.id) if e.kind == "step"]
    batch(world, job, names[0], "running", 2, {"loss": 1.0})
    world.core.flush()
    assert [e.step for e in world.core.events(job.id) if e.kind == "step"] == [2]


def test_counters_equal_a_full_scan_under_random_reports() -> None:
    rng = random.Random(7)
    world_size = 64
    progress, ranks = JobProgress(world_size), {}
    for _ in range(3000):
        r = rng.randrange(world_size)
        old = ranks.get(r)
        if old is not None and old.exited:
            continue
        phase = rng.choice(["rendezvous", "groups", "running", "running", "running", "done", "failed"])
        exited = rng.random() < 0.05
        step = (old.step if old else 0) + (rng.random() < 0.5)
        new = RankRecord(r, "n", phase, step, "", "boom" if phase == "failed" else "",
                         rng.choice([0, 0, 1]) if exited else 0, exited)
        progress.moved(old, new)
        ranks[r] = new
        everyone = [ranks.get(i, RankRecord(i, "n")) for i in range(world_size)]
        failed = sorted(x.rank for x in everyone if is_failed(x))
        assert progress.min_step == min(x.step for x in everyone)
        assert progress.max_step == max(x.step for x in everyone)
        assert progress.exited == sum(x.exited for x in everyone)
        shown = progress.summary().failing     # the lowest failed ranks first
        assert (shown[0].rank if shown else None) == (failed[0] if failed else None)
        assert progress.all_running() == all(x.passed_running() for x in everyone)
        assert sum(progress.phases.values()) == world_size
        assert progress.phases == {p: n for p, n in
                                   __import__("collections").Counter(x.phase for x in everyone).items()}
        # the summary's lists are kept between polls (``JobProgress._shown_ranks``): never stale
        summary, low = progress.summary(), min(x.step for x in everyone)
        lagging = [x.rank for x in everyone if x.step == low] if max(x.step for x in everyone) > low else []
        assert summary.stragglers == lagging[:SHOWN]
        assert [x.rank for x in summary.failing] == failed[:SHOWN]


def test_a_stalled_loop_does_not_mark_live_nodes_lost(world: World) -> None:
    job, names = start(world, 4)
    world.clock.t += 30                          # the loop was stuck for 30 s (heartbeats unread)
    world.core.tick(loop_lag=30)
    assert all(world.core.nodes.get(n).status is NodeStatus.READY for n in names)
    assert job.state is S.STARTING
    world.clock.t += 11                          # then really silent, past the 10 s timeout
    world.core.tick()
    assert all(world.core.nodes.get(n).status is NodeStatus.LOST for n in names)
    assert job.state is S.FAILED


def test_nodes_learn_what_is_stored_with_acks(world: World) -> None:
    job, names = start(world, 2)
    batch(world, job, names[0], "running")
    world.core.flush()
    acks = world.nodes[names[0]].bodies("ack")
    assert [a.last_seq for a in acks] == [8]


def test_report_buffer_keeps_the_newest_step_per_rank_and_never_drops_phase_changes() -> None:
    buf = ReportBuffer()
    st = lambda phase, step=0: pb.RankStatus(rank=0, phase=phase, step=step)  # noqa: E731
    buf.add("j", 1, st("groups"))
    buf.add("j", 1, st("running"))
    for step in range(1, 50):
        buf.add("j", 1, st("running", step), step_only=True)
    buf.add("j", 1, st("done", 49))
    sent = buf.take(100)
    assert [(r.status.phase, r.status.step) for r in sent] == [("groups", 0), ("running", 0), ("running", 49),
                                                               ("done", 49)]
    assert buf.coalesced == 48
    assert buf.rewind(sent[1].seq) == 2            # a new session replays what is not stored
    assert [r.seq for r in buf.take(10)] == [sent[2].seq, sent[3].seq]
    buf.acked(sent[-1].seq)
    assert len(buf) == 0


def test_a_coordinator_killed_between_group_commits_loses_nothing_it_acknowledged(tmp_path: Path) -> None:
    """The daemon's buffer (worker.reportbuf) against a core that dies with reports queued but not stored:
    after the restart, Registered.last_seq is what the store holds and the replay fills the gap exactly."""
    from rankctl.coordinator.jobs.core import Coordinator
    from rankctl.coordinator.model.records import NodeHello
    from rankctl.coordinator.store.database import Store

    w = make_world(tmp_path)
    job, names = start(w, 2)
    bufs = {n: ReportBuffer() for n in names}

    def play(phase: str, step: int = 0) -> None:
        for n in names:
            k = job.nodes.index(n)
            for r in range(k * 8, k * 8 + 8):
                bufs[n].add(job.id, 1, pb.RankStatus(rank=r, node=n, phase=phase, step=step,
                                                     metrics_json=json.dumps({"loss": 10.0 - step})),
                            step_only=phase == "running" and step > 1)

    def deliver(core, sessions) -> None:
        for n in names:
            core.rank_reports(sessions[n], bufs[n].take(1000))  # the wire's RankReports, as node_service passes them

    sessions = {n: w.nodes[n].session for n in names}
    for step in range(0, 4):
        play("running", step)
        deliver(w.core, sessions)
        w.core.flush()
    play("running", 4)
    deliver(w.core, sessions)          # queued, never flushed: the coordinator dies here
    stored_steps = [e.step for e in w.core.events(job.id) if e.kind == "step"]
    assert stored_steps == [1, 2, 3]
    w.store.close()

    store = Store(tmp_path)
    core = Coordinator(store, clock=w.clock, heartbeat_timeout=10.0)
    assert core.get(job.id).state is S.RUNNING
    sessions = {}
    for n in names:
        sent: list = []
        hello = NodeHello(n, f"{n}.lan", 8, {"gpus": []}, (29500,), (RunningJob(job.id, 1, tuple(range(16))),), "s1")
        sessions[n] = core.register(hello, sent.append)
        last = sent[0].registered.last_seq
        assert bufs[n].rewind(last) == 8          # step 4 of the node's 8 ranks was never stored: replayed
    deliver(core, sessions)
    core.flush()
    assert [e.step for e in core.events(job.id) if e.kind == "step"] == [1, 2, 3, 4]   # no step twice, none lost
    assert core.summary(job.id).min_step == 4
    store.close()


def test_a_steps_figures_are_the_numbers_the_daemon_copied_folded_by_the_kinds_rules() -> None:
    """The daemon copies the numbers of a rank's metrics into ``figures`` (worker.reporting.step_figures); the
    coordinator folds those the job's kind names, each by its rule (train: loss first, tokens/s min), and the
    step time's spread; what the kind does not name (lr) and what is not a number stay out."""
    from rankctl.worker.uplink.reporting import MAX_FIGURES

    rows = [{"loss": None, "tokens_per_s": 900.0, "step_time_s": 0.52},
            {"loss": 2.25, "val_loss": 2.5, "tokens_per_s": 1000, "step_time_s": 0.5},
            {"loss": 2.5, "tokens_per_s": 950.0, "step_time": 0.61, "lr": 1e-3},
            {"loss": True, "tokens_per_s": "fast"}]          # not numbers: not copied
    progress = JobProgress(len(rows), folds=TRAINING_FIGURES)
    for rank, m in enumerate(rows):
        status = pb.RankStatus(rank=rank, phase="running", step=1, metrics_json=json.dumps(m))
        step_figures(status, m)
        progress.step_figures(1, status)
        progress.moved_step(rank, 0, 1)
    assert progress.metrics == {"step": 1, "loss": 2.25, "val_loss": 2.5, "tokens_per_s": 900.0,
                                "step_time_min": 0.5, "step_time_max": 0.61}
    many = pb.RankStatus()
    step_figures(many, {"step": 3, "note": "x", **{f"m{i}": float(i) for i in range(40)}, "x" * 65: 1.0})
    assert dict(many.figures) == {f"m{i}": float(i) for i in range(MAX_FIGURES)}   # bounded, in the rank's order
