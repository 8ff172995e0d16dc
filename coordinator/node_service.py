"""The NodeService servicer: one bidirectional stream per worker daemon, and blob fetches.

Thin like ``servicer``: protobuf in, core call, protobuf out. The daemon's messages are
handed to the core in arrival order from one reader task per stream.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc
import structlog

from rankctl.coordinator import convert
from rankctl.coordinator.auth import caller, caller_revoked
from rankctl.coordinator.blobs import BlobMissing, BlobStore
from rankctl.coordinator.core import Coordinator
from rankctl.coordinator.errors import ProtocolError
from rankctl.coordinator.nodes import NodeSession
from rankctl.coordinator.ratelimit import StreamBudget
from rankctl.coordinator.servicer import _abort
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc

log = structlog.get_logger("rankctl.coordinator")
REVOCATION_CHECK_S = 2.0  # how often a live stream asks whether its certificate has been revoked since


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
            first = await anext(messages)
        except StopAsyncIteration:
            return
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
                session = self.core.register(convert.hello_from_pb(first.register), outbox.put_nowait)
            except Exception as exc:
                await _abort(context, exc)
            revoked: list[str] = []
            tasks = [asyncio.create_task(self._read(messages, session, outbox))]
            if (check := caller_revoked()) is not None:
                tasks.append(asyncio.create_task(_watch_revocation(check, outbox, revoked)))
            try:
                while (msg := await outbox.get()) is not None:
                    yield msg
            finally:
                for task in tasks:
                    task.cancel()
                self.core.disconnect(session, "certificate revoked" if revoked else "stream closed")
            if revoked:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, revoked[0])

    async def _read(self, messages: AsyncIterator[pb.NodeMessage], session: NodeSession,
                    outbox: asyncio.Queue) -> None:
        """Feed the daemon's messages to the core; end the stream when they stop. A stream over its
        report or byte budget (``coordinator.ratelimit``) is read more slowly, never dropped."""
        budget, loop = StreamBudget(), asyncio.get_running_loop()
        try:
            async for msg in messages:
                body = msg.WhichOneof("body")
                wait = budget.delay(len(msg.batch.reports) + 1 if body == "batch" else 1, msg.ByteSize(), loop.time())
                if wait > 0:
                    if budget.waited == wait:  # the first time only
                        log.warning("node.rate_limited", node=session.name, wait_s=round(wait, 3))
                    await asyncio.sleep(wait)
                try:
                    self._handle(session, msg)
                except Exception:  # a bug or a bad message must not end the session
                    log.exception("node.message_failed", node=session.name, body=msg.WhichOneof("body"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream broke: the session ends
            log.warning("node.stream_error", node=session.name, error=str(exc) or type(exc).__name__)
        outbox.put_nowait(None)

    def _handle(self, session: NodeSession, msg: pb.NodeMessage) -> None:
        body = msg.WhichOneof("body")
        if body == "heartbeat":
            if msg.heartbeat.HasField("usage"):
                session.usage = msg.heartbeat.usage
            self.core.heartbeat(session, list(msg.heartbeat.free_ports))
        elif body == "batch":
            self.core.rank_reports(session, msg.batch.reports)  # read in place: no copy per report
        elif body == "log_chunk":
            self.core.logfetch.deliver(session.name, msg.log_chunk)
        else:
            log.warning("node.unexpected_message", node=session.name, body=body)


async def _watch_revocation(check, outbox: asyncio.Queue, revoked: list[str]) -> None:  # noqa: ANN001
    """End the stream once ``check()`` says the node's certificate is revoked (its reason appended to ``revoked``)."""
    while (why := check()) is None:
        await asyncio.sleep(REVOCATION_CHECK_S)
    log.warning("node.certificate_revoked", reason=why)
    revoked.append(why)
    outbox.put_nowait(None)
