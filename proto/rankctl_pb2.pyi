import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_PLACED: _ClassVar[JobState]
    JOB_STATE_STARTING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_RESTARTING: _ClassVar[JobState]

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_READY: _ClassVar[NodeState]
    NODE_STATE_LOST: _ClassVar[NodeState]
    NODE_STATE_DISCONNECTED: _ClassVar[NodeState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_PLACED: JobState
JOB_STATE_STARTING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_RESTARTING: JobState
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_READY: NodeState
NODE_STATE_LOST: NodeState
NODE_STATE_DISCONNECTED: NodeState

class GpuInfo(_message.Message):
    __slots__ = ("index", "name", "memory_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    memory_bytes: int
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class Hardware(_message.Message):
    __slots__ = ("hostname", "cpu_count", "memory_bytes", "gpus")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    cpu_count: int
    memory_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    def __init__(self, hostname: _Optional[str] = ..., cpu_count: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ...) -> None: ...

class GpuUsage(_message.Message):
    __slots__ = ("index", "utilization", "memory_used_bytes", "memory_total_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    utilization: float
    memory_used_bytes: int
    memory_total_bytes: int
    def __init__(self, index: _Optional[int] = ..., utilization: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ...) -> None: ...

class NodeUsage(_message.Message):
    __slots__ = ("cpu_percent", "memory_used_bytes", "memory_total_bytes", "gpus", "sample_time")
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TIME_FIELD_NUMBER: _ClassVar[int]
    cpu_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuUsage]
    sample_time: _timestamp_pb2.Timestamp
    def __init__(self, cpu_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuUsage, _Mapping]]] = ..., sample_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("name", "address", "slots", "free_slots", "state", "hardware", "rejected_reports", "draining", "excluded_for", "last_seen_time", "usage", "pool", "jobs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    REJECTED_REPORTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FOR_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_TIME_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    slots: int
    free_slots: int
    state: NodeState
    hardware: Hardware
    rejected_reports: int
    draining: bool
    excluded_for: _containers.RepeatedScalarFieldContainer[str]
    last_seen_time: _timestamp_pb2.Timestamp
    usage: NodeUsage
    pool: str
    jobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., state: _Optional[_Union[NodeState, str]] = ..., hardware: _Optional[_Union[Hardware, _Mapping]] = ..., rejected_reports: _Optional[int] = ..., draining: _Optional[bool] = ..., excluded_for: _Optional[_Iterable[str]] = ..., last_seen_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., usage: _Optional[_Union[NodeUsage, _Mapping]] = ..., pool: _Optional[str] = ..., jobs: _Optional[_Iterable[str]] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "node", "phase", "step", "metrics_json", "error", "exit_code", "exited", "step_time_s", "process", "compute_s", "wait_s", "collectives", "stack", "update_time", "figures", "notice", "preflight", "ranks", "first_step")
    class FiguresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    PREFLIGHT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    phase: str
    step: int
    metrics_json: str
    error: str
    exit_code: int
    exited: bool
    step_time_s: float
    process: str
    compute_s: float
    wait_s: float
    collectives: str
    stack: str
    update_time: _timestamp_pb2.Timestamp
    figures: _containers.ScalarMap[str, float]
    notice: str
    preflight: str
    ranks: int
    first_step: bool
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., phase: _Optional[str] = ..., step: _Optional[int] = ..., metrics_json: _Optional[str] = ..., error: _Optional[str] = ..., exit_code: _Optional[int] = ..., exited: _Optional[bool] = ..., step_time_s: _Optional[float] = ..., process: _Optional[str] = ..., compute_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., collectives: _Optional[str] = ..., stack: _Optional[str] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., figures: _Optional[_Mapping[str, float]] = ..., notice: _Optional[str] = ..., preflight: _Optional[str] = ..., ranks: _Optional[int] = ..., first_step: _Optional[bool] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("seq", "job_id", "state", "kind", "message", "rank", "step", "event_time", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    job_id: str
    state: JobState
    kind: str
    message: str
    rank: RankStatus
    step: int
    event_time: _timestamp_pb2.Timestamp
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, seq: _Optional[int] = ..., job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ..., rank: _Optional[_Union[RankStatus, _Mapping]] = ..., step: _Optional[int] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class JobSummary(_message.Message):
    __slots__ = ("phases", "running", "exited", "failed", "min_step", "max_step", "stragglers", "failing", "reports", "slow", "metrics", "preflight_ms", "preflight_note", "stall")
    class PhasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PreflightMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PHASES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_FIELD_NUMBER: _ClassVar[int]
    STRAGGLERS_FIELD_NUMBER: _ClassVar[int]
    FAILING_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    SLOW_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    PREFLIGHT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFLIGHT_NOTE_FIELD_NUMBER: _ClassVar[int]
    STALL_FIELD_NUMBER: _ClassVar[int]
    phases: _containers.ScalarMap[str, int]
    running: int
    exited: int
    failed: int
    min_step: int
    max_step: int
    stragglers: _containers.RepeatedScalarFieldContainer[int]
    failing: _containers.RepeatedCompositeFieldContainer[RankStatus]
    reports: int
    slow: _containers.RepeatedCompositeFieldContainer[SlowRank]
    metrics: _containers.ScalarMap[str, float]
    preflight_ms: _containers.ScalarMap[str, float]
    preflight_note: str
    stall: str
    def __init__(self, phases: _Optional[_Mapping[str, int]] = ..., running: _Optional[int] = ..., exited: _Optional[int] = ..., failed: _Optional[int] = ..., min_step: _Optional[int] = ..., max_step: _Optional[int] = ..., stragglers: _Optional[_Iterable[int]] = ..., failing: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., reports: _Optional[int] = ..., slow: _Optional[_Iterable[_Union[SlowRank, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., preflight_ms: _Optional[_Mapping[str, float]] = ..., preflight_note: _Optional[str] = ..., stall: _Optional[str] = ...) -> None: ...

class SlowRank(_message.Message):
    __slots__ = ("rank", "node", "compute_s", "median_s", "steps")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    compute_s: float
    median_s: float
    steps: int
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., compute_s: _Optional[float] = ..., median_s: _Optional[float] = ..., steps: _Optional[int] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "name", "state", "reason", "attempt", "world_size", "nodes", "ranks", "kind", "summary", "rank_offset", "next_rank_offset", "attempts", "stopping", "submitted_by", "create_time", "finish_time", "spec", "result", "allocation", "node_count")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NEXT_RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_BY_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    FINISH_TIME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    state: JobState
    reason: str
    attempt: int
    world_size: int
    nodes: _containers.RepeatedScalarFieldContainer[str]
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    kind: str
    summary: JobSummary
    rank_offset: int
    next_rank_offset: int
    attempts: _containers.RepeatedCompositeFieldContainer[Attempt]
    stopping: int
    submitted_by: str
    create_time: _timestamp_pb2.Timestamp
    finish_time: _timestamp_pb2.Timestamp
    spec: _struct_pb2.Struct
    result: _struct_pb2.Struct
    allocation: Allocation
    node_count: int
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., attempt: _Optional[int] = ..., world_size: _Optional[int] = ..., nodes: _Optional[_Iterable[str]] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., kind: _Optional[str] = ..., summary: _Optional[_Union[JobSummary, _Mapping]] = ..., rank_offset: _Optional[int] = ..., next_rank_offset: _Optional[int] = ..., attempts: _Optional[_Iterable[_Union[Attempt, _Mapping]]] = ..., stopping: _Optional[int] = ..., submitted_by: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finish_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., spec: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., result: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., allocation: _Optional[_Union[Allocation, _Mapping]] = ..., node_count: _Optional[int] = ...) -> None: ...

class AllocationRequest(_message.Message):
    __slots__ = ("scheduler", "spares", "partition", "time", "account", "qos", "extra_args", "worker_state_dir", "ctl", "gpus_per_node", "worker_args", "worker_tls_dir")
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_ARGS_FIELD_NUMBER: _ClassVar[int]
    WORKER_STATE_DIR_FIELD_NUMBER: _ClassVar[int]
    CTL_FIELD_NUMBER: _ClassVar[int]
    GPUS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ARGS_FIELD_NUMBER: _ClassVar[int]
    WORKER_TLS_DIR_FIELD_NUMBER: _ClassVar[int]
    scheduler: str
    spares: int
    partition: str
    time: str
    account: str
    qos: str
    extra_args: _containers.RepeatedScalarFieldContainer[str]
    worker_state_dir: str
    ctl: str
    gpus_per_node: int
    worker_args: _containers.RepeatedScalarFieldContainer[str]
    worker_tls_dir: str
    def __init__(self, scheduler: _Optional[str] = ..., spares: _Optional[int] = ..., partition: _Optional[str] = ..., time: _Optional[str] = ..., account: _Optional[str] = ..., qos: _Optional[str] = ..., extra_args: _Optional[_Iterable[str]] = ..., worker_state_dir: _Optional[str] = ..., ctl: _Optional[str] = ..., gpus_per_node: _Optional[int] = ..., worker_args: _Optional[_Iterable[str]] = ..., worker_tls_dir: _Optional[str] = ...) -> None: ...

class Allocation(_message.Message):
    __slots__ = ("request", "pool", "id", "state", "nodes", "output", "number")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    request: AllocationRequest
    pool: str
    id: str
    state: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    output: str
    number: int
    def __init__(self, request: _Optional[_Union[AllocationRequest, _Mapping]] = ..., pool: _Optional[str] = ..., id: _Optional[str] = ..., state: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., output: _Optional[str] = ..., number: _Optional[int] = ...) -> None: ...

class WorkerPool(_message.Message):
    __slots__ = ("id", "allocation", "nodes", "slots", "state", "reason", "create_time", "requested_by")
    ID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    id: str
    allocation: Allocation
    nodes: int
    slots: int
    state: str
    reason: str
    create_time: _timestamp_pb2.Timestamp
    requested_by: str
    def __init__(self, id: _Optional[str] = ..., allocation: _Optional[_Union[Allocation, _Mapping]] = ..., nodes: _Optional[int] = ..., slots: _Optional[int] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., requested_by: _Optional[str] = ...) -> None: ...

class StartWorkersRequest(_message.Message):
    __slots__ = ("allocation", "nodes", "slots")
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    allocation: AllocationRequest
    nodes: int
    slots: int
    def __init__(self, allocation: _Optional[_Union[AllocationRequest, _Mapping]] = ..., nodes: _Optional[int] = ..., slots: _Optional[int] = ...) -> None: ...

class StartWorkersResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: WorkerPool
    def __init__(self, pool: _Optional[_Union[WorkerPool, _Mapping]] = ...) -> None: ...

class ReleaseWorkersRequest(_message.Message):
    __slots__ = ("id", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    reason: str
    def __init__(self, id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseWorkersResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: WorkerPool
    def __init__(self, pool: _Optional[_Union[WorkerPool, _Mapping]] = ...) -> None: ...

class ListWorkerPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkerPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[WorkerPool]
    def __init__(self, pools: _Optional[_Iterable[_Union[WorkerPool, _Mapping]]] = ...) -> None: ...

class Attempt(_message.Message):
    __slots__ = ("attempt", "state", "reason", "start_time", "finish_time", "nodes", "world_size", "layout", "failure")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    FINISH_TIME_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    state: str
    reason: str
    start_time: _timestamp_pb2.Timestamp
    finish_time: _timestamp_pb2.Timestamp
    nodes: int
    world_size: int
    layout: str
    failure: Failure
    def __init__(self, attempt: _Optional[int] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finish_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., nodes: _Optional[int] = ..., world_size: _Optional[int] = ..., layout: _Optional[str] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("cause", "node", "rank", "exit_code", "step")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    cause: str
    node: str
    rank: int
    exit_code: int
    step: int
    def __init__(self, cause: _Optional[str] = ..., node: _Optional[str] = ..., rank: _Optional[int] = ..., exit_code: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class Assign(_message.Message):
    __slots__ = ("job_id", "attempt", "world_size", "first_rank", "rank_count", "rendezvous", "backend", "kind", "spec_json", "restart", "replica_peer", "restore_peer")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_COUNT_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    REPLICA_PEER_FIELD_NUMBER: _ClassVar[int]
    RESTORE_PEER_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    world_size: int
    first_rank: int
    rank_count: int
    rendezvous: str
    backend: str
    kind: str
    spec_json: str
    restart: bool
    replica_peer: str
    restore_peer: str
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., world_size: _Optional[int] = ..., first_rank: _Optional[int] = ..., rank_count: _Optional[int] = ..., rendezvous: _Optional[str] = ..., backend: _Optional[str] = ..., kind: _Optional[str] = ..., spec_json: _Optional[str] = ..., restart: _Optional[bool] = ..., replica_peer: _Optional[str] = ..., restore_peer: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("last_seq", "heartbeat_interval", "resend")
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    RESEND_FIELD_NUMBER: _ClassVar[int]
    last_seq: int
    heartbeat_interval: float
    resend: bool
    def __init__(self, last_seq: _Optional[int] = ..., heartbeat_interval: _Optional[float] = ..., resend: _Optional[bool] = ...) -> None: ...

class FetchLogs(_message.Message):
    __slots__ = ("request_id", "job_id", "attempt", "rank", "offset", "tail", "max_lines", "records")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    MAX_LINES_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    job_id: str
    attempt: int
    rank: int
    offset: int
    tail: int
    max_lines: int
    records: bool
    def __init__(self, request_id: _Optional[int] = ..., job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., rank: _Optional[int] = ..., offset: _Optional[int] = ..., tail: _Optional[int] = ..., max_lines: _Optional[int] = ..., records: _Optional[bool] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("job_id", "attempt", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("name", "address", "slots", "hardware", "free_ports", "running", "session", "peer_port", "pool", "replaces", "relays", "data_roots")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    FREE_PORTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PEER_PORT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLACES_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    DATA_ROOTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    slots: int
    hardware: Hardware
    free_ports: _containers.RepeatedScalarFieldContainer[int]
    running: _containers.RepeatedCompositeFieldContainer[RunningJob]
    session: str
    peer_port: int
    pool: str
    replaces: bool
    relays: bool
    data_roots: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., slots: _Optional[int] = ..., hardware: _Optional[_Union[Hardware, _Mapping]] = ..., free_ports: _Optional[_Iterable[int]] = ..., running: _Optional[_Iterable[_Union[RunningJob, _Mapping]]] = ..., session: _Optional[str] = ..., peer_port: _Optional[int] = ..., pool: _Optional[str] = ..., replaces: _Optional[bool] = ..., relays: _Optional[bool] = ..., data_roots: _Optional[_Iterable[str]] = ...) -> None: ...

class RunningJob(_message.Message):
    __slots__ = ("job_id", "attempt", "ranks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("ts", "free_ports", "usage")
    TS_FIELD_NUMBER: _ClassVar[int]
    FREE_PORTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ts: float
    free_ports: _containers.RepeatedScalarFieldContainer[int]
    usage: NodeUsage
    def __init__(self, ts: _Optional[float] = ..., free_ports: _Optional[_Iterable[int]] = ..., usage: _Optional[_Union[NodeUsage, _Mapping]] = ...) -> None: ...

class RankReport(_message.Message):
    __slots__ = ("job_id", "attempt", "status", "result_json", "seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    status: RankStatus
    result_json: str
    seq: int
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., status: _Optional[_Union[RankStatus, _Mapping]] = ..., result_json: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class ReportBatch(_message.Message):
    __slots__ = ("reports",)
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    reports: _containers.RepeatedCompositeFieldContainer[RankReport]
    def __init__(self, reports: _Optional[_Iterable[_Union[RankReport, _Mapping]]] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("request_id", "lines", "next_offset", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    lines: _containers.RepeatedScalarFieldContainer[str]
    next_offset: int
    error: str
    def __init__(self, request_id: _Optional[int] = ..., lines: _Optional[_Iterable[str]] = ..., next_offset: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class NodeMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "batch", "log_chunk", "relay_done", "relayed")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    LOG_CHUNK_FIELD_NUMBER: _ClassVar[int]
    RELAY_DONE_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    batch: ReportBatch
    log_chunk: LogChunk
    relay_done: RelayDone
    relayed: RelayedBatches
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., batch: _Optional[_Union[ReportBatch, _Mapping]] = ..., log_chunk: _Optional[_Union[LogChunk, _Mapping]] = ..., relay_done: _Optional[_Union[RelayDone, _Mapping]] = ..., relayed: _Optional[_Union[RelayedBatches, _Mapping]] = ...) -> None: ...

class RelayedBatches(_message.Message):
    __slots__ = ("batches",)
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[NodeBatch]
    def __init__(self, batches: _Optional[_Iterable[_Union[NodeBatch, _Mapping]]] = ...) -> None: ...

class NodeBatch(_message.Message):
    __slots__ = ("node", "seq", "batch", "mac")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    node: str
    seq: int
    batch: bytes
    mac: bytes
    def __init__(self, node: _Optional[str] = ..., seq: _Optional[int] = ..., batch: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("node", "heartbeat_interval", "last_seq", "folds", "relay_key")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    FOLDS_FIELD_NUMBER: _ClassVar[int]
    RELAY_KEY_FIELD_NUMBER: _ClassVar[int]
    node: str
    heartbeat_interval: float
    last_seq: int
    folds: bool
    relay_key: bytes
    def __init__(self, node: _Optional[str] = ..., heartbeat_interval: _Optional[float] = ..., last_seq: _Optional[int] = ..., folds: _Optional[bool] = ..., relay_key: _Optional[bytes] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("registered", "assign", "cancel", "ack", "fetch_logs", "checkpoint", "release", "relay")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    FETCH_LOGS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    assign: Assign
    cancel: Cancel
    ack: Ack
    fetch_logs: FetchLogs
    checkpoint: CheckpointNow
    release: Release
    relay: Relay
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., assign: _Optional[_Union[Assign, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., fetch_logs: _Optional[_Union[FetchLogs, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointNow, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., relay: _Optional[_Union[Relay, _Mapping]] = ...) -> None: ...

class Relay(_message.Message):
    __slots__ = ("bundle", "items")
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    bundle: int
    items: _containers.RepeatedCompositeFieldContainer[Relayed]
    def __init__(self, bundle: _Optional[int] = ..., items: _Optional[_Iterable[_Union[Relayed, _Mapping]]] = ...) -> None: ...

class Relayed(_message.Message):
    __slots__ = ("node", "peer", "seq", "message", "mac", "report_via")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    REPORT_VIA_FIELD_NUMBER: _ClassVar[int]
    node: str
    peer: str
    seq: int
    message: bytes
    mac: bytes
    report_via: str
    def __init__(self, node: _Optional[str] = ..., peer: _Optional[str] = ..., seq: _Optional[int] = ..., message: _Optional[bytes] = ..., mac: _Optional[bytes] = ..., report_via: _Optional[str] = ...) -> None: ...

class RelayDone(_message.Message):
    __slots__ = ("bundle", "failed", "error")
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    bundle: int
    failed: _containers.RepeatedScalarFieldContainer[str]
    error: str
    def __init__(self, bundle: _Optional[int] = ..., failed: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class CheckpointNow(_message.Message):
    __slots__ = ("job_id", "attempt", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    step: int
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class BlobChunk(_message.Message):
    __slots__ = ("digest", "size", "data")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    digest: str
    size: int
    data: bytes
    def __init__(self, digest: _Optional[str] = ..., size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class FetchBlobRequest(_message.Message):
    __slots__ = ("digest",)
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    digest: str
    def __init__(self, digest: _Optional[str] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec_yaml", "overrides", "source", "queue_anyway", "allocation")
    SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ANYWAY_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    spec_yaml: str
    overrides: _containers.RepeatedScalarFieldContainer[str]
    source: str
    queue_anyway: bool
    allocation: AllocationRequest
    def __init__(self, spec_yaml: _Optional[str] = ..., overrides: _Optional[_Iterable[str]] = ..., source: _Optional[str] = ..., queue_anyway: _Optional[bool] = ..., allocation: _Optional[_Union[AllocationRequest, _Mapping]] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id", "rank_offset", "rank_limit", "summary_only")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RANK_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_ONLY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank_offset: int
    rank_limit: int
    summary_only: bool
    def __init__(self, job_id: _Optional[str] = ..., rank_offset: _Optional[int] = ..., rank_limit: _Optional[int] = ..., summary_only: _Optional[bool] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "states")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    states: _containers.RepeatedScalarFieldContainer[JobState]
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., states: _Optional[_Iterable[_Union[JobState, str]]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "after_seq", "min_interval")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    MIN_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    min_interval: float
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., min_interval: _Optional[float] = ...) -> None: ...

class JobEventBatch(_message.Message):
    __slots__ = ("events", "state", "reason", "summary", "attempt")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[JobEvent]
    state: JobState
    reason: str
    summary: JobSummary
    attempt: int
    def __init__(self, events: _Optional[_Iterable[_Union[JobEvent, _Mapping]]] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., summary: _Optional[_Union[JobSummary, _Mapping]] = ..., attempt: _Optional[int] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("node", "undrain", "reason")
    NODE_FIELD_NUMBER: _ClassVar[int]
    UNDRAIN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node: str
    undrain: bool
    reason: str
    def __init__(self, node: _Optional[str] = ..., undrain: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainNodeResponse(_message.Message):
    __slots__ = ("node", "jobs")
    NODE_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    node: Node
    jobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[_Union[Node, _Mapping]] = ..., jobs: _Optional[_Iterable[str]] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class GetLogsRequest(_message.Message):
    __slots__ = ("job_id", "rank", "all_ranks", "follow", "tail", "records", "from_attempt")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALL_RANKS_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    FROM_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    all_ranks: bool
    follow: bool
    tail: int
    records: bool
    from_attempt: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., all_ranks: _Optional[bool] = ..., follow: _Optional[bool] = ..., tail: _Optional[int] = ..., records: _Optional[bool] = ..., from_attempt: _Optional[int] = ...) -> None: ...

class LogLine(_message.Message):
    __slots__ = ("rank", "line", "attempt")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    line: str
    attempt: int
    def __init__(self, rank: _Optional[int] = ..., line: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class PlanJobRequest(_message.Message):
    __slots__ = ("spec_yaml", "overrides", "source")
    SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    spec_yaml: str
    overrides: _containers.RepeatedScalarFieldContainer[str]
    source: str
    def __init__(self, spec_yaml: _Optional[str] = ..., overrides: _Optional[_Iterable[str]] = ..., source: _Optional[str] = ...) -> None: ...

class PlanJobResponse(_message.Message):
    __slots__ = ("layout", "spec")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    layout: _struct_pb2.Struct
    spec: _struct_pb2.Struct
    def __init__(self, layout: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., spec: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class StatBlobRequest(_message.Message):
    __slots__ = ("digest",)
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    digest: str
    def __init__(self, digest: _Optional[str] = ...) -> None: ...

class StatBlobResponse(_message.Message):
    __slots__ = ("exists", "size")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    size: int
    def __init__(self, exists: _Optional[bool] = ..., size: _Optional[int] = ...) -> None: ...

class BlobRef(_message.Message):
    __slots__ = ("digest", "size")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    size: int
    def __init__(self, digest: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class GetJobSchemaRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetJobSchemaResponse(_message.Message):
    __slots__ = ("schema_json", "version")
    SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    schema_json: str
    version: str
    def __init__(self, schema_json: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoordinatorMember(_message.Message):
    __slots__ = ("id", "address", "version", "leading", "started_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEADING_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    version: str
    leading: bool
    started_at: float
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., version: _Optional[str] = ..., leading: _Optional[bool] = ..., started_at: _Optional[float] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("id", "address", "role", "leader_address", "store_kind", "store", "version", "members", "store_problem")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STORE_KIND_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    STORE_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    role: str
    leader_address: str
    store_kind: str
    store: str
    version: str
    members: _containers.RepeatedCompositeFieldContainer[CoordinatorMember]
    store_problem: str
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[str] = ..., leader_address: _Optional[str] = ..., store_kind: _Optional[str] = ..., store: _Optional[str] = ..., version: _Optional[str] = ..., members: _Optional[_Iterable[_Union[CoordinatorMember, _Mapping]]] = ..., store_problem: _Optional[str] = ...) -> None: ...

class ShardChunk(_message.Message):
    __slots__ = ("job_name", "step", "rank", "file", "root", "data", "last")
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    job_name: str
    step: int
    rank: int
    file: str
    root: str
    data: bytes
    last: bool
    def __init__(self, job_name: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., file: _Optional[str] = ..., root: _Optional[str] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class PutShardsResponse(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: int
    def __init__(self, files: _Optional[int] = ...) -> None: ...

class DeliverRequest(_message.Message):
    __slots__ = ("item",)
    ITEM_FIELD_NUMBER: _ClassVar[int]
    item: Relayed
    def __init__(self, item: _Optional[_Union[Relayed, _Mapping]] = ...) -> None: ...

class DeliverResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: NodeBatch
    def __init__(self, batch: _Optional[_Union[NodeBatch, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetShardsRequest(_message.Message):
    __slots__ = ("job_name", "ranks", "root", "job_id")
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_name: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    root: str
    job_id: str
    def __init__(self, job_name: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., root: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...
