"""Checkpoint and snapshot replication between nodes: a node's lost shards survive on a peer.

A train rank writes each checkpoint step under its node's ``{state}/checkpoints/{job name}``, and
each in-memory snapshot (``train.snapshot_every``) under the node's tmpfs snapshot root
(``contract.files.checkpoints``). Two areas of files (``AREAS``; the wire's ``root``: ``""`` checkpoints,
``"snapshots"``; "kind" is kept for job kinds), handled alike: each daemon pushes the newest complete step of each of its ranks,
of each area, to the job's *replica peer* (``Assign.replica_peer``: the next node of the job), which
keeps checkpoints under ``{state}/replicas/{job name}`` and snapshots in its own memory
(``contract.files.checkpoints.snapshot_replica_root``), the newest ``KEEP_STEPS`` steps of each rank; a
step that arrives drops the rank's newer steps there (they belong to an earlier run or attempt).
When a node replaces a lost one, its Assign names a ``restore_peer`` that holds those ranks' files
(the lost node's peer, or a node that ran them before), and the daemon fetches, of each area, the
newest step complete and intact (checksums) for all of its ranks into its own roots before they start; they then resume
(a restart's ranks agree on the newest step every rank holds in either root). A node without
them starts over. Each damaged step the peer passes over is logged there and sent back (GetShards' trailing
metadata, ``PASSED_METADATA``); the fetching node logs it and puts it on the job's record (``worker.replication.replication``).

Files travel as ``ShardChunk`` streams (1 MiB chunks, the .pt first, then its done-marker), are
written to a temporary name and renamed, and every name from the wire is checked before it
becomes a path. File IO runs on worker threads, never on the daemon's event loop. A peer without room
for a pushed step (past its snapshot memory bound, ``worker.files.snapmem``, or out of space) keeps nothing
partial and answers RESOURCE_EXHAUSTED; the sender does not push that step again, a newer one it does. Files are
written, renamed and removed through no symbolic link below the peer's state dir or snapshot memory
(``contract.files.safepath``: the job name is a user's value); a link planted there is refused, FAILED_PRECONDITION
naming it, and not pushed to again before a newer step.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable

import grpc
import structlog

from rankctl.contract.files import checkpoints as layout
from rankctl.contract.files import safepath
from rankctl.contract.names import job_name_problem
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc as pb_grpc
from rankctl.worker.replication.peerchannels import PeerChannels, peer_channel
from rankctl.worker.uplink.relay import RelayInbox, serve_deliver, serve_forward
from rankctl.worker.replication.shardstore import AREAS, SNAPSHOTS, ShardStore

__all__ = ["AREAS", "SNAPSHOTS", "BadShard", "NoRoom", "PeerServicer", "Replicator", "ShardStore",
           "restore"]   # the store's names re-exported: what this module serves and pushes

if TYPE_CHECKING:
    from rankctl.worker.files.snapmem import Bound

log = structlog.get_logger("rankctl.worker")
CHUNK = 1 << 20
FILES = ("pt", "done")
MAX_RANK = 1 << 20
PASSED_METADATA = "rankctl-passed-over-bin"  # GetShards' trailing metadata: the damaged steps the peer passed over
PASSED_SHOWN, PASSED_CHARS = 4, 4000         # ... at most these lines and characters


class BadShard(ValueError):
    """A chunk whose names cannot be paths (or a request for nothing)."""


class NoRoom(OSError):
    """A pushed file does not fit (the snapshot memory bound, ``worker.files.snapmem``, or no space): a failed write."""


def _check(name: str, step: int, rank: int, file: str, area: str = "") -> None:
    problem = job_name_problem(name, "job_name")
    if problem:
        raise BadShard(problem)
    if not 0 <= step < 10 ** 8 or not 0 <= rank < MAX_RANK or file not in FILES:
        raise BadShard(f"step={step}, rank={rank}, file={file!r}: not a checkpoint file")
    if area not in AREAS:
        raise BadShard(f"root={area[:40]!r}: not one of {AREAS}")


def _path(root: str, step: int, rank: int, file: str) -> str:
    return layout.rank_file(root, step, rank) if file == "pt" else layout.marker_file(root, step, rank)


class _Writer:
    """Chunks in, files out (temporary name, renamed on the last chunk). ``bound``: the node's snapshot memory
    bound; when only accounted, the snapshot files under it are counted once a stream (the ranks write theirs
    from other processes), then this stream's chunks are added as they come."""

    def __init__(self, root_of, base_of, dropped=lambda name: False,  # noqa: ANN001
                 bound: Bound | None = None) -> None:
        self.root_of, self.base_of, self.dropped = root_of, base_of, dropped  # base_of(area): ShardStore.base
        self.f, self.tmp, self.final, self.base, self.files = None, "", "", "", 0
        self.markers: dict[tuple[str, str], dict[int, int]] = {}  # (name, area) -> rank -> step of a marker
        self.written: set[tuple[str, str, int, int]] = set()   # (base, root, step, rank) of every file written
        self.bound, self.in_use, self.incoming = bound, -1, 0  # in_use: counted at the first snapshot chunk

    def feed(self, c: pb.ShardChunk) -> None:
        """One chunk; NoRoom when it does not fit (the caller aborts: nothing partial stays)."""
        if c.root == SNAPSHOTS and self.bound is not None and self.bound.accounted:
            if self.in_use < 0:
                self.in_use = self.bound.in_use()
            if self.in_use + self.incoming + len(c.data) > self.bound.limit:
                raise NoRoom(self.bound.full(self.in_use, self.incoming + len(c.data)))
        try:
            self._write(c)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            if c.root == SNAPSHOTS and self.bound is not None:
                raise NoRoom(self.bound.full(self.bound.in_use(), len(c.data))) from exc
            raise NoRoom(f"no space left for {self.final}: {exc.strerror}") from exc
        self.incoming += len(c.data) if c.root == SNAPSHOTS else 0

    def _write(self, c: pb.ShardChunk) -> None:
        if self.f is None:
            _check(c.job_name, c.step, c.rank, c.file, c.root)
            if c.root == SNAPSHOTS and self.dropped(c.job_name):
                raise BadShard(f"the snapshots of {c.job_name} were dropped here: its run ended")
            self.base = self.base_of(c.root)
            self.final = _path(self.root_of(c.job_name, c.root), c.step, c.rank, c.file)
            self.tmp = f"{self.final}.part"   # through no link below the state dir or snapshot memory (the name's)
            self.f = open(safepath.open_write(self.base, self.tmp, create_dirs=True), "wb")  # noqa: SIM115
        self.f.write(c.data)
        if c.last:
            self.f.close()
            safepath.replace(self.base, self.tmp, self.final)
            self.f, self.files = None, self.files + 1
            self.written.add((self.base, self.root_of(c.job_name, c.root), c.step, c.rank))
            if c.file == "done":
                self.markers.setdefault((c.job_name, c.root), {})[c.rank] = c.step

    def drop_incomplete(self) -> None:
        """Files this stream wrote for a rank's step whose marker never came (the sender stopped half-way, e.g.
        its run ended and dropped its snapshots while pushing): useless to any restore, and in the peer's
        memory for snapshots; removed."""
        for base, root, step, rank in self.written:
            if layout.read_marker(root, step, rank) is None:
                layout.remove_rank_step(root, step, rank, base=base)

    def abort(self) -> None:
        self.drop_incomplete()
        if self.f is not None:
            with contextlib.suppress(OSError):  # a full filesystem refuses the buffered rest: it goes anyway
                self.f.close()
            self.f = None
            with contextlib.suppress(OSError):
                safepath.unlink(self.base, self.tmp)
            with contextlib.suppress(OSError):
                safepath.rmdir(self.base, os.path.dirname(self.tmp))  # a step directory made for nothing else


def _chunks(name: str, step: int, rank: int, root: str, area: str = "") -> Iterable[pb.ShardChunk]:
    for file in FILES:
        with open(_path(root, step, rank, file), "rb") as f:
            data = f.read(CHUNK)
            while True:
                nxt = f.read(CHUNK)
                yield pb.ShardChunk(job_name=name, step=step, rank=rank, file=file, data=data, last=not nxt,
                                    root=area)
                if not nxt:
                    break
                data = nxt


async def _threaded(chunks: Iterable[pb.ShardChunk]) -> AsyncIterator[pb.ShardChunk]:
    it = iter(chunks)
    while (c := await asyncio.to_thread(next, it, None)) is not None:
        yield c


class PeerServicer(pb_grpc.PeerServiceServicer):
    """Serves this node's shards to peers and keeps the copies they push. ``identify(context)``: the
    caller's certificate identity (mutual TLS), when given only nodes are served."""

    def __init__(self, store: ShardStore, identify=None, bound: Bound | None = None,  # noqa: ANN001
                 relay: RelayInbox | None = None) -> None:
        self.store, self.identify, self.bound = store, identify, bound  # identify: context -> Identity | None
        self.relay = relay   # relayed items for this node (``worker.uplink.relay``); None: none taken

    async def Deliver(self, request: pb.DeliverRequest, context) -> pb.DeliverResponse:  # noqa: ANN001, N802 - gRPC
        await self._admit(context)
        if self.relay is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node takes no relayed items")
        return await serve_deliver(self.relay, request, context)

    async def Forward(self, request: pb.ForwardRequest, context) -> pb.ForwardResponse:  # noqa: ANN001, N802 - gRPC
        await self._admit(context)
        if self.relay is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node carries no relayed batches")
        return await serve_forward(self.relay, request, context)

    async def _admit(self, context) -> None:  # noqa: ANN001
        if self.identify is None:
            return
        try:
            who = self.identify(context)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"not a rankctl identity: {exc}")
        if who is None or who.kind != "node":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{who or 'an anonymous caller'} is not a node: "
                                "only nodes exchange checkpoint shards")

    async def PutShards(self, request_iterator, context):  # noqa: ANN001, ANN201, N802 - gRPC
        await self._admit(context)
        writer = _Writer(self.store.replica_root, self.store.base, self.store.dropped, self.bound)
        try:
            async for chunk in request_iterator:
                await asyncio.to_thread(writer.feed, chunk)
        except BadShard as exc:
            writer.abort()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoRoom as exc:  # the steps completed before it stay (and are pruned); the rest goes
            await asyncio.to_thread(self._settle, writer, True)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except safepath.UnsafePath as exc:   # a link planted where the job name's files go: nothing written there
            await asyncio.to_thread(self._settle, writer, True)
            log.warning("replica refused", error=exc.strerror)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, exc.strerror)
        except BaseException:
            writer.abort()
            raise
        await asyncio.to_thread(self._settle, writer, False)
        return pb.PutShardsResponse(files=writer.files)

    def _settle(self, writer: _Writer, aborted: bool) -> None:
        """A stream's end: its incomplete steps dropped, the kept copies of the ranks that arrived pruned."""
        if aborted:
            writer.abort()
        else:
            writer.drop_incomplete()
        for (name, area), arrived in writer.markers.items():
            self.store.prune(name, area, arrived)

    async def GetShards(self, request, context):  # noqa: ANN001, ANN201, N802 - gRPC
        await self._admit(context)
        ranks, area = list(request.ranks), request.root
        try:
            for r in ranks or [-1]:
                _check(request.job_name, 0, r, "pt", area)
        except BadShard as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        passed: list[str] = []
        found = await asyncio.to_thread(self.store.newest, request.job_name, ranks, area, request.job_id, passed)
        for line in passed:
            log.warning("checkpoint passed over", job_name=request.job_name, ranks=ranks, detail=line)
        if passed:   # the fetching node names them on the job's record (``restore``)
            context.set_trailing_metadata(((PASSED_METADATA, passed_text(passed)),))
        if found is None:
            return
        step, where = found
        for r in ranks:
            async for chunk in _threaded(_chunks(request.job_name, step, r, where[r], area)):
                yield chunk


class Replicator:
    """Pushes the newest complete step of each of this node's ranks, checkpoints and snapshots, to
    their replica peer, once."""

    def __init__(self, store: ShardStore, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.store, self.credentials = store, credentials
        self.channels = PeerChannels(credentials)                # one per peer, kept between rounds
        self._pushed: dict[tuple[str, str, str, int], int] = {}  # (peer, job name, area, rank) -> newest step pushed
        self._refused: dict[tuple[str, str, str, int], int] = {}  # ... -> newest step the peer had no room for
        self._busy: set[str] = set()                             # peers with a push in flight
        self._waiting: dict[str, dict[str, list[int]]] = {}      # peer -> job name -> ranks: rounds asked for

    def due(self, peer: str, name: str, ranks: Iterable[int]) -> list[tuple[str, int, int]]:
        """(area, rank, step) whose newest complete step has not reached ``peer`` (blocking: a thread).
        A newest step below the one pushed last is pushed too: a new run under the name started over. A step
        the peer had no room for is not pushed again; a newer one is."""
        out, ranks = [], list(ranks)
        for area in AREAS:
            root = self.store.own_root(name, area)
            for r in ranks:
                steps = layout.complete_for(root, [r])
                key = (peer, name, area, r)
                if steps and steps[-1] not in (self._pushed.get(key), self._refused.get(key)):
                    out.append((area, r, steps[-1]))
        return out

    async def push(self, peer: str, name: str, ranks: list[int]) -> None:
        """A push round of ``name``'s new steps to ``peer``. Asked for while a round to that peer is in flight,
        it runs right after that one: a save's wake (``worker.replication.savewake``) is never lost to a busy peer."""
        waiting = self._waiting.setdefault(peer, {})
        waiting[name] = sorted(ranks)
        if peer in self._busy:
            return
        self._busy.add(peer)
        try:
            while waiting:
                await self._round(peer, *waiting.popitem())
        finally:
            self._busy.discard(peer)
            if not waiting:
                self._waiting.pop(peer, None)

    async def _round(self, peer: str, name: str, ranks: list[int]) -> None:
        due: list[tuple[str, int, int]] = []
        try:
            due = await asyncio.to_thread(self.due, peer, name, ranks)
            if not due:
                return

            def all_chunks() -> Iterable[pb.ShardChunk]:
                for area, r, step in due:
                    yield from _chunks(name, step, r, self.store.own_root(name, area), area)

            channel = self.channels.get(peer, self._busy)
            await pb_grpc.PeerServiceStub(channel).PutShards(_threaded(all_chunks()), timeout=300)
            for area, r, step in due:
                self._pushed[(peer, name, area, r)] = step
            log.info("checkpoint replicated", peer=peer, job_name=name,
                     steps={area or "checkpoints": sorted({s for k, _, s in due if k == area}) for area in AREAS
                            if any(k == area for k, _, _ in due)})
        except (grpc.aio.AioRpcError, OSError) as exc:
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self._refuse(peer, name, due)   # the peer answered: its channel is fine
            elif code == grpc.StatusCode.FAILED_PRECONDITION:   # a link where the peer keeps them: not again
                self._refused.update(((peer, name, k, r), step) for k, r, step in due)
            else:
                self.channels.forget(peer)
            log.warning("checkpoint replication failed", peer=peer, job_name=name,
                        error=exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc))

    def _refuse(self, peer: str, name: str, due: list[tuple[str, int, int]]) -> None:
        """The peer had no room for this push: its snapshot steps (the stream's first files), or its checkpoint
        steps when it had none, are not pushed again, so the next round sends the rest alone."""
        area = SNAPSHOTS if any(k == SNAPSHOTS for k, _, _ in due) else ""
        for k, r, step in due:
            if k == area:
                self._refused[(peer, name, k, r)] = step


def passed_text(lines: list[str]) -> bytes:
    """The lines of ``PASSED_METADATA``, bounded."""
    return "\n".join(lines[:PASSED_SHOWN]).encode()[:PASSED_CHARS]


async def restore(store: ShardStore, peer: str, name: str, ranks: list[int], timeout: float = 300.0,
                  credentials: grpc.ChannelCredentials | None = None, job_id: str = "",
                  passed: list[str] | None = None) -> int | None:
    """Fetch, of checkpoints and of snapshots, the newest step ``peer`` holds for all of ``ranks`` into this node's
    own roots; the newer of the two steps (None when the peer has neither). With ``job_id``, that job's newest
    step, else (it wrote none there yet: a job resuming another's) any job's: an earlier job of the same name may
    have left newer steps of these ranks on the peer, which the restarting ranks would not take. The damaged
    steps the peer passed over go on ``passed``, one line each."""
    writer = _Writer(store.own_root, store.base)
    steps: list[int] = []
    try:
        async with peer_channel(peer, credentials) as channel:
            stub = pb_grpc.PeerServiceStub(channel)
            for area in AREAS:
                for which in dict.fromkeys([job_id, ""]):
                    call = stub.GetShards(pb.GetShardsRequest(job_name=name, ranks=ranks, root=area, job_id=which),
                                          timeout=timeout)
                    got = False
                    async for chunk in call:
                        if chunk.root != area:
                            raise BadShard(f"asked for root={area!r}, got a chunk of root={chunk.root[:40]!r}")
                        await asyncio.to_thread(writer.feed, chunk)
                        steps.append(chunk.step)
                        got = True
                    if passed is not None:   # (a step asked for twice, the job's and any job's, named once)
                        passed += [line for line in _passed_lines(await call.trailing_metadata()) if line not in passed]
                    if got:
                        break
    except BaseException:
        writer.abort()
        raise
    return max(steps, default=None)


def _passed_lines(metadata: Any) -> list[str]:
    """The peer's ``PASSED_METADATA`` lines (none from a peer that sends none)."""
    raw = dict(metadata or ()).get(PASSED_METADATA, b"")
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return [line for line in text[:PASSED_CHARS].splitlines() if line][:PASSED_SHOWN]
