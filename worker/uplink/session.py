"""The daemon's session with the coordinator: one bidirectional stream (NodeService.Connect).

It registers (name, address, slots, hardware, free ports, the attempts still alive here), then reads the
coordinator's messages (Assign, Cancel and CheckpointNow go to the daemon; Acks let the outbox forget
stored reports; FetchLogs is answered from the rank's file, ``worker.uplink.logship``) and is the stream's only
writer: a due heartbeat first, then answers, then one ReportBatch per report tick (a phase change, exit or
error at once). A broken stream is retried with jittered backoff (``reconnect_delay``); reports wait in the
outbox, and those the coordinator has not stored are replayed after re-registering.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import grpc

from rankctl.proto import LEADER_METADATA
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc as pb_grpc
from rankctl.worker.files.blobs import FetchFailed
from rankctl.worker.daemon.config import DaemonConfig
from rankctl.worker.uplink.logship import answer_fetch
from rankctl.worker.daemon.metrics import DaemonStats
from rankctl.worker.uplink.outbox import Outbox
from rankctl.worker.uplink.relay import Uplink
from rankctl.worker.uplink.reporting import free_ports, hardware_pb
from rankctl.worker.uplink.reportfold import fold
from rankctl.worker.daemon.usage import UsageSampler

BATCH_REPORTS = 4096  # reports in one ReportBatch at most
PORT_BEAT = 5         # every fifth heartbeat carries free ports, and is sent even right after a batch


class NodeNameTaken(RuntimeError):
    """The coordinator refused this node's name: another live daemon holds it. Retrying cannot help."""


class Inbound(Protocol):
    """Who acts on the coordinator's requests (``worker.daemon.daemon.WorkerDaemon``)."""

    async def assign(self, msg: pb.Assign) -> None: ...
    def relay_through(self, msg: pb.Relay) -> None: ...
    async def cancel(self, msg: pb.Cancel) -> None: ...
    def checkpoint(self, msg: pb.CheckpointNow) -> None: ...
    def release(self, msg: pb.Release) -> None: ...


# HTTP/2 pings every 2 s: a coordinator that stopped answering (SIGSTOP, a frozen host, a cut link) ends the
# session within ~4 s, so the daemon moves to another coordinator instead of waiting on a silent stream
# (gRPC 1.85 ends an unanswered ping on ``ping_timeout_ms`` only: with ``keepalive_timeout_ms`` alone a stopped
# coordinator's stream stayed open, measured; tests/e2e/test_e2e_keepalive.py checks both directions)
KEEPALIVE = (("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 2000),
             ("grpc.http2.ping_timeout_ms", 2000), ("grpc.keepalive_permit_without_calls", 1),
             ("grpc.http2.max_pings_without_data", 0))


def reconnect_delay(previous: float, initial: float, cap: float, rng: random.Random) -> float:
    """The wait before the next connection attempt: "decorrelated jitter", uniform between ``initial`` and
    three times the previous wait, at most ``cap`` (``previous`` 0: the first retry after a session ended).
    Daemons cut off together (a coordinator restart) thus come back spread out, not in lockstep."""
    return min(cap, rng.uniform(initial, 3 * max(previous, initial)))


def name_taken(exc: grpc.aio.AioRpcError) -> bool:
    """The coordinator's refusal of a second live session under one node name."""
    return exc.code() == grpc.StatusCode.ALREADY_EXISTS and (exc.details() or "").startswith("node name")


async def raise_ended(call: Any) -> None:
    """The stream ended while this side wrote (grpc.aio's ``InvalidStateError: RPC already finished``, e.g. the
    coordinator refused a revoked certificate just as a heartbeat went out): raise what a read would have, the
    coordinator's status as an ``AioRpcError``, or ``ConnectionError`` for a stream it closed without one. Either
    way the session ends and the daemon reconnects, instead of dying of the race."""
    code = await call.code()
    if code == grpc.StatusCode.OK:
        raise ConnectionError("the coordinator closed the stream")
    raise grpc.aio.AioRpcError(code, await call.initial_metadata(), await call.trailing_metadata(),
                               await call.details())


class CoordinatorSession:
    """``running()`` and ``hardware()`` fill each registration; ``on_change`` hears when ``online`` changed."""

    def __init__(self, cfg: DaemonConfig, *, outbox: Outbox, inbound: Inbound,
                 running: Callable[[], list[pb.RunningJob]], hardware: Callable[[], dict[str, Any]],
                 on_change: Callable[[], Awaitable[None]], credentials: grpc.ChannelCredentials | None,
                 stats: DaemonStats, rng: random.Random, session_id: str, log: Any,
                 data_roots: tuple[str, ...] = ()) -> None:
        self.cfg = cfg
        self._outbox = outbox
        self._inbound = inbound
        self._running = running
        self._hardware = hardware
        self._on_change = on_change
        self._credentials = credentials
        self._stats = stats
        self._rng = rng
        self._session_id = session_id
        self._data_roots = data_roots   # where its jobs may create files, told to the coordinator on Register
        self._log = log
        self.heartbeat_interval = 1.0  # the coordinator's, from its Registered
        self.connected = asyncio.Event()  # set while registered
        self._folds = False               # the coordinator applies folded reports (``Registered.folds``)
        self._answers: deque[pb.NodeMessage] = deque()  # log chunks, sent before reports
        self._fetches: set[asyncio.Task] = set()        # log fetches being answered
        self._beat = asyncio.Event()                     # a heartbeat is due
        self._channel: grpc.aio.Channel | None = None    # the session's, for FetchBlob
        self._usage = UsageSampler()                     # CPU, memory and GPU use, sent with each heartbeat
        self._ports: list[int] = []                      # the rendezvous ports last offered
        self.uplink = Uplink(cfg.name, credentials, log)   # reports through a relay head; a head's carried batches
        # the coordinators to try in turn (several: the coordinators of one replicated store; the leader serves)
        self._addresses = [a.strip() for a in cfg.coordinator.split(",") if a.strip()] or [cfg.coordinator]
        self.target = self._addresses[0]

    @property
    def online(self) -> bool:
        """A session with the coordinator is registered."""
        return self.connected.is_set()

    async def run(self) -> None:
        """Sessions one after another, until cancelled; raises ``NodeNameTaken`` when retrying cannot help."""
        delay = 0.0  # the previous wait; 0 after a registered session
        while True:
            registered, error = self._stats.registrations, ""
            try:
                await self._session_once()
            except (grpc.aio.AioRpcError, ConnectionError, OSError) as exc:
                error = self._failed(exc)
            if self._stats.registrations > registered:
                delay = 0.0
            delay = reconnect_delay(delay, self.cfg.backoff_initial, self.cfg.backoff_max, self._rng)
            if error:
                self._log.warning("coordinator unreachable", coordinator=self.cfg.coordinator, error=error,
                                  retry_in=round(delay, 2), next=self.target)
            await asyncio.sleep(delay)

    def _failed(self, exc: Exception) -> str:
        """Why a session could not start or broke; raises ``NodeNameTaken`` when that is why. Picks the next
        coordinator to try: the leader a standby named, else the next address."""
        rpc = exc if isinstance(exc, grpc.aio.AioRpcError) else None
        self._next_target(rpc)
        if rpc is not None and name_taken(rpc):
            self._log.error("node name taken; stopping", error=rpc.details())
            raise NodeNameTaken(rpc.details()) from None
        if rpc is not None and "revoked" in (rpc.details() or ""):
            self._log.error("the coordinator refuses this node's certificate: it is revoked (ctl certs "
                            "revoke); retrying at the backoff's pace", error=rpc.details())
        self._stats.connect_failures += 1
        return rpc.details() if rpc is not None else str(exc)

    async def fetch_blob(self, digest: str) -> AsyncIterator[bytes]:
        """A blob's bytes from the coordinator, over the session's channel; FetchFailed when that fails."""
        if self._channel is None:
            raise FetchFailed("not connected to the coordinator")
        call = pb_grpc.NodeServiceStub(self._channel).FetchBlob(pb.FetchBlobRequest(digest=digest))
        try:
            async for chunk in call:
                yield chunk.data
        except grpc.aio.AioRpcError as exc:
            raise FetchFailed(f"{exc.code().name}: {exc.details()}") from None

    def _next_target(self, rpc: grpc.aio.AioRpcError | None) -> None:
        leader = ""
        if rpc is not None and rpc.code() == grpc.StatusCode.UNAVAILABLE:
            leader = dict(rpc.trailing_metadata() or ()).get(LEADER_METADATA, "")
        if leader and leader != self.target:
            self.target = leader
        else:
            known = self._addresses.index(self.target) if self.target in self._addresses else -1
            self.target = self._addresses[(known + 1) % len(self._addresses)]

    # -- one session -------------------------------------------------------------------------
    def _channel_to_coordinator(self) -> grpc.aio.Channel:
        if self._credentials is not None:
            return grpc.aio.secure_channel(self.target, self._credentials, options=KEEPALIVE)
        return grpc.aio.insecure_channel(self.target, options=KEEPALIVE)

    def _register_msg(self) -> pb.NodeMessage:
        cfg = self.cfg
        return pb.NodeMessage(register=pb.Register(
            name=cfg.name, address=cfg.advertise_address, slots=cfg.slots, hardware=hardware_pb(self._hardware()),
            running=self._running(), session=self._session_id, peer_port=cfg.peer_port, pool=cfg.pool,
            free_ports=self._offer_ports(), replaces=True, relays=True, data_roots=self._data_roots,
        ))

    async def _session_once(self) -> None:
        async with self._channel_to_coordinator() as channel:
            self._channel = channel
            try:
                call = pb_grpc.NodeServiceStub(channel).Connect()
                try:
                    await self._register(call)
                    try:
                        await self._serve(call)
                    finally:
                        await self._ended(call)
                except asyncio.InvalidStateError:   # a write raced the stream's end: what ended it is the error
                    await raise_ended(call)
            finally:
                self._channel = None

    async def _ended(self, call: Any) -> None:
        """A registered session ended: stop what it started, and say so."""
        self.connected.clear()
        for t in self._fetches:
            t.cancel()
        self._fetches.clear()
        self.uplink.ended()   # the batches it was to carry: their nodes send them on their own streams
        call.cancel()
        await self._on_change()  # last: a cancellation here skips nothing else

    async def _register(self, call: Any) -> None:
        await call.write(self._register_msg())
        first = await call.read()
        if first is grpc.aio.EOF or first.WhichOneof("body") != "registered":
            raise ConnectionError("coordinator did not acknowledge registration")
        ack = first.registered
        self.heartbeat_interval = ack.heartbeat_interval or 1.0
        self._folds = ack.folds   # an older coordinator reads one rank a report: never fold for it
        self.uplink.keyed(ack.relay_key)
        replayed = self._outbox.buffer.rewind(ack.last_seq)
        self._answers.clear()
        self._stats.registrations += 1
        self._outbox.wake.set()
        self.connected.set()
        await self._on_change()
        self._log.info("registered", coordinator=self.target, replayed=replayed)

    async def _serve(self, call: Any) -> None:
        """Read, write and beat until one of them ends (the stream broke)."""
        tasks = [asyncio.create_task(c) for c in (self._read(call), self._write(call), self._heartbeats())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()
        finally:
            for t in tasks:
                t.cancel()

    async def _read(self, call: Any) -> None:
        while (msg := await call.read()) is not grpc.aio.EOF:  # read() style only: aio forbids mixing
            body = msg.WhichOneof("body")
            if body == "assign":
                self.uplink.via = ""   # the coordinator sends on this stream: report on it too
                await self._inbound.assign(msg.assign)
            elif body == "cancel":
                await self._inbound.cancel(msg.cancel)
            elif body == "ack":
                self._outbox.buffer.acked(msg.ack.last_seq)
                if msg.ack.resend:   # the relay head that carried our batches was lost: here, again
                    self.uplink.via = ""
                    self._outbox.buffer.rewind(msg.ack.last_seq)
                    self._outbox.wake.set()
                if msg.ack.heartbeat_interval > 0:  # the fleet changed size: beat at its pace from the next beat
                    self.heartbeat_interval = msg.ack.heartbeat_interval
            elif body == "checkpoint":
                self._inbound.checkpoint(msg.checkpoint)
            elif body == "release":
                self._inbound.release(msg.release)
            elif body == "relay":
                self._inbound.relay_through(msg.relay)
            elif body == "fetch_logs":
                task = asyncio.create_task(self._answer_fetch(msg.fetch_logs))
                self._fetches.add(task)
                task.add_done_callback(self._fetches.discard)

    async def _answer_fetch(self, req: pb.FetchLogs) -> None:
        """Read a rank's log file off the loop and send the chunk back."""
        chunk = await asyncio.to_thread(answer_fetch, self.cfg.state_dir, req)
        self._stats.log_lines_shipped += len(chunk.lines)
        if self.online:
            self._answers.append(pb.NodeMessage(log_chunk=chunk))
            self._outbox.wake.set()

    # -- the stream's only writer ------------------------------------------------------------
    async def _write(self, call: Any) -> None:
        """A due heartbeat first, then answers, then one batch of reports per report tick."""
        loop, wake, buffer = asyncio.get_running_loop(), self._outbox.wake, self._outbox.buffer
        beat, last_batch = 0, 0.0
        while True:
            await wake.wait()
            wake.clear()
            if self._beat.is_set():
                self._beat.clear()
                beat += 1
                # a batch sent within the interval already showed the node alive: skip all but the port beats
                if beat % PORT_BEAT == 0 or loop.time() - last_batch >= self.heartbeat_interval:
                    await call.write(self._heartbeat(loop.time(), with_ports=beat % PORT_BEAT == 0))
            while self._answers:
                await call.write(self._answers.popleft())
            while self.uplink.carried:
                msg, written = self.uplink.take_carried()
                await call.write(msg)
                written()
            if not buffer.unsent:
                continue
            wait = 0.0 if buffer.urgent else last_batch + self.cfg.report_interval - loop.time()
            if wait > 0:  # step reports made meanwhile coalesce; a phase change or a due heartbeat ends the wait
                await self._tick(wait)
                continue
            last_batch = loop.time()
            batch = buffer.take(BATCH_REPORTS)
            body = pb.ReportBatch(reports=fold(batch) if self._folds else batch)
            if not (self.uplink.via and await self.uplink.forward(body)):
                await call.write(pb.NodeMessage(batch=body))
            self._stats.reports_sent += len(batch)
            if buffer.unsent:
                wake.set()

    def answer(self, msg: pb.NodeMessage) -> None:
        """Send ``msg`` before the next reports (dropped when no session is registered: the coordinator's own
        timeout covers what it said)."""
        if self.online:
            self._answers.append(msg)
            self._outbox.wake.set()

    def _offer_ports(self) -> list[int]:
        """The rendezvous ports offered to the coordinator: the last offer's that are still free, then new ones
        (an unchanged offer asks nothing of the scheduler)."""
        self._ports = free_ports(self.cfg.advertise_address, self.cfg.free_ports, self._ports)
        return self._ports

    def _heartbeat(self, ts: float, *, with_ports: bool) -> pb.NodeMessage:
        ports = self._offer_ports() if with_ports else []
        return pb.NodeMessage(heartbeat=pb.Heartbeat(ts=ts, free_ports=ports, usage=self._usage.sample()))

    async def _tick(self, wait: float) -> None:
        """Wait up to ``wait`` seconds for the report tick, or less when something hurries the writer."""
        if not self._beat.is_set():
            self._outbox.hurry.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._outbox.hurry.wait(), wait)
        self._outbox.wake.set()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            self._beat.set()
            self._outbox.wake.set()
            self._outbox.hurry.set()
