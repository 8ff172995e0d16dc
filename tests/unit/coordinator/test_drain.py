"""Draining nodes, excluding a node that failed a job twice in a row, and stopping ended attempts, in the
coordinator core without a network (issue 13): a fake clock, fake node outboxes, a real store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankctl.contract.files.rankfiles import SAVED_ON_REQUEST
from rankctl.coordinator.recovery.drains import DRAIN_LEAD_STEPS, DRAIN_WAIT_S
from rankctl.coordinator.model.errors import InvalidRequest
from rankctl.coordinator.fleet.nodes import NodeNotFound
from rankctl.coordinator.model.records import RankRecord, RankUpdate, RunningJob
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.scheduling.stops import STOP_TIMEOUT_S
from rankctl.coordinator.store.database import Store
from rankctl.coordinator.store.schema import SCHEMA_VERSION
from test_core import World, make_world

S = JobState
TRAIN = """
name: tr
kind: train
resources: {{nodes: 2, slots_per_node: 2}}
parallel: {{tp: 2}}
restart: {{max_restarts: {restarts}}}
model: {{layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256}}
train: {{steps: 40, global_batch: 8, micro_batch: 2, lr: 1.0e-2, warmup: 2, seed: 11, checkpoint_every: 0,
         data: builtin:pydoc}}
"""


def comm_yaml(restarts: int = 0, name: str = "cc") -> str:
    return (f"name: {name}\nkind: comm-check\nresources: {{nodes: 2, slots_per_node: 2}}\nparallel: {{tp: 2}}\n"
            f"restart: {{max_restarts: {restarts}}}\n")


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    yield w
    w.store.close()


def connect(world: World, *names: str) -> None:
    for i, name in enumerate(names):
        world.connect(name).session.peer_port = 7100 + int(name[1:])


def step(world: World, job, rank: int, n: int, saved: int | None = None) -> None:
    """Rank ``rank`` reports step ``n`` (the common running-rank report); ``saved``: the step of the checkpoint
    it saved on request (``SAVED_ON_REQUEST`` in its metrics)."""
    node = world.nodes[job.nodes[rank // job.slots_per_node]]
    node.seq += 1
    metrics = json.dumps({"loss": 1.0, **({SAVED_ON_REQUEST: saved} if saved is not None else {})})
    world.deliver(node.session, RankUpdate(job.id, job.attempt, RankRecord(rank, node.name, "running", n,
                                                                           metrics_json=metrics), "", node.seq))


def exit_node(world: World, job, node: str, code: int = -9) -> None:
    k = job.nodes.index(node)
    for r in range(2 * k, 2 * k + 2):
        world.report(job.id, r, "exited", code=code, node=node)


def tick(world: World, dt: float = 0.0) -> None:
    world.clock.t += dt
    for fake in world.nodes.values():
        if fake.session is not None and not fake.closed:
            world.core.heartbeat(fake.session)
    world.core.tick()


def running_train(world: World, restarts: int = 0, at: int = 5):
    job = world.core.submit(TRAIN.format(restarts=restarts))
    for r in range(job.world_size):
        world.report(job.id, r, "running")
    for r in range(job.world_size):
        step(world, job, r, at)
    assert job.state is S.RUNNING
    return job


def test_a_drained_train_job_checkpoints_then_moves_to_the_spare_without_using_a_restart(world: World) -> None:
    connect(world, "n0", "n1", "n2")
    job = running_train(world, restarts=0)
    assert job.nodes == ["n0", "n1"]
    moved = world.core.drain("n0", "kernel update")
    assert [j.id for j in moved] == [job.id]
    target = 5 + DRAIN_LEAD_STEPS
    for name in ("n0", "n1"):
        asks = world.nodes[name].bodies("checkpoint")
        assert [(a.job_id, a.attempt, a.step) for a in asks] == [(job.id, 1, target)]
    assert job.state is S.RUNNING and f"every rank saves a checkpoint at step {target}" in job.reason
    for r in range(4):
        step(world, job, r, target - 1)
    tick(world, 1)
    assert job.state is S.RUNNING                                   # not every rank has passed the step yet
    for r in range(3):
        step(world, job, r, target, saved=target)
    tick(world, 1)
    assert job.state is S.RUNNING
    step(world, job, 3, target, saved=target)
    tick(world, 1)
    assert job.state is S.RESTARTING, job.reason
    assert job.reason.startswith("attempt 1 ended: node n0 drained (kernel update)"), job.reason
    for name in ("n0", "n1"):
        exit_node(world, job, name)
    assert job.attempt == 2 and job.state is S.STARTING
    assert job.nodes == ["n2", "n1"]                                # the spare takes n0's place; n1 keeps its own
    assign = [a for a in world.nodes["n2"].bodies("assign") if a.attempt == 2][0]
    assert assign.restart and assign.restore_peer == "n0.lan:7100"  # fetched from the drained node itself
    kept = [a for a in world.nodes["n1"].bodies("assign") if a.attempt == 2][0]
    assert kept.restore_peer == ""                                  # it ran the same ranks: its own checkpoint
    attempts = world.store.attempts.listed(job.id)
    assert attempts[0]["state"] == "RESTARTING" and "node n0 drained" in attempts[0]["reason"]
    assert f"every rank passed step {target} (its checkpoint; the next attempt resumes from step {target} or a " \
        "newer checkpoint every rank holds)" in attempts[0]["reason"]   # the one step convention (``resumed_from``)
    world.run_all(job.id)
    assert job.state is S.SUCCEEDED                                 # max_restarts 0: the drain used none


def test_a_drain_moves_the_job_once_every_rank_saved_even_at_a_later_step_than_asked_never_on_passing_alone(
        world: World) -> None:
    """A CI run moved a drained job when every rank passed the asked step although the ranks had saved at another
    (the request reached them late): the next attempt found no step every rank held and started from 0."""
    connect(world, "n0", "n1", "n2")
    job = running_train(world, restarts=0)
    world.core.drain("n0", "kernel update")
    target = 5 + DRAIN_LEAD_STEPS
    for r in range(4):
        step(world, job, r, target + 1)                             # passed the step, saved nothing (late)
    tick(world, 1)
    assert job.state is S.RUNNING, job.reason
    for r in range(4):
        step(world, job, r, target + 2, saved=target + 2)           # the ranks agreed on a later step
    tick(world, 1)
    assert job.state is S.RESTARTING, job.reason
    assert f"every rank passed step {target + 2} (its checkpoint; the next attempt resumes from step {target + 2}" \
        in job.reason


def test_a_drain_waits_a_bounded_time_for_the_checkpoint_and_says_so(world: World) -> None:
    connect(world, "n0", "n1", "n2")
    job = running_train(world, restarts=1)
    world.core.drain("n1")
    tick(world, DRAIN_WAIT_S - 1)
    assert job.state is S.RUNNING
    tick(world, 2)
    assert job.state is S.RESTARTING
    assert f"no checkpoint at step {5 + DRAIN_LEAD_STEPS} within {DRAIN_WAIT_S:g} s (slowest rank at step 5)" \
        in world.store.attempts.listed(job.id)[0]["reason"]
    for name in ("n0", "n1"):
        exit_node(world, job, name)
    assert job.nodes == ["n0", "n2"]
    world.report(job.id, 2, "failed", code=1, error="boom")        # a real failure: the one restart is still there
    assert job.state is S.RESTARTING and job.reason.startswith("attempt 2 failed: rank 2 on node n2")


def test_a_job_that_is_not_a_running_train_job_moves_at_once_and_waits_without_a_spare(world: World) -> None:
    connect(world, "n0", "n1")
    job = world.core.submit(comm_yaml())
    assert job.state is S.STARTING
    world.core.drain("n1")
    assert job.state is S.RESTARTING and "node n1 drained" in job.reason
    assert not world.nodes["n0"].bodies("checkpoint")
    assert world.core.stopping_ranks(job.id) == 4
    for name in ("n0", "n1"):
        exit_node(world, job, name)
    assert job.state is S.PENDING and job.attempt == 2
    assert "waiting for capacity" in job.reason and "not placed: n1 draining" in job.reason, job.reason
    other = world.core.submit(comm_yaml(name="other"), queue_anyway=True)
    assert other.state is S.PENDING
    assert world.core.undrain("n1") == []
    assert job.state is S.STARTING and job.nodes == ["n0", "n1"]


def test_a_draining_node_lost_before_the_checkpoint_is_no_failure(world: World) -> None:
    connect(world, "n0", "n1", "n2")
    job = running_train(world, restarts=0)
    world.core.drain("n0")
    world.core.disconnect(world.nodes["n0"].session)
    assert job.state is S.RESTARTING and "node n0 drained; then lost" in job.reason, job.reason
    exit_node(world, job, "n1")
    assert job.state is S.STARTING and job.attempt == 2 and job.nodes == ["n2", "n1"]


def test_drain_and_undrain_name_a_known_node_and_a_bounded_reason(world: World) -> None:
    connect(world, "n0")
    with pytest.raises(NodeNotFound, match=r"no node 'nope' is known to this coordinator \(`ctl nodes` lists them\)"):
        world.core.drain("nope")
    with pytest.raises(NodeNotFound):
        world.core.undrain("nope")
    with pytest.raises(InvalidRequest, match=r"node 'Bad_Name' must be 1-253 characters"):
        world.core.drain("Bad_Name")
    with pytest.raises(InvalidRequest, match=r"reason is 5000 characters; at most 1000"):
        world.core.drain("n0", "x" * 5000)
    assert world.core.drain("n0") == [] and world.core.nodes.draining == {"n0": ""}
    assert world.core.drain("n0", "again") == [] and world.core.nodes.draining == {"n0": "again"}


def test_drains_exclusions_and_the_previous_attempts_nodes_survive_a_coordinator_restart(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    connect(w, "n0", "n1")
    job = w.core.submit(comm_yaml(restarts=2))
    w.core.drain("n0", "disk")
    w.core.disconnect(w.nodes["n1"].session)                        # lost while the drained attempt stops
    exit_node(w, job, "n0")
    assert job.state is S.PENDING and job.attempt == 2 and "n0 draining" in job.reason
    w.store.close()

    w2 = make_world(tmp_path)
    assert w2.store.schema_version() == SCHEMA_VERSION == 7
    assert w2.core.nodes.draining == {"n0": "disk"}
    connect(w2, "n0", "n2", "n3")
    again = w2.core.get(job.id)
    assert again.state is S.STARTING and again.nodes == ["n2", "n3"]
    restores = [a.restore_peer for n in ("n2", "n3") for a in w2.nodes[n].bodies("assign")]
    assert restores == ["n0.lan:7100", "n0.lan:7100"]               # n0 ran node 0's ranks and kept node 1's copies
    w2.store.close()


def test_a_node_whose_ranks_fail_two_attempts_in_a_row_is_not_placed_for_that_job_again(world: World) -> None:
    connect(world, "n0", "n1", "n2")
    job = world.core.submit(comm_yaml(restarts=9))
    world.report(job.id, 2, "failed", code=1, error="bad gpu")       # attempt 1: n1
    for name in ("n0", "n1"):
        exit_node(world, job, name)
    assert job.attempt == 2 and job.nodes == ["n0", "n1"]
    world.report(job.id, 1, "failed", code=1, error="flaky")         # attempt 2: n0 (another node)
    for name in ("n0", "n1"):
        exit_node(world, job, name)
    assert job.attempt == 3 and job.nodes == ["n0", "n1"] and not world.core.nodes.excluded
    world.report(job.id, 0, "failed", code=1, error="flaky again")   # attempt 3: n0 again
    assert world.core.nodes.excluded == {job.id: {"n0": "its ranks failed in attempts 2 and 3"}}
    for name in ("n0", "n1"):
        exit_node(world, job, name)
    assert job.attempt == 4 and job.nodes == ["n2", "n1"]
    assert world.store.load_exclusions() == world.core.nodes.excluded
    assert world.core.nodes.exclusions_by_node() == {"n0": [job.id]}
    world.core.disconnect(world.nodes["n1"].session)                 # attempt 4: n1 lost ...
    exit_node(world, job, "n2")
    assert job.state is S.PENDING and "not placed: n0 excluded for this job" in job.reason, job.reason
    assert world.core.undrain("n0") == [job.id]                      # ... the operator clears n0
    assert job.attempt == 5 and job.nodes == ["n2", "n0"] and not world.core.nodes.excluded
    world.connect("n1").session.peer_port = 7101                     # n1 back, placed again in attempt 6 ...
    world.core.disconnect(world.nodes["n0"].session)
    exit_node(world, job, "n2")
    assert job.attempt == 6 and job.nodes == ["n2", "n1"]
    world.core.disconnect(world.nodes["n1"].session)                 # ... and lost again: not in a row (5 was n0)
    assert world.core.nodes.excluded == {}
    world.core.cancel(job.id)
    assert world.store.load_exclusions() == {}


def test_a_node_lost_in_two_attempts_in_a_row_is_excluded_and_an_ended_job_keeps_no_exclusion(world: World) -> None:
    connect(world, "n0", "n1")
    job = world.core.submit(comm_yaml(restarts=5))
    world.core.disconnect(world.nodes["n1"].session)
    exit_node(world, job, "n0")
    assert job.state is S.PENDING
    world.connect("n1")                                               # it comes back and is placed again
    assert job.state is S.STARTING and job.nodes == ["n0", "n1"] and job.attempt == 2
    world.core.disconnect(world.nodes["n1"].session)
    assert world.core.nodes.excluded == {job.id: {"n1": "its ranks failed in attempts 1 and 2"}}
    exit_node(world, job, "n0")
    world.connect("n1")
    assert job.state is S.PENDING and "not placed: n1 excluded for this job" in job.reason
    events = [e.message for e in world.core.events(job.id) if e.kind == "node"]
    assert any("node n1 is not placed for this job again" in m and "ctl undrain n1" in m for m in events), events
    world.core.cancel(job.id)
    assert world.core.nodes.excluded == {} and world.store.load_exclusions() == {}


def test_a_cancelled_jobs_slots_wait_until_its_ranks_are_confirmed_gone(world: World) -> None:
    connect(world, "n0", "n1")
    job = world.core.submit(comm_yaml())
    for r in range(4):
        world.report(job.id, r, "running")
    world.core.cancel(job.id)
    assert job.state is S.CANCELLED and world.core.stopping_ranks(job.id) == 4
    assert [c.attempt for c in world.nodes["n0"].bodies("cancel")] == [1]
    nxt = world.core.submit(comm_yaml(name="next"))
    assert nxt.state is S.PENDING and "waiting for capacity" in nxt.reason   # the slots are still taken
    assert world.core.shown.nodes()[0].free == 0
    exit_node(world, job, "n0")
    assert world.core.stopping_ranks(job.id) == 2 and nxt.state is S.PENDING
    world.core.disconnect(world.nodes["n1"].session)                 # n1's ranks die with it
    assert world.core.stopping_ranks(job.id) == 0
    events = [e.message for e in world.core.events(job.id) if e.kind == "stop"]
    assert events and "every rank confirmed gone" in events[0]
    world.connect("n1")
    assert nxt.state is S.STARTING


def test_a_stop_never_confirmed_frees_the_slots_after_the_timeout_and_says_so(world: World) -> None:
    connect(world, "n0", "n1")
    job = world.core.submit(comm_yaml())
    world.report(job.id, 0, "failed", code=1, error="boom")          # FAILED; ranks 1-3 not yet gone
    assert job.state is S.FAILED and world.core.stopping_ranks(job.id) == 3
    nxt = world.core.submit(comm_yaml(name="next"))
    tick(world, STOP_TIMEOUT_S - 1)
    assert nxt.state is S.PENDING
    tick(world, 2)
    assert nxt.state is S.STARTING and world.core.stopping_ranks(job.id) == 0
    events = [e.message for e in world.core.events(job.id) if e.kind == "stop"]
    assert events == [f"attempt 1: 3 rank(s) on connected nodes never reported their exit within "
                      f"{STOP_TIMEOUT_S:g} s; their slots are reused"]


def test_after_a_coordinator_restart_a_restart_is_confirmed_by_the_nodes_coming_back(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    connect(w, "n0", "n1")
    job = w.core.submit(comm_yaml(restarts=1))
    w.report(job.id, 0, "failed", code=1, error="boom")
    assert job.state is S.RESTARTING
    w.store.close()

    w2 = make_world(tmp_path)
    job = w2.core.get(job.id)
    assert w2.core.stopping_ranks(job.id) == 3                        # disconnected is not gone: wait for them
    w2.core.tick()
    assert job.state is S.RESTARTING
    w2.connect("n0", running=())                                      # back without the attempt: its ranks are gone
    assert w2.core.stopping_ranks(job.id) == 2 and job.state is S.RESTARTING
    w2.connect("n1", running=(RunningJob(job.id, 1, (2, 3)),))        # still runs them: told to stop again
    assert [c.attempt for c in w2.nodes["n1"].bodies("cancel")] == [1]
    exit_node(w2, job, "n1")
    assert job.attempt == 2 and job.state is S.STARTING and job.nodes == ["n0", "n1"]
    w2.store.close()


def test_a_version_2_store_is_upgraded_in_place(tmp_path: Path) -> None:
    """Version 2 (no drains, exclusions, attempt causes), 3 (no jobs.submitted_by) and 4 (no jobs.allocation_json)
    read as version 5."""
    import sqlite3

    db = sqlite3.connect(tmp_path / "coordinator.db")
    db.executescript("""
        CREATE TABLE attempts (job_id TEXT NOT NULL, attempt INTEGER NOT NULL, nodes_json TEXT NOT NULL,
          rendezvous TEXT NOT NULL, started_at REAL NOT NULL, finished_at REAL NOT NULL, state TEXT NOT NULL,
          reason TEXT NOT NULL, PRIMARY KEY (job_id, attempt));
        INSERT INTO attempts VALUES ('j-000001', 1, '["n0", "n1"]', 'n0:1', 1.0, 2.0, 'RESTARTING', 'boom');
        CREATE TABLE jobs (
          seqno INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, name TEXT NOT NULL, kind TEXT NOT NULL,
          spec_json TEXT NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL, attempt INTEGER NOT NULL,
          world_size INTEGER NOT NULL, slots_per_node INTEGER NOT NULL, created_at REAL NOT NULL,
          finished_at REAL NOT NULL, nodes_json TEXT NOT NULL, rendezvous TEXT NOT NULL, result_json TEXT);
        INSERT INTO jobs VALUES (NULL, 'j-000001', 'j', 'comm-check', '{}', 'FAILED', 'boom', 1, 2, 1, 1.0, 2.0,
          '["n0", "n1"]', 'n0:1', NULL);
        PRAGMA user_version=2;""")
    db.close()
    store = Store(tmp_path)
    assert store.schema_version() == SCHEMA_VERSION == 7
    (job,) = store.load_jobs()
    assert job.id == "j-000001" and job.submitted_by == "" and job.reason == "boom" and job.allocation is None
    assert store.attempts.nodes("j-000001", 1) == ["n0", "n1"] and store.attempts.blamed("j-000001", 1) == ""
    assert store.attempts.drained("j-000001") == 0 and store.load_drains() == {} and store.load_exclusions() == {} and store.load_pools() == []
    assert store.attempts.listed("j-000001")[0]["reason"] == "boom"
    store.close()
