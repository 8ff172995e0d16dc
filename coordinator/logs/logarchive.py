"""Rank logs kept by the coordinator when their nodes are about to go (a Slurm allocation ending with its job).

Rank logs live on the nodes (``logfetch``); an allocation's workers exit when its job ends, and a node-local state
dir goes with them. Before they are told to exit, the coordinator reads the last ``LINES`` lines of every rank of
the job's last attempt (rankctl's record lines included, as ``ctl logs --records`` shows) and writes them under
``<state dir>/logs/<job>/attempt-<n>/rank-<r>.log``. ``ctl logs`` reads them from there once a rank's node cannot
be asked (``LogReading``), so it works for a Slurm-run job after its allocation ended as for any other.

Bounded: ``CONCURRENCY`` reads at a time, ``JOB_BYTES`` per job (ranks past it are not kept), ``DEADLINE_S`` for
the whole job (the workers are released then, whatever was read). Files are written off the event loop thread.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Callable

import structlog

from rankctl.contract.files.logrecords import is_record
from rankctl.coordinator.logs.logfetch import LogFetcher, LogsUnavailable
from rankctl.coordinator.model.records import JobRecord
from rankctl.parallel.placement import node_of_rank
from rankctl.proto import rankctl_pb2 as pb

log = structlog.get_logger("rankctl.coordinator")
LINES = 1000               # the last lines of each rank kept
JOB_BYTES = 64 << 20       # per job, all ranks together
CONCURRENCY = 64           # FetchLogs in flight for one archive
DEADLINE_S = 15.0          # the most an archive delays the release of the allocation's workers


class LogArchive:
    """The archived logs under one coordinator state dir."""

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / "logs"

    def path(self, job_id: str, attempt: int, rank: int) -> Path:
        return self.root / job_id / f"attempt-{attempt}" / f"rank-{rank}.log"

    async def take(self, fetcher: LogFetcher, job: JobRecord, clock: Callable[[], float]) -> int:
        """Archive the last lines of every rank of ``job``'s attempt; the number of ranks kept."""
        if not job.nodes:
            return 0
        gate, budget, kept = asyncio.Semaphore(CONCURRENCY), JOB_BYTES, 0
        start = clock()

        async def one(rank: int) -> None:
            nonlocal budget, kept
            node = job.nodes[node_of_rank(rank, job.slots_per_node)]
            async with gate:
                if budget <= 0:
                    return
                try:
                    chunk = await fetcher.fetch(node, job.id, job.attempt, rank, tail=LINES, max_lines=LINES,
                                                records=True)
                except LogsUnavailable:
                    return
            if chunk.error:
                return
            text = "".join(line + "\n" for line in chunk.lines)
            budget -= len(text)
            if budget >= 0:
                await asyncio.to_thread(_write, self.path(job.id, job.attempt, rank), text)
                kept += 1

        tasks = [asyncio.ensure_future(one(rank)) for rank in range(job.world_size)]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), DEADLINE_S)
        except asyncio.TimeoutError:
            for task in tasks:
                task.cancel()
        log.info("logs.archived", job=job.id, attempt=job.attempt, ranks=kept, of=job.world_size,
                 seconds=round(clock() - start, 2))
        return kept

    def chunk(self, job_id: str, attempt: int, rank: int, offset: int, tail: int,
              records: bool = False) -> pb.LogChunk | None:
        """The archived log of a rank as a node would answer FetchLogs (offsets count the lines shown: with
        ``records`` rankctl's own record lines too, else what the program printed), or None."""
        try:
            text = self.path(job_id, attempt, rank).read_text(errors="replace")
        except OSError:
            return None
        lines = text.split("\n")[:-1] if text else []   # not splitlines(): it splits at the records' mark (\x1e)
        if not records:
            lines = [line for line in lines if not is_record(line)]
        first = max(0, len(lines) - tail) if tail else min(offset, len(lines))
        shown = lines[first:]
        if first == 0 and offset == 0:
            shown = [f"[rankctl: the node of rank {rank} has left; its last {len(lines)} line(s), kept by the "
                     "coordinator]", *shown]
        return pb.LogChunk(lines=shown, next_offset=len(lines))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
