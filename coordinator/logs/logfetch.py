"""Rank logs live on the nodes: the coordinator reads them from the owning daemon (FetchLogs).

``LogFetcher`` pairs each FetchLogs sent down a node's stream with the LogChunk that node
answers; ``get_logs`` serves ClientService.GetLogs from it, rank by rank. Nothing is stored
here: a lost node's ranks get a marker line (and their last reported error) instead of lines.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

from rankctl.coordinator.model.errors import InvalidRequest, ProtocolError
from rankctl.coordinator.fleet.nodes import NodeStatus
from rankctl.coordinator.model.states import is_terminal
from rankctl.parallel.placement import node_of_rank
from rankctl.proto import rankctl_pb2 as pb

MAX_LINES = 5000            # lines per FetchLogs answer, and the largest tail a client may ask
MAX_OUTSTANDING = 10_000    # FetchLogs awaiting an answer, all nodes together
PIPELINE = 8                # ranks whose first chunk is requested ahead of the one being sent
FIRST_PASS_CHUNKS = 1024    # chunks read from one rank in a call's first pass (~1 GiB), then on
FOLLOW_CHUNKS = 8           # chunks read from one rank per follow round: a chatty rank starves none
FOLLOW_POLL_S = 0.5         # a follow round at most this often
SLICE_S = 1.0               # a node's answer is waited for in slices of this (``LogFetcher._answer``)

Send = Callable[[str, pb.CoordinatorMessage], bool]


class LogsUnavailable(ProtocolError):
    """A node could not be asked for a log, or did not answer (FAILED_PRECONDITION)."""


@dataclass
class _Request:
    node: str
    rank: int
    future: asyncio.Future


class LogFetcher:
    """Outstanding FetchLogs requests, answered by the nodes' LogChunk messages.

    ``send(node, msg)`` puts a message in a connected node's outbox (False: not connected).
    Call everything from the event loop thread.
    """

    def __init__(self, send: Send, timeout: float = 10.0, max_outstanding: int = MAX_OUTSTANDING) -> None:
        self._send, self.timeout, self.max_outstanding = send, timeout, max_outstanding
        self._ids = itertools.count(1)
        self._pending: dict[int, _Request] = {}

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    async def fetch(self, node: str, job_id: str, attempt: int, rank: int, *, offset: int = 0, tail: int = 0,
                    max_lines: int = MAX_LINES, records: bool = False) -> pb.LogChunk:
        """The node's answer (its own read errors in ``chunk.error``); LogsUnavailable when the node is
        not connected, does not answer within ``timeout``, or is lost meanwhile (``fail_node``).
        ``records``: rankctl's own record lines too (default: only what the program printed)."""
        if len(self._pending) >= self.max_outstanding:
            raise LogsUnavailable(f"{len(self._pending)} log reads are in flight; try again")
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = _Request(node, rank, future)
        try:
            msg = pb.CoordinatorMessage(fetch_logs=pb.FetchLogs(
                request_id=rid, job_id=job_id, attempt=attempt, rank=rank, offset=offset, tail=tail,
                max_lines=max_lines, records=records))
            if not self._send(node, msg):
                raise LogsUnavailable(f"node {node} is LOST")
            return await self._answer(node, future)
        finally:
            self._pending.pop(rid, None)

    async def _answer(self, node: str, future: asyncio.Future) -> pb.LogChunk:
        """The node's answer, waited for in slices of ``SLICE_S``: a slice stretched by the coordinator's own stall
        (SIGSTOP, a blocked loop) counts as ``SLICE_S`` only, so that an answer that waits in the socket while the
        coordinator stood still is not taken for a node that did not answer."""
        loop, left = asyncio.get_running_loop(), self.timeout
        while True:
            began = loop.time()
            try:
                return await asyncio.wait_for(asyncio.shield(future), min(SLICE_S, left))
            except asyncio.TimeoutError:
                left -= min(loop.time() - began, SLICE_S)
                if left <= 1e-3:
                    raise LogsUnavailable(f"node {node} did not answer within {self.timeout:g}s") from None

    def deliver(self, node: str, chunk: pb.LogChunk) -> None:
        """A node's LogChunk: it resolves its request only if that request went to ``node``."""
        req = self._pending.get(chunk.request_id)
        if req is None or req.node != node or req.future.done():
            return  # unknown, timed out, or another node's request: ignored
        del self._pending[chunk.request_id]
        req.future.set_result(chunk)

    def fail_node(self, node: str, why: str) -> None:
        """``node``'s stream is gone: its outstanding requests fail now, with ``why`` (a phrase such as
        "node n1 is LOST") as their reason, instead of timing out."""
        for rid, req in list(self._pending.items()):
            if req.node == node:
                del self._pending[rid]
                if not req.future.done():
                    req.future.set_exception(LogsUnavailable(why or f"node {node} is LOST"))


# -- GetLogs ---------------------------------------------------------------------------------
@dataclass
class _Reading:
    """One GetLogs call: the job as last read, each rank's next offset, what could not be read.

    ``tail`` applies to the call's first pass only. Within a pass, a rank marked unreachable (``gone``) is not
    asked again and a node that could not be asked (``down``) is not asked for its other ranks; a follow round
    (``refresh``) asks again those whose node is connected, and a rank's marker lines come once an outage
    (``marked``) (before, one node answer late, or a coordinator that stood still for 10 s, ended following that
    rank for the rest of the call).
    """

    core: Any                   # get(), book.ranks(), logfetch
    job: Any                    # a JobRecord
    tail: int
    records: bool = False       # rankctl's own record lines too
    offsets: dict[int, int] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)
    down: dict[str, LogsUnavailable] = field(default_factory=dict)
    marked: set[int] = field(default_factory=set)   # ranks whose marker was sent and whose log has not come back
    attempt: int = 0            # the attempt being read (0: the job's current one)
    old_nodes: list[str] = field(default_factory=list)   # an earlier attempt's nodes, while it is read
    old_of: int = 0             # the attempt ``old_nodes`` are of

    def __post_init__(self) -> None:
        self.attempt = self.attempt or self.job.attempt

    def _nodes(self) -> list[str]:
        """The nodes of the attempt being read: the job's, or an ended attempt's as stored (read once)."""
        if self.attempt == self.job.attempt:
            return self.job.nodes
        if self.old_of != self.attempt:
            self.old_nodes, self.old_of = self.core.store.attempts.nodes(self.job.id, self.attempt), self.attempt
        return self.old_nodes

    def node_of(self, rank: int) -> str | None:
        k, nodes = node_of_rank(rank, self.job.slots_per_node), self._nodes()
        return nodes[k] if k < len(nodes) else None

    def ranks(self, request: pb.GetLogsRequest) -> range:
        """The ranks a pass reads: the one asked for, or every rank of the attempt being read."""
        return range(len(self._nodes()) * self.job.slots_per_node) if request.all_ranks \
            else range(request.rank, request.rank + 1)

    @property
    def behind(self) -> bool:
        """An earlier attempt than the job's is being read (``GetLogsRequest.from_attempt``)."""
        return self.attempt < self.job.attempt

    def refresh(self, every: bool = False) -> None:
        """Read the job again; a new attempt starts every rank's log afresh (``every``: only once the earlier
        attempts were read to their ends, ``next_attempt``)."""
        job = self.core.get(self.job.id)   # the live record: it changes in place
        self.job = job
        if job.attempt != self.attempt and not every:
            self._switch(job.attempt)
        self.down.clear()
        self.gone = {r for r in self.gone if not self._connected(self.node_of(r))}

    def next_attempt(self) -> None:
        """On to the attempt after the one read to its end."""
        self._switch(self.attempt + 1)

    def _switch(self, attempt: int) -> None:
        self.attempt = attempt
        self.offsets.clear()
        self.gone.clear()
        self.marked.clear()

    def _connected(self, node: str | None) -> bool:
        session = self.core.nodes.get(node) if node is not None else None
        return session is not None and session.status == NodeStatus.READY

    async def first(self, rank: int) -> pb.LogChunk | LogsUnavailable:
        """The rank's first chunk of a pass."""
        return await self._fetch(rank, self.offsets.get(rank, 0), self.tail)

    async def _fetch(self, rank: int, offset: int, tail: int) -> pb.LogChunk | LogsUnavailable:
        node = self.node_of(rank)
        if node in self.down:
            return await self._archived(rank, offset, tail) or self.down[node]
        try:
            return await self.core.logfetch.fetch(node, self.job.id, self.attempt, rank, offset=offset,
                                                  tail=tail, max_lines=MAX_LINES, records=self.records)
        except LogsUnavailable as exc:
            self.down.setdefault(node, exc)
            return await self._archived(rank, offset, tail) or exc

    async def _archived(self, rank: int, offset: int, tail: int) -> pb.LogChunk | None:
        """What the coordinator kept of the rank's log before its node left (``logarchive``), or None."""
        archive = getattr(self.core, "logarchive", None)
        if archive is None:
            return None
        return await asyncio.to_thread(archive.chunk, self.job.id, self.attempt, rank, offset, tail,
                                       self.records)

    async def lines(self, rank: int, first: pb.LogChunk | LogsUnavailable,
                    max_chunks: int) -> AsyncIterator[pb.LogLine]:
        """The lines of ``first`` and of up to ``max_chunks - 1`` more chunks while the offset advances."""
        chunk, was_tail = first, self.tail > 0
        for n in itertools.count(1):
            if isinstance(chunk, LogsUnavailable) or chunk.error:
                for text in self._marker(rank, chunk):
                    yield self._line(rank, text)
                return
            self.marked.discard(rank)
            for text in chunk.lines:
                yield self._line(rank, text)
            before, self.offsets[rank] = self.offsets.get(rank, 0), chunk.next_offset
            if was_tail or n >= max_chunks or chunk.next_offset == before:
                return
            chunk = await self._fetch(rank, chunk.next_offset, 0)

    def _line(self, rank: int, text: str) -> pb.LogLine:
        return pb.LogLine(rank=rank, line=text, attempt=self.attempt)

    def _marker(self, rank: int, why: pb.LogChunk | LogsUnavailable) -> list[str]:
        """Why the rank's log cannot be shown, and the last error the rank reported (once an outage); asked no more
        in this pass."""
        self.gone.add(rank)
        if rank in self.marked:
            return []
        self.marked.add(rank)
        node = self.node_of(rank)
        if isinstance(why, LogsUnavailable):
            out = [f"[rankctl: {why}; the log of rank {rank} is on that node]"]
        else:
            out = [f"[rankctl: node {node} cannot read the log of rank {rank}: {why.error}]"]
        record = self.core.book.ranks(self.job.id).get(rank)
        error = getattr(record, "error", "") if record is not None else ""
        if error:
            out += [f"[rankctl: rank {rank} last reported: {text}]" for text in error.splitlines() or [error]]
        return out


async def _pass(reading: _Reading, ranks: Iterator[int], max_chunks: int) -> AsyncIterator[pb.LogLine]:
    """Every rank's lines in rank order; the first chunks of the next ``PIPELINE`` ranks are asked ahead."""
    window: deque[tuple[int, asyncio.Task]] = deque()

    def fill() -> None:
        while len(window) < PIPELINE:
            rank = next(ranks, None)
            if rank is None:
                return
            if rank not in reading.gone and reading.node_of(rank) is not None:
                window.append((rank, asyncio.ensure_future(reading.first(rank))))

    try:
        fill()
        while window:
            rank, task = window.popleft()
            fill()
            async for line in reading.lines(rank, await task, max_chunks):
                yield line
    finally:
        for _, task in window:
            task.cancel()


def _check(job: Any, request: pb.GetLogsRequest) -> None:
    if request.tail < 0 or request.tail > MAX_LINES:
        raise InvalidRequest(f"tail {request.tail} must be between 0 and {MAX_LINES} lines")
    if request.from_attempt < 0:
        raise InvalidRequest(f"from_attempt {request.from_attempt} must be 0 (the current attempt) or an attempt")
    if not request.all_ranks and not 0 <= request.rank < job.world_size:
        raise InvalidRequest(f"rank {request.rank} is not a rank of job {job.id} (world size {job.world_size})")


async def get_logs(core: Any, request: pb.GetLogsRequest, *,
                   poll_s: float = FOLLOW_POLL_S) -> AsyncIterator[pb.LogLine]:
    """The log of one rank (or of every rank, in rank order) of the job's current attempt, from its nodes.

    What the program printed; with ``records``, rankctl's own record lines too (``contract.files.logrecords``).
    ``tail``: the last lines per rank, else each whole log. ``follow``: then new lines every
    ``poll_s`` until the job is terminal, with one last round after that; with ``from_attempt`` too, from that
    attempt on, each read to its end before the next (what a rank printed before a restart is not skipped). A job
    not placed yet has no lines (with ``follow``: until it is placed). Raises JobNotFound/AmbiguousJob/InvalidRequest;
    an unreachable node never fails the call (see ``_Reading._marker``).
    """
    job = core.get(request.job_id)
    _check(job, request)
    every = request.follow and request.from_attempt > 0
    reading = _Reading(core, job, request.tail, request.records, attempt=min(request.from_attempt, job.attempt))
    done = is_terminal(job.state)  # read before each round (the record changes in place): the last round
    async for line in _pass(reading, iter(reading.ranks(request)), FIRST_PASS_CHUNKS):  # begins after the job ended
        yield line
    reading.tail = 0
    while request.follow and (not done or reading.behind):
        if not reading.behind:
            await asyncio.sleep(poll_s)
        reading.refresh(every)
        done = is_terminal(reading.job.state)
        if reading.behind:   # the earlier attempt's last lines, then the next one's from its start
            async for line in _pass(reading, iter(reading.ranks(request)), FIRST_PASS_CHUNKS):
                yield line
            reading.next_attempt()
        async for line in _pass(reading, iter(reading.ranks(request)), FOLLOW_CHUNKS):
            yield line
