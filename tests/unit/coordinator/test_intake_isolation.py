"""What one node's reports can do to a group commit (pure, no processes): a rank result of a shape its kind does
not expect, or a bug raised on one node's reports, leaves every other report of the commit stored and never
marks a report stored that is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankctl.coordinator.model.records import RankRecord, RankUpdate
from rankctl.coordinator.jobs.reports import ReportApplier
from rankctl.coordinator.model.states import JobState
from test_core import World, job_yaml, make_world


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    yield w
    w.store.close()


def queue(world: World, job_id: str, node: str, ranks: range, phase: str, result: dict | None = None) -> None:
    """One batch of ``node``'s reports, queued for the next group commit (not flushed)."""
    job, fake = world.core.get(job_id), world.nodes[node]
    updates = []
    for r in ranks:
        fake.seq += 1
        status = RankRecord(r, node, phase, exited=phase == "done", exit_code=0)
        updates.append(RankUpdate(job_id, job.attempt, status, json.dumps(result) if result else "", fake.seq))
    world.core.rank_reports(fake.session, updates)


def stored_seq(world: World, node: str) -> int:
    return next(n.last_seq for n in world.store.load_nodes() if n.name == node)


def test_a_result_of_a_shape_its_kind_does_not_expect_ends_the_job_with_the_error_named(world: World) -> None:
    for n in ("n0", "n1"):
        world.connect(n, slots=2)
    job = world.core.submit(job_yaml())
    for n, ranks in (("n0", range(0, 2)), ("n1", range(2, 4))):
        queue(world, job.id, n, ranks, "running")
    world.core.flush()
    for n, ranks in (("n0", range(0, 2)), ("n1", range(2, 4))):
        queue(world, job.id, n, ranks, "done", result={"groups": [{}]})   # no "members": comm-check's shape broken
    world.core.flush()
    job = world.core.get(job.id)
    assert job.state is JobState.SUCCEEDED, job.reason
    assert "the comm-check kind could not aggregate its ranks' results: KeyError: 'members'" in job.result["error"]
    assert set(job.result["ranks"]) == {"0", "1", "2", "3"}
    assert stored_seq(world, "n0") == 4 and stored_seq(world, "n1") == 4


def test_a_bug_on_one_nodes_reports_stores_the_others_and_never_acknowledges_its_own(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    for n in ("n0", "n1"):
        world.connect(n, slots=2)
    job = world.core.submit(job_yaml())
    real = ReportApplier.apply

    def buggy(self, session, updates, touched):  # noqa: ANN001, ANN202
        if session.name == "n0":
            raise RuntimeError("a bug")
        return real(self, session, updates, touched)
    monkeypatch.setattr(ReportApplier, "apply", buggy)
    queue(world, job.id, "n0", range(0, 2), "running")
    queue(world, job.id, "n1", range(2, 4), "running")
    world.core.flush()
    rows = world.store.ranks(job.id)
    assert sorted(rows) == [2, 3] and all(rows[r].phase == "running" for r in rows)   # n1's: stored
    assert stored_seq(world, "n1") == 2
    assert stored_seq(world, "n0") == 0 and world.nodes["n0"].session.record.last_seq == 0   # n0's: not marked
    monkeypatch.setattr(ReportApplier, "apply", real)
    queue(world, job.id, "n0", range(0, 2), "running")   # the daemon's next reports go in as usual
    world.core.flush()
    assert sorted(world.store.ranks(job.id)) == [0, 1, 2, 3] and stored_seq(world, "n0") == 4
    assert world.core.get(job.id).state is JobState.RUNNING


def test_a_bug_on_every_nodes_reports_holds_them_after_a_few_instead_of_resyncing_for_each(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    from rankctl.coordinator.jobs import intake
    from rankctl.coordinator.jobs.book import JobBook

    names = [f"n{i}" for i in range(6)]
    for n in names:
        world.connect(n, slots=2)
    job = world.core.submit(job_yaml(nodes=6))
    resyncs = []
    real_resync = JobBook.resync
    monkeypatch.setattr(JobBook, "resync", lambda self: (resyncs.append(1), real_resync(self))[1])
    real = ReportApplier.apply
    monkeypatch.setattr(ReportApplier, "apply", lambda self, s, u, t: (_ for _ in ()).throw(RuntimeError("bug")))
    for k, n in enumerate(names):
        queue(world, job.id, n, range(2 * k, 2 * k + 2), "running")
    world.core.flush()
    assert len(resyncs) == 1 + intake.MAX_DROPPED          # the group's, then one per node until the limit
    assert world.core.held_reports == 2 * (len(names) - intake.MAX_DROPPED)   # the rest held, not dropped
    monkeypatch.setattr(ReportApplier, "apply", real)
    assert world.core.flush(force=True)                     # the bug gone: the held reports go in
    assert sorted(world.store.ranks(job.id)) == list(range(2 * intake.MAX_DROPPED, 12))
