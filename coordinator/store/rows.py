"""Rows of the coordinator's tables and the records they hold: the column lists and the conversions, in one place."""

from __future__ import annotations

import json
from dataclasses import asdict

from rankctl.coordinator.model.allocation import Allocation
from rankctl.coordinator.model.records import JobRecord, RankRecord
from rankctl.coordinator.model.states import JobState
from rankctl.kinds.spec import stored_spec

_JOB_COLS = (
    "seqno, id, name, kind, spec_json, state, reason, attempt, world_size, slots_per_node, "
    "created_at, finished_at, nodes_json, rendezvous, result_json, submitted_by, allocation_json"
)
_RANK_COLS = "rank, node, phase, step, metrics_json, error, exit_code, exited, updated_at, result_json"


def _job_from_row(row: tuple) -> JobRecord:
    (seqno, jid, name, kind, spec, state, reason, attempt, world, spn, created, finished, nodes, rdv, res, by,
     alloc) = row
    return JobRecord(
        id=jid, name=name, kind=kind, spec=stored_spec(json.loads(spec), name, kind), state=JobState(state), reason=reason,
        world_size=world, slots_per_node=spn, created_at=created, attempt=attempt, finished_at=finished,
        nodes=json.loads(nodes), rendezvous=rdv, result=json.loads(res) if res else None, seqno=seqno,
        submitted_by=by, allocation=Allocation.from_dict(json.loads(alloc)) if alloc else None,
    )


def _rank_from_row(row: tuple) -> RankRecord:
    rank, node, phase, step, metrics, error, code, exited, updated, result = row
    return RankRecord(rank, node, phase, step, metrics, error, code, bool(exited), updated, result)


def _rank_to_json(r: RankRecord) -> str:
    return json.dumps(asdict(r), separators=(",", ":"))
