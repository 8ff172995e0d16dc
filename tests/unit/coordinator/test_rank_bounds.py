"""A rank's report cannot grow the job's record without bound (pure, no processes): a 10 MB error, metrics,
result or stack from a rank's process, or a phase outside the known set, is cut or named ``unknown`` before it
reaches the record, the store, the summary and the events every ``GetJob`` and watch sends."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankctl.coordinator.model import rankbounds as bounds
from rankctl.proto import rankctl_pb2 as pb
from test_core import World, job_yaml, make_world

BIG = 10 << 20


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    yield w
    w.store.close()


def send(world: World, job, node: str, status: pb.RankStatus, result: str = "") -> None:
    fake = world.nodes[node]
    fake.seq += 1
    world.core.rank_reports(fake.session, [pb.RankReport(job_id=job.id, attempt=job.attempt, seq=fake.seq,
                                                         status=status, result_json=result)])
    world.core.flush()


def test_huge_fields_and_odd_phases_are_bounded_before_the_record(world: World) -> None:
    for n in ("n0", "n1"):
        world.connect(n, slots=2)
    job = world.core.submit(job_yaml())
    send(world, job, "n0", pb.RankStatus(rank=0, phase="running", metrics_json='{"a":"' + "x" * BIG + '"}'))
    send(world, job, "n0", pb.RankStatus(rank=1, phase="zzz\x00\u202e" + "p" * BIG))
    send(world, job, "n1", pb.RankStatus(rank=2, phase="running"))
    send(world, job, "n1", pb.RankStatus(rank=2, phase="running", step=1, metrics_json='{"b":"' + "y" * BIG + '"}',
                                         collectives="c" * BIG, stack="s" * BIG, process="q" * BIG))
    send(world, job, "n1", pb.RankStatus(rank=3, phase="failed", exited=True, exit_code=1,
                                         error="Traceback\n" + "e" * BIG + "\nValueError: the end"),
         result="r" * BIG)
    ranks = {r.rank: r for r in world.core.book.rank_page(world.core.get(job.id), 0, 4)}
    assert len(ranks[0].metrics_json) < 200 and "over the limit of 16384" in ranks[0].metrics_json
    assert ranks[1].phase == "unknown"
    assert len(ranks[2].metrics_json) < 200 and ranks[2].collectives == "" and ranks[2].process == "unknown"
    assert len(ranks[2].stack) == bounds.EVIDENCE_CHARS
    assert len(ranks[3].error) <= bounds.ERROR_CHARS and ranks[3].error.startswith("Traceback")
    assert ranks[3].error.endswith("ValueError: the end") and "characters cut" in ranks[3].error
    assert len(ranks[3].result_json) < 200
    stored = world.store.ranks(job.id)
    assert max(len(r.error) + len(r.metrics_json) + len(r.result_json) + len(r.phase) for r in stored.values()) \
        < 10_000
    summary = world.core.summary(job.id)
    assert set(summary.phases) <= bounds.KNOWN_PHASES
    sizes = [len(e.message) + (len(e.rank.error) + len(e.rank.metrics_json) + len(e.rank.result_json) if e.rank else 0)
             for e in world.core.events(job.id)]
    assert max(sizes) < 20_000


@pytest.mark.parametrize("change, named", [
    ({"address": "a" * 300}, r"address \(300 characters\) must be at most 256"),
    ({"session": "s" * 300}, r"session \(300 characters\)"),
    ({"hardware": {"hostname": "h" * (9 << 20)}}, r"hardware.hostname \(9437184 characters\)"),
    ({"hardware": {"gpus": [{"index": i} for i in range(10_000)]}}, r"hardware.gpus has 10000 entries; at most 256"),
    ({"hardware": {"cpu_count": -5}}, r"hardware.cpu_count=-5 must not be negative"),
    ({"free_ports": tuple(range(1, 100_001))}, r"free_ports has 100000 entries; at most 4096"),
    ({"free_ports": (-1,)}, r"port -1 \(free_ports or peer_port\) must be between 1 and 65535"),
    ({"peer_port": 70_000}, r"port 70000"),
    ({"data_roots": tuple(f"/d{i}" for i in range(100))}, r"data_roots has 100 entries; at most 64"),
    ({"data_roots": ("relative",)}, r"data_roots\[0\] must be an absolute path of at most 4096 characters"),
    ({"data_roots": ("/" + "d" * 5000,)}, r"data_roots\[0\] must be an absolute path"),
])
def test_a_register_out_of_bounds_is_refused_naming_the_field(world: World, change: dict, named: str) -> None:
    from rankctl.coordinator.model.errors import ProtocolError
    from rankctl.coordinator.model.records import NodeHello

    hello = NodeHello(**{"name": "n0", "address": "n0.lan", "slots": 2, **change})
    with pytest.raises(ProtocolError, match=named):
        world.core.register(hello, lambda msg: None)
    assert world.store.load_nodes() == []


def test_a_heartbeats_ports_beyond_the_bounds_go_unused(world: World) -> None:
    node = world.connect("n0", slots=2)
    world.core.heartbeat(node.session, [-1, 0, 70_000, 29_600] + list(range(1, 10_000)))
    assert node.session.free_ports[0] == 29_600 and len(node.session.free_ports) <= 4096
