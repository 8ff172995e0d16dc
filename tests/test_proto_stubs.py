"""The committed protobuf stubs are exactly what the pinned generator writes today."""

from pathlib import Path

import pytest

from rankctl.proto import generate, short_name


def test_stubs_are_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    written = generate.generate(tmp_path)
    assert {p.name for p in written} == {"rankctl_pb2.py", "rankctl_pb2.pyi", "rankctl_pb2_grpc.py"}
    for fresh in written:
        committed = generate.HERE / fresh.name
        assert committed.exists(), f"{fresh.name} is not committed; run python -m rankctl.proto.generate"
        assert committed.read_text() == fresh.read_text(), (
            f"{fresh.name} is stale; run python -m rankctl.proto.generate and commit the result"
        )


def test_stubs_import_inside_the_package() -> None:
    from rankctl.proto import rankctl_pb2, rankctl_pb2_grpc

    assert rankctl_pb2.DESCRIPTOR.package == "rankctl.v1"
    assert rankctl_pb2.DESCRIPTOR.name == "rankctl/v1/rankctl.proto"
    assert hasattr(rankctl_pb2_grpc, "ClientServiceStub")


def test_v1_enum_names_stay_as_aliases_of_the_prefixed_ones() -> None:
    from rankctl.proto import rankctl_pb2 as pb

    assert (pb.PENDING, pb.RUNNING, pb.READY) == (pb.JOB_STATE_PENDING, pb.JOB_STATE_RUNNING, pb.NODE_STATE_READY)
    assert pb.JobState.Value("RUNNING") == pb.JobState.Value("JOB_STATE_RUNNING")
    assert pb.JobState.Name(pb.RUNNING) == "JOB_STATE_RUNNING"
    assert [short_name(pb.JobState, v) for v in (pb.PENDING, pb.RESTARTING)] == ["PENDING", "RESTARTING"]
    assert short_name(pb.NodeState, pb.DISCONNECTED) == "DISCONNECTED"
