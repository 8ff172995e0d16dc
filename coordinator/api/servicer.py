"""Thin grpc.aio servicers: protobuf in, core call, protobuf out, domain errors -> status codes.

Errors clients see carry the domain message only; anything unexpected is logged with its
traceback here and answered INTERNAL without details. Parsing and checking a job file is
pure CPU work of bounded but real cost: it runs on a worker thread (``_off_loop``), never on
the event loop, so a hostile job file cannot stall heartbeats, reports or other clients.

Reads are bounded whatever the job's size: a Job carries the core's constant-size summary
and one page of ranks (``_job``); watchers read stored events in chunks and send what is
ready in batches (``WatchJobBatches``), with step events coalesced under ``min_interval``.
A job whose ended attempt still has ranks not confirmed gone says so in ``stopping`` and at the
end of its reason ("; stopping: N rank(s) not yet confirmed gone"), so every client shows it.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from typing import Any, AsyncIterator, Awaitable, Callable, NoReturn

import grpc
import structlog

from rankctl.coordinator.api import convert
from rankctl.coordinator.api.auth import ADMIN, caller
from rankctl.coordinator.store.blobs import BlobMissing, BlobStore
from rankctl.coordinator.jobs.core import Coordinator
from rankctl.coordinator.model.errors import (
    AmbiguousJob, CapacityError, InvalidRequest, JobNotFound, NodeNameTaken, PoolNotFound, ProtocolError,
)
from rankctl.coordinator.jobs.book import MAX_PAGE
from rankctl.coordinator.logs.logfetch import get_logs
from rankctl.coordinator.api.grpcstatus import os_status
from rankctl.coordinator.fleet.nodes import NodeNotFound
from rankctl.coordinator.batch.pools import pool_to_pb
from rankctl.coordinator.model.records import EventRecord, JobRecord
from rankctl.contract.jobfile import SpecError
from rankctl.coordinator.model.states import JobState, is_terminal
from rankctl.coordinator.store.database import StoreError, durability
from rankctl.coordinator.store.durability import WRITTEN
from rankctl.proto import rankctl_pb2 as pb
from rankctl.kinds import registry
from rankctl.proto import rankctl_pb2_grpc
from rankctl.security.malformed import MalformedRequest

log = structlog.get_logger("rankctl.coordinator")
FOLLOW_POLL_S = 1.0  # watchers re-check at least this often even without a wake-up
DEFAULT_PAGE = 100
PAGE_BYTES = 1 << 20  # a ListJobs page stops near this size, whatever page_size says
DETAILS_MAX = 8192    # characters of an error's details sent to a client
RANK_PAGE = 256       # ranks in a GetJob page when rank_limit is 0
MAX_RANK_PAGE = 4096  # ... and at most this many
RANK_PAGE_BYTES = 1 << 20  # a page of ranks also stops near this size (long errors)
NODES_BYTES = 1 << 20      # a job's node list is sent whole when its names fit in this; else not at all
EVENT_CHUNK = 1000    # stored events read at once by WatchJob
BATCH_EVENTS = 500    # stored events read for one JobEventBatch
BATCH_BYTES = 1 << 20  # ... and a batch stops near this size (rank events carry error tails)

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (SpecError, grpc.StatusCode.INVALID_ARGUMENT),
    (AmbiguousJob, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (JobNotFound, grpc.StatusCode.NOT_FOUND),
    (NodeNotFound, grpc.StatusCode.NOT_FOUND),
    (PoolNotFound, grpc.StatusCode.NOT_FOUND),
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


def domain_status(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status code and message of a domain error (what a client is told), None for any other error.
    The dashboard answers with the same (``coordinator.web.app.http_error``)."""
    if isinstance(exc, StoreError):
        return _store_code(exc), str(exc)
    if isinstance(exc, OSError):  # a disk full, a permission: named, never INTERNAL (coordinator.errors)
        return os_status(exc)
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, "\n".join(exc.errors) if isinstance(exc, SpecError) else str(exc)
    return None


def _answers(method: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]
             ) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    """A unary RPC's one error path: any exception becomes its status code (``_abort``), never a traceback. An
    RPC that wrote answers once its writes are stored (a replicated store stores behind the loop:
    ``coordinator.store.durability``); a read never waits."""
    @functools.wraps(method)
    async def answer(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        mine = WRITTEN.set(0)   # this RPC's own writes (other tasks' writes meanwhile are theirs to wait for)
        try:
            response = await method(self, request, context)
            if (ticket := WRITTEN.get()) and self.core is not None:
                await durability(self.core.store).stored(ticket)
            return response
        except Exception as exc:
            await _abort(context, exc)
        finally:
            WRITTEN.reset(mine)
    return answer


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """Abort the RPC with the status code of ``exc``; never sends a traceback."""
    if isinstance(exc, (grpc.aio.AbortError, MalformedRequest)):   # the RequestGuard answers a corrupt message
        raise exc
    known = domain_status(exc)
    if known is not None:
        await context.abort(known[0], known[1][:DETAILS_MAX])
    log.exception("rpc.internal_error")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the coordinator log")


def _job_state(value: int) -> JobState:
    """A ``ListJobs`` state filter; InvalidRequest naming it when it is no job state."""
    names = [n for n in pb.JobState.keys() if n != "JOB_STATE_UNSPECIFIED"]
    if value not in [pb.JobState.Value(n) for n in names]:
        raise InvalidRequest(f"states: {value} is not a job state; one of {', '.join(n[10:] for n in names)}")
    return convert.job_state_from_pb(value)


def _page_token(token: str) -> int:
    if not token:
        return 0
    if not (token.isascii() and token.isdigit()) or len(token) > 18:
        raise InvalidRequest(f"page_token {token[:20]!r} is not one this coordinator gave out")
    return int(token)


def _rank_window(offset: int, limit: int) -> int:
    """The page size for ``GetJob(rank_offset, rank_limit)``; InvalidRequest for a bad field."""
    if offset < 0:
        raise InvalidRequest(f"rank_offset={offset} must be 0 or more (the first rank of the page)")
    if limit < 0:
        raise InvalidRequest(f"rank_limit={limit} must be 0 or more (0: {RANK_PAGE} ranks; at most {MAX_RANK_PAGE})")
    return min(limit or RANK_PAGE, MAX_RANK_PAGE)


def _nodes_fit(names: list[str]) -> bool:
    """Whether a job's node list fits NODES_BYTES; stops once past it (O(budget), not O(nodes))."""
    total = 0
    for name in names:
        total += len(name) + 3  # a repeated string's tag, length and text
        if total > NODES_BYTES:
            return False
    return True


def coalesce_steps(events: list[EventRecord]) -> list[EventRecord]:
    """Each run of consecutive ``step`` events reduced to its newest; every other event kept."""
    out: list[EventRecord] = []
    for ev in events:
        if ev.kind == "step" and out and out[-1].kind == "step":
            out[-1] = ev
        else:
            out.append(ev)
    return out


def _fill(repeated, messages, budget: int) -> None:  # noqa: ANN001 - a repeated message field, an iterator
    """Append ``messages`` to ``repeated`` until their bytes pass ``budget`` (always at least one)."""
    used = 0
    for msg in messages:
        used += msg.ByteSize()
        if used > budget and len(repeated):
            break
        repeated.append(msg)


async def _upload_chunks(first: pb.BlobChunk, rest: AsyncIterator[pb.BlobChunk]) -> AsyncIterator[bytes]:
    yield first.data
    async for chunk in rest:
        yield chunk.data


class ClientServiceServicer(rankctl_pb2_grpc.ClientServiceServicer):
    """ctl's API: submit, inspect, watch, cancel, logs, plan, blobs (packed workdirs), the job file's schema."""

    def __init__(self, core: Coordinator | None, blobs: BlobStore | None) -> None:
        self.core = core    # None while this coordinator stands by (the leader gate answers for it)
        self.blobs = blobs
        self.info: Callable[[], pb.GetInfoResponse] | None = None  # set by the server

    def _job(self, job_id: str, offset: int = 0, limit: int = RANK_PAGE, summary_only: bool = False) -> pb.Job:
        """The job as shown (``coordinator.jobs.shown``) with ranks ``offset ..`` (at most ``limit``, and about
        RANK_PAGE_BYTES)."""
        shown = self.core.shown.job(job_id, offset, 0 if summary_only else limit)
        job = shown.job
        msg = convert.job_to_pb(job, summary=shown.summary, rank_offset=offset, nodes=_nodes_fit(job.nodes))
        msg.stopping, msg.reason = shown.stopping, shown.reason
        msg.attempts.extend(convert.attempts_to_pb(shown.attempts, job))
        _fill(msg.ranks, map(convert.rank_to_pb, shown.ranks), RANK_PAGE_BYTES)
        end = offset + len(msg.ranks)
        msg.next_rank_offset = end if msg.ranks and end < job.world_size else 0
        return msg

    def _batch(self, job: JobRecord, events: list[EventRecord]) -> pb.JobEventBatch:
        """The job now and ``events`` from the first, stopping near BATCH_BYTES (at least one event)."""
        shown = self.core.shown.job(job.id, attempts=False)
        batch = pb.JobEventBatch(state=convert.job_state(job.state), attempt=job.attempt, reason=shown.reason,
                                 summary=convert.summary_to_pb(shown.summary))
        _fill(batch.events, map(convert.event_to_pb, events), BATCH_BYTES)
        return batch

    @_answers
    async def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext) -> pb.SubmitJobResponse:
        spec = await _off_loop(self.core.validate, request.spec_yaml, list(request.overrides),
                               request.source or "job file")
        missing = self.blobs.missing(registry.blobs_of(spec))
        if missing:
            raise BlobMissing(f"the job references {missing[0]}, which the coordinator does not hold: "
                              "upload it first (ctl submit packs and uploads python.workdir)")
        who = caller()
        allocation = convert.allocation_request_from_pb(request.allocation) \
            if request.HasField("allocation") else None
        job = self.core.submit_spec(spec, queue_anyway=request.queue_anyway, submitted_by=who.name if who else "",
                                    allocation=allocation)
        return pb.SubmitJobResponse(job=self._job(job.id))

    @_answers
    async def GetJob(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext) -> pb.Job:
        """Summary and one page of ranks: ``rank_limit`` 0 means RANK_PAGE; ``next_rank_offset`` 0: no more."""
        limit = _rank_window(request.rank_offset, request.rank_limit)
        return self._job(request.job_id, request.rank_offset, limit, request.summary_only)

    @_answers
    async def ListJobs(self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:
        if request.page_size < 0:
            raise InvalidRequest(f"page_size={request.page_size} must not be negative")
        size = min(request.page_size or DEFAULT_PAGE, MAX_PAGE)
        before = _page_token(request.page_token)
        states = [_job_state(s) for s in request.states]
        jobs, cursor = self.core.book.page(size, before, states)
        out, used = pb.ListJobsResponse(), 0
        for i, job in enumerate(jobs):
            msg = convert.job_summary_pb(job)
            used += msg.ByteSize()
            if used > PAGE_BYTES and i > 0:  # bounded whatever the page size: continue from here
                cursor = jobs[i - 1].seqno
                break
            out.jobs.append(msg)
        if cursor:
            out.next_page_token = str(cursor)
        return out

    @_answers
    async def CancelJob(self, request: pb.CancelJobRequest, context: grpc.aio.ServicerContext) -> pb.CancelJobResponse:
        who = caller()
        if who is not None and who.role != ADMIN:
            owner = self.core.book.get(request.job_id).submitted_by
            if owner != who.name:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{who} may not cancel job {request.job_id} of {owner or 'another user'}: "
                                    f"cancelling another user's job needs the admin role")
        job = self.core.cancel(request.job_id, request.reason)
        return pb.CancelJobResponse(job=self._job(job.id))

    @_answers
    async def ListNodes(self, request: pb.ListNodesRequest, context: grpc.aio.ServicerContext) -> pb.ListNodesResponse:
        return pb.ListNodesResponse(nodes=[convert.node_to_pb(node) for node in self.core.shown.nodes()])

    @_answers
    async def StartWorkers(self, request: pb.StartWorkersRequest,
                           context: grpc.aio.ServicerContext) -> pb.StartWorkersResponse:
        """A worker pool for the general queue on a new allocation (``ctl slurm workers``)."""
        who = caller()
        pool = self.core.pools.start(convert.allocation_request_from_pb(request.allocation), request.nodes,
                                     request.slots, requested_by=who.name if who else "")
        return pb.StartWorkersResponse(pool=pool_to_pb(pool))

    @_answers
    async def ReleaseWorkers(self, request: pb.ReleaseWorkersRequest,
                             context: grpc.aio.ServicerContext) -> pb.ReleaseWorkersResponse:
        """Drain a worker pool's nodes, then let its workers go (``ctl slurm release``)."""
        return pb.ReleaseWorkersResponse(pool=pool_to_pb(self.core.pools.release(request.id,
                                                                                         request.reason)))

    @_answers
    async def ListWorkerPools(self, request: pb.ListWorkerPoolsRequest,
                              context: grpc.aio.ServicerContext) -> pb.ListWorkerPoolsResponse:
        return pb.ListWorkerPoolsResponse(pools=[pool_to_pb(p) for p in self.core.pools.listing()])

    @_answers
    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        return await asyncio.to_thread(self.info)

    @_answers
    async def DrainNode(self, request: pb.DrainNodeRequest, context: grpc.aio.ServicerContext) -> pb.DrainNodeResponse:
        """Drain: ``jobs`` are the jobs that move off the node. Undrain: the jobs it may run again (its
        exclusions, cleared). ``node`` is the node afterwards."""
        if request.undrain:
            jobs = self.core.undrain(request.node)
        else:
            jobs = [job.id for job in self.core.drain(request.node, request.reason)]
        return pb.DrainNodeResponse(node=convert.node_to_pb(self.core.shown.node(request.node)), jobs=jobs)

    @_answers
    async def PlanJob(self, request: pb.PlanJobRequest, context: grpc.aio.ServicerContext) -> pb.PlanJobResponse:
        layout, spec = await _off_loop(self.core.plan, request.spec_yaml, list(request.overrides),
                                       request.source or "job file")
        return convert.plan_to_pb(layout, spec)

    @_answers
    async def GetJobSchema(self, request: pb.GetJobSchemaRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetJobSchemaResponse:
        """The job file's JSON Schema: built once (tens of ms, on a worker thread), then cached."""
        return await _off_loop(convert.job_schema_to_pb)

    @_answers
    async def StatBlob(self, request: pb.StatBlobRequest, context: grpc.aio.ServicerContext) -> pb.StatBlobResponse:
        size = self.blobs.size(request.digest)
        return pb.StatBlobResponse(exists=size is not None, size=size or 0)

    @_answers
    async def UploadBlob(self, request_iterator: AsyncIterator[pb.BlobChunk],
                         context: grpc.aio.ServicerContext) -> pb.BlobRef:
        """The first chunk names the digest and the size; the blob is stored once, verified."""
        chunks = request_iterator.__aiter__()
        first = await anext(chunks, None)
        if first is None:
            raise InvalidRequest("an upload needs at least one chunk naming its digest and size")
        who = caller()  # the blob is charged to its first uploader's quota
        size = await self.blobs.put(first.digest, first.size, _upload_chunks(first, chunks),
                                    owner=who.name if who else "")
        log.info("blob.stored", digest=first.digest, size=size)
        return pb.BlobRef(digest=first.digest, size=size)

    async def WatchJob(self, request: pb.WatchJobRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.JobEvent]:
        """Stored events after ``after_seq``, then live ones, until the job is terminal; one per message."""
        try:
            job_id, seq = self.core.get(request.job_id).id, request.after_seq
            while True:
                wake = self.core.signals.arm(job_id)
                done = is_terminal(self.core.get(job_id).state)  # read before the events: the final one is included
                while True:
                    chunk = self.core.events(job_id, seq, EVENT_CHUNK)
                    for ev in chunk:
                        seq = ev.seq
                        yield convert.event_to_pb(ev)
                    if len(chunk) < EVENT_CHUNK:
                        break
                if done:
                    return
                await self.core.signals.wait(wake, FOLLOW_POLL_S)
        except Exception as exc:
            await _abort(context, exc)

    async def WatchJobBatches(self, request: pb.WatchJobRequest,
                              context: grpc.aio.ServicerContext) -> AsyncIterator[pb.JobEventBatch]:
        """Events after ``after_seq`` in batches, each with the job's state and summary, until terminal.

        The first batch comes at once (it may hold no events); later ones only with events. A batch
        holds what one read of at most BATCH_EVENTS gives. ``min_interval`` > 0 spaces batches by that
        many seconds and keeps only the newest of consecutive step events; a backlog (the last read
        was full) and the job's end are sent without waiting, so a watcher of a long history catches up
        at once and one waiting for the end returns with it.
        """
        try:
            interval = request.min_interval
            if not (math.isfinite(interval) and interval >= 0):
                raise InvalidRequest(f"min_interval={interval} must be a number of seconds, 0 or more")
            job_id, seq = self.core.get(request.job_id).id, request.after_seq
            sent, behind = None, False
            while True:
                if interval and sent is not None and not behind:
                    await self._spaced(job_id, sent + interval)
                wake = self.core.signals.arm(job_id)
                job = self.core.get(job_id)  # state, events and summary read together, with no await between
                read = self.core.events(job_id, seq, BATCH_EVENTS)
                events = coalesce_steps(read) if interval else read
                done = is_terminal(job.state)
                if events or sent is None:
                    batch = self._batch(job, events)
                    behind = len(read) == BATCH_EVENTS or len(batch.events) < len(events)
                    seq = batch.events[-1].seq if batch.events else seq
                    yield batch
                    sent = time.monotonic()
                else:
                    behind = False
                if done and not behind:
                    return
                if not behind:
                    await self.core.signals.wait(wake, FOLLOW_POLL_S)
        except Exception as exc:
            await _abort(context, exc)

    async def _spaced(self, job_id: str, until: float) -> None:
        """Wait until ``until`` (monotonic) between two batches, but no longer than the job runs: its end is
        sent at once, so that a follower returns when the job does (each wake-up is one state read)."""
        while (left := until - time.monotonic()) > 0:
            wake = self.core.signals.arm(job_id)
            if is_terminal(self.core.get(job_id).state):
                return
            await self.core.signals.wait(wake, left)

    async def GetLogs(self, request: pb.GetLogsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LogLine]:
        """A rank's (or every rank's) log, read from the nodes that ran them; ``follow`` until terminal."""
        try:
            async for line in get_logs(self.core, request):
                yield line
        except Exception as exc:
            await _abort(context, exc)
