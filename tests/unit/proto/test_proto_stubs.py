"""The committed protobuf stubs are exactly what the pinned generator writes today."""

from pathlib import Path

import pytest

from rankctl.proto import from_short_name, from_struct, generate, short_name, to_struct


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


def test_enum_values_have_only_their_prefixed_names_and_short_names_map_both_ways() -> None:
    from rankctl.proto import rankctl_pb2 as pb

    assert not hasattr(pb, "RUNNING") and not hasattr(pb, "READY")            # no v1 aliases
    with pytest.raises(ValueError):
        pb.JobState.Value("RUNNING")
    assert pb.JobState.Name(pb.JOB_STATE_RUNNING) == "JOB_STATE_RUNNING"
    assert [short_name(pb.JobState, v) for v in (pb.JOB_STATE_PENDING, pb.JOB_STATE_RESTARTING)] == [
        "PENDING", "RESTARTING"]
    assert short_name(pb.NodeState, pb.NODE_STATE_DISCONNECTED) == "DISCONNECTED"
    assert from_short_name(pb.JobState, "RUNNING") == from_short_name(pb.JobState, "JOB_STATE_RUNNING") == 4
    with pytest.raises(ValueError, match=r"'GONE' is not a NodeState \(one of READY, LOST, DISCONNECTED\)"):
        from_short_name(pb.NodeState, "GONE")


def test_removed_fields_are_reserved_by_number_and_name() -> None:
    from google.protobuf.descriptor_pb2 import FileDescriptorProto

    from rankctl.proto import rankctl_pb2 as pb

    file = FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(file)
    reserved = {m.name: (set(m.reserved_name), {n for r in m.reserved_range for n in range(r.start, r.end)})
                for m in file.message_type if m.reserved_name}
    assert reserved["Job"] == ({"created_at", "finished_at", "spec_json", "result_json"}, {7, 8, 11, 12})
    assert reserved["Attempt"] == ({"started_at", "finished_at"}, {4, 5})
    assert reserved["Node"] == ({"last_seen"}, {7}) and reserved["RankStatus"] == (
        {"updated_at", "loss", "val_loss", "tokens_per_s"}, {9, 10, 11, 12})
    assert reserved["JobEvent"] == ({"ts", "metrics_json"}, {3, 9})
    assert reserved["NodeMessage"] == ({"report", "logs"}, {3, 4}) and reserved["Assign"] == ({"ranks"}, {3})
    assert reserved["ListJobsRequest"] == ({"limit"}, {1}) and reserved["ReportBatch"] == ({"logs"}, {2})
    assert "LogLines" not in pb.DESCRIPTOR.message_types_by_name
    assert "RankAssignmentMsg" not in pb.DESCRIPTOR.message_types_by_name


def test_a_struct_round_trip_gives_back_the_json_it_was_made_from() -> None:
    doc = {"name": "x", "steps": 40, "lr": 0.5, "none": None, "nested": {"list": [1, 2.5, "a", True, {}]}}
    assert from_struct(to_struct(doc)) == doc
    assert from_struct(to_struct(None)) == {}
