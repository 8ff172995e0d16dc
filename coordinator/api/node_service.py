"""The NodeService servicer: one bidirectional stream per worker daemon, and blob fetches.

Thin like ``servicer``: protobuf in, core call, protobuf out. The daemon's messages are
handed to the core in arrival order from one reader task per stream.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc
import structlog

from rankctl.coordinator.api import convert
from rankctl.coordinator.api.auth import caller, caller_certificate
from rankctl.coordinator.store.blobs import BlobMissing, BlobStore
from rankctl.coordinator.fleet.registrations import RegistrationBatch
from rankctl.coordinator.jobs.core import Coordinator
from rankctl.coordinator.model.errors import ProtocolError
from rankctl.coordinator.fleet.nodes import NodeSession
from rankctl.coordinator.api.ratelimit import StreamBudget
from rankctl.coordinator.api.servicer import _abort
from rankctl.coordinator.fleet.sessions import MAX_GPUS
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc
from rankctl.security.malformed import MalformedRequest
from rankctl.security.revocation import serial_of_pem
from rankctl.security.tls import revoked_problem

log = structlog.get_logger("rankctl.coordinator")
REVOCATION_CHECK_S = 1.0  # how often one watcher asks whether the revocation list changed
REGISTER_WAIT_S = 30.0    # a node stream's first message (Register) comes within this, or the stream is closed
MAX_CARRIED = 1024        # node batches of one RelayedBatches read at most (a head carries --relay-width nodes')


class NodeServiceServicer(rankctl_pb2_grpc.NodeServiceServicer):
    """One bidirectional stream per worker daemon.

    The first message must be Register; the core answers Registered through the
    session's outbox (an asyncio.Queue drained here). A reader task feeds heartbeats,
    reports and logs to the core; when the daemon's side ends, or the core puts ``None``
    in the outbox (node lost, or replaced by a newer stream), the stream closes and
    the core hears ``disconnect``.
    """

    def __init__(self, core: Coordinator, blobs: BlobStore) -> None:
        self.core = core
        self.blobs = blobs
        self.revoked: RevokedStreams | None = None  # made at the first stream checked against a revocation list
        self.registrations = RegistrationBatch(lambda: self.core)  # Registers opened together (one store write)

    async def FetchBlob(self, request: pb.FetchBlobRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.BlobChunk]:
        """A stored blob, in chunks of at most 1 MiB; the first names its digest and size."""
        try:
            size = self.blobs.size(request.digest)
            if size is None:
                raise BlobMissing(f"blob {request.digest} is not stored on the coordinator")
            first = True
            async for data in self.blobs.read(request.digest):
                yield pb.BlobChunk(digest=request.digest if first else "", size=size if first else 0, data=data)
                first = False
        except Exception as exc:
            await _abort(context, exc)

    async def Connect(self, request_iterator: AsyncIterator[pb.NodeMessage],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CoordinatorMessage]:
        messages = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(anext(messages), REGISTER_WAIT_S)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            await _abort(context, ProtocolError(f"no Register within {REGISTER_WAIT_S:g} s of opening the node stream"))
        if first.WhichOneof("body") != "register":
            await _abort(context, ProtocolError("the first message on a node stream must be Register"))
        who = caller()
        if who is not None and first.register.name != who.name:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{who} may not register as node {first.register.name[:64]!r}: a node registers "
                                f"only under the name in its certificate")
        outbox: asyncio.Queue[pb.CoordinatorMessage | None] = asyncio.Queue()
        with structlog.contextvars.bound_contextvars(node=first.register.name[:64]):
            try:
                session = await self.registrations.register(convert.hello_from_pb(first.register), outbox.put_nowait)
            except Exception as exc:
                await _abort(context, exc)
            closed: list[tuple] = []   # (status, why, node detail): the coordinator ended it (revoked, undecodable)
            reader = asyncio.create_task(self._read(messages, session, outbox, closed))
            watch = self._watch(who, outbox, closed)
            try:
                fanouts = self.core.fanouts
                while (msg := await outbox.get()) is not None:
                    yield msg
                    fanouts.handed(msg)   # gRPC took it (it asks for the next one): timed fan-outs end here
            finally:
                reader.cancel()
                watch()
                self.core.disconnect(session, closed[0][2] if closed else "stream closed")
                self.core.relays.head_lost(session.name)   # what it was to forward goes direct
            if closed:
                await context.abort(*closed[0][:2])

    def _watch(self, who, outbox: asyncio.Queue, closed: list[tuple]):  # noqa: ANN001, ANN202
        """Close this stream (a reason in ``closed``, None in ``outbox``) if its certificate is revoked later;
        returns the call that stops watching it."""
        held = caller_certificate()
        if held is None:
            return lambda: None
        revocations, pem = held
        if self.revoked is None:
            self.revoked = RevokedStreams(revocations)

        def close() -> None:
            why = revoked_problem(revocations, pem, who) or f"the certificate of {who} is revoked"
            closed.append((grpc.StatusCode.UNAUTHENTICATED, why, "certificate revoked"))
            log.warning("node.certificate_revoked", reason=why)
            outbox.put_nowait(None)
        return self.revoked.add(serial_of_pem(pem), close)

    async def _read(self, messages: AsyncIterator[pb.NodeMessage], session: NodeSession,
                    outbox: asyncio.Queue, closed: list) -> None:
        """Feed the daemon's messages to the core; end the stream when they stop. A stream over its
        report or byte budget (``coordinator.api.ratelimit``) is read more slowly, never dropped."""
        budget, loop = StreamBudget(), asyncio.get_running_loop()
        try:
            async for msg in messages:
                body = msg.WhichOneof("body")
                if body == "register":   # a stream registers once; the daemon opens a new stream to register again
                    closed.append((grpc.StatusCode.FAILED_PRECONDITION, "a second Register on one node stream: a "
                                   "stream registers once (open a new one)", "registered twice on one stream"))
                    break
                wait = budget.delay(len(msg.batch.reports) + 1 if body == "batch" else 1, msg.ByteSize(), loop.time())
                if wait > 0:
                    if budget.waited == wait:  # the first time only
                        log.warning("node.rate_limited", node=session.name, wait_s=round(wait, 3))
                    held_back(session, self.core.clock(), wait)
                    await asyncio.sleep(wait)
                try:
                    self._handle(session, msg)
                except Exception:  # a bug or a bad message must not end the session
                    log.exception("node.message_failed", node=session.name, body=msg.WhichOneof("body"))
        except asyncio.CancelledError:
            raise
        except MalformedRequest as exc:   # not a NodeMessage (security.malformed): the daemon is told why its stream ends
            closed.append((grpc.StatusCode.INVALID_ARGUMENT, str(exc), "sent a message that is not a NodeMessage"))
            log.warning("node.bad_message", node=session.name, error=str(exc))
        except Exception as exc:  # the stream broke: the session ends
            log.warning("node.stream_error", node=session.name, error=str(exc) or type(exc).__name__)
        outbox.put_nowait(None)

    def _handle(self, session: NodeSession, msg: pb.NodeMessage) -> None:
        body = msg.WhichOneof("body")
        if body == "heartbeat":
            if msg.heartbeat.HasField("usage") and len(msg.heartbeat.usage.gpus) <= MAX_GPUS:   # shown by ListNodes
                session.usage = msg.heartbeat.usage
            self.core.heartbeat(session, list(msg.heartbeat.free_ports))
        elif body == "batch":
            self.core.rank_reports(session, msg.batch.reports)  # read in place: no copy per report
            self.core.relays.reported_direct(session.name)
        elif body == "relayed":   # a relay head's bundle of its group's batches, each checked (``coordinator.scheduling.relay``)
            for nb in msg.relayed.batches[:MAX_CARRIED]:
                if (got := self.core.relays.up(session.name, nb)) is not None:
                    self.core.rank_reports(got[0], got[1].reports)
        elif body == "log_chunk":
            self.core.logfetch.deliver(session.name, msg.log_chunk)
        elif body == "relay_done":
            self.core.relays.done(session.name, msg.relay_done)
        else:
            log.warning("node.unexpected_message", node=session.name, body=body)



def held_back(session: NodeSession, now: float, seconds: float) -> None:
    """The node's stream is read ``seconds`` later than its messages came (``coordinator.api.ratelimit``): its heartbeats
    wait behind them, so that silence is the coordinator's, not the node's; its liveness counts from the end of it."""
    session.last_heartbeat = max(session.last_heartbeat, now + seconds)


class RevokedStreams:
    """One watcher for every node stream checked against one revocation list: once a second (the list's own stat)
    it closes the streams whose certificate serial the list has come to hold. Adding and removing a stream is O(1);
    only a change of the list costs O(streams). The task runs while streams are watched."""

    def __init__(self, revocations) -> None:  # noqa: ANN001 - security.revocation.Revocations
        self.revocations, self.seen = revocations, revocations.version
        self.streams: dict[int, set] = {}
        self.task: asyncio.Task | None = None

    def add(self, serial: int, close):  # noqa: ANN001, ANN201 - close() ends one stream; returns its remover
        if self.revocations.revoked(serial):  # revoked between the interceptor's check and now
            close()
            return lambda: None
        self.streams.setdefault(serial, set()).add(close)
        if self.task is None:
            self.task = asyncio.create_task(self._run())
        return lambda: self._remove(serial, close)

    def _remove(self, serial: int, close) -> None:  # noqa: ANN001
        closes = self.streams.get(serial)
        if closes is not None:
            closes.discard(close)
            if not closes:
                del self.streams[serial]
        if not self.streams and self.task is not None:
            self.task.cancel()
            self.task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(REVOCATION_CHECK_S)
            self.revocations.refresh()
            if self.revocations.version == self.seen:
                continue
            self.seen = self.revocations.version
            for serial in [s for s in self.streams if self.revocations.revoked(s)]:
                for close in list(self.streams.pop(serial, ())):
                    close()
