"""The coordinator's domain core: jobs, FIFO queue, placement, node sessions, failure detection.

Plain Python (no grpc), one instance per coordinator, called from the event loop
thread only. Time comes from an injected ``clock`` (unix seconds) and everything
that must survive a restart goes through the injected ``Store``; each public
operation commits its writes before it returns.

Nodes talk to the core through an *outbox* per session (see ``nodes.Outbox``): a
callable that takes a ``CoordinatorMessage`` to send, or ``None`` meaning "close this
stream" (a node declared lost or replaced by a newer connection).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import replace
from typing import Callable, Iterable, Sequence

import structlog

from rankctl.coordinator import convert
from rankctl.coordinator.checks import check_job
from rankctl.coordinator.errors import ProtocolError
from rankctl.coordinator.jobs import JobBook
from rankctl.coordinator.nodes import NodeSession, NodeStatus, NodeTable, Outbox
from rankctl.coordinator.planner import build_assignments, pick_port, plan_layout
from rankctl.coordinator.progress import all_running, all_succeeded, changed, failure_reason, first_failure, rank_span
from rankctl.coordinator.records import (
    EventRecord, JobRecord, LogRecord, NodeHello, RankRecord, RankUpdate, RunningJob,
)
from rankctl.coordinator.results import aggregate, parse_rank_results
from rankctl.coordinator.signals import Signals
from rankctl.coordinator.spec import JobSpec, build_spec, load_yaml_text
from rankctl.coordinator.states import JobState, is_active, is_terminal
from rankctl.coordinator.store import Store
from rankctl.parallel.placement import NodeSlots, PlacementError, place

log = structlog.get_logger("rankctl.coordinator")
S = JobState


def _gone(ranks: list[int]) -> str:
    return f"{rank_span(ranks)} {'is' if len(ranks) == 1 else 'are'} gone"


class Coordinator:
    """Jobs and nodes of one coordinator; see the module docstring for the threading contract."""

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time,
                 heartbeat_timeout: float = 10.0, signals: Signals | None = None) -> None:
        self.store, self.clock, self.heartbeat_timeout = store, clock, heartbeat_timeout
        self.signals = signals or Signals()
        self.book = JobBook(store, clock, self.signals)
        self.nodes = NodeTable.from_records(store.load_nodes())
        self.started_at = clock()
        self.stopping = False

    @property
    def heartbeat_interval(self) -> float:
        """What nodes are asked for: four heartbeats per timeout, at most one every 2 s."""
        return min(2.0, self.heartbeat_timeout / 4)

    def shutdown(self) -> None:
        """Stop reacting to closing streams: a coordinator going down must not fail its jobs."""
        self.stopping = True

    # -- client operations ---------------------------------------------------
    def validate(self, spec_yaml: str, overrides: Sequence[str] = (), source: str = "job file") -> JobSpec:
        """Build and check a spec; raises SpecError with one line per problem."""
        spec = build_spec(load_yaml_text(spec_yaml, source), list(overrides))
        check_job(spec)
        return spec

    def plan(self, spec_yaml: str, overrides: Sequence[str] = (), source: str = "job file") -> tuple[dict, dict]:
        """(layout document, spec dict) of a job file, without storing anything."""
        spec = self.validate(spec_yaml, overrides, source)
        return plan_layout(check_job(spec), spec.resources.slots_per_node), spec.to_dict()

    def submit(self, spec_yaml: str, overrides: Sequence[str] = (), source: str = "job file") -> JobRecord:
        """Validate (SpecError: nothing stored), store the job PENDING and run a schedule pass."""
        spec = self.validate(spec_yaml, overrides, source)
        job = JobRecord(
            id=self._new_id(spec.name), name=spec.name, kind=spec.kind, spec=spec.to_dict(), state=S.PENDING,
            reason="queued", world_size=spec.world_size, slots_per_node=spec.resources.slots_per_node,
            created_at=self.clock(),
        )
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
        return [r for _, r in sorted(self.book.ranks(job_id).items())]

    def events(self, job_id: str, after_seq: int = 0) -> list[EventRecord]:
        return self.store.events(job_id, after_seq)

    def logs(self, job_id: str, rank: int | None = None, *, after_id: int = 0, tail: int = 0) -> list[LogRecord]:
        """Stored log lines of a job (one rank, or all when ``rank`` is None)."""
        return self.store.logs(job_id, rank, after_id=after_id, tail=tail)

    def cancel(self, id_or_name: str, reason: str = "") -> JobRecord:
        """CANCELLED plus a Cancel to every node of the job; a terminal job is returned unchanged."""
        job = self.book.get(id_or_name)
        if not is_terminal(job.state):
            self._finish(job, S.CANCELLED, f"cancelled: {reason}" if reason else "cancelled by user")
        return job

    def node_views(self) -> list[tuple[NodeSession, int]]:
        """Every known node with its free slots (0 unless READY)."""
        free = self._free_slots()
        return [(s, free.get(s.name, 0)) for s in self.nodes]

    # -- scheduling ----------------------------------------------------------
    def schedule(self) -> None:
        """Start pending jobs in submission order; the first that does not fit blocks the rest."""
        if self.stopping:
            return
        blocker: JobRecord | None = None
        for job in self.book.pending():
            if job.state is not S.PENDING:
                continue
            if blocker is not None:
                self.book.set_waiting(job, f"queued behind {blocker.id}")
                continue
            why = self._try_start(job)
            if why is not None:
                self.book.set_waiting(job, why)
                blocker = job

    def _free_slots(self) -> dict[str, int]:
        free = {s.name: s.record.slots for s in self.nodes.ready()}
        for job in self.book.active():
            for name in job.nodes:
                if name in free:
                    free[name] -= job.slots_per_node
        return free

    def _ports_in_use(self, node: str) -> set[int]:
        return {int(j.rendezvous.rsplit(":", 1)[1]) for j in self.book.active() if j.nodes[:1] == [node]}

    def _try_start(self, job: JobRecord) -> str | None:
        """Place and start ``job``; or return why it must wait."""
        slots = [NodeSlots(name, n) for name, n in self._free_slots().items()]
        try:
            names = place(job.nodes_needed, job.slots_per_node, slots)
        except PlacementError as exc:
            return f"waiting for capacity: {exc}"
        port = pick_port(self.nodes.get(names[0]).free_ports, self._ports_in_use(names[0]))
        if port is None:
            return f"waiting for a rendezvous port: node {names[0]} reported no free port that is not in use"
        self._start(job, names, port)
        return None

    def _start(self, job: JobRecord, names: list[str], port: int) -> None:
        records = {n: self.nodes.get(n).record for n in names}
        rendezvous = f"{records[names[0]].host}:{port}"
        try:
            by_node = build_assignments(replace(job, nodes=names, rendezvous=rendezvous), records)
        except Exception as exc:  # a stored spec that no longer lays out: fail it, keep the queue moving
            log.exception("job.assignments_failed", job=job.id)
            self.book.transition(job, S.FAILED, f"cannot build rank assignments: {exc}")
            return
        with self.store.transaction():
            job.nodes, job.rendezvous = names, rendezvous
            self.book.transition(job, S.PLACED, f"placed on {', '.join(names)}; rendezvous {job.rendezvous}")
            self.store.put_attempt(job, self.clock())
            self.book.start_ranks(job)
            self.book.transition(job, S.STARTING, f"sent {job.world_size} rank assignment(s) to {len(by_node)} node(s)")
        for name, assignments in by_node.items():
            self.nodes.send(name, convert.assign_message(job.id, job.attempt, assignments))

    def _finish(self, job: JobRecord, state: JobState, reason: str) -> None:
        """Move to a terminal state; FAILED/CANCELLED tell every node of the job to stop it."""
        self.book.transition(job, state, reason)
        if state is not S.SUCCEEDED:
            for name in dict.fromkeys(job.nodes):
                self.nodes.send(name, convert.cancel_message(job.id, job.attempt, reason))
        self.schedule()

    # -- node sessions -------------------------------------------------------
    def register(self, hello: NodeHello, outbox: Outbox) -> NodeSession:
        """Open a node session: answer Registered, reconcile the jobs it runs, schedule.

        A job of ours that the node does not list in ``running`` may have finished while
        the stream was down, its exit reports still buffered: the same daemon session
        gets until its first heartbeat (after the replay) before such a job is FAILED.
        """
        if not hello.name or hello.slots < 1:
            raise ProtocolError(f"Register needs a node name and at least one slot (got {hello.name!r}, "
                                f"slots={hello.slots})")
        old = self.nodes.get(hello.name)
        if old is not None and old.outbox is not None and old.status is NodeStatus.READY:
            old.outbox(None)  # a newer connection replaces this stream
        same_daemon = old is not None and old.record.session == hello.session
        session = self.nodes.connect(hello, outbox, self.clock())
        self.store.put_node(session.record)
        outbox(convert.registered_message(hello.name, self.heartbeat_interval, session.record.last_seq))
        log.info("node.registered", node=hello.name, slots=hello.slots, running=len(hello.running))
        self._reconcile(session, hello.running)
        if not same_daemon:  # a new daemon instance has no buffered reports to replay
            self._verify(session)
        self.schedule()
        return session

    def _reconcile(self, session: NodeSession, running: Iterable[RunningJob]) -> None:
        """Note our jobs the node did not list (checked by ``_verify``); cancel the ones we do not run."""
        listed = {(r.job_id, r.attempt) for r in running}
        for job in self.book.active():
            if session.name not in job.nodes:
                continue
            if (job.id, job.attempt) in listed:
                self.book.event(job, "node", f"node {session.name} reconnected")
            else:
                session.unverified.add((job.id, job.attempt))
        for r in running:
            job = self.book.jobs.get(r.job_id)
            if job is None or not is_active(job.state) or job.attempt != r.attempt:
                state = job.state.value if job is not None else "unknown"
                self.nodes.send(session.name, convert.cancel_message(r.job_id, r.attempt, f"job is {state}"))

    def _verify(self, session: NodeSession) -> None:
        """Fail the unlisted jobs whose ranks on this node did not all exit (after the replay)."""
        pending, session.unverified = session.unverified, set()
        for job_id, attempt in sorted(pending):
            job = self.book.jobs[job_id]
            if not is_active(job.state) or job.attempt != attempt:
                continue
            ranks = self.book.ranks(job.id)
            missing = [r for r in job.ranks_on(session.name) if not (r in ranks and ranks[r].exited)]
            if missing:
                self._finish(job, S.FAILED, f"node {session.name} reconnected without this job; {_gone(missing)}")

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
        if session.unverified:  # the replay of buffered reports came before this heartbeat
            self._verify(session)
        if free_ports and tuple(free_ports) != session.free_ports:
            session.free_ports = tuple(free_ports)
            self.schedule()

    def tick(self) -> None:
        """Failure detection, called periodically: silent nodes and nodes that never came back."""
        now, timeout = self.clock(), self.heartbeat_timeout
        for s in list(self.nodes):
            if s.status is NodeStatus.READY and now - s.last_heartbeat > timeout:
                self._node_lost(s, f"no heartbeat for {timeout:.1f} s")
            elif s.status is NodeStatus.DISCONNECTED and now - self.started_at > timeout:
                self._node_lost(s, f"did not reconnect within {timeout:.1f} s of the coordinator start")

    def _node_lost(self, session: NodeSession, detail: str) -> None:
        session.status, session.detail = NodeStatus.LOST, detail
        if session.outbox is not None:
            session.outbox(None)
            session.outbox = None
        self.store.put_node(session.record)
        log.warning("node.lost", node=session.name, detail=detail)
        for job in self.book.active():
            if session.name in job.nodes:
                ranks = job.ranks_on(session.name)
                self._finish(job, S.FAILED, f"node {session.name} lost ({detail}); {_gone(ranks)}")

    # -- reports -------------------------------------------------------------
    def rank_report(self, session: NodeSession, update: RankUpdate) -> bool:
        """Apply one rank report; False when dropped (a replay already seen, or a stale stream)."""
        if not self.nodes.is_current(session):
            return False
        rec = session.record
        session.last_heartbeat = rec.last_seen = self.clock()  # a report shows the node is alive
        if update.seq and update.seq <= rec.last_seq:
            return False
        job = self.book.jobs.get(update.job_id)
        with self.store.transaction():
            if update.seq:
                rec.last_seq = update.seq
                self.store.set_node_seq(rec.name, update.seq)
            if job is None or update.attempt != job.attempt or not 0 <= update.status.rank < job.world_size:
                log.warning("report.ignored", node=rec.name, job=update.job_id, attempt=update.attempt)
                return True
            self._apply_rank(job, session.name, update)
        self._advance(job)
        return True

    def _apply_rank(self, job: JobRecord, node: str, update: RankUpdate) -> None:
        old = self.book.ranks(job.id).get(update.status.rank)
        st = update.status
        # an exit report carries no step or metrics: keep the last ones the rank reported
        keep_metrics = st.metrics_json in ("", "{}") and old is not None
        new = RankRecord(
            rank=st.rank, node=node, phase=st.phase or (old.phase if old else "pending"),
            step=st.step or (old.step if old else 0),
            metrics_json=old.metrics_json if keep_metrics else st.metrics_json,
            error=st.error or (old.error if old else ""), exit_code=st.exit_code, exited=st.exited,
            updated_at=st.updated_at or self.clock(),
            result_json=update.result_json or (old.result_json if old else ""),
        )
        self.book.put_rank(job, new)
        if changed(old, new):
            self.book.event(job, "rank", f"rank {new.rank} {'exited' if new.exited else new.phase}", new)

    def _advance(self, job: JobRecord) -> None:
        """Move an active job along from its rank statuses."""
        if not is_active(job.state):
            return
        ranks = self.book.ranks(job.id)
        bad = first_failure(ranks)
        if bad is not None:
            self._finish(job, S.FAILED, failure_reason(bad))
            return
        if job.state is S.STARTING and all_running(ranks, job.world_size):
            self.book.transition(job, S.RUNNING, f"all {job.world_size} ranks running")
        if job.state is S.RUNNING and all_succeeded(ranks, job.world_size):
            results = parse_rank_results({r: rec.result_json for r, rec in ranks.items()})
            with self.store.transaction():
                job.result = aggregate(job.kind, results)
                self.book.save(job)
                self.book.event(job, "result", f"result from {len(results)} rank(s)")
            self._finish(job, S.SUCCEEDED, f"all {job.world_size} ranks exited 0")

    def append_logs(self, session: NodeSession, job_id: str, attempt: int, rank: int, lines: list[str]) -> None:
        """Store a batch of a rank's log lines (bounded tail) and wake log followers."""
        if not lines or job_id not in self.book.jobs or not self.nodes.is_current(session):
            return
        self.store.append_logs(job_id, attempt, rank, lines)
        self.signals.notify(job_id)
