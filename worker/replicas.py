"""Checkpoint replication between nodes: a node's lost shards survive on a peer.

A train rank writes each checkpoint step under its node's ``{state}/checkpoints/{job name}``
(``contract.checkpoints``). Each daemon pushes the newest complete step of each of its ranks to
the job's *replica peer* (``Assign.replica_peer``: the next node of the job), which keeps them under
``{state}/replicas/{job name}`` (the newest ``KEEP_STEPS`` steps). When a node replaces a lost
one, its Assign names a ``restore_peer`` that holds those ranks' files (the lost node's peer,
or a node that ran them before), and the daemon fetches the newest step complete for all of its
ranks into its own checkpoint root before they start; they then resume from it (a restart's
ranks agree on the newest step every rank has). A node without them starts over.

Files travel as ``ShardChunk`` streams (1 MiB chunks, the .pt first, then its done-marker), are
written to a temporary name and renamed, and every name from the wire is checked before it
becomes a path. File IO runs on worker threads, never on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import AsyncIterator, Iterable

import grpc
import structlog

from rankctl.contract import checkpoints as layout
from rankctl.contract.names import job_name_problem
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc as pb_grpc

log = structlog.get_logger("rankctl.worker")
CHUNK = 1 << 20
KEEP_STEPS = 2
FILES = ("pt", "done")
MAX_RANK = 1 << 20


class BadShard(ValueError):
    """A chunk whose names cannot be paths (or a request for nothing)."""


def _check(name: str, step: int, rank: int, file: str) -> None:
    problem = job_name_problem(name, "job_name")
    if problem:
        raise BadShard(problem)
    if not 0 <= step < 10 ** 8 or not 0 <= rank < MAX_RANK or file not in FILES:
        raise BadShard(f"step={step}, rank={rank}, file={file!r}: not a checkpoint file")


def _path(root: str, step: int, rank: int, file: str) -> str:
    return layout.rank_file(root, step, rank) if file == "pt" else layout.marker_file(root, step, rank)


class ShardStore:
    """This node's complete checkpoint steps: its own ranks' and the copies it keeps for peers."""

    def __init__(self, state_dir: Path | str) -> None:
        self.state_dir = str(state_dir)

    def own_root(self, name: str) -> str:
        return layout.root_in(self.state_dir, name)

    def replica_root(self, name: str) -> str:
        return os.path.join(self.state_dir, "replicas", name)

    def newest(self, name: str, ranks: list[int]) -> tuple[int, dict[int, str]] | None:
        """The newest step complete for every rank in either root, and the root of each rank's files."""
        roots = (self.own_root(name), self.replica_root(name))
        steps = set()
        for root in roots:
            steps.update(layout.list_steps(root))
        for step in sorted(steps, reverse=True):
            where = {}
            for r in ranks:
                root = next((rt for rt in roots if layout.read_marker(rt, step, r) is not None), None)
                if root is None:
                    break
                where[r] = root
            else:
                return step, where
        return None

    def prune(self, name: str) -> None:
        """Keep the newest KEEP_STEPS steps of the copies kept for peers."""
        root = self.replica_root(name)
        for step in layout.list_steps(root)[:-KEEP_STEPS]:
            d = layout.step_dir(root, step)
            for entry in os.listdir(d):
                os.unlink(os.path.join(d, entry))
            os.rmdir(d)


class _Writer:
    """Chunks in, files out (temporary name, renamed on the last chunk)."""

    def __init__(self, root_of) -> None:  # noqa: ANN001 - name -> root
        self.root_of, self.f, self.tmp, self.final, self.files = root_of, None, "", "", 0

    def feed(self, c: pb.ShardChunk) -> None:
        if self.f is None:
            _check(c.job_name, c.step, c.rank, c.file)
            self.final = _path(self.root_of(c.job_name), c.step, c.rank, c.file)
            os.makedirs(os.path.dirname(self.final), exist_ok=True)
            self.tmp = f"{self.final}.part"
            self.f = open(self.tmp, "wb")
        self.f.write(c.data)
        if c.last:
            self.f.close()
            os.replace(self.tmp, self.final)
            self.f, self.files = None, self.files + 1

    def abort(self) -> None:
        if self.f is not None:
            self.f.close()
            try:
                os.unlink(self.tmp)
            except OSError:
                pass


def _chunks(name: str, step: int, rank: int, root: str) -> Iterable[pb.ShardChunk]:
    for file in FILES:
        with open(_path(root, step, rank, file), "rb") as f:
            data = f.read(CHUNK)
            while True:
                nxt = f.read(CHUNK)
                yield pb.ShardChunk(job_name=name, step=step, rank=rank, file=file, data=data, last=not nxt)
                if not nxt:
                    break
                data = nxt


async def _threaded(chunks: Iterable[pb.ShardChunk]) -> AsyncIterator[pb.ShardChunk]:
    it = iter(chunks)
    while (c := await asyncio.to_thread(next, it, None)) is not None:
        yield c


class PeerServicer(pb_grpc.PeerServiceServicer):
    """Serves this node's shards to peers and keeps the copies they push."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store

    async def PutShards(self, request_iterator, context):  # noqa: ANN001, ANN201, N802 - gRPC
        writer, names = _Writer(self.store.replica_root), set()
        try:
            async for chunk in request_iterator:
                await asyncio.to_thread(writer.feed, chunk)
                names.add(chunk.job_name)
        except BadShard as exc:
            writer.abort()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except BaseException:
            writer.abort()
            raise
        for name in names:
            await asyncio.to_thread(self.store.prune, name)
        return pb.PutShardsResponse(files=writer.files)

    async def GetShards(self, request, context):  # noqa: ANN001, ANN201, N802 - gRPC
        ranks = list(request.ranks)
        try:
            for r in ranks or [-1]:
                _check(request.job_name, 0, r, "pt")
        except BadShard as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        found = await asyncio.to_thread(self.store.newest, request.job_name, ranks)
        if found is None:
            return
        step, where = found
        for r in ranks:
            async for chunk in _threaded(_chunks(request.job_name, step, r, where[r])):
                yield chunk


class Replicator:
    """Pushes the newest complete step of each of this node's ranks to their replica peer, once."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store
        self._pushed: dict[tuple[str, str, int], int] = {}   # (peer, job name, rank) -> newest step pushed
        self._busy: set[str] = set()                         # peers with a push in flight

    def due(self, peer: str, name: str, ranks: Iterable[int]) -> list[tuple[int, int]]:
        """(rank, step) pairs whose newest complete step has not reached ``peer`` (blocking: a thread)."""
        root, out = self.store.own_root(name), []
        for r in ranks:
            steps = layout.complete_for(root, [r])
            if steps and steps[-1] > self._pushed.get((peer, name, r), -1):
                out.append((r, steps[-1]))
        return out

    async def push(self, peer: str, name: str, ranks: list[int]) -> None:
        """One push round to ``peer`` (skipped while the last one is in flight)."""
        if peer in self._busy:
            return
        self._busy.add(peer)
        try:
            due = await asyncio.to_thread(self.due, peer, name, ranks)
            if not due:
                return
            root = self.store.own_root(name)

            def all_chunks() -> Iterable[pb.ShardChunk]:
                for r, step in due:
                    yield from _chunks(name, step, r, root)

            async with grpc.aio.insecure_channel(peer) as channel:
                await pb_grpc.PeerServiceStub(channel).PutShards(_threaded(all_chunks()), timeout=300)
            for r, step in due:
                self._pushed[(peer, name, r)] = step
            log.info("checkpoint replicated", peer=peer, job_name=name, steps=sorted({s for _, s in due}))
        except (grpc.aio.AioRpcError, OSError) as exc:
            log.warning("checkpoint replication failed", peer=peer, job_name=name,
                        error=exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc))
        finally:
            self._busy.discard(peer)


async def restore(store: ShardStore, peer: str, name: str, ranks: list[int], timeout: float = 300.0) -> int | None:
    """Fetch the newest step ``peer`` holds for all of ``ranks`` into this node's checkpoint root."""
    writer = _Writer(store.own_root)
    step = None
    try:
        async with grpc.aio.insecure_channel(peer) as channel:
            call = pb_grpc.PeerServiceStub(channel).GetShards(pb.GetShardsRequest(job_name=name, ranks=ranks),
                                                               timeout=timeout)
            async for chunk in call:
                await asyncio.to_thread(writer.feed, chunk)
                step = chunk.step
    except BaseException:
        writer.abort()
        raise
    return step
