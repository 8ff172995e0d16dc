"""Thin grpc.aio servicers: protobuf in, core call, protobuf out, domain errors -> status codes.

Errors clients see carry the domain message only; anything unexpected is logged with its
traceback here and answered INTERNAL without details. Parsing and checking a job file is
pure CPU work of bounded but real cost: it runs on a worker thread (``_off_loop``), never on
the event loop, so a hostile job file cannot stall heartbeats, reports or other clients.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, NoReturn

import grpc
import structlog

from rankctl.coordinator import convert
from rankctl.coordinator.blobs import BlobMissing, BlobStore
from rankctl.coordinator.core import Coordinator
from rankctl.coordinator.errors import (
    AmbiguousJob, CapacityError, InvalidRequest, JobNotFound, NodeNameTaken, ProtocolError,
)
from rankctl.coordinator.jobs import MAX_PAGE
from rankctl.coordinator.logfetch import get_logs
from rankctl.contract.jobfile import SpecError
from rankctl.coordinator.states import is_terminal
from rankctl.coordinator.store import StoreError
from rankctl.proto import rankctl_pb2 as pb
from rankctl.kinds import registry
from rankctl.proto import rankctl_pb2_grpc

log = structlog.get_logger("rankctl.coordinator")
FOLLOW_POLL_S = 1.0  # watchers re-check at least this often even without a wake-up
DEFAULT_PAGE = 100
PAGE_BYTES = 1 << 20  # a ListJobs page stops near this size, whatever page_size says
DETAILS_MAX = 8192    # characters of an error's details sent to a client

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (SpecError, grpc.StatusCode.INVALID_ARGUMENT),
    (AmbiguousJob, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (JobNotFound, grpc.StatusCode.NOT_FOUND),
    (ProtocolError, grpc.StatusCode.FAILED_PRECONDITION),
    (CapacityError, grpc.StatusCode.FAILED_PRECONDITION),
    (BlobMissing, grpc.StatusCode.FAILED_PRECONDITION),
    (NodeNameTaken, grpc.StatusCode.ALREADY_EXISTS),
)


def _store_code(exc: StoreError) -> grpc.StatusCode:
    return grpc.StatusCode.RESOURCE_EXHAUSTED if exc.full else grpc.StatusCode.UNAVAILABLE


async def _off_loop(fn, *args):  # noqa: ANN001, ANN202 - a thin wrapper over to_thread
    """Run pure CPU work (job-file parsing, layout planning) on a worker thread."""
    return await asyncio.to_thread(fn, *args)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """Abort the RPC with the status code of ``exc``; never sends a traceback."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if isinstance(exc, StoreError):
        await context.abort(_store_code(exc), str(exc)[:DETAILS_MAX])
    for kind, code in _CODES:
        if isinstance(exc, kind):
            details = "\n".join(exc.errors) if isinstance(exc, SpecError) else str(exc)
            await context.abort(code, details[:DETAILS_MAX])
    log.exception("rpc.internal_error")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the coordinator log")


def _page_token(token: str) -> int:
    if not token:
        return 0
    if not token.isdigit() or len(token) > 18:
        raise InvalidRequest(f"page_token {token[:20]!r} is not one this coordinator gave out")
    return int(token)


async def _upload_chunks(first: pb.BlobChunk, rest: AsyncIterator[pb.BlobChunk]) -> AsyncIterator[bytes]:
    yield first.data
    async for chunk in rest:
        yield chunk.data


class ClientServiceServicer(rankctl_pb2_grpc.ClientServiceServicer):
    """ctl's API: submit, inspect, watch, cancel, logs, plan, blobs (packed workdirs)."""

    def __init__(self, core: Coordinator, blobs: BlobStore) -> None:
        self.core = core
        self.blobs = blobs

    def _job(self, job_id: str) -> pb.Job:
        job = self.core.get(job_id)
        return convert.job_to_pb(job, self.core.ranks(job.id))

    async def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext) -> pb.SubmitJobResponse:
        try:
            spec = await _off_loop(self.core.validate, request.spec_yaml, list(request.overrides),
                                   request.source or "job file")
            missing = self.blobs.missing(registry.blobs_of(spec.to_dict()))
            if missing:
                raise BlobMissing(f"the job references {missing[0]}, which the coordinator does not hold: "
                                  "upload it first (ctl submit packs and uploads python.workdir)")
            job = self.core.submit_spec(spec, queue_anyway=request.queue_anyway)
            return pb.SubmitJobResponse(job=self._job(job.id))
        except Exception as exc:
            await _abort(context, exc)

    async def GetJob(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext) -> pb.Job:
        try:
            return self._job(request.job_id)
        except Exception as exc:
            await _abort(context, exc)

    async def ListJobs(self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:
        try:
            if request.page_size < 0 or request.limit < 0:
                raise InvalidRequest(f"page_size={request.page_size} and limit={request.limit} must not be negative")
            size = min(request.page_size or request.limit or DEFAULT_PAGE, MAX_PAGE)
            before = _page_token(request.page_token)
            states = [convert.job_state_from_pb(s) for s in request.states]
            jobs, cursor = self.core.book.page(size, before, states)
            out, used = pb.ListJobsResponse(), 0
            for i, job in enumerate(jobs):
                msg = convert.job_summary_pb(job)
                used += msg.ByteSize()
                if used > PAGE_BYTES and i > 0:  # bounded whatever the page size: continue from here
                    cursor = jobs[i - 1].seqno
                    break
                out.jobs.append(msg)
            if cursor and not request.limit:
                out.next_page_token = str(cursor)
            return out
        except Exception as exc:
            await _abort(context, exc)

    async def CancelJob(self, request: pb.CancelJobRequest, context: grpc.aio.ServicerContext) -> pb.CancelJobResponse:
        try:
            job = self.core.cancel(request.job_id, request.reason)
            return pb.CancelJobResponse(job=self._job(job.id))
        except Exception as exc:
            await _abort(context, exc)

    async def ListNodes(self, request: pb.ListNodesRequest, context: grpc.aio.ServicerContext) -> pb.ListNodesResponse:
        try:
            rejected = self.core.rejected_reports
            return pb.ListNodesResponse(nodes=[convert.node_to_pb(s, free, rejected[s.name])
                                               for s, free in self.core.node_views()])
        except Exception as exc:
            await _abort(context, exc)

    async def PlanJob(self, request: pb.PlanJobRequest, context: grpc.aio.ServicerContext) -> pb.PlanJobResponse:
        try:
            layout, spec = await _off_loop(self.core.plan, request.spec_yaml, list(request.overrides),
                                           request.source or "job file")
            return pb.PlanJobResponse(layout_json=json.dumps(layout, separators=(",", ":")), spec_json=json.dumps(spec))
        except Exception as exc:
            await _abort(context, exc)

    async def StatBlob(self, request: pb.StatBlobRequest, context: grpc.aio.ServicerContext) -> pb.StatBlobResponse:
        try:
            size = self.blobs.size(request.digest)
            return pb.StatBlobResponse(exists=size is not None, size=size or 0)
        except Exception as exc:
            await _abort(context, exc)

    async def UploadBlob(self, request_iterator: AsyncIterator[pb.BlobChunk],
                         context: grpc.aio.ServicerContext) -> pb.BlobRef:
        """The first chunk names the digest and the size; the blob is stored once, verified."""
        try:
            chunks = request_iterator.__aiter__()
            first = await anext(chunks, None)
            if first is None:
                raise InvalidRequest("an upload needs at least one chunk naming its digest and size")
            size = await self.blobs.put(first.digest, first.size, _upload_chunks(first, chunks))
            log.info("blob.stored", digest=first.digest, size=size)
            return pb.BlobRef(digest=first.digest, size=size)
        except Exception as exc:
            await _abort(context, exc)

    async def WatchJob(self, request: pb.WatchJobRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.JobEvent]:
        """Stored events after ``after_seq``, then live ones, until the job is terminal."""
        try:
            job = self.core.get(request.job_id)
            seq = request.after_seq
            while True:
                wake = self.core.signals.arm(job.id)
                done = is_terminal(job.state)  # read before the events: the final event is then included
                for ev in self.core.events(job.id, seq):
                    seq = ev.seq
                    yield convert.event_to_pb(ev)
                if done:
                    return
                await self.core.signals.wait(wake, FOLLOW_POLL_S)
        except Exception as exc:
            await _abort(context, exc)

    async def GetLogs(self, request: pb.GetLogsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LogLine]:
        """A rank's (or every rank's) log, read from the nodes that ran them; ``follow`` until terminal."""
        try:
            async for line in get_logs(self.core, request):
                yield line
        except Exception as exc:
            await _abort(context, exc)
