"""The coordinator's domain core: jobs, FIFO queue, placement, node sessions, failure detection.

Plain Python (no grpc), one instance per coordinator, called from the event loop
thread only. Time comes from an injected ``clock`` (unix seconds) and everything
that must survive a restart goes through the injected ``Store``; each public
operation commits its writes before it returns. When the store refuses a write
(``StoreError``: disk full, I/O error), the operation's memory changes are undone
(``_consistent``: the job book is reloaded from the store) and the error is raised to
the caller; work the coordinator owes itself (scheduling, advancing a job, failing the
jobs of a lost node, rank reports received meanwhile) is retried by ``tick``.

Nodes talk to the core through an *outbox* per session (see ``nodes.Outbox``): a
callable that takes a ``CoordinatorMessage`` to send, or ``None`` meaning "close this
stream" (a node declared lost or replaced by a newer connection). Messages that follow
from rank reports are sent only once the group commit that decided them is stored.

Every per-message path is constant time in the job's size: per-job counters
(``progress.JobProgress``), indexes of active and pending jobs, a node -> job-node index per
job, and a compact per-node Assign. The failure detector discounts the time the event loop
itself was stalled (``tick(loop_lag=...)``), so a slow moment never marks live nodes LOST.

Operators drain nodes (``drain``/``undrain``): a draining node takes no new work and its jobs
move off it (``restarts``). An ended attempt's slots and ports are reused only once its ranks
are confirmed gone (``restarts.Stop``).
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Sequence

import structlog

from rankctl.contract.jobfile import load_yaml_text
from rankctl.contract.limits import MAX_SLOTS_PER_NODE
from rankctl.contract.names import node_name_problem
from rankctl.contract.spec import JobSpec
from rankctl.coordinator import capacity, convert
from rankctl.coordinator.errors import CapacityError, InvalidRequest, NodeNameTaken, ProtocolError
from rankctl.coordinator.jobs import JobBook
from rankctl.coordinator.nodes import NodeSession, NodeStatus, NodeTable, Outbox
from rankctl.coordinator.logfetch import LogFetcher
from rankctl.coordinator.metrics import CoordinatorStats
from rankctl.coordinator.planner import assign_messages, pick_port, plan_layout
from rankctl.coordinator.progress import JobSummary, failure_reason, rank_span
from rankctl.coordinator.records import EventRecord, JobRecord, NodeHello, RankRecord, RunningJob
from rankctl.coordinator.reports import ReportsMixin
from rankctl.coordinator.restarts import DrainWait, RestartsMixin, Stop
from rankctl.coordinator.results import aggregate, parse_rank_results
from rankctl.coordinator.signals import Signals
from rankctl.coordinator.states import JobState, is_active, is_terminal
from rankctl.coordinator.store import Store, StoreError
from rankctl.kinds.spec import build_spec, check_job
from rankctl.parallel.placement import NodeSlots, PlacementError
from rankctl.proto import rankctl_pb2 as pb

RECONNECT_GRACE_S = 10.0  # at least this long for a DISCONNECTED node to come back: a daemon retries at
                          # least every 5 s (worker DaemonConfig.backoff_max), later on a loaded machine
log = structlog.get_logger("rankctl.coordinator")
S = JobState
HEAD_WAIT_S = 60.0          # how long the first job that cannot start holds back the jobs behind it
DRAIN_REASON_MAX = 1000     # characters of a ctl drain --reason


def _gone(ranks: list[int]) -> str:
    return f"{rank_span(ranks)} {'is' if len(ranks) == 1 else 'are'} gone"


def _node_span(names: list[str], shown: int = 8) -> str:
    """The nodes of a placement, at most ``shown`` of them named."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


class Coordinator(ReportsMixin, RestartsMixin):
    """Jobs and nodes of one coordinator; see the module docstring for the threading contract."""

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time,
                 heartbeat_timeout: float = 10.0, signals: Signals | None = None,
                 head_wait: float = HEAD_WAIT_S) -> None:
        self.store, self.clock, self.heartbeat_timeout = store, clock, heartbeat_timeout
        self.head_wait = head_wait
        self.signals = signals or Signals()
        self.book = JobBook(store, clock, self.signals)
        self.nodes = NodeTable.from_records(store.load_nodes(), store.load_drains(), store.load_exclusions())
        self.started_at = clock()
        self.stopping = False
        self.rejected_reports: Counter[str] = Counter()  # node -> reports for ranks it does not own
        self.stats = CoordinatorStats()                  # counters for the metrics (coordinator.metrics)
        self._head_since: dict[str, float] = {}          # job id -> when it first could not start
        self._owed: set[str] = set()                     # jobs whose advance failed to store: retried by tick
        self._reschedule = False                         # a schedule pass failed to store: retried by tick
        self._inbox: list = []                           # (session, [RankUpdate]) queued for the next flush
        self._held: list = []                            # the same, refused by the store: retried
        self._queued = 0
        self._flush_due = False                          # a flush is set for the loop's next turn (a phase change)
        self._refused_at = 0.0
        self._deferred: list[tuple[str, pb.CoordinatorMessage]] | None = None  # sent after the commit
        self._stops: dict[str, Stop] = {}                # job -> its ended attempt, until its ranks are gone
        self._drains: dict[str, DrainWait] = {}          # RUNNING train job -> the drain checkpoint it is asked for
        self._prev_nodes: dict[str, list[str]] = {}      # requeued job -> its previous attempt's nodes (cache)
        self.logfetch = LogFetcher(self.nodes.send)
        for job in self.book.active():  # restarts under way before the coordinator stopped: confirm them again
            if job.state is S.RESTARTING:
                self._begin_stop(job)

    @property
    def heartbeat_interval(self) -> float:
        """What nodes are asked for: four heartbeats per timeout, at most one every 2 s."""
        return min(2.0, self.heartbeat_timeout / 4)

    def shutdown(self) -> None:
        """Stop reacting to closing streams: a coordinator going down must not fail its jobs."""
        self.stopping = True

    @contextmanager
    def _consistent(self) -> Iterator[None]:
        """Undo memory changes of a block whose writes did not all commit (the store is the truth)."""
        try:
            yield
        except StoreError:
            if not self.store.in_transaction:  # else the outermost block, once rolled back, resyncs
                self.book.resync()
                stored = {r.name: r.last_seq for r in self.store.load_nodes()}
                for session in self.nodes:
                    session.record.last_seq = stored.get(session.name, 0)
                self.nodes.draining, self.nodes.excluded = self.store.load_drains(), self.store.load_exclusions()
            raise

    @contextmanager
    def _outgoing_after_commit(self) -> Iterator[None]:
        """Hold node messages decided inside the block; send them only if it completes (it committed)."""
        outer = self._deferred is None
        if outer:
            self._deferred = []
        try:
            yield
        except BaseException:
            if outer:
                self._deferred = None
            raise
        if outer:
            held, self._deferred = self._deferred, None
            for name, msg in held:
                self.nodes.send(name, msg)

    def _send(self, name: str, msg: pb.CoordinatorMessage) -> None:
        if self._deferred is not None:
            self._deferred.append((name, msg))
        else:
            self.nodes.send(name, msg)

    def _close_stream(self, session: NodeSession) -> None:
        """End a session's stream (the servicer then hears ``disconnect``); its log fetches fail."""
        if session.outbox is not None:
            session.outbox(None)
            session.outbox = None
        self.logfetch.fail_node(session.name, f"node {session.name} is {session.status.value}")

    # -- client operations ---------------------------------------------------
    def validate(self, spec_yaml: str, overrides: Sequence[str] = (), source: str = "job file") -> JobSpec:
        """Build and check a spec; raises SpecError with one line per problem. Pure: any thread may call it."""
        spec = build_spec(load_yaml_text(spec_yaml, source), list(overrides))
        check_job(spec)
        return spec

    def plan(self, spec_yaml: str, overrides: Sequence[str] = (), source: str = "job file") -> tuple[dict, dict]:
        """(layout document, spec dict) of a job file, without storing anything. Pure: any thread may call it."""
        spec = build_spec(load_yaml_text(spec_yaml, source), list(overrides))
        return plan_layout(check_job(spec), spec.resources.slots_per_node), spec.to_dict()

    def submit(self, spec_yaml: str, overrides: Sequence[str] = (), source: str = "job file", *,
               queue_anyway: bool = False) -> JobRecord:
        """Validate and submit (see ``submit_spec``)."""
        return self.submit_spec(self.validate(spec_yaml, overrides, source), queue_anyway=queue_anyway)

    def submit_spec(self, spec: JobSpec, *, queue_anyway: bool = False, submitted_by: str = "") -> JobRecord:
        """Store a validated job PENDING and run a schedule pass.

        A job larger than every node the cluster knows could hold is refused (CapacityError,
        nothing stored) unless ``queue_anyway``: then it waits for nodes and holds no one back.
        """
        res = spec.resources
        short = capacity.shortfall(list(self.nodes), res.nodes, res.slots_per_node)
        if short is not None and not queue_anyway:
            raise CapacityError(f"{short}; submit with --queue-anyway to wait for more nodes")
        job = JobRecord(
            id=self._new_id(spec.name), name=spec.name, kind=spec.kind, spec=spec.to_dict(), state=S.PENDING,
            reason="queued" if short is None else f"queued for nodes: {short}", world_size=spec.world_size,
            slots_per_node=res.slots_per_node, created_at=self.clock(), submitted_by=submitted_by,
        )
        with self._consistent():
            self.book.add(job)
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

    def ranks(self, job_id: str) -> list[RankRecord]:
        """Every rank of the job (O(world): for tests and small jobs; clients page with ``rank_page``)."""
        job = self.book.jobs[job_id]
        return self.book.rank_page(job, 0, job.world_size)

    def rank_page(self, job_id: str, offset: int, limit: int) -> list[RankRecord]:
        """Ranks ``offset`` .. ``offset + limit - 1`` of the job's current attempt; unheard ones ``pending``."""
        return self.book.rank_page(self.book.jobs[job_id], offset, limit)

    def summary(self, job_id: str) -> JobSummary:
        """Counts per phase, slowest and fastest step, stragglers and failing ranks: constant time."""
        return self.book.progress(self.book.jobs[job_id]).summary()

    def attempts(self, job_id: str, last: int = 0) -> list[dict]:
        """The job's stored attempts, oldest first (``last`` > 0: the newest ``last``)."""
        return self.store.attempts(job_id, last)

    def events(self, job_id: str, after_seq: int = 0, limit: int = 0, *, ranks: bool = True) -> list[EventRecord]:
        return self.store.events(job_id, after_seq, limit, ranks=ranks)

    def cancel(self, id_or_name: str, reason: str = "") -> JobRecord:
        """CANCELLED plus a Cancel to every node of the job; a terminal job is returned unchanged."""
        job = self.book.get(id_or_name)
        if not is_terminal(job.state):
            with self._consistent():
                self._finish(job, S.CANCELLED, f"cancelled: {reason}" if reason else "cancelled by user")
        return job

    def node_views(self) -> list[tuple[NodeSession, int]]:
        """Every known node with its free slots (0 unless READY)."""
        free = self._free_slots()
        return [(s, free.get(s.name, 0)) for s in self.nodes]

    def node_view(self, name: str) -> tuple[NodeSession, int]:
        """One node and its free slots; NodeNotFound when no node has that name."""
        session = self.nodes.known(name)
        return session, self._free_slots().get(name, 0)

    def drain(self, name: str, reason: str = "") -> list[JobRecord]:
        """``ctl drain``: the node takes no new work (stored: it survives a restart) and every active job
        on it moves off it (``restarts``); the jobs concerned. Draining again only updates the reason."""
        self._node_request(name, reason)
        with self._consistent():
            if self.nodes.draining.get(name) != reason:
                with self.store.transaction(f"the drain of node {name}"):
                    self.store.set_drain(name, reason, self.clock())
                    self.nodes.draining[name] = reason
            moved = self._drain_jobs(name)
        log.warning("node.draining", node=name, reason=reason, jobs=len(moved))
        return moved

    def undrain(self, name: str) -> list[str]:
        """``ctl undrain``: the node takes work again and is placed again for the jobs it was excluded from;
        those jobs' ids."""
        self._node_request(name, "")
        cleared = self.nodes.exclusions_by_node().get(name, [])
        with self._consistent():
            with self.store.transaction(f"the undrain of node {name}"):
                self.store.clear_drain(name)
                self.store.clear_exclusions(node=name)
                self.nodes.draining.pop(name, None)
                for job_id in cleared:
                    names = self.nodes.excluded[job_id]
                    names.pop(name, None)
                    if not names:
                        del self.nodes.excluded[job_id]
                    self.book.event(self.book.jobs[job_id], "node", f"node {name} may run this job again (undrained)")
                self._stop_draining(name)
        log.info("node.undrained", node=name, cleared=len(cleared))
        self.schedule()
        return cleared

    def _node_request(self, name: str, reason: str) -> NodeSession:
        """The node a drain or undrain names; InvalidRequest / NodeNotFound naming the bad field."""
        problem = node_name_problem(name, "node")
        if problem is not None:
            raise InvalidRequest(problem)
        if len(reason) > DRAIN_REASON_MAX:
            raise InvalidRequest(f"reason is {len(reason)} characters; at most {DRAIN_REASON_MAX}")
        return self.nodes.known(name)

    def pending_work(self) -> bool:
        """Whether a flush has reports to store (the server's group-commit loop asks)."""
        return bool(self._inbox or self._held)

    # -- scheduling ----------------------------------------------------------
    def schedule(self) -> None:
        """Start pending jobs in queue order (see ``capacity``); a pass that cannot store is retried by tick."""
        if self.stopping or (not self.book.pending() and not self._reschedule):
            return
        if self.store.in_transaction:  # never inside another change's transaction: right after it, by tick
            self._reschedule = True
            return
        try:
            with self._consistent():
                self._schedule_pass()
            self._reschedule = False
        except StoreError as exc:
            self._reschedule = True
            log.warning("schedule.store_failed", error=str(exc))

    def _schedule_pass(self) -> None:
        head: JobRecord | None = None
        sessions, now = list(self.nodes), self.clock()
        for job in self.book.pending():
            if job.state is not S.PENDING:
                continue
            if head is not None and not capacity.may_pass(head, sessions, now - self._head_since[head.id],
                                                          self.head_wait):
                self.book.set_waiting(job, f"queued behind {head.id}")
                continue
            why = self._try_start(job)
            if why is None:
                self._head_since.pop(job.id, None)
                continue
            self.book.set_waiting(job, why)
            self._head_since.setdefault(job.id, now)
            head = head or job

    def _holding(self) -> list[JobRecord]:
        """Jobs that hold slots and ports: the active ones, and ended ones whose ranks are not confirmed gone."""
        jobs = self.book.active()
        for job_id in self._stops:
            job = self.book.jobs.get(job_id)
            if job is not None and is_terminal(job.state):
                jobs.append(job)
        return jobs

    def _free_slots(self) -> dict[str, int]:
        return capacity.free_slots(self.nodes.ready(), self._holding())

    def _ports_in_use(self, node: str) -> set[int]:
        return {int(j.rendezvous.rsplit(":", 1)[1]) for j in self._holding() if j.nodes[:1] == [node]}

    def _try_start(self, job: JobRecord) -> str | None:
        """Place and start ``job`` (a restart against its previous attempt's nodes); or return why it must wait.

        Draining nodes and the nodes excluded for this job are not placed; the reason names them."""
        blocked = self.nodes.blocked(job.id)
        slots = [NodeSlots(name, n) for name, n in self._free_slots().items() if name not in blocked]
        try:
            names = capacity.place_keeping(self._prev_attempt_nodes(job), job.nodes_needed, job.slots_per_node,
                                           slots)
        except PlacementError as exc:
            shown = "; ".join(f"{name} {why}" for name, why in sorted(blocked.items())[:8])
            more = f" and {len(blocked) - 8} more" if len(blocked) > 8 else ""
            return f"waiting for capacity: {exc}" + (f"; not placed: {shown}{more}" if blocked else "")
        port = pick_port(self.nodes.get(names[0]).free_ports, self._ports_in_use(names[0]))
        if port is None:
            return f"waiting for a rendezvous port: node {names[0]} reported no free port that is not in use"
        self._start(job, names, port)
        return None

    def _start(self, job: JobRecord, names: list[str], port: int) -> None:
        rendezvous = f"{self.nodes.get(names[0]).record.host}:{port}"
        try:
            messages = assign_messages(job, names, rendezvous, [self.nodes.get(n).peer for n in names],
                                       self._restore_sources(job, names))
        except Exception as exc:  # a stored spec that no longer lays out: fail it, keep the queue moving
            log.exception("job.assignments_failed", job=job.id)
            self.book.transition(job, S.FAILED, f"cannot build rank assignments: {exc}")
            return
        waited = self.book.waited(job)
        with self.store.transaction(f"the placement of job {job.id}"):
            job.nodes, job.rendezvous = names, rendezvous
            self.book.transition(job, S.PLACED, f"placed on {_node_span(names)}; rendezvous {job.rendezvous}")
            self.store.put_attempt(job, self.clock())
            self.book.start_ranks(job)
            self.book.transition(job, S.STARTING, f"sent {job.world_size} rank assignment(s) to {len(names)} node(s)")
        self.stats.queue_wait.observe(waited)
        for name, msg in zip(names, messages):
            self._send(name, msg)

    def _finish(self, job: JobRecord, state: JobState, reason: str, *, stop: bool = True) -> None:
        """Move to a terminal state; FAILED/CANCELLED tell every node of the job to stop it, and its slots
        wait until its ranks are confirmed gone (``stop``; False: they are free at once)."""
        self.book.transition(job, state, reason)
        self._drains.pop(job.id, None)
        self._prev_nodes.pop(job.id, None)
        if job.id in self.nodes.excluded:  # an ended job is placed nowhere again
            self.store.clear_exclusions(job_id=job.id)
            del self.nodes.excluded[job.id]
        if state is not S.SUCCEEDED:
            msg = convert.cancel_message(job.id, job.attempt, reason)
            for name in dict.fromkeys(job.nodes):
                self._send(name, msg)
        if stop and state is not S.SUCCEEDED and job.nodes:
            self._begin_stop(job)
            self._check_stop(job, quiet=True)  # nothing left to confirm: free now, without an event
        else:
            self._stops.pop(job.id, None)
        self.schedule()

    # -- node sessions -------------------------------------------------------
    def register(self, hello: NodeHello, outbox: Outbox) -> NodeSession:
        """Open a node session: answer Registered, reconcile the jobs it runs, schedule.

        A name held by a live session of another daemon is refused (NodeNameTaken); the
        same daemon reconnecting (same session id) replaces its old stream. The node's
        record is stored before the session opens, so a failed write changes nothing.
        A job of ours that the node does not list in ``running`` may have finished while
        the stream was down, its exit reports still buffered: the same daemon session
        gets until its first heartbeat (after the replay) before such a job is FAILED.
        """
        self._check_hello(hello)
        old = self.nodes.get(hello.name)
        live = old is not None and old.outbox is not None and old.status is NodeStatus.READY
        same_daemon = old is not None and old.record.session == hello.session
        if live and not same_daemon:
            raise NodeNameTaken(
                f"node name {hello.name!r} is held by another live daemon (address {old.record.address}, "
                f"last heard {self.clock() - old.last_heartbeat:.1f} s ago); stop it or give this daemon "
                "another --name")
        record = self.nodes.record_for(hello, self.clock())
        self.store.put_node(record)
        if live:
            self._close_stream(old)  # the same daemon's newer connection replaces this stream
        session = self.nodes.connect(record, hello, outbox, self.clock())
        outbox(convert.registered_message(hello.name, self.heartbeat_interval, session.record.last_seq))
        log.info("node.registered", node=hello.name, slots=hello.slots, running=len(hello.running))
        try:
            with self._consistent():
                self._reconcile(session, hello.running)
                if not same_daemon:  # a new daemon instance has no buffered reports to replay
                    self._verify(session)
                self._resend_checkpoints(hello.name)
                if hello.name in self.nodes.draining:  # drained while the coordinator was down: move its jobs
                    self._drain_jobs(hello.name)
                self._check_stops()
        except StoreError as exc:  # the session stands; the jobs it concerns are re-checked by tick
            log.warning("node.reconcile_store_failed", node=hello.name, error=str(exc))
        self.schedule()
        return session

    @staticmethod
    def _check_hello(hello: NodeHello) -> None:
        problem = node_name_problem(hello.name)
        if problem is not None:
            raise ProtocolError(f"Register: {problem}")
        if not 1 <= hello.slots <= MAX_SLOTS_PER_NODE:
            raise ProtocolError(f"Register: slots={hello.slots} must be between 1 and {MAX_SLOTS_PER_NODE}")

    def _reconcile(self, session: NodeSession, running: Iterable[RunningJob]) -> None:
        """Note our jobs the node did not list (checked by ``_verify``); cancel the ones we do not run.

        An attempt being stopped is told to stop again when listed (the first Cancel may never have
        reached the node); when not listed, its ranks there count as gone."""
        listed = {(r.job_id, r.attempt) for r in running}
        for job_id, stop in self._stops.items():
            job = self.book.jobs.get(job_id)
            k = job.node_index().get(session.name) if job is not None and job.attempt == stop.attempt else None
            if k is None:
                continue
            if (job.id, job.attempt) not in listed:
                stop.gone.add(k)
            elif job.state is S.RESTARTING:
                self._send(session.name, convert.cancel_message(job.id, job.attempt, "the attempt is stopping"))
        for job in self.book.active():
            if not job.runs_on(session.name) or job.state is S.RESTARTING:
                continue
            if (job.id, job.attempt) in listed:
                self.book.event(job, "node", f"node {session.name} reconnected")
            else:
                session.unverified.add((job.id, job.attempt))
        for r in running:
            job = self.book.jobs.get(r.job_id)
            if job is None or not is_active(job.state) or job.attempt != r.attempt:
                state = job.state.value if job is not None else "unknown"
                self._send(session.name, convert.cancel_message(r.job_id, r.attempt, f"job is {state}"))

    def _verify(self, session: NodeSession) -> None:
        """Fail the unlisted jobs whose ranks on this node did not all exit (after the replay)."""
        pending = set(session.unverified)
        for job_id, attempt in sorted(pending):
            job = self.book.jobs[job_id]
            if is_active(job.state) and job.attempt == attempt:
                ranks = self.book.ranks(job.id)
                missing = [r for r in job.ranks_on(session.name) if not (r in ranks and ranks[r].exited)]
                if missing:
                    self._fail_attempt(job, f"node {session.name} reconnected without this job; {_gone(missing)}",
                                       node=session.name)
            session.unverified.discard((job_id, attempt))

    def disconnect(self, session: NodeSession, detail: str = "stream closed") -> None:
        """The session's stream ended: the node is LOST unless a newer session replaced it."""
        if self.stopping or not self.nodes.is_current(session) or session.status is not NodeStatus.READY:
            return
        self._node_lost(session, detail)

    def heartbeat(self, session: NodeSession, free_ports: Sequence[int] = ()) -> None:
        """Note a heartbeat; a new free-port list may let a waiting job start."""
        if not self.nodes.is_current(session) or session.status is not NodeStatus.READY:
            return
        session.last_heartbeat = session.record.last_seen = self.clock()
        if session.unverified and self.flush():  # the replay came before this heartbeat: stored first
            with self._consistent():
                self._verify(session)
        if free_ports and tuple(free_ports) != session.free_ports:
            session.free_ports = tuple(free_ports)
            self.schedule()

    def tick(self, loop_lag: float = 0.0) -> None:
        """Failure detection, called periodically; then whatever a refused write left owed.

        ``loop_lag``: how late this call is because the event loop was busy. That time is not
        held against any node: heartbeats may be waiting, unread, behind the stall.
        """
        if loop_lag > 0:
            for s in self.nodes.sessions.values():
                s.last_heartbeat += loop_lag
            self.started_at += loop_lag
        try:
            with self._consistent():
                self._check_hangs(loop_lag)
        except StoreError as exc:
            log.warning("job.hang_store_failed", error=str(exc))
        now, timeout = self.clock(), self.heartbeat_timeout
        for s in self.nodes.sessions.values():
            if s.status is NodeStatus.READY and now - s.last_heartbeat > timeout:
                self._node_lost(s, f"no heartbeat for {timeout:.1f} s")
            elif s.status is NodeStatus.DISCONNECTED and now - max(self.started_at, s.since) > max(timeout,
                                                                                                 RECONNECT_GRACE_S):
                since = "of the coordinator start" if s.since == 0 else "of being asked to reconnect"
                self._node_lost(s, f"did not reconnect within {max(timeout, RECONNECT_GRACE_S):.1f} s {since}")
        self._settle()

    def _settle(self) -> None:
        """Retry what a refused write left undone: held reports, owed job advances, lost nodes' jobs, scheduling."""
        if self._held:
            self.flush()
        if self._stops or self._drains:
            try:
                with self._consistent():
                    self._check_stops()
                    self._check_drains()
            except StoreError as exc:
                log.warning("job.stop_store_failed", error=str(exc))
        for s in [s for s in self.nodes.sessions.values() if s.owes_failures]:
            if s.status is NodeStatus.LOST:
                self._fail_jobs_of(s)
        for job_id in sorted(self._owed):
            self._owed.discard(job_id)
            self._advance(self.book.jobs[job_id])
        if self._reschedule:
            self.schedule()

    def _node_lost(self, session: NodeSession, detail: str) -> None:
        session.status, session.detail = NodeStatus.LOST, detail
        self._close_stream(session)
        log.warning("node.lost", node=session.name, detail=detail)
        session.owes_failures = True
        self._fail_jobs_of(session)

    def _fail_jobs_of(self, session: NodeSession) -> None:
        """FAILED for every active job with ranks on a lost node (retried by tick if the store refuses)."""
        try:
            with self._consistent():
                self._node_gone(session.name)
                for job in self.book.active():
                    if not job.runs_on(session.name) or job.state is S.RESTARTING:
                        continue  # a restart's stop is checked below: the node's ranks there are gone too
                    gone = _gone(job.ranks_on(session.name))
                    if session.name in self.nodes.draining:  # drained, then taken away: still no failure
                        self._drain_restart(job, [session.name], f"then lost ({session.detail}); {gone}")
                    else:
                        self._fail_attempt(job, f"node {session.name} lost ({session.detail}); {gone}",
                                           node=session.name)
                self._check_stops()
            session.owes_failures = False
        except StoreError as exc:
            log.warning("node.lost_store_failed", node=session.name, error=str(exc))

    def _advance(self, job: JobRecord) -> None:
        """Move an active job along from its rank statuses (owed to tick when the store refuses)."""
        if not is_active(job.state) and job.id not in self._stops:
            return
        try:
            with self._consistent():
                self._advance_once(job)
        except StoreError as exc:
            self._owed.add(job.id)
            log.warning("job.advance_store_failed", job=job.id, error=str(exc))

    def _advance_once(self, job: JobRecord) -> None:
        """Move the job along from its counters (constant time; a result reads every rank once)."""
        if not is_active(job.state):
            if job.id in self._stops:  # an ended attempt: an exit may complete its stop
                self._check_stop(job)
            return
        if job.state is S.RESTARTING:
            self._maybe_requeue(job)
            return
        progress = self.book.progress(job)
        bad = progress.lowest_failed()
        if bad is not None:
            self._fail_attempt(job, failure_reason(bad), node=bad.node)
            return
        if job.state is S.STARTING and progress.all_running():
            self.book.transition(job, S.RUNNING, f"all {job.world_size} ranks running")
            progress.advanced_at = self.clock()
        if job.state is S.RUNNING and progress.all_succeeded():
            ranks = self.book.ranks(job.id)
            results = parse_rank_results({r: rec.result_json for r, rec in ranks.items()})
            with self.store.transaction(f"the result of job {job.id}"):
                job.result = aggregate(job.kind, results)
                self.book.save(job)
                self.book.event(job, "result", f"result from {len(results)} rank(s)")
            self._finish(job, S.SUCCEEDED, f"all {job.world_size} ranks exited 0")
