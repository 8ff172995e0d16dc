"""The coordinator core without a network: fake clock, fake node outboxes, a real store."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rankctl.coordinator.jobs.core import Coordinator
from rankctl.coordinator.fleet.nodes import NodeSession, NodeStatus
from rankctl.coordinator.model.records import NodeHello, RankRecord, RankUpdate, RunningJob
from rankctl.contract.jobfile import SpecError
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.store.database import Store
from rankctl.contract.assignment import RankAssignment
from rankctl.worker.runs.assign import expand

S = JobState


def job_yaml(name: str = "cc", nodes: int = 2, slots: int = 2, tp: int = 2) -> str:
    return f"name: {name}\nkind: comm-check\nresources: {{nodes: {nodes}, slots_per_node: {slots}}}\nparallel: {{tp: {tp}}}\n"


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeNode:
    name: str
    session: NodeSession | None = None
    sent: list = field(default_factory=list)
    seq: int = 0
    gpus: int = 0

    def bodies(self, kind: str) -> list:
        return [getattr(m, kind) for m in self.sent if m is not None and m.WhichOneof("body") == kind]

    def assignments(self, job_id: str) -> list[RankAssignment]:
        """What the node's daemon makes of its Assigns (the real expansion, as a daemon runs it)."""
        gpus = 2 if self.gpus else 0
        return [a for msg in self.bodies("assign") if msg.job_id == job_id
                for a in expand(msg, self.name, "", gpus)]

    @property
    def closed(self) -> bool:
        return None in self.sent


@dataclass
class World:
    core: Coordinator
    clock: Clock
    store: Store
    nodes: dict[str, FakeNode] = field(default_factory=dict)

    def connect(self, name: str, slots: int = 2, *, gpus: int = 0, ports: tuple[int, ...] = (29500, 29501),
                running: tuple[RunningJob, ...] = (), session: str = "s1", replaces: bool = False) -> FakeNode:
        """``replaces``: the daemon stops an older attempt's ranks before a newer Assign (restarts go in place)."""
        node = self.nodes.setdefault(name, FakeNode(name))
        node.gpus = gpus
        hw = {"gpus": [{"index": i} for i in range(gpus)]}
        hello = NodeHello(name, f"{name}.lan", slots, hw, ports, running, session, replaces=replaces)
        node.session = self.core.register(hello, node.sent.append)
        return node

    def report(self, job_id: str, rank: int, phase: str, *, code: int | None = None, error: str = "",
               result: dict | None = None, node: str | None = None, seq: int | None = None) -> bool:
        job = self.core.get(job_id)
        fake = self.nodes[node or job.nodes[rank // job.slots_per_node]]
        if seq is None:
            fake.seq += 1
            seq = fake.seq
        status = RankRecord(rank, fake.name, phase, exited=code is not None, exit_code=code or 0, error=error)
        update = RankUpdate(job_id, job.attempt, status, json.dumps(result) if result else "", seq)
        return self.deliver(fake.session, update)

    def deliver(self, session, update: RankUpdate) -> bool:  # noqa: ANN001 - a NodeSession
        """Queue one report and store it at once; False when the core dropped it unseen (a replay, a stale
        stream): neither applied nor rejected as another node's."""
        seen = self.core.stats.rank_reports + sum(self.core.rejected_reports.values())
        self.core.rank_reports(session, [update])
        self.core.flush()
        return self.core.stats.rank_reports + sum(self.core.rejected_reports.values()) > seen

    def run_all(self, job_id: str, result: dict | None = None) -> None:
        job = self.core.get(job_id)
        for r in range(job.world_size):
            self.report(job_id, r, "running")
        for r in range(job.world_size):
            self.report(job_id, r, "done", code=0, result=result)


def make_world(path: Path, timeout: float = 10.0) -> World:
    clock, store = Clock(), Store(path)
    return World(Coordinator(store, clock=clock, heartbeat_timeout=timeout), clock, store)


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    yield w
    w.store.close()


def kinds(core: Coordinator, job_id: str) -> list[tuple[str, str]]:
    return [(e.kind, e.state.value) for e in core.events(job_id)]


def test_submit_without_nodes_is_refused_unless_queued_anyway(world: World) -> None:
    from rankctl.coordinator.model.errors import CapacityError

    with pytest.raises(CapacityError, match=r"needs 2 node\(s\) with 2 slots each; the cluster has 0 such node"):
        world.core.submit(job_yaml())
    assert world.core.list() == [] and world.store.load_jobs() == []
    job = world.core.submit(job_yaml(), queue_anyway=True)
    assert job.id.startswith("cc-") and len(job.id) == len("cc-") + 6
    assert job.state is S.PENDING
    assert "needs 2 node(s) with 2 free slots each, 0 available (no nodes connected)" in job.reason
    assert kinds(world.core, job.id) == [("transition", "PENDING"), ("waiting", "PENDING")]
    world.core.schedule()                       # same reason: no new event
    assert len(world.core.events(job.id)) == 2
    assert world.core.get("cc") is job


def test_invalid_spec_stores_nothing(world: World) -> None:
    with pytest.raises(SpecError) as err:
        world.core.submit(job_yaml(tp=3), source="bad.yaml")
    assert any("tp" in line for line in err.value.errors)
    with pytest.raises(SpecError):
        world.core.submit("name: x\nbogus: 1\n")
    assert world.core.list() == [] and world.store.load_jobs() == []


def test_placement_is_node_major_and_each_node_gets_only_its_ranks(world: World) -> None:
    n0, n1 = world.connect("n0", gpus=2), world.connect("n1", gpus=2)
    job = world.core.submit(job_yaml(nodes=2, slots=2, tp=2))
    assert job.state is S.STARTING and job.nodes == ["n0", "n1"]
    assert [k for k, _ in kinds(world.core, job.id)] == ["transition", "transition", "transition"]
    a0, a1 = n0.assignments(job.id), n1.assignments(job.id)
    assert [a.rank for a in a0] == [0, 1] and [a.rank for a in a1] == [2, 3]
    assert [a.local_rank for a in a1] == [0, 1] and [a.device for a in a1] == [0, 1]
    assert {a.rendezvous for a in a0 + a1} == {"n0.lan:29500"}
    assert a1[0].groups["tp"] == [2, 3] and a1[0].groups["dp"] == [0, 2]
    assert a1[1].coords["tp"] == 1 and a1[1].coords["dp"] == 1
    assert all(a.world_size == 4 and a.kind == "comm-check" and a.attempt == 1 and a.run_dir == "" for a in a0)
    assert a0[0].spec.to_dict()["resources"] == {"nodes": 2, "slots_per_node": 2, "shm_mb": 1024,
                                                 "memory_mb": None, "pids_max": None, "min_nodes": None}


def test_cpu_nodes_get_no_device_and_ports_in_use_are_skipped(world: World) -> None:
    n0 = world.connect("n0", slots=4)
    first = world.core.submit(job_yaml("a", nodes=1, slots=2, tp=1))
    second = world.core.submit(job_yaml("b", nodes=1, slots=2, tp=1))
    assert {a.device for a in n0.assignments(first.id)} == {None}
    assert first.rendezvous == "n0.lan:29500" and second.rendezvous == "n0.lan:29501"
    third_node = world.connect("n1", slots=2, ports=())
    world.core.cancel(first.id)
    assert third_node.assignments(second.id) == []


def test_fifo_a_job_that_does_not_fit_blocks_the_ones_behind_it(world: World) -> None:
    for name in ("n0", "n1", "n2"):
        world.connect(name)
    a = world.core.submit(job_yaml("a", nodes=2))
    b = world.core.submit(job_yaml("b", nodes=2))
    c = world.core.submit(job_yaml("c", nodes=1))
    assert a.state is S.STARTING
    assert b.state is S.PENDING and "1 available (n0: 0 free, n1: 0 free, n2: 2 free)" in b.reason
    assert c.state is S.PENDING and c.reason == f"queued behind {b.id}"
    world.run_all(a.id)
    assert a.state is S.SUCCEEDED
    assert b.state is S.STARTING and c.state is S.STARTING
    assert b.nodes == ["n0", "n1"] and c.nodes == ["n2"]


def test_running_then_succeeded_with_a_comm_check_table(world: World) -> None:
    world.connect("n0"), world.connect("n1")
    job = world.core.submit(job_yaml())
    for r in range(3):
        world.report(job.id, r, "running")
    assert job.state is S.STARTING
    world.report(job.id, 3, "rendezvous")
    world.report(job.id, 3, "running")
    assert job.state is S.RUNNING and job.reason == "all 4 ranks running"
    row = {"kinds": ["tp"], "members": [0, 1],
           "allreduce": {"us": 10.0, "busbw_gbps": 1.0, "algbw_gbps": 1.0, "bytes": 1000},
           "allgather": {"us": 20.0, "busbw_gbps": 1.0, "algbw_gbps": 1.0, "bytes": 1000}}
    for r in range(4):
        world.report(job.id, r, "done", code=0, result={"size_bytes": 1000, "iters": 1, "groups": [row]})
    assert job.state is S.SUCCEEDED and job.finished_at == world.clock.t
    table = job.result["comm"]
    assert [(r["kind"], r["op"], r["max_us"], r["groups"], r["size"]) for r in table] == [
        ("tp", "allreduce", 10.0, 1, 2), ("tp", "allgather", 20.0, 1, 2)]
    assert table[0]["min_busbw_gbps"] == pytest.approx(1000 / 10e-6 / 1e9 * 1.0)
    assert [k for k, _ in kinds(world.core, job.id)][-2:] == ["result", "transition"]
    assert all(r.exited for r in world.core.rank_page(job.id, 0, job.world_size))
    assert world.core.shown.nodes()[0].free == 2     # slots are free again


def test_a_rank_that_exits_nonzero_fails_the_job_and_cancels_every_node(world: World) -> None:
    n0, n1 = world.connect("n0"), world.connect("n1")
    job = world.core.submit(job_yaml())
    world.report(job.id, 0, "running")
    world.report(job.id, 2, "failed", code=3, error="Traceback ...\nRuntimeError: NCCL timeout\n")
    assert job.state is S.FAILED
    assert job.reason == "rank 2 on node n1 exited with code 3: RuntimeError: NCCL timeout"
    for node in (n0, n1):
        assert [c.job_id for c in node.bodies("cancel")] == [job.id]
    world.report(job.id, 3, "exited", code=-15)  # later exits are stored, state stays
    assert job.state is S.FAILED and world.core.rank_page(job.id, 0, job.world_size)[3].exit_code == -15


def test_node_lost_by_heartbeat_fails_its_jobs_and_cancels_the_others(world: World) -> None:
    n0, n1 = world.connect("n0", slots=4), world.connect("n1", slots=4)
    job = world.core.submit(job_yaml(nodes=2, slots=4))
    world.clock.t += 6
    world.core.heartbeat(n0.session, [29500])
    world.clock.t += 5
    world.core.tick()
    assert n1.session.status is NodeStatus.LOST and n1.closed and not n0.closed
    assert job.state is S.FAILED
    assert job.reason == "node n1 lost (no heartbeat for 10.0 s); ranks 4-7 are gone"
    assert [c.job_id for c in n0.bodies("cancel")] == [job.id]
    assert n1.bodies("cancel") == []
    world.core.disconnect(n1.session)           # its stream closing later changes nothing
    assert job.reason.startswith("node n1 lost")


def test_stream_closing_marks_the_node_lost(world: World) -> None:
    n0, n1 = world.connect("n0"), world.connect("n1")
    job = world.core.submit(job_yaml())
    world.core.disconnect(n0.session)
    assert job.state is S.FAILED and job.reason == "node n0 lost (stream closed); ranks 0-1 are gone"
    assert [c.job_id for c in n1.bodies("cancel")] == [job.id]
    assert world.core.shown.nodes()[0].session.status is NodeStatus.LOST


def test_cancel(world: World) -> None:
    _, n1 = world.connect("n0"), world.connect("n1")
    job = world.core.submit(job_yaml())
    queued = world.core.submit(job_yaml("later"))
    world.core.cancel(queued.id, "not needed")
    assert queued.state is S.CANCELLED and queued.reason == "cancelled: not needed"
    world.core.cancel(job.id)
    assert job.state is S.CANCELLED and job.reason == "cancelled by user"
    assert [c.job_id for c in n1.bodies("cancel")] == [job.id]
    assert world.core.cancel(job.id).state is S.CANCELLED  # idempotent


def _restarted(world: World, path: Path) -> World:
    world.core.shutdown()
    world.store.close()
    again = make_world(path)
    again.clock.t = world.clock.t + 100
    again.core.started_at = again.clock.t
    return again


def test_restart_keeps_jobs_and_accepts_reconnect_with_replay(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    w.connect("n0"), w.connect("n1")
    job = w.core.submit(job_yaml())
    for r in range(4):
        w.report(job.id, r, "running")
    w.report(job.id, 0, "done", code=0)            # n0's seq 3, stored before the restart
    before = [(e.seq, e.kind, e.message) for e in w.core.events(job.id)]
    w2 = _restarted(w, tmp_path)
    again = w2.core.get(job.id)
    assert again.state is S.RUNNING and again.nodes == ["n0", "n1"]
    assert [(e.seq, e.kind, e.message) for e in w2.core.events(job.id)] == before
    assert {n.session.status for n in w2.core.shown.nodes()} == {NodeStatus.DISCONNECTED}
    w2.clock.t += 5
    w2.core.tick()
    assert again.state is S.RUNNING                # still within the reconnect grace
    n0 = w2.connect("n0", running=(RunningJob(job.id, 1, (0, 1)),))
    assert n0.bodies("registered")[0].last_seq == 3
    assert not w2.report(job.id, 0, "done", code=0, seq=3, node="n0")    # a replay: dropped
    assert w2.report(job.id, 1, "done", code=0, seq=4, node="n0")         # buffered, new
    n1 = w2.connect("n1", running=(RunningJob(job.id, 1, (2, 3)),))
    assert n1.bodies("registered")[0].last_seq == 2
    w2.report(job.id, 2, "done", code=0, seq=3, node="n1")
    assert again.state is S.RUNNING
    w2.report(job.id, 3, "done", code=0, seq=4, node="n1")
    assert [e.message for e in w2.core.events(job.id) if e.kind == "node"] == ["node n0 reconnected",
                                                                                "node n1 reconnected"]
    assert again.state is S.SUCCEEDED
    w2.store.close()


def test_after_a_restart_known_nodes_are_waited_for_while_others_still_register(tmp_path: Path) -> None:
    """A reconnect storm (thousands of daemons after a failover) takes longer than one grace: a known node is lost
    only after a grace in which no node registered (at most STORM_GRACES graces from the start)."""
    w = make_world(tmp_path)
    for name in ("n0", "n1", "n2"):
        w.connect(name)
    w2 = _restarted(w, tmp_path)
    w2.clock.t += 9.0
    w2.connect("n0")                      # still registering at 9 s ...
    w2.clock.t += 9.0
    w2.connect("n1")                      # ... and at 18 s: n2 is waited for past the first grace
    w2.core.heartbeat(w2.nodes["n0"].session)
    w2.core.tick()
    assert {s.name: s.status.value for s in w2.core.nodes}["n2"] == "DISCONNECTED"
    w2.clock.t += 10.5                    # a whole grace with no registration
    for name in ("n0", "n1"):
        w2.core.heartbeat(w2.nodes[name].session)
    w2.core.tick()
    assert {s.name: s.status.value for s in w2.core.nodes}["n2"] == "LOST"
    w2.store.close()


def test_restart_node_that_does_not_come_back_is_lost(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    w.connect("n0"), w.connect("n1")
    job = w.core.submit(job_yaml())
    w2 = _restarted(w, tmp_path)
    w2.connect("n0", running=(RunningJob(job.id, 1, (0, 1)),))
    w2.clock.t += 10.5
    w2.core.heartbeat(w2.nodes["n0"].session)
    w2.core.tick()
    again = w2.core.get(job.id)
    assert again.state is S.FAILED and again.reason.startswith("node n1 lost (did not reconnect within 10.0 s")
    assert [c.job_id for c in w2.nodes["n0"].bodies("cancel")] == [job.id]
    w2.store.close()


def test_reconnect_without_the_job_fails_it_and_unknown_jobs_are_cancelled(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    w.connect("n0"), w.connect("n1")
    job = w.core.submit(job_yaml())
    w2 = _restarted(w, tmp_path)                     # n0's daemon restarted too (a new session)
    n1 = w2.connect("n1", running=(RunningJob(job.id, 1, (2, 3)),))
    n0 = w2.connect("n0", running=(RunningJob("ghost-000000", 1, (0,)),), session="s2")
    again = w2.core.get(job.id)
    assert again.state is S.FAILED and again.reason == "node n0 reconnected without this job; ranks 0-1 are gone"
    assert sorted(c.job_id for c in n0.bodies("cancel")) == sorted([job.id, "ghost-000000"])
    assert [c.job_id for c in n1.bodies("cancel")] == [job.id]
    assert n0.bodies("registered")[-1].last_seq == 0   # a new daemon session restarts numbering
    w2.store.close()


def test_comm_check_result_takes_the_slowest_member_and_the_lowest_busbw() -> None:
    from rankctl.coordinator.jobs.results import aggregate

    def row(members: list[int], us: float) -> dict:
        m = {"us": us, "busbw_gbps": 0.0, "algbw_gbps": 0.0, "bytes": 4000}
        return {"kinds": ["dp", "dp_cp"], "members": members, "allreduce": m}

    results = {0: {"groups": [row([0, 2], 10.0)]}, 2: {"groups": [row([0, 2], 30.0)]},
               1: {"groups": [row([1, 3], 20.0)]}, 3: {"groups": [row([1, 3], 20.0)]}}
    comm = aggregate("comm-check", results)["comm"]
    assert [r["kind"] for r in comm] == ["dp", "dp_cp"]
    dp = comm[0]
    assert (dp["op"], dp["groups"], dp["size"], dp["mean_us"], dp["max_us"]) == ("allreduce", 2, 2, 25.0, 30.0)
    assert dp["min_busbw_gbps"] == pytest.approx(4000 / 30e-6 / 1e9)
    assert aggregate("other", {1: {"loss": 1.0}}) == {"ranks": {"1": {"loss": 1.0}}}
    # train: the lowest rank that holds every step's loss reports for the job (a last pp stage)
    losses = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
    nan_stage = {"losses": [{"step": 1, "loss": None}, {"step": 2, "loss": None}]}
    train = aggregate("train", {0: nan_stage, 2: {"losses": losses, "final": {"step": 2}}, 3: {"losses": losses}})
    assert train["losses"] == losses and train["reported_by"] == 2 and train["final"] == {"step": 2}


def test_register_needs_a_name_and_slots(world: World) -> None:
    from rankctl.coordinator.model.errors import ProtocolError

    with pytest.raises(ProtocolError):
        world.connect("", slots=2)
    with pytest.raises(ProtocolError):
        world.connect("n0", slots=0)


def test_same_daemon_reconnecting_after_its_ranks_exited_replays_them_first(world: World) -> None:
    world.connect("n0"), world.connect("n1")
    job = world.core.submit(job_yaml())
    for r in range(4):
        world.report(job.id, r, "running")
    world.connect("n0", running=())                  # ranks 0-1 exited while the stream was down
    assert job.state is S.RUNNING
    world.report(job.id, 0, "done", code=0)          # the replayed exits
    world.report(job.id, 1, "done", code=0)
    world.core.heartbeat(world.nodes["n0"].session)
    assert job.state is S.RUNNING
    world.connect("n1", running=())                  # n1's ranks are really gone
    world.core.heartbeat(world.nodes["n1"].session)
    assert job.state is S.FAILED and job.reason == "node n1 reconnected without this job; ranks 2-3 are gone"
