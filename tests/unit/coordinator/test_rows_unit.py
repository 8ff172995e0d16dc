"""Unit tests of coordinator.store.rows: the job and rank column lists and their conversions from and to rows."""

from __future__ import annotations

import json

from rankctl.coordinator.model.allocation import Allocation, AllocationRequest
from rankctl.coordinator.model.records import RankRecord
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.store.rows import _JOB_COLS, _RANK_COLS, _job_from_row, _rank_from_row, _rank_to_json
from rankctl.kinds.spec import build_spec

SPEC_DOC = build_spec({"name": "a", "kind": "comm-check",
                       "resources": {"nodes": 2, "slots_per_node": 4}}).to_dict()


def _job_row(**kw: object) -> tuple:
    row = {"seqno": 7, "id": "a-00000f", "name": "a", "kind": "comm-check", "spec_json": json.dumps(SPEC_DOC),
           "state": "RUNNING", "reason": "placed", "attempt": 3, "world_size": 8, "slots_per_node": 4,
           "created_at": 100.5, "finished_at": 0.0, "nodes_json": '["n0", "n1"]', "rendezvous": "n0:29500",
           "result_json": None, "submitted_by": "user alice", "allocation_json": ""}
    row.update(kw)
    return tuple(row.values())


def test_the_job_columns_are_the_seventeen_a_job_row_unpacks_in_that_order() -> None:
    cols = [c.strip() for c in _JOB_COLS.split(",")]
    assert cols == ["seqno", "id", "name", "kind", "spec_json", "state", "reason", "attempt", "world_size",
                    "slots_per_node", "created_at", "finished_at", "nodes_json", "rendezvous", "result_json",
                    "submitted_by", "allocation_json"]


def test_the_rank_columns_follow_the_rank_records_stored_fields_in_order() -> None:
    cols = [c.strip() for c in _RANK_COLS.split(",")]
    assert cols == ["rank", "node", "phase", "step", "metrics_json", "error", "exit_code", "exited", "updated_at",
                    "result_json"]
    assert cols == list(RankRecord.__dataclass_fields__)[:len(cols)]


def test_a_job_row_becomes_a_job_record_with_every_column_in_its_field() -> None:
    job = _job_from_row(_job_row())
    assert (job.seqno, job.id, job.name, job.kind) == (7, "a-00000f", "a", "comm-check")
    assert job.state is JobState.RUNNING and job.reason == "placed"
    assert (job.attempt, job.world_size, job.slots_per_node) == (3, 8, 4)
    assert (job.created_at, job.finished_at) == (100.5, 0.0)
    assert job.nodes == ["n0", "n1"] and job.rendezvous == "n0:29500"
    assert job.result is None and job.allocation is None and job.submitted_by == "user alice"
    assert job.spec.resources.nodes == 2 and job.nodes_needed == 2


def test_a_job_rows_result_json_is_parsed_and_an_empty_one_is_none() -> None:
    assert _job_from_row(_job_row(result_json='{"comm": [1, 2]}')).result == {"comm": [1, 2]}
    assert _job_from_row(_job_row(result_json="")).result is None


def test_a_job_rows_allocation_json_becomes_its_allocation() -> None:
    alloc = Allocation(request=AllocationRequest(spares=1, partition="gpu"), pool="a-00000f-a1", id="1234",
                       state="RUNNING", nodes=["n0", "n1", "n2"])
    job = _job_from_row(_job_row(allocation_json=json.dumps(alloc.to_dict())))
    assert job.allocation == alloc
    assert job.pool == "a-00000f-a1"


def test_a_job_row_of_a_kind_no_longer_known_keeps_its_common_sections() -> None:
    doc = {**SPEC_DOC, "kind": "gone-plugin"}
    job = _job_from_row(_job_row(kind="gone-plugin", spec_json=json.dumps(doc)))
    assert job.kind == "gone-plugin" and job.spec.kind == "gone-plugin"
    assert job.spec.resources.slots_per_node == 4


def test_a_rank_row_becomes_a_rank_record_with_exited_as_a_bool() -> None:
    row = (5, "n1", "failed", 12, '{"loss": 1.5}', "boom", 3, 1, 42.0, '{"x": 1}')
    rank = _rank_from_row(row)
    assert rank == RankRecord(5, "n1", "failed", 12, '{"loss": 1.5}', "boom", 3, True, 42.0, '{"x": 1}')
    assert rank.exited is True
    assert _rank_from_row((0, "n0", "running", 0, "", "", 0, 0, 0.0, "")).exited is False


def test_a_rank_records_json_is_compact_and_reads_back_to_an_equal_record() -> None:
    rank = RankRecord(3, "n1", "running", step=7, metrics_json='{"loss":2.0}', exited=False, updated_at=2.0,
                      stack="frame")
    text = _rank_to_json(rank)
    assert text.startswith('{"rank":3,"node":"n1","phase":"running","step":7,')
    assert ", " not in text and '": ' not in text
    doc = json.loads(text)
    assert doc["metrics_json"] == '{"loss":2.0}' and doc["stack"] == "frame"
    assert RankRecord(**doc) == rank
