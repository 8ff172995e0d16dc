"""The SQLite store: round trips, WAL mode, bounded log tails, state across reopen."""

from pathlib import Path

import pytest

from rankctl.coordinator.model.records import EventRecord, JobRecord, NodeRecord, RankRecord
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.store.database import Store, prune_events
from rankctl.kinds.spec import build_spec


def _job(job_id: str = "a-000001", **kw) -> JobRecord:
    base = dict(id=job_id, name="a", kind="comm-check", spec=build_spec({"name": "a", "kind": "comm-check"}),
                state=JobState.PENDING,
                reason="queued", world_size=4, slots_per_node=2, created_at=100.0)
    return JobRecord(**{**base, **kw})


def test_wal_mode_and_file_location(tmp_path: Path) -> None:
    store = Store(tmp_path / "state")
    assert store.journal_mode() == "wal"
    assert (tmp_path / "state" / "coordinator.db").exists()
    store.close()


def test_jobs_events_ranks_nodes_survive_reopen(tmp_path: Path) -> None:
    store = Store(tmp_path)
    first, second = _job("a-000001"), _job("b-000002", name="b")
    first.seqno = store.insert_job(first)    # (the job book sets it: the one writer of a JobRecord)
    second.seqno = store.insert_job(second)
    first.state, first.nodes, first.rendezvous, first.result = JobState.RUNNING, ["n0", "n1"], "h:1", {"x": 1}
    store.update_job(first)
    store.append_event(EventRecord(first.id, 1, 1.0, JobState.PENDING, "transition", "submitted"))
    rank = RankRecord(3, "n1", "running", step=7, exited=False, updated_at=2.0)
    store.append_event(EventRecord(first.id, 2, 2.0, JobState.RUNNING, "rank", "rank 3 running", rank))
    store.put_rank(first.id, rank)
    store.put_node(NodeRecord("n0", "10.0.0.1", 4, {"gpus": [{"index": 0}]}, "s1", 17, 5.0))
    store.attempts.put(first, 3.0)
    store.close()

    again = Store(tmp_path)
    jobs = again.load_jobs()
    assert [j.id for j in jobs] == ["a-000001", "b-000002"]          # submission order
    assert jobs[0] == first and jobs[0].seqno < jobs[1].seqno
    events = again.events(first.id)
    assert [e.seq for e in events] == [1, 2] and events[1].rank == rank
    assert again.events(first.id, after_seq=1) == events[1:]
    assert again.last_event_seqs() == {first.id: 2}
    assert again.ranks(first.id) == {3: rank}
    assert again.load_nodes()[0].last_seq == 17 and again.load_nodes()[0].gpu_count == 1
    assert again.attempts.listed(first.id)[0]["rendezvous"] == "h:1"
    again.close()


def test_failed_transaction_rolls_back(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.insert_job(_job())
            raise RuntimeError("boom")
    assert store.load_jobs() == []
    store.close()


def test_job_level_events_skip_rank_events_through_their_index(tmp_path: Path) -> None:
    store = Store(tmp_path)
    job = _job()
    store.insert_job(job)
    seq = 0
    for step in range(1, 4):
        for r in range(50):   # a job's rank events outnumber its step events by the world size
            seq += 1
            rank = RankRecord(r, "n0", "running", step=step, exited=False, updated_at=1.0)
            store.append_event(EventRecord(job.id, seq, 1.0, JobState.RUNNING, "rank", "running", rank))
        seq += 1
        store.append_event(EventRecord(job.id, seq, 1.0, JobState.RUNNING, "step", "", step=step,
                                       metrics={"loss": 3.0 - step}))
    steps = store.events(job.id, ranks=False)
    assert [e.step for e in steps] == [1, 2, 3] and [e.seq for e in steps] == [51, 102, 153]
    assert [e.seq for e in store.events(job.id, after_seq=51, limit=1, ranks=False)] == [102]
    assert len(store.events(job.id)) == 153
    plan = store._db.execute("EXPLAIN QUERY PLAN SELECT seq FROM events WHERE job_id=? AND seq>? AND kind != 'rank' "
                             "ORDER BY seq LIMIT 5", (job.id, 0)).fetchall()
    assert "events_job_level" in str(plan)   # rank rows are never read
    store.close()


def test_the_events_of_jobs_finished_long_ago_are_pruned_but_their_last(tmp_path: Path) -> None:
    store = Store(tmp_path)
    old, recent, live = _job("a-000001"), _job("b-000002", name="b"), _job("c-000003", name="c")
    for job in (old, recent, live):
        store.insert_job(job)
        for seq in range(1, 6):
            store.append_event(EventRecord(job.id, seq, float(seq), JobState.RUNNING, "step", f"step {seq}"))
    old.state, old.finished_at = JobState.SUCCEEDED, 100.0
    recent.state, recent.finished_at = JobState.SUCCEEDED, 900.0
    store.update_job(old)
    store.update_job(recent)
    assert prune_events(store, finished_before=500.0, limit=3) == 3
    assert prune_events(store, finished_before=500.0, limit=3) == 1
    assert prune_events(store, finished_before=500.0, limit=3) == 0
    assert [e.seq for e in store.events(old.id)] == [5]
    assert len(store.events(recent.id)) == len(store.events(live.id)) == 5
    assert store.last_event_seqs()[old.id] == 5
    store.close()
