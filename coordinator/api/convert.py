"""Domain records <-> protobuf messages of ``rankctl.v1`` (no logic beyond the mapping)."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import TYPE_CHECKING, Any

from google.protobuf.timestamp_pb2 import Timestamp

from rankctl.coordinator.model.allocation import Allocation, AllocationRequest
from rankctl.coordinator.model.faults import Fault
from rankctl.coordinator.fleet.nodes import NodeStatus
from rankctl.coordinator.diagnosis.progress import SHOWN
from rankctl.coordinator.model.records import EventRecord, JobRecord, NodeHello, RankRecord, RunningJob
from rankctl.coordinator.model.states import JobState
from rankctl.kinds import registry
from rankctl.kinds.spec import spec_model
from rankctl.parallel.layout import layout_words
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import from_short_name, short_name, to_struct

if TYPE_CHECKING:
    from rankctl.coordinator.diagnosis.progress import JobSummary
    from rankctl.coordinator.jobs.shown import NodeShown

SUMMARY_ERROR_CHARS = 2000  # a failing rank's error in a summary: its tail (the summary goes out with every batch)
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
REDACTED = "<redacted>"  # what clients see of a kind's secret field (``JobKind.secrets``): only the Assign carries it
NODES_SHOWN = 1024  # an allocation's node names in a Job message (ctl status shows them; the count is the request's)
TIMESTAMP_END_S = 253_402_300_800  # 10000-01-01T00:00:00Z: past google.protobuf.Timestamp's range

_NODE_STATE = {
    NodeStatus.READY: pb.NODE_STATE_READY,
    NodeStatus.LOST: pb.NODE_STATE_LOST,
    NodeStatus.DISCONNECTED: pb.NODE_STATE_DISCONNECTED,
}


def job_state(state: JobState) -> int:
    return from_short_name(pb.JobState, state.value)


def job_state_from_pb(value: int) -> JobState:
    return JobState(short_name(pb.JobState, value))


def stamp(field: Timestamp, seconds: float) -> None:
    """Set a message's Timestamp ``field`` to unix ``seconds``, in place (the cheapest way measured: this
    runs per rank); left unset for 0 (not yet) and for what a Timestamp cannot hold (NaN too)."""
    if 0 < seconds < TIMESTAMP_END_S:
        whole = int(seconds)
        field.seconds = whole
        field.nanos = min(round((seconds - whole) * 1e9), 999_999_999)


def _seconds(ts: Timestamp) -> float:
    return ts.seconds + ts.nanos / 1e9


def update_seconds(st: pb.RankStatus | RankRecord) -> float:
    """When a rank wrote a status, in unix seconds (0: not said), from a status message or a record."""
    return st.updated_at if isinstance(st, RankRecord) else _seconds(st.update_time)


# -- domain -> pb ---------------------------------------------------------------
def rank_to_pb(r: RankRecord) -> pb.RankStatus:
    msg = pb.RankStatus(
        rank=r.rank, node=r.node, phase=r.phase, step=r.step, metrics_json=r.metrics_json, error=r.error,
        exit_code=r.exit_code, exited=r.exited,
    )
    stamp(msg.update_time, r.updated_at)
    return msg


def job_to_pb(job: JobRecord, ranks: list[RankRecord] = (), *, summary: "JobSummary | None" = None,
              rank_offset: int = 0, next_rank_offset: int = 0, nodes: bool = True) -> pb.Job:
    """A whole job message; ``ranks`` is one page starting at ``rank_offset`` (``nodes=False``: no node list)."""
    msg = job_summary_pb(job)
    msg.nodes.extend(job.nodes if nodes else ())
    msg.ranks.extend(rank_to_pb(r) for r in ranks)
    msg.rank_offset, msg.next_rank_offset, msg.submitted_by = rank_offset, next_rank_offset, job.submitted_by
    if isinstance(job.result, dict):
        msg.result.update(job.result)
    if summary is not None:
        msg.summary.CopyFrom(summary_to_pb(summary))
    return msg


def _attempt_to_pb(a: dict, job: JobRecord | None) -> pb.Attempt:
    """A stored attempt row (an attempt still running has no end state yet); with the job, its size and layout."""
    msg = pb.Attempt(attempt=a["attempt"], state=a["state"] if a["finished_at"] else "",
                     reason=a["reason"] if a["finished_at"] else "")
    stamp(msg.start_time, a["started_at"])
    stamp(msg.finish_time, a["finished_at"])
    if (fault := Fault.from_json(a.get("fault_json") or "")) is not None:
        msg.failure.CopyFrom(failure_to_pb(fault))
    nodes = a.get("nodes") or 0
    if job is not None and nodes:
        msg.nodes, msg.world_size = nodes, nodes * job.slots_per_node
        msg.layout = layout_words(job.spec.parallel, msg.world_size)
    return msg


def failure_to_pb(f: Fault) -> pb.Failure:
    """A typed fault on the wire (its reason is the attempt's)."""
    msg = pb.Failure(cause=f.cause.value, node=f.node)
    if isinstance(f.rank, int):
        msg.rank = f.rank
    if isinstance(f.code, int) and -2**31 <= f.code < 2**31:
        msg.exit_code = f.code
    if isinstance(f.step, int) and -2**63 <= f.step < 2**63:
        msg.step = f.step
    return msg


def attempts_to_pb(rows: list[dict], job: JobRecord | None = None) -> list[pb.Attempt]:
    return [_attempt_to_pb(a, job) for a in rows]


def summary_to_pb(s: "JobSummary") -> pb.JobSummary:
    return pb.JobSummary(
        phases=s.phases, running=s.running, exited=s.exited, failed=s.failed, min_step=s.min_step,
        max_step=s.max_step, stragglers=s.stragglers, failing=[_error_tail(rank_to_pb(r)) for r in s.failing],
        metrics=_numbers(s.metrics), reports=s.reports,
        preflight_ms=s.preflight.figures if s.preflight else {}, preflight_note=s.preflight.note if s.preflight else "",
        stall=s.stall,
        slow=[pb.SlowRank(rank=r.rank, node=r.node, compute_s=r.compute_s, median_s=r.median_s, steps=r.steps)
              for r in s.slow[:SHOWN]],
    )


def job_summary_pb(job: JobRecord) -> pb.Job:
    """A job for lists: no ranks, no result, no node list (their size grows with the job)."""
    msg = pb.Job(id=job.id, name=job.name, state=job_state(job.state), reason=job.reason, attempt=job.attempt,
                 world_size=job.world_size, kind=job.kind, spec=to_struct(public_spec(job.spec.to_dict())),
                 node_count=len(job.nodes))
    stamp(msg.create_time, job.created_at)
    stamp(msg.finish_time, job.finished_at)
    if job.allocation is not None:
        msg.allocation.CopyFrom(allocation_to_pb(job.allocation))
    return msg


def allocation_request_to_pb(r: AllocationRequest) -> pb.AllocationRequest:
    return pb.AllocationRequest(scheduler=r.scheduler, spares=r.spares, partition=r.partition, time=r.time,
                                account=r.account, qos=r.qos, extra_args=r.extra_args,
                                worker_state_dir=r.worker_state_dir, ctl=r.ctl, gpus_per_node=r.gpus_per_node,
                                worker_args=r.worker_args, worker_tls_dir=r.worker_tls_dir)


def allocation_request_from_pb(m: pb.AllocationRequest) -> AllocationRequest:
    return AllocationRequest(scheduler=m.scheduler, spares=m.spares, partition=m.partition, time=m.time,
                             account=m.account, qos=m.qos, extra_args=tuple(m.extra_args),
                             worker_state_dir=m.worker_state_dir, ctl=m.ctl, gpus_per_node=m.gpus_per_node,
                             worker_args=tuple(m.worker_args), worker_tls_dir=m.worker_tls_dir)


def allocation_to_pb(a: Allocation) -> pb.Allocation:
    return pb.Allocation(request=allocation_request_to_pb(a.request), pool=a.pool, id=a.id, state=a.state,
                         nodes=a.nodes[:NODES_SHOWN], output=a.output, number=a.number)


def _numbers(metrics: dict[str, Any] | None) -> dict[str, float]:
    """The numeric entries of a metrics dict (a map<string, double> field; anything else is left out)."""
    return {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def plan_to_pb(layout: dict[str, Any], spec: dict[str, Any]) -> pb.PlanJobResponse:
    return pb.PlanJobResponse(layout=to_struct(layout), spec=to_struct(public_spec(spec)))


def public_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec as clients see it: each secret field its kind declares (``JobKind.secrets``) redacted: a mapping's
    values (its keys stay), any other value whole; the rest as is."""
    known = registry.kinds().get(spec.get("kind", "")) if isinstance(spec, dict) else None
    for path in known.secrets if known is not None else ():
        spec = _redacted(spec, path.split("."))
    return spec


def _redacted(doc: Any, path: list[str]) -> Any:
    """``doc`` (not changed) with the value at ``path`` redacted, where it is."""
    if not isinstance(doc, dict) or path[0] not in doc:
        return doc
    value = doc[path[0]]
    if len(path) > 1:
        return {**doc, path[0]: _redacted(value, path[1:])}
    if isinstance(value, dict):
        return {**doc, path[0]: {key: REDACTED for key in value}}
    return {**doc, path[0]: REDACTED if value not in (None, "", [], {}) else value}


def _error_tail(msg: pb.RankStatus) -> pb.RankStatus:
    msg.error = msg.error[-SUMMARY_ERROR_CHARS:]
    return msg


def event_to_pb(ev: EventRecord) -> pb.JobEvent:
    msg = pb.JobEvent(seq=ev.seq, job_id=ev.job_id, state=job_state(ev.state), kind=ev.kind,
                      message=ev.message, step=ev.step, metrics=_numbers(ev.metrics))
    stamp(msg.event_time, ev.ts)
    if ev.rank is not None:
        msg.rank.CopyFrom(rank_to_pb(ev.rank))
        if ev.ranks > 1:   # the ranks from msg.rank.rank that it stands for (``RankStatus.ranks``)
            msg.rank.ranks = ev.ranks
    return msg


def job_schema_to_pb() -> pb.GetJobSchemaResponse:
    """The job file's JSON Schema (the spec model with every registered kind's sections) and its digest."""
    text, version = _job_schema(spec_model())
    return pb.GetJobSchemaResponse(schema_json=text, version=version)


@functools.lru_cache(maxsize=1)
def _job_schema(model: type) -> tuple[str, str]:
    """Built once per spec model (``spec_model`` makes a new one only when the registered kinds change);
    ``kind`` lists the registered kinds (the model checks it with a validator, which a schema cannot show)."""
    schema = {"$schema": JSON_SCHEMA_DIALECT, **model.model_json_schema()}
    schema["properties"]["kind"]["enum"] = sorted(registry.kinds())
    text = json.dumps(schema, separators=(",", ":"))
    return text, "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def hardware_to_pb(hw: dict[str, Any]) -> pb.Hardware:
    return pb.Hardware(
        hostname=hw.get("hostname", ""), cpu_count=hw.get("cpu_count", 0), memory_bytes=hw.get("memory_bytes", 0),
        gpus=[pb.GpuInfo(index=g.get("index", 0), name=g.get("name", ""), memory_bytes=g.get("memory_bytes", 0))
              for g in hw.get("gpus") or []],
    )


def node_to_pb(node: "NodeShown") -> pb.Node:
    """A node as shown (``coordinator.jobs.shown``)."""
    session, r = node.session, node.session.record
    msg = pb.Node(
        name=r.name, address=r.address, slots=r.slots, free_slots=node.free, state=_NODE_STATE[session.status],
        hardware=hardware_to_pb(r.hardware), rejected_reports=node.rejected,
        draining=node.draining is not None, excluded_for=node.excluded_for, usage=session.usage, pool=session.pool,
        jobs=node.jobs,
    )
    stamp(msg.last_seen_time, r.last_seen)
    return msg


def retune_message(heartbeat_interval: float) -> pb.CoordinatorMessage:
    """An Ack that acknowledges nothing and asks for heartbeats every ``heartbeat_interval`` seconds from now on."""
    return pb.CoordinatorMessage(ack=pb.Ack(last_seq=0, heartbeat_interval=heartbeat_interval))


def registered_message(node: str, heartbeat_interval: float, last_seq: int,
                       relay_key: bytes = b"") -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(registered=pb.Registered(
        node=node, heartbeat_interval=heartbeat_interval, last_seq=last_seq, folds=True, relay_key=relay_key))


def cancel_message(job_id: str, attempt: int, reason: str) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(cancel=pb.Cancel(job_id=job_id, attempt=attempt, reason=reason))


def checkpoint_message(job_id: str, attempt: int, step: int) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(checkpoint=pb.CheckpointNow(job_id=job_id, attempt=attempt, step=step))


# -- pb -> domain ---------------------------------------------------------------
def hardware_from_pb(hw: pb.Hardware) -> dict[str, Any]:
    return {
        "hostname": hw.hostname, "cpu_count": hw.cpu_count, "memory_bytes": hw.memory_bytes,
        "gpus": [{"index": g.index, "name": g.name, "memory_bytes": g.memory_bytes} for g in hw.gpus],
    }


def hello_from_pb(reg: pb.Register) -> NodeHello:
    return NodeHello(
        name=reg.name, address=reg.address, slots=reg.slots, hardware=hardware_from_pb(reg.hardware),
        free_ports=tuple(reg.free_ports), session=reg.session, peer_port=reg.peer_port,
        running=tuple(RunningJob(r.job_id, r.attempt, tuple(r.ranks)) for r in reg.running), pool=reg.pool,
        replaces=reg.replaces, relays=reg.relays, data_roots=tuple(reg.data_roots),
    )
