"""Node sessions: a daemon's Register, heartbeats and stream end; a node that stops answering is LOST.

On Register the node's jobs are reconciled with ours: a job of ours it does not list may have finished
while the stream was down (its exits still buffered), so the same daemon session gets until its first
heartbeat, after its replay, before such a job's attempt fails (``verify``); jobs it runs that we do not
are cancelled; a stopping attempt it no longer runs counts as gone there. A LOST node's jobs fail their
attempt (or move, when it is draining: ``coordinator.recovery.restarts``). A node known only from the store gets
``RECONNECT_GRACE_S`` (at least the heartbeat timeout) to come back.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import structlog

from rankctl.contract.limits import MAX_SLOTS_PER_NODE
from rankctl.contract.names import node_name_problem
from rankctl.coordinator.api import convert
from rankctl.coordinator.jobs.commit import Outgoing, StoreGuard
from rankctl.coordinator.jobs.dirty import Dirty
from rankctl.coordinator.recovery.drains import Drains
from rankctl.coordinator.model.errors import NodeNameTaken, ProtocolError
from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.logs.logfetch import LogFetcher
from rankctl.coordinator.fleet.nodes import NodeSession, NodeStatus, NodeTable, Outbox
from rankctl.coordinator.model.records import NodeHello, NodeRecord, RunningJob
from rankctl.coordinator.recovery.restarts import Restarts
from rankctl.coordinator.model.states import JobState, is_active
from rankctl.coordinator.scheduling.stops import Stops
from rankctl.coordinator.store.database import Store, StoreError
from rankctl.coordinator.app.transport import base_heartbeat_interval

FROZEN_S = 3.0   # a coordinator stall this long may have made daemons drop their streams (they ping every 2 s, 2 s wait)
RECONNECT_GRACE_S = 10.0  # at least this long for a DISCONNECTED node to come back: a daemon retries at
                          # least every 5 s (worker DaemonConfig.backoff_max), later on a loaded machine
MAX_HELLO_TEXT = 256         # characters of a Register's address, session, hostname, GPU name
MAX_FREE_PORTS = 4096        # free ports a node offers at most (a Register's or a heartbeat's)
MAX_GPUS = 256               # GPUs of one node at most
MAX_DATA_ROOTS = 64          # data roots one node reports (each as given and real, with its state dir)
MAX_PATH = 4096              # characters of one reported data root (Linux's PATH_MAX)
MAX_HEARTBEAT_RATE = 1000.0  # heartbeats a second from the whole fleet at most (ctl coordinator --max-heartbeat-rate)
STORM_GRACES = 6          # after a start (a restart, a failover) nodes known from the store are waited for while any
                          # node still registers, up to this many graces: thousands re-register in a storm
log = structlog.get_logger("rankctl.coordinator")
S = JobState


class Streams:
    """Ends node streams (the servicer then hears ``disconnect``); the node's log fetches fail with them."""

    def __init__(self, clock: Callable[[], float], logfetch: LogFetcher) -> None:
        self._clock, self._logfetch = clock, logfetch

    def close(self, session: NodeSession) -> None:
        if session.outbox is not None:
            session.outbox(None)
            session.outbox = None
        self._logfetch.fail_node(session.name, f"node {session.name} is {session.status.value}")

    def resync(self, session: NodeSession) -> None:
        """Close the stream without losing the node: it reconnects and replays what the store lacks."""
        session.status, session.detail = NodeStatus.DISCONNECTED, "asked to reconnect and replay its reports"
        session.since = self._clock()
        self.close(session)


def beat_interval(current: float, base: float, nodes: int, rate: float) -> float:
    """The heartbeat interval for a fleet of ``nodes``: ``base``, doubled while the fleet would send more than ``rate``
    heartbeats a second; halved again only once it would send at most 3/4 of ``rate`` at half of it, so that a fleet
    hovering at a threshold does not retune its nodes back and forth (``current``: the interval in force)."""
    interval = max(current, base)
    while nodes / interval > rate:
        interval *= 2
    while interval > base and nodes / (interval / 2) <= 0.75 * rate:
        interval /= 2
    return interval


def check_hello(hello: NodeHello) -> None:
    """ProtocolError naming the field when a Register cannot be a node's."""
    problem = node_name_problem(hello.name)
    if problem is not None:
        raise ProtocolError(f"Register: {problem}")
    if not 1 <= hello.slots <= MAX_SLOTS_PER_NODE:
        raise ProtocolError(f"Register: slots={hello.slots} must be between 1 and {MAX_SLOTS_PER_NODE}")
    problem = node_name_problem(hello.pool, "pool") if hello.pool else None
    if problem is None:
        problem = _hello_bounds(hello)
    if problem is not None:
        raise ProtocolError(f"Register: {problem}")


def _hello_bounds(hello: NodeHello) -> str | None:
    """What of a Register is out of its bounds (every node's record goes into each ``ListNodes``), or None."""
    hw = hello.hardware
    texts = [("address", hello.address), ("session", hello.session), ("hardware.hostname", hw.get("hostname", ""))]
    texts += [(f"hardware.gpus[{i}].name", g.get("name", "")) for i, g in enumerate(hw.get("gpus", [])[:MAX_GPUS])]
    for field, text in texts:
        if len(text) > MAX_HELLO_TEXT:
            return f"{field} ({len(text)} characters) must be at most {MAX_HELLO_TEXT} characters"
    counts = [("free_ports", len(hello.free_ports), MAX_FREE_PORTS), ("hardware.gpus", len(hw.get("gpus", [])), MAX_GPUS),
              ("running", len(hello.running), MAX_SLOTS_PER_NODE)]
    counts += [(f"running[{i}].ranks", len(r.ranks), MAX_SLOTS_PER_NODE) for i, r in enumerate(hello.running)]
    counts.append(("data_roots", len(hello.data_roots), MAX_DATA_ROOTS))
    texts = [(f"data_roots[{i}]", r) for i, r in enumerate(hello.data_roots[:MAX_DATA_ROOTS])]
    bad_root = next((f for f, r in texts if len(r) > MAX_PATH or not r.startswith("/") or "\x00" in r), None)
    if bad_root:
        return f"{bad_root} must be an absolute path of at most {MAX_PATH} characters"
    for field, n, most in counts:
        if n > most:
            return f"{field} has {n} entries; at most {most}"
    bad = next((p for p in (*hello.free_ports, hello.peer_port or 1) if not 1 <= p <= 65535), None)
    if bad is not None:
        return f"port {bad} (free_ports or peer_port) must be between 1 and 65535"
    for field in ("cpu_count", "memory_bytes"):
        if hw.get(field, 0) < 0:
            return f"hardware.{field}={hw[field]} must not be negative"
    return None


class Sessions:
    """The live side of the node table; called from the event loop thread only.

    A registration or a new free-port list marks the queue, a reconnect the stops under way (``dirty``);
    ``shutting_down``: true once the coordinator is going down (closing streams then fail no job).
    """

    def __init__(self, nodes: NodeTable, book: JobBook, store: Store, clock: Callable[[], float],
                 guard: StoreGuard, outgoing: Outgoing, streams: Streams, stops: Stops, drains: Drains,
                 restarts: Restarts, dirty: Dirty, *, heartbeat_timeout: float, shutting_down: Callable[[], bool],
                 max_heartbeat_rate: float = MAX_HEARTBEAT_RATE) -> None:
        if not max_heartbeat_rate > 0:   # the CLI refuses it too; a programmatic caller would loop for ever
            raise ValueError(f"max_heartbeat_rate={max_heartbeat_rate!r}: must be more than 0 heartbeats a second")
        self._nodes, self._book, self._store, self._clock = nodes, book, store, clock
        self._guard, self._outgoing, self._streams = guard, outgoing, streams
        self._stops, self._drains, self._restarts = stops, drains, restarts
        self._dirty, self._shutting_down = dirty, shutting_down
        self.heartbeat_timeout, self.max_heartbeat_rate = heartbeat_timeout, max_heartbeat_rate
        self._interval = self.base_interval  # what nodes are asked for now (set by ``check_liveness``)
        self.started_at = self.checked_at = clock()   # checked_at: the last liveness check (the loop ran then)
        self.frozen_until = 0.0   # streams closing before this closed for the coordinator's own stall
        self.last_registration = 0.0  # when a node last registered (0: none since the start)

    @property
    def base_interval(self) -> float:
        return base_heartbeat_interval(self.heartbeat_timeout)

    @property
    def heartbeat_interval(self) -> float:
        """What nodes are asked for: ``base_interval``, longer in a fleet too big for ``max_heartbeat_rate``
        (``beat_interval``; a node silent that long is still found by the keepalive pings, ``transport``)."""
        return self._interval

    def liveness_limit(self, session: NodeSession) -> float:
        """Seconds without a heartbeat or a report before a READY node is lost: the heartbeat timeout, or four of
        the intervals the node was asked for when that is longer."""
        return max(self.heartbeat_timeout, 4 * session.beat, session.was_beat + self.heartbeat_timeout)

    def register(self, hello: NodeHello, outbox: Outbox) -> NodeSession:
        """Open one node session (``register_many`` of one); raises what refused it."""
        result = self.register_many([(hello, outbox)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def register_many(self, hellos: list[tuple[NodeHello, Outbox]]) -> list[NodeSession | Exception]:
        """Open node sessions: answer Registered, reconcile the jobs each runs, one schedule pass.

        A name held by a live session of another daemon is refused (NodeNameTaken); the same daemon
        reconnecting (same session id) replaces its old stream. The records of all of them, with their jobs'
        "reconnected" events, are stored in one transaction before any session opens (a registration storm after
        a restart or a failover costs one store write per batch), so a failed write changes nothing: then every
        one of them gets the StoreError. One entry per hello: its session, or the exception that refused it.
        """
        out: list[NodeSession | Exception] = []
        admitted: list[tuple[int, NodeHello, Outbox, NodeRecord, bool]] = []
        sessions: dict[str, str] = {}  # name -> the daemon session admitted under it in this batch
        for i, (hello, outbox) in enumerate(hellos):
            try:
                if sessions.setdefault(hello.name, hello.session) != hello.session:
                    raise NodeNameTaken(f"node name {hello.name!r} is being registered by another daemon at the "
                                        "same moment; give each daemon its own --name")
                admitted.append((i, hello, outbox, *self._admit(hello)))
            except Exception as exc:  # noqa: BLE001 - handed back to this hello's caller
                out.append(exc)
                continue
            out.append(None)  # type: ignore[arg-type] - filled below
        if admitted:
            try:
                self._store_records(admitted)
            except StoreError as exc:
                for i, *_ in admitted:
                    out[i] = exc
                return out
        for i, hello, outbox, record, same_daemon in admitted:
            out[i] = self._open(hello, outbox, record, same_daemon)
        if admitted:
            self._dirty.place()
        return out

    def _admit(self, hello: NodeHello) -> tuple[NodeRecord, bool]:
        """Check a Register; its record to store and whether the same daemon had the name (a reconnect)."""
        check_hello(hello)
        old = self._nodes.get(hello.name)
        live = old is not None and old.outbox is not None and old.status is NodeStatus.READY
        same_daemon = old is not None and old.record.session == hello.session
        if live and not same_daemon:
            raise NodeNameTaken(
                f"node name {hello.name!r} is held by another live daemon (address {old.record.address}, "
                f"last heard {self._clock() - old.last_heartbeat:.1f} s ago); stop it or give this daemon "
                "another --name")
        return self._nodes.record_for(hello, self._clock()), same_daemon

    def _store_records(self, admitted: list) -> None:
        what = f"the registration of node {admitted[0][1].name}" + (f" and {len(admitted) - 1} more"
                                                                     if len(admitted) > 1 else "")
        active = list(self._book.active())
        with self._guard.consistent(), self._store.transaction(what):
            for _, hello, _, record, _ in admitted:
                self._store.put_node(record)
                listed = {(r.job_id, r.attempt) for r in hello.running}
                for job in active:
                    if (job.id, job.attempt) in listed and job.state is not S.RESTARTING and job.runs_on(hello.name):
                        self._book.event(job, "node", f"node {hello.name} reconnected")
        self.last_registration = self._clock()

    def _open(self, hello: NodeHello, outbox: Outbox, record: NodeRecord, same_daemon: bool) -> NodeSession:
        old = self._nodes.get(hello.name)
        if old is not None and old.outbox is not None and old.status is NodeStatus.READY:
            self._streams.close(old)  # the same daemon's newer connection replaces this stream
        session = self._nodes.connect(record, hello, outbox, self._clock())
        session.beat = self.heartbeat_interval
        outbox(convert.registered_message(hello.name, session.beat, session.record.last_seq, session.relay_key))
        log.info("node.registered", node=hello.name, slots=hello.slots, running=len(hello.running))
        try:
            with self._guard.consistent():
                self._reconcile(session, hello.running, replays=same_daemon)
        except StoreError as exc:  # the session stands; the jobs it concerns are re-checked by tick
            log.warning("node.reconcile_store_failed", node=hello.name, error=str(exc))
        return session

    def _reconcile(self, session: NodeSession, running: Iterable[RunningJob], *, replays: bool) -> None:
        """Note our jobs the node did not list (checked by ``_verify``, at once unless the same daemon may
        still replay their exits); cancel the ones we do not run; stops, drains and moves it concerns."""
        name = session.name
        listed = {(r.job_id, r.attempt) for r in running}
        for job in self._stops.node_back(name, listed):  # the first Cancel may never have reached the node
            self._outgoing.send(name, convert.cancel_message(job.id, job.attempt, "the attempt is stopping"))
        for job in self._book.active():
            if not job.runs_on(name) or job.state is S.RESTARTING:
                continue
            if (job.id, job.attempt) not in listed:  # a listed one's "reconnected" event went with the record
                session.unverified.add((job.id, job.attempt))
        for r in running:
            job = self._book.jobs.get(r.job_id)
            if job is None or not is_active(job.state) or job.attempt != r.attempt:
                state = job.state.value if job is not None else "unknown"
                self._outgoing.send(name, convert.cancel_message(r.job_id, r.attempt, f"job is {state}"))
        if not replays:  # a new daemon instance has no buffered reports to replay
            self._verify(session)
        self._drains.resend(name)
        if name in self._nodes.draining:  # drained while the coordinator was down: move its jobs
            self._restarts.drain_node(name)
        self._dirty.jobs(self._stops.job_ids())   # a stop may be complete now (the node came back without it)

    def _verify(self, session: NodeSession) -> None:
        """Fail the unlisted jobs whose ranks on this node did not all exit (after the replay)."""
        for job_id, attempt in sorted(set(session.unverified)):
            job = self._book.jobs[job_id]
            if is_active(job.state) and job.attempt == attempt:
                ranks = self._book.ranks(job.id)
                missing = [r for r in job.ranks_on(session.name) if not (r in ranks and ranks[r].exited)]
                if missing:
                    self._restarts.node_back_without(job, session.name, missing)
            session.unverified.discard((job_id, attempt))

    def disconnect(self, session: NodeSession, detail: str = "stream closed") -> None:
        """The session's stream ended: the node is LOST unless a newer session replaced it."""
        if self._shutting_down() or not self._nodes.is_current(session) or session.status is not NodeStatus.READY:
            return
        now = self._clock()
        if now < self.frozen_until or now - self.checked_at > FROZEN_S:
            # the coordinator itself stood still (SIGSTOP, a frozen VM): daemons drop a stream whose pings go
            # unanswered for 4 s; theirs closed for that, not because they died. Each gets a grace to come back.
            session.status, session.since = NodeStatus.DISCONNECTED, now
            session.detail = f"{detail} while the coordinator stood still; waiting for it to reconnect"
            log.warning("node.disconnected_by_stall", node=session.name, detail=detail)
            return
        self._node_lost(session, detail)

    def heartbeat(self, session: NodeSession, free_ports: Sequence[int] = ()) -> bool:
        """Note a heartbeat; a new free-port list may let a waiting job start. True: the session has jobs to
        verify once the reports received so far are stored (``verify``)."""
        if not self._nodes.is_current(session) or session.status is not NodeStatus.READY:
            return False
        session.last_heartbeat = session.record.last_seen = self._clock()
        session.was_beat = 0.0
        if session.beat != self._interval:  # the fleet grew or shrank past a step since this node was told
            session.was_beat, session.beat = session.beat, self._interval
            self._outgoing.send(session.name, convert.retune_message(session.beat))
        if free_ports:   # a Register's bounds: ports beyond them go unused
            free_ports = [p for p in free_ports[:MAX_FREE_PORTS] if 1 <= p <= 65535]
        if free_ports and tuple(free_ports) != session.free_ports:
            session.free_ports = tuple(free_ports)
            self._dirty.place()
        return bool(session.unverified)

    def verify(self, session: NodeSession) -> None:
        """The reports received before this heartbeat are stored (the replay came first): fail the jobs the node
        did not list whose ranks there did not all exit."""
        with self._guard.consistent():
            self._verify(session)

    def stalled(self, loop_lag: float) -> None:
        """The event loop was stalled ``loop_lag`` seconds: that time is not held against any node, and after a
        stall long enough for daemons to drop their streams (``FROZEN_S``), a stream that closes within a grace
        is waited for instead of lost (``disconnect``)."""
        if loop_lag >= FROZEN_S:
            self.frozen_until = self._clock() + max(self.heartbeat_timeout, RECONNECT_GRACE_S)
        for s in self._nodes.sessions.values():
            s.last_heartbeat += loop_lag
        self.started_at += loop_lag
        self.last_registration += loop_lag if self.last_registration else 0.0

    def check_liveness(self) -> None:
        """LOST: a READY node silent for the heartbeat timeout, or a known one that did not reconnect in time: a
        grace from when it was asked to; or, known from the store at the start, a grace with no node registering
        at all (at most ``STORM_GRACES`` graces from the start)."""
        now, timeout = self._clock(), self.heartbeat_timeout
        self.checked_at = now
        grace = max(timeout, RECONNECT_GRACE_S)
        storm = now - self.started_at <= STORM_GRACES * grace and now - self.last_registration <= grace
        fleet = 0  # nodes that beat, or will again: READY and DISCONNECTED ones
        for s in self._nodes.sessions.values():
            fleet += s.status is not NodeStatus.LOST
            if s.status is NodeStatus.READY and now - s.last_heartbeat > (limit := self.liveness_limit(s)):
                self._node_lost(s, f"no heartbeat for {limit:.1f} s")
            elif (s.status is NodeStatus.DISCONNECTED and now - max(self.started_at, s.since) > grace
                  and not (s.since == 0 and storm)):
                since = "of the coordinator start" if s.since == 0 else "of its stream closing"
                self._node_lost(s, f"did not reconnect within {grace:.1f} s {since}")
        interval = beat_interval(self._interval, self.base_interval, fleet, self.max_heartbeat_rate)
        if interval != self._interval:  # nodes are told at their next heartbeat
            log.info("node.heartbeat_retuned", interval=interval, nodes=fleet, max_rate=self.max_heartbeat_rate)
            self._interval = interval

    def _node_lost(self, session: NodeSession, detail: str) -> None:
        session.status, session.detail = NodeStatus.LOST, detail
        self._streams.close(session)
        log.warning("node.lost", node=session.name, detail=detail)
        self._dirty.node_lost(session.name)   # the turn fails the attempts of its jobs
