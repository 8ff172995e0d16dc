"""A daemon's batch folded before the wire (worker.reportfold): a node's start-up and stop become one report
for its ranks, and the coordinator ends in the same state as from the reports one by one."""

from __future__ import annotations

import json
from pathlib import Path

from rankctl.coordinator.model.states import JobState
from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.uplink.reportbuf import ReportBuffer
from rankctl.worker.uplink.reportfold import fold
from rankctl.worker.uplink.reporting import exit_status, stamp_update, step_figures
from test_core import World, make_world
from test_scale_core import start

JOB = "j-1"


def status(rank: int, phase: str, step: int = 0, metrics: dict | None = None, ts: float = 100.0) -> pb.RankStatus:
    st = pb.RankStatus(rank=rank, node="n0", phase=phase, step=step, metrics_json=json.dumps(metrics or {}))
    step_figures(st, metrics)
    stamp_update(st, ts)
    return st


def start_up(buf: ReportBuffer, job: str, ranks: range, loss_rank: int | None = None, marked: bool = False) -> None:
    """What a node's daemon makes for a start-up: three phases of each rank, then step 1 (a loss on one rank;
    ``marked``: each rank's first step of the attempt, as the daemon marks it in ``worker.runs.runs``)."""
    for phase in ("rendezvous", "groups", "running"):
        for r in ranks:
            buf.add(job, 1, status(r, phase, ts=100.0 + r))
    for r in ranks:
        st = status(r, "running", 1, {"step_time": 0.5, **({"loss": 2.0} if r == loss_rank else {})}, ts=101.0 + r)
        st.first_step = marked
        buf.add(job, 1, st, step_only=True)


def test_a_start_up_folds_to_the_newest_step_and_equal_ranks_to_one_report() -> None:
    buf = ReportBuffer()
    start_up(buf, JOB, range(8, 16), loss_rank=8)
    taken = buf.take(1000)
    out = fold(taken)
    assert [(r.status.rank, r.status.ranks, r.status.step, r.status.phase) for r in out] == \
        [(8, 0, 1, "running"), (9, 7, 1, "running")]
    assert out[0].seq == 25 and out[1].seq == 32               # the newest each stands for: acks stay exact
    assert json.loads(out[0].status.metrics_json)["loss"] == 2.0 and "loss" not in out[1].status.figures
    assert out[1].status.update_time.seconds == 101 + 15       # the newest of the ranks' times
    assert [r.status.ranks for r in taken] == [0] * 32         # the buffer's own reports are not changed


def test_a_ranks_first_step_is_never_folded_away_by_its_next_one() -> None:
    """A loaded daemon reads steps 1-3 of a rank in one poll: step 2 goes (step 3 says more), step 1 stays, so that
    the coordinator learns the attempt started at step 1 (not a resume at 3) and counts steps 1 and 2 (CI: a
    step histogram counted 38 of 40 steps when both ranks' steps 1-2 were folded into their step 3)."""
    buf = ReportBuffer()
    for step in (1, 2, 3):
        for r in (0, 1):
            st = status(r, "running", step, {"step_time": 0.5 + r})
            st.first_step = step == 1   # as the daemon marks it (``worker.runs.runs``)
            buf.add(JOB, 1, st, step_only=step > 1)
    out = fold(buf.take(1000))
    assert [(r.status.rank, r.status.step, r.status.first_step) for r in out] == \
        [(0, 1, True), (1, 1, True), (0, 3, False), (1, 3, False)]


def test_exits_fold_unless_they_differ_and_nothing_merges_across_an_exit() -> None:
    reps = [pb.RankReport(job_id=JOB, attempt=1, seq=i + 1, status=exit_status(r, "n0", -15, "stopped: cancelled"))
            for i, r in enumerate(range(8))]
    reps[5].status.exit_code = 1                                  # rank 5 failed on its own
    out = fold(reps)
    assert [(r.status.rank, r.status.ranks, r.status.exit_code) for r in out] == [(0, 5, -15), (5, 0, 1), (6, 2, -15)]
    gap = [reps[0], reps[2]]                                      # ranks 0 and 2: not consecutive, not folded
    assert [r.status.ranks for r in fold(gap)] == [0, 0]
    mixed = [pb.RankReport(job_id=JOB, attempt=1, seq=1, status=status(0, "groups")),
             pb.RankReport(job_id=JOB, attempt=1, seq=2, status=exit_status(0, "n0", 1, "boom")),
             pb.RankReport(job_id=JOB, attempt=1, seq=3, status=status(0, "running"))]
    assert [r.seq for r in fold(mixed)] == [1, 2, 3]              # a rank's exit is never merged away or crossed
    other = [pb.RankReport(job_id=JOB, attempt=a, seq=a, status=status(0, "groups")) for a in (1, 2)]
    assert len(fold(other)) == 2                                  # another attempt is another rank


def _play(w: World, job, names: list[str], folded: bool) -> tuple:
    """Start-up then stop of every node's ranks; what the coordinator said after the start-up."""
    bufs = {n: ReportBuffer() for n in names}
    for k, n in enumerate(names):
        start_up(bufs[n], job.id, range(k * 8, k * 8 + 8), loss_rank=0 if k == 0 else None, marked=True)
        w.nodes[n].seq = 0
    for n in names:
        taken = bufs[n].take(1000)
        w.core.rank_reports(w.nodes[n].session, fold(taken) if folded else taken)
    w.core.flush()
    assert w.core.get(job.id).state is JobState.RUNNING
    s = w.core.summary(job.id)
    started = (dict(s.phases), s.running, s.exited, s.min_step, s.max_step,
               [(x.phase, x.step, x.node) for x in w.core.book.rank_page(job, 0, 16)])
    if folded:   # one event a node's start-up, not one a rank
        assert [e.message for e in w.core.events(job.id) if e.kind == "rank"] == ["ranks 0-7 running",
                                                                                  "ranks 8-15 running"]
    w.core.cancel(job.id, "done here")
    for k, n in enumerate(names):
        for r in range(k * 8, k * 8 + 8):
            bufs[n].add(job.id, 1, exit_status(r, n, -15, "stopped: done here"))
        taken = bufs[n].take(1000)
        w.core.rank_reports(w.nodes[n].session, fold(taken) if folded else taken)
    w.core.flush()
    return started


def test_the_coordinator_ends_the_same_from_folded_and_from_single_reports(tmp_path: Path) -> None:
    worlds = []
    for folded in (False, True):
        w = make_world(tmp_path / str(folded))
        job, names = start(w, 2)
        started = _play(w, job, names, folded)
        stored = {r: (x.phase, x.step, x.exited, x.exit_code, x.error, x.node) for r, x in w.store.ranks(job.id).items()}
        memory = [(x.rank, x.phase, x.step, x.exited, x.exit_code, x.error, x.node, x.metrics_json)
                  for x in w.core.book.rank_page(job, 0, 16)]
        s = w.core.summary(job.id)
        worlds.append((started, stored, memory, (s.phases, s.running, s.exited, s.failed, s.min_step, s.max_step),
                       w.core.get(job.id).state, [e.step for e in w.core.events(job.id) if e.kind == "step"],
                       {n: w.nodes[n].session.record.last_seq for n in names}))
        w.store.close()
    single, folded = worlds
    assert folded == single
    started, stored, memory, counts, state, steps, seqs = folded
    assert started[0] == {"running": 16} and started[1] == 16 and started[3] == 1   # counted once a rank
    assert len(stored) == 16 and all(v[2] and v[3] == -15 for v in stored.values())
    assert steps == [1] and seqs == {"n0000": 32 + 8, "n0001": 32 + 8}
    assert counts[2] == 16 and state is JobState.CANCELLED


def test_a_watcher_sees_every_rank_of_a_folded_report_move(tmp_path: Path) -> None:
    """Issue 43, item 8: a node's ranks reporting alike make one event; it named the node's last rank only,
    so `ctl watch` kept the others at their first phase for the whole run. The event (read back from the
    store, as WatchJob sends it) now stands for the node's ranks, and the view moves them all."""
    from rankctl.cli.view.render import apply_event
    from rankctl.coordinator.api.convert import event_to_pb

    w = make_world(tmp_path)
    job, names = start(w, 2)
    page = pb.Job(id=job.id, world_size=16, ranks=[pb.RankStatus(rank=r, phase="pending") for r in range(16)])
    for k, n in enumerate(names):
        buf = ReportBuffer()
        start_up(buf, job.id, range(k * 8, k * 8 + 8), marked=True)
        w.nodes[n].seq = 0
        w.core.rank_reports(w.nodes[n].session, fold(buf.take(1000)))
    w.core.flush()
    for event in w.core.events(job.id):
        apply_event(page, event_to_pb(event))
    assert [(r.rank, r.phase, r.node) for r in page.ranks] == [(r, "running", names[r // 8]) for r in range(16)]
    w.store.close()
