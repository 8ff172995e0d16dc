"""Plain domain records shared by the coordinator core, its store and the pb conversion."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rankctl.contract.spec import JobSpec
from rankctl.coordinator.model.allocation import Allocation
from rankctl.contract.files.rankstatus import PHASES as RANK_PHASES
from rankctl.coordinator.model.states import JobState
from rankctl.parallel.placement import ranks_of_node

# rank phases in order, as the coordinator sees them: before its daemon hears it, launched, what the rank writes
# (``contract.files.rankstatus.PHASES``, the one list), gone; a rank at index >= RUNNING_INDEX has passed "running"
PHASES = ("pending", "starting", *RANK_PHASES, "exited")
PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}
RUNNING_INDEX = PHASES.index("running")


@dataclass
class JobRecord:
    """One job as the coordinator holds it (mutable; the store persists every change)."""

    id: str
    name: str
    kind: str
    spec: JobSpec  # typed: parsed once at submit, or once when read back from the store
    state: JobState
    reason: str
    world_size: int
    slots_per_node: int
    created_at: float
    attempt: int = 1
    finished_at: float = 0.0
    nodes: list[str] = field(default_factory=list)   # job node k = nodes[k]
    rendezvous: str = ""                             # "host:port" of rank 0's store
    result: dict[str, Any] | None = None
    seqno: int = 0                                   # submission order, set by the store
    submitted_by: str = ""                           # the submitter's identity ("user alice (submitter)"; "" without TLS)
    allocation: Allocation | None = None             # the allocation it is pinned to (None: the general pool)

    @property
    def pool(self) -> str:
        """The pool of nodes it runs in: its allocation's, or "" (the general pool)."""
        return self.allocation.pool if self.allocation is not None else ""

    @property
    def nodes_needed(self) -> int:
        """The nodes of its full size (``resources.nodes``; an elastic job's attempt may run on fewer)."""
        return self.spec.resources.nodes

    def ranks_on(self, node: str) -> list[int]:
        """Global ranks the job runs on ``node`` (node-major placement)."""
        k = self.node_index().get(node)
        return [] if k is None else list(ranks_of_node(k, self.slots_per_node))

    def node_index(self) -> dict[str, int]:
        """node name -> job node index, cached until ``nodes`` is replaced (O(1) lookups at any size)."""
        cached = self.__dict__.get("_node_index")
        if cached is None or cached[0] is not self.nodes:
            cached = self.__dict__["_node_index"] = (self.nodes, {n: k for k, n in enumerate(self.nodes)})
        return cached[1]

    def runs_on(self, node: str) -> bool:
        return node in self.node_index()


@dataclass(slots=True)
class RankRecord:
    """Latest known status of one rank of a job."""

    rank: int
    node: str
    phase: str = "pending"
    step: int = 0
    metrics_json: str = ""
    error: str = ""
    exit_code: int = 0
    exited: bool = False
    updated_at: float = 0.0
    result_json: str = ""
    process: str = ""          # the daemon's view of the process ("stopped"); kept in memory only
    collectives: str = ""      # the daemon's snapshot of its collective counters when they stopped moving (memory only)
    stack: str = ""            # the rank's Python stack at that moment (memory only)

    def passed_running(self) -> bool:
        """True once the rank reported ``running`` or any later phase (or exited)."""
        return self.exited or PHASE_INDEX.get(self.phase, -1) >= RUNNING_INDEX


@dataclass
class NodeRecord:
    """A worker node as stored: identity, capacity and report bookkeeping."""

    name: str
    address: str
    slots: int
    hardware: dict[str, Any] = field(default_factory=dict)
    session: str = ""
    last_seq: int = 0          # highest RankReport.seq stored from this node's session
    last_seen: float = 0.0

    @property
    def gpu_count(self) -> int:
        return len(self.hardware.get("gpus") or [])

    @property
    def host(self) -> str:
        """The host part of ``address`` ("10.0.0.5", "node-1:7000" -> "node-1", "[::1]:7" -> "[::1]")."""
        addr = self.address
        if addr.startswith("["):
            return addr.split("]", 1)[0] + "]"
        return addr.rsplit(":", 1)[0] if addr.count(":") == 1 else addr


@dataclass(frozen=True)
class EventRecord:
    job_id: str
    seq: int
    ts: float
    state: JobState
    kind: str              # transition | waiting | rank | node | result | step | stop (an ended attempt's ranks gone)
    message: str
    rank: RankRecord | None = None
    step: int = 0                          # kind "step": the step every rank has finished
    metrics: dict[str, Any] | None = None  # kind "step": loss, tokens_per_s, step-time spread
    ranks: int = 0                         # kind "rank": the consecutive ranks from ``rank.rank`` it stands for
                                           # (0 or 1: that rank alone; a daemon's folded report of several)

    def data(self) -> dict[str, Any] | None:
        """What it carries besides its message and rank (the store's ``data_json``), None: nothing."""
        ranks = {"ranks": self.ranks} if self.ranks > 1 else {}
        return {"step": self.step, "metrics": self.metrics, **ranks} if self.step or self.metrics or ranks else None


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    attempt: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class NodeHello:
    """A daemon's Register message, as domain data."""

    name: str
    address: str
    slots: int
    hardware: dict[str, Any] = field(default_factory=dict)
    free_ports: tuple[int, ...] = ()
    running: tuple[RunningJob, ...] = ()
    session: str = ""
    peer_port: int = 0         # the daemon's PeerService (checkpoint replication); 0: none
    pool: str = ""             # the allocation it was started for ("": the general pool)
    replaces: bool = False     # a newer attempt's Assign stops the older one's ranks there first (``Register.replaces``)
    relays: bool = False       # it forwards a Relay's items as a relay tree's head (``coordinator.scheduling.relay``)
    data_roots: tuple[str, ...] = ()  # where its jobs may create files (``Register.data_roots``; (): not told)


@dataclass(frozen=True)
class RankUpdate:
    """A daemon's RankReport, as domain data (``status`` carries rank, node, phase ...)."""

    job_id: str
    attempt: int
    status: RankRecord
    result_json: str = ""
    seq: int = 0           # 0 = not sequenced, never treated as a replay
