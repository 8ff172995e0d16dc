"""The coordinator's domain core: the client operations, over collaborators that each do one job.

Plain Python (no grpc), one instance per coordinator, called from the event loop thread only. Time
comes from an injected ``clock`` (unix seconds) and everything that must survive a restart goes
through the injected ``Store``; each public operation commits its writes before it returns. When the
store refuses a write (``StoreError``), the operation's memory changes are undone (``commit``) and the
error is raised to the caller.

What happens to a job next is decided in one place: every change marks the jobs it concerns (``dirty``), and the
turn that ends each operation (``turn``) reconciles each marked job once from its level state
(``coordinator.recovery.reconciler``) and runs one placement pass. The tick marks every job time alone may move on
(hangs, held failures, stops, drains, growth), so a mark a refused write left is retried there.

Nodes talk to the core through an *outbox* per session (``nodes.Outbox``): a callable that takes a
``CoordinatorMessage``, or ``None`` meaning "close this stream". Messages that follow from rank reports
are sent only once the group commit that decided them is stored. Every per-message path is constant
time in the job's size, and the failure detector discounts the time the event loop itself was
stalled (``tick(loop_lag=...)``), so a slow moment never marks live nodes LOST.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections import Counter
from typing import Callable, Sequence

import structlog

from rankctl.contract.jobfile import load_yaml_text
from rankctl.contract.names import node_name_problem
from rankctl.contract.spec import JobSpec
from rankctl.coordinator.scheduling import capacity
from rankctl.coordinator.jobs.dirty import Dirty
from rankctl.coordinator.jobs.shown import Shown
from rankctl.coordinator.jobs.turn import Turn
from rankctl.coordinator.recovery.reconciler import JobReconciler
from rankctl.coordinator.model.allocation import AllocationRequest
from rankctl.coordinator.batch.holds import AllocationHolds
from rankctl.coordinator.batch.allocations import Allocations
from rankctl.coordinator.jobs.commit import Outgoing, StoreGuard
from rankctl.coordinator.recovery.drains import Drains
from rankctl.coordinator.model.errors import CapacityError, InvalidRequest
from rankctl.coordinator.scheduling.fanout import Fanouts
from rankctl.coordinator.jobs.intake import ReportIntake
from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.logs.logarchive import LogArchive
from rankctl.coordinator.logs.logfetch import LogFetcher
from rankctl.coordinator.fleet.nodes import NodeSession, NodeTable, Outbox
from rankctl.coordinator.scheduling.noderoots import roots_problems
from rankctl.coordinator.scheduling.planner import plan_layout
from rankctl.coordinator.scheduling.relay import WIDTH as RELAY_WIDTH
from rankctl.coordinator.batch.pools import PoolRecords, WorkerPools
from rankctl.coordinator.diagnosis.progress import JobSummary
from rankctl.coordinator.model.records import EventRecord, JobRecord, NodeHello, RankRecord
from rankctl.coordinator.jobs.reports import Report, ReportApplier
from rankctl.coordinator.recovery.restarts import Restarts
from rankctl.coordinator.scheduling.scheduler import HEAD_WAIT_S, Scheduler
from rankctl.coordinator.fleet.sessions import MAX_HEARTBEAT_RATE, Sessions, Streams
from rankctl.coordinator.jobs.signals import Signals
from rankctl.coordinator.model.states import JobState, is_terminal
from rankctl.coordinator.model.stats import CoordinatorStats
from rankctl.coordinator.scheduling.stops import Stops
from rankctl.coordinator.store.database import Store, durability
from rankctl.kinds.spec import build_spec, check_job

log = structlog.get_logger("rankctl.coordinator")
S = JobState
DRAIN_REASON_MAX = 1000     # characters of a ctl drain --reason


def _free_slots(nodes: NodeTable, book: JobBook, stops: Stops) -> dict[str, int]:
    """READY node -> its slots no job holds (active jobs, and ended ones whose ranks are not confirmed gone)."""
    return capacity.free_slots(nodes.ready(), book.active() + list(stops.ended()))


def validate_spec(spec_yaml: str, overrides: Sequence[str] = (), source: str = "job file") -> JobSpec:
    """Build and check a spec; raises SpecError with one line per problem. Pure."""
    spec = build_spec(load_yaml_text(spec_yaml, source), list(overrides))
    check_job(spec)
    return spec


def plan_spec(spec_yaml: str, overrides: Sequence[str] = (), source: str = "job file") -> tuple[dict, dict]:
    """(layout document, spec dict) of a job file, without storing anything. Pure."""
    spec = build_spec(load_yaml_text(spec_yaml, source), list(overrides))
    return plan_layout(check_job(spec), spec.resources.slots_per_node), spec.to_dict()


class Coordinator:
    """Jobs and nodes of one coordinator, assembled from its collaborators (see the module docstring).

    ``shown`` (the read model: a job, a node, as every reader shows them), ``book`` (jobs, ranks, events),
    ``nodes`` (sessions), ``stats`` (counters for the metrics), ``signals`` (watchers) and ``logfetch`` are read by
    the servicers and the dashboard; ``allocations`` and ``pools`` by the server's allocation loop.
    """

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time,
                 heartbeat_timeout: float = 10.0, signals: Signals | None = None,
                 head_wait: float = HEAD_WAIT_S, max_heartbeat_rate: float = MAX_HEARTBEAT_RATE,
                 relay_width: int = RELAY_WIDTH, dial: tuple[str, bool] = ("", False)) -> None:
        """``relay_width``: Assign fan-outs wider than this go through relay heads (``coordinator.scheduling.relay``);
        ``dial``: where the workers a batch scheduler starts dial this coordinator, and whether it serves mutual TLS."""
        self.store, self.clock = store, clock
        self._dirty = Dirty(self.turn)   # what changed since the last turn (``coordinator.jobs.dirty``)
        self.signals = signals or Signals()
        self.book = JobBook(store, clock, self.signals)
        self.nodes = NodeTable.from_records(store.load_nodes(), store.load_drains(), store.load_exclusions(),
                                            durability=durability(store))
        self.stats = CoordinatorStats()
        self.logfetch = LogFetcher(self.nodes.send)
        self.logarchive = LogArchive(store.path.parent)   # logs of ranks whose allocation's nodes left
        self.shutting_down = False
        self.fanouts = Fanouts()   # fan-outs of messages to many nodes, timed (``coordinator.scheduling.fanout``)
        self._outgoing = Outgoing(self.nodes, self.fanouts, self.book, relay_width)
        self._guard, self.relays = StoreGuard(store, self.book, self.nodes), self._outgoing.relays   # relay heads
        self._stops = Stops(self.book, self.nodes, clock)
        self._drains = Drains(self.book, clock, self._outgoing)
        pools = PoolRecords(store)   # the worker pools, built first: the scheduler asks which queue a worker serves
        holds = AllocationHolds(clock)   # what the restarts and the scheduler ask of the allocations
        self._scheduler = Scheduler(self.book, self.nodes, store, clock, self._guard, self._outgoing, self.stats,
                                    self._dirty, ended=self._stops.ended, shutting_down=self._is_shutting_down,
                                    head_wait=head_wait, general=pools.general, gathering=holds.gathering)
        self._restarts = Restarts(self.book, self.nodes, store, clock, self._outgoing, self._stops, self._drains,
                                  self._scheduler, self.stats, self._dirty, hold_loss=holds.hold_loss)
        self.pools = WorkerPools(pools, self.nodes, store, clock, self._guard, self._restarts,
                                 functools.partial(_free_slots, self.nodes, self.book, self._stops), dial)
        self._reconciler = JobReconciler(self.book, store, clock, self._restarts, self._stops, self._drains,
                                         self._scheduler, self._dirty.later)
        self.allocations = Allocations(self.book, self.nodes, store, clock, self._guard, self._restarts, self._dirty,
                                       holds, dial)
        self._assemble_node_side(heartbeat_timeout, max_heartbeat_rate)
        for job in self.book.active():  # restarts under way before the coordinator stopped: confirm them again
            if job.state is S.RESTARTING:
                self._stops.begin(job)

    def _assemble_node_side(self, heartbeat_timeout: float, max_heartbeat_rate: float) -> None:
        """The parts that hear nodes: report intake and node sessions."""
        streams = Streams(self.clock, self.logfetch)
        self._applier = ReportApplier(self.book, self.clock)
        self._intake = ReportIntake(self.nodes, self.store, self.clock, self._guard, self._outgoing, self._applier,
                                    self.stats, dirty=self._dirty, resync=streams.resync)
        self._sessions = Sessions(self.nodes, self.book, self.store, self.clock, self._guard, self._outgoing,
                                  streams, self._stops, self._drains, self._restarts, self._dirty,
                                  heartbeat_timeout=heartbeat_timeout,
                                  shutting_down=self._is_shutting_down, max_heartbeat_rate=max_heartbeat_rate)
        self.shown = Shown(self.book, self.nodes, self._stops, self.store, self._scheduler.free_slots,
                           self._applier.rejected)   # the read model (``coordinator.jobs.shown``)
        self._turn = Turn(self._dirty, self.store, self._guard, self._outgoing, self._intake, self.nodes, self._restarts,
                          self._reconciler, self._scheduler)

    def _is_shutting_down(self) -> bool:
        return self.shutting_down

    def rewound(self) -> None:
        """The replicated store refused writes committed to its copy, which is back to what it holds (``StoreGuard``)."""
        self._guard.rewound()
        self._dirty.jobs(self._reconciler.timed())
        self.schedule()

    def shutdown(self) -> None:
        """Stop reacting to closing streams: a coordinator going down must not fail its jobs."""
        self.shutting_down = True

    @property
    def heartbeat_interval(self) -> float:
        return self._sessions.heartbeat_interval

    @property
    def head_wait(self) -> float:
        return self._scheduler.head_wait

    @property
    def started_at(self) -> float:
        """When this coordinator started (a node known from the store has a grace from then to reconnect)."""
        return self._sessions.started_at

    @started_at.setter
    def started_at(self, value: float) -> None:
        self._sessions.started_at = value

    # -- client operations ---------------------------------------------------
    validate, plan = staticmethod(validate_spec), staticmethod(plan_spec)   # pure: any thread may call them

    def submit(self, spec_yaml: str, overrides: Sequence[str] = (), source: str = "job file", *,
               queue_anyway: bool = False) -> JobRecord:
        """Validate and submit (see ``submit_spec``)."""
        return self.submit_spec(self.validate(spec_yaml, overrides, source), queue_anyway=queue_anyway)

    def submit_spec(self, spec: JobSpec, *, queue_anyway: bool = False, submitted_by: str = "",
                    allocation: AllocationRequest | None = None) -> JobRecord:
        """Store a validated job PENDING and run a schedule pass. Refused, nothing stored: one writing outside every
        node's roots (``noderoots``); one larger than the known nodes hold (CapacityError) unless ``queue_anyway``:
        it then waits for nodes, holding no one back. With an ``allocation`` it runs on nodes a scheduler grants."""
        res = spec.resources
        problems = (self.allocations.problems(allocation) if allocation is not None
                    else roots_problems(spec, self.nodes, self.pools.general))
        if problems:
            raise InvalidRequest("; ".join(problems))
        spec = spec if allocation is None else spec.with_spares(allocation.spares)   # restarts onto the spares
        short = None if allocation is not None else capacity.shortfall(list(self.nodes), res.fewest_nodes,
                                                                       res.slots_per_node)
        if short is not None and not queue_anyway:
            raise CapacityError(f"{short}; submit with --queue-anyway to wait for more nodes")
        job = JobRecord(
            id=self._new_id(spec.name), name=spec.name, kind=spec.kind, spec=spec, state=S.PENDING,
            reason="queued" if short is None else f"queued for nodes: {short}", world_size=spec.world_size,
            slots_per_node=res.slots_per_node, created_at=self.clock(), submitted_by=submitted_by,
        )
        if allocation is not None:
            self.allocations.attach(job, allocation)
        with self._guard.consistent():
            self.book.add(job)
        self.allocations.added(job)
        self.schedule()
        return job

    def _new_id(self, name: str) -> str:
        while True:
            job_id = f"{name}-{secrets.token_hex(3)}"
            if job_id not in self.book.jobs:
                return job_id

    def get(self, id_or_name: str) -> JobRecord:
        """A job by id or unique name; raises JobNotFound / AmbiguousJob."""
        return self.book.get(id_or_name)

    def list(self, limit: int = 0) -> list[JobRecord]:
        return self.book.list(limit)

    def rank_page(self, job_id: str, offset: int, limit: int) -> list[RankRecord]:
        """Ranks ``offset`` .. ``offset + limit - 1`` of the job's current attempt; unheard ones ``pending``."""
        return self.book.rank_page(self.book.jobs[job_id], offset, limit)

    def summary(self, job_id: str) -> JobSummary:
        """Counts per phase, slowest and fastest step, stragglers and failing ranks: constant time."""
        return self.book.progress(self.book.jobs[job_id]).summary()

    def attempts(self, job_id: str, last: int = 0) -> list[dict]:
        """The job's stored attempts, oldest first (``last`` > 0: the newest ``last``)."""
        return self.store.attempts.listed(job_id, last)

    def events(self, job_id: str, after_seq: int = 0, limit: int = 0, *, ranks: bool = True) -> list[EventRecord]:
        return self.store.events(job_id, after_seq, limit, ranks=ranks)

    def stopping_ranks(self, job_id: str) -> int:
        """Ranks of the job's ended attempt not yet confirmed gone (0: none, or nothing is stopping)."""
        return self._stops.stopping_ranks(job_id)

    def cancel(self, id_or_name: str, reason: str = "") -> JobRecord:
        """CANCELLED plus a Cancel to every node of the job; a terminal job is returned unchanged."""
        job = self.book.get(id_or_name)
        if not is_terminal(job.state):
            with self._guard.consistent():
                self._restarts.finish(job, S.CANCELLED, cancel_reason(reason))
            self.turn()
        return job

    def drain(self, name: str, reason: str = "") -> list[JobRecord]:
        """``ctl drain``: the node takes no new work (stored: it survives a restart) and every active job
        on it moves off it (``restarts``); the jobs concerned. Draining again only updates the reason."""
        self._node_request(name, reason)
        with self._guard.consistent():
            moved = self._restarts.drain(name, reason)
        self.turn()
        return moved

    def undrain(self, name: str) -> list[str]:
        """``ctl undrain``: the node takes work again, placed again for the jobs it was excluded from; their ids."""
        self._node_request(name, "")
        with self._guard.consistent():
            cleared = self._restarts.undrain_node(name)
        self.turn()
        return cleared

    def _node_request(self, name: str, reason: str) -> NodeSession:
        """The node a drain or undrain names; InvalidRequest / NodeNotFound naming the bad field."""
        problem = node_name_problem(name, "node")
        if problem is not None:
            raise InvalidRequest(problem)
        if len(reason) > DRAIN_REASON_MAX:
            raise InvalidRequest(f"reason is {len(reason)} characters; at most {DRAIN_REASON_MAX}")
        return self.nodes.known(name)

    def schedule(self) -> None:
        """Start pending jobs in queue order (``scheduler``), in a turn."""
        self._dirty.place()
        self.turn()

    def turn(self) -> None:
        """Act on every mark since the last turn (``coordinator.jobs.turn``); each operation ends with one."""
        self._turn.run()

    # -- what nodes say --------------------------------------------------------
    def register(self, hello: NodeHello, outbox: Outbox) -> NodeSession:
        """Open one node session; raises what refused it (``register_many``)."""
        result = self.register_many([(hello, outbox)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def register_many(self, hellos: list[tuple[NodeHello, Outbox]]) -> list[NodeSession | Exception]:
        """Open node sessions (``sessions``), their records stored together: Registered, the jobs each runs
        reconciled, one schedule pass; a worker of an allocation no active job owns is told to exit
        (``allocations``). One entry per hello: its session or what refused it."""
        out = self._sessions.register_many(hellos)
        for session in out:
            if isinstance(session, NodeSession) and not self.pools.registered(session):
                self.allocations.registered(session)
        self.turn()
        return out

    def heartbeat(self, session: NodeSession, free_ports: Sequence[int] = ()) -> None:
        if self._sessions.heartbeat(session, free_ports) and self.flush():   # the replay came first: stored first
            self._sessions.verify(session)
        if self._dirty:
            self.turn()

    def disconnect(self, session: NodeSession, detail: str = "stream closed") -> None:
        self._sessions.disconnect(session, detail)
        self.turn()

    def rank_reports(self, session: NodeSession, updates: Sequence[Report]) -> int:
        """Queue one node's reports for the next group commit (``intake``); the number queued."""
        return self._intake.accept(session, updates)

    def flush(self, *, force: bool = False) -> bool:
        """Store every queued report in one transaction, then reconcile the jobs it touched (a turn); False when the
        store refused."""
        stored = self._intake.flush(force=force)
        self.turn()
        return stored

    def pending_work(self) -> bool:
        """Whether a flush has reports to store (the server's group-commit loop asks)."""
        return self._intake.pending()

    @property
    def held_reports(self) -> int:
        """Reports received but not yet stored (the store refused them)."""
        return self._intake.held

    @property
    def rejected_reports(self) -> Counter[str]:
        """node -> reports it sent for ranks it does not run."""
        return self._applier.rejected

    # -- time ------------------------------------------------------------------
    def tick(self, loop_lag: float = 0.0) -> None:
        """Failure detection, called periodically; then a turn over every job time alone may move on.

        ``loop_lag``: how late this call is because the event loop was busy. That time is not
        held against any node, nor counted towards a hang: heartbeats and reports may be waiting, unread, behind
        the stall.
        """
        if loop_lag > 0:
            self._sessions.stalled(loop_lag)
            self._reconciler.discount(loop_lag)
        self._sessions.check_liveness()
        if self._intake.held:   # reports the store refused: retried (``intake``)
            self._intake.flush()
        self._dirty.resume()   # what refused writes left: retried here, once a tick
        self._dirty.jobs(self._reconciler.timed(), timed=True)
        if self._scheduler.due():
            self._dirty.place()
        self.turn()


def cancel_reason(reason: str) -> str:
    """A cancelled job's reason: ``cancelled: REASON`` (a reason that already says "cancelled" as it is, so an older
    ctl's default "cancelled by user" is not "cancelled: cancelled by user"), "cancelled by user" for none."""
    if not reason:
        return "cancelled by user"
    return reason if reason.lower().startswith("cancelled") else f"cancelled: {reason}"
