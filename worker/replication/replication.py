"""This node's side of checkpoint replication (``worker.replication.replicas`` moves the bytes): push its runs' new
steps to their replica peer, fetch a replaced node's steps before its ranks start, free a finished job's
in-memory snapshots. A failure here never fails a rank; at worst a restart starts over."""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

import grpc

from rankctl.contract.files.safepath import UnsafePath
from rankctl.worker.replication.replicas import BadShard, Replicator, restore
from rankctl.worker.runs.runstate import RunState
from rankctl.worker.replication.shardstore import ShardStore
from rankctl.worker.daemon.tasks import Background


class Replication:
    def __init__(self, shards: ShardStore, *, credentials: grpc.ChannelCredentials | None, background: Background,
                 log: Any) -> None:
        self.shards = shards
        self._replicator = Replicator(shards, credentials)
        self._credentials = credentials
        self._background = background
        self._log = log

    def push(self, runs: Iterable[RunState]) -> None:
        """Start a push of new checkpoint steps for every live run that has a replica peer."""
        for run in runs:
            if run.replica_peer and run.job_name and run.alive:
                self._background.spawn(self._replicator.push(run.replica_peer, run.job_name, sorted(run.ranks)))

    async def close(self) -> None:
        """The daemon stops: close the channels kept to replica peers."""
        await self._replicator.channels.close()

    def revive(self, name: str) -> None:
        """A run of ``name`` starts here: its peers' snapshot pushes are welcome again."""
        self.shards.revive(name)

    async def restore(self, peer: str, name: str, ranks: list[int], job_id: str = "") -> list[str]:
        """This node replaces the one that ran ``ranks`` of ``job_id``: fetch their newest checkpoint step of that
        job from ``peer`` (a failure only means the ranks start over). Returns one line per damaged step the peer
        passed over (each logged here too), for the job's record."""
        passed: list[str] = []
        try:
            step = await restore(self.shards, peer, name, ranks, credentials=self._credentials, job_id=job_id,
                                 passed=passed)
            self._log.info("checkpoint restored from peer", peer=peer, job_name=name, ranks=ranks, step=step)
        except (grpc.aio.AioRpcError, OSError, BadShard) as exc:
            self._log.warning("checkpoint restore failed; the ranks start over", peer=peer, job_name=name,
                              error=exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc))
            if isinstance(exc, UnsafePath):   # a link where this node keeps the name's files: on the job's record
                passed.append(f"not restored, the ranks start over: {exc.strerror}")
        lines = [f"restoring from peer {peer}: {line}" for line in passed]
        for line in lines:
            self._log.warning("checkpoint passed over", job=job_id, job_name=name, detail=line)
        return lines

    def finished(self, run: RunState) -> None:
        """Every rank of ``run`` on this node finished its job: its snapshots served only restarts."""
        if run.job_name:
            self._background.spawn(self._drop_snapshots(run))

    async def _drop_snapshots(self, run: RunState) -> None:
        """Free the run's in-memory snapshots (and the copies this node keeps for the job's other node)."""
        try:
            removed = await asyncio.to_thread(self.shards.drop_snapshots, run.job_name, sorted(run.ranks))
        except OSError as exc:
            self._log.warning("snapshots not removed", job=run.job_id, error=str(exc))
            return
        if removed:
            self._log.info("snapshots removed", job=run.job_id, job_name=run.job_name, files=removed)
