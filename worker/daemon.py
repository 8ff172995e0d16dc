"""The worker daemon: one per node, one bidirectional stream to the coordinator.

It registers (name, address, slots, hardware, free ports, the jobs still alive here),
heartbeats, hands assignments to its warm launcher (a subprocess; this process never
forks) and turns the ranks' status files and exits into numbered reports: one ReportBatch
per tick with every rank that changed (``worker.reportbuf`` keeps only the newest step of a
rank under backlog); a phase change, exit or error goes out at once, without waiting for the tick. Heartbeats never queue behind reports: the writer sends a due heartbeat
before the next batch (and skips it, but for every fifth, which carries free ports, when a batch
went out within the interval: a report shows the node alive as well). Rank logs stay in their files here; the coordinator reads them on
demand (FetchLogs, answered by ``worker.logship``; the launcher rotates them as bytes arrive, ``worker.rankio``). While the coordinator is away it
reconnects with jittered backoff (``reconnect_delay``) and keeps every report; after re-registering
it replays those the coordinator has not yet stored.

When the launcher dies, every rank it had forked died with it (``PR_SET_PDEATHSIG``): the
daemon reports them killed and starts a new launcher. Health (``set_serving``) is SERVING only
while a coordinator session is registered and a launcher runs. ``LauncherLost`` ends ``run()``
when no launcher starts after a few tries, so that the process exits and its supervisor restarts it. ``NodeNameTaken`` ends it when the
coordinator refuses the node's name. A coordinator's ids become paths only once
``worker.paths`` has checked them; rank logs ship within ``worker.logship``'s limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc
import structlog

from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc as pb_grpc
from rankctl.contract.assignment import RankAssignment
from rankctl.kinds.registry import blob_limit_of, blobs_of
from rankctl.worker.assign import claimed_ranks, expand
from rankctl.worker.blobs import FetchFailed, WorkdirCache
from rankctl.worker import hangwatch
from rankctl.worker.hangwatch import HangWatch
from rankctl.worker.launcher_client import Launcher, LauncherError
from rankctl.contract.collfiles import read_counters
from rankctl.contract.rankfiles import log_path, write_control
from rankctl.contract.rankstatus import RankStatusRecord
from rankctl.worker.logship import answer_fetch
from rankctl.worker import shm
from rankctl.worker.rankio import GENERATION_BYTES
from rankctl.worker.metrics import DaemonStats
from rankctl.worker.paths import Refused, run_dir_for
from rankctl.worker.replicas import BadShard, Replicator, ShardStore, restore
from rankctl.worker.reportbuf import ReportBuffer
from rankctl.worker.sandbox import allowed_roots, assignment_problem
from rankctl.worker.reporting import (
    exit_code, free_ports, hardware_pb, how_launcher_ended, process_state, to_wire,
)
from rankctl.worker.status import StatusTailer
from rankctl.worker.usage import UsageSampler

log = structlog.get_logger("rankctl.worker")

MAX_BUFFERED_REPORTS = 200_000
BATCH_REPORTS = 4096          # reports in one ReportBatch at most
WATCH_EVERY = 10              # poll turns between two looks at the ranks' process states
REPLICATE_EVERY = 2           # poll turns between two looks for new checkpoint or snapshot steps to push
STARTED_PHASES = ("running", "done", "failed")
FAST_POLL_S = 10.0            # a run's status files are polled at start_poll_interval at most this long


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    coordinator: str
    name: str
    slots: int
    state_dir: Path
    advertise_address: str = "127.0.0.1"
    health_listen: str = "127.0.0.1:0"
    poll_interval: float = 0.1
    start_poll_interval: float = 0.02  # ... while a run's ranks are starting (their phase changes are the start-up)
    report_interval: float = 0.2  # at most one ReportBatch this often (reports in between coalesce)
    log_cap_bytes: int = GENERATION_BYTES  # the launcher rotates a rank log at this size as bytes arrive
    peer_port: int = 0            # where this node's PeerService listens (on advertise_address); 0: none
    backoff_initial: float = 0.2
    backoff_max: float = 5.0      # retries at least this often (the coordinator's RECONNECT_GRACE_S counts on it)
    free_ports: int = 8
    launcher_restarts: int = 4  # tries to start a new launcher before the daemon gives up
    launcher_backoff: float = 1.0  # seconds before the second try; doubles each time
    launcher_stable_s: float = 30.0  # a launcher that dies sooner than this counts towards giving up
    py_spy: str | None = None  # py-spy for a stalled rank's stack; None: on PATH or beside python; "": never
    tls_dir: str | None = None  # this node's identity directory: mutual TLS to the coordinator and to peers
    data_roots: tuple[str, ...] = ()  # where a job's data and other node paths may lie (besides the state dir)
    metrics_listen: str = ""      # HOST:PORT of the Prometheus /metrics endpoint (worker.metrics); "": none
    workdir_cache_mb: int = 20480  # the node's cache of extracted workdirs; least recently used evicted past it
    snapshot_memory_mb: int | None = None  # bound on rankctl's snapshot memory (worker.snapmem); None: a quarter
                                           # of the node's memory, 0: none of rankctl's own


class LauncherLost(RuntimeError):
    """The launcher died and no new one would start: the daemon must exit (non-zero)."""


class NodeNameTaken(RuntimeError):
    """The coordinator refused this node's name: another live daemon holds it. Retrying cannot help."""


def _unmount_shm(run_dirs: list[str]) -> None:
    """The private /dev/shm of each run whose launcher died (it unmounts them itself otherwise)."""
    for run_dir in run_dirs:
        shm.unmount_job_shm(run_dir)


def reconnect_delay(previous: float, initial: float, cap: float, rng: random.Random) -> float:
    """The wait before the next connection attempt: "decorrelated jitter", uniform between ``initial`` and
    three times the previous wait, at most ``cap`` (``previous`` 0: the first retry after a session ended).
    Daemons cut off together (a coordinator restart) thus come back spread out, not in lockstep."""
    return min(cap, rng.uniform(initial, 3 * max(previous, initial)))


def name_taken(exc: grpc.aio.AioRpcError) -> bool:
    """The coordinator's refusal of a second live session under one node name."""
    return exc.code() == grpc.StatusCode.ALREADY_EXISTS and (exc.details() or "").startswith("node name")


@dataclass
class RunState:
    """One job attempt with ranks on this node."""

    job_id: str
    attempt: int
    run_dir: str
    ranks: set[int]
    alive: set[int] = field(default_factory=set)
    tailer: StatusTailer | None = None                   # reads the ranks' status lines
    phase: dict[int, str] = field(default_factory=dict)  # rank -> phase of its last report
    pids: dict[int, int] = field(default_factory=dict)   # rank -> pid, from the launcher's "started"
    job_name: str = ""                                   # the spec's name: its checkpoints' directory
    replica_peer: str = ""                               # where its checkpoint steps are copied
    process: dict[int, str] = field(default_factory=dict)  # rank -> last reported process state
    hangs: HangWatch | None = None                       # whose collective counters stopped moving
    succeeded: set[int] = field(default_factory=set)     # ranks that exited 0
    started: bool = False                                # every rank reported running (or ended)
    workdir_blob: str = ""                               # the shipped workdir its ranks run in (pinned in the cache)
    assigned_at: float = field(default_factory=time.monotonic)

    def starting(self) -> bool:
        """Some rank is on its way to running, within ``FAST_POLL_S`` of the assignment (a long rendezvous
        wait for other nodes is polled at the usual pace); one look per rank until every one is there."""
        if not self.started:
            self.started = time.monotonic() - self.assigned_at > FAST_POLL_S or all(
                self.phase.get(r) in STARTED_PHASES or r not in self.alive for r in self.ranks)
        return not self.started


class WorkerDaemon:
    """Runs until ``stop()``; ``launcher`` is a started ``worker.launcher.Launcher``.

    ``start_launcher`` starts a replacement when the launcher dies (the daemon closes those it
    started); ``set_serving`` reports the health service's status when it changes (True while a session is
    registered and a launcher runs); ``rng`` jitters the reconnect waits (tests pass a seeded one).
    """

    def __init__(self, cfg: DaemonConfig, launcher: Any, *,
                 start_launcher: Callable[[], Awaitable[Any]] | None = None,
                 set_serving: Callable[[bool], Awaitable[None]] | None = None,
                 rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.stats = DaemonStats()
        self._rng = rng or random.Random()
        self._healthy: bool | None = None  # what set_serving was last told
        self.launcher = launcher
        self._start_launcher = start_launcher or Launcher.start
        self._set_serving = set_serving
        self._own_launcher: Any = None  # a replacement this daemon started
        self._launcher_up = asyncio.Event()
        self._launcher_up.set()
        self.runs: dict[tuple[str, int], RunState] = {}
        self.reports = ReportBuffer(MAX_BUFFERED_REPORTS)
        self._control: deque[pb.NodeMessage] = deque()  # answers (log chunks), sent before reports
        self._wake = asyncio.Event()                     # the writer has something to send
        self._beat = asyncio.Event()                     # a heartbeat is due
        self._hurry = asyncio.Event()                    # ends the writer's wait for the report tick
        self._answers: set[asyncio.Task] = set()         # log fetches being answered
        self._background: set[asyncio.Task] = set()      # checkpoint pushes to replica peers
        self._online = False                             # a session is registered
        self._stopping = asyncio.Event()
        self.refused = 0  # Assign messages refused (bad ids)
        self._heartbeat_interval = 1.0
        self.connected = asyncio.Event()
        self._channel: grpc.aio.Channel | None = None  # the session's, for FetchBlob
        self.workdirs = WorkdirCache(cfg.state_dir, cfg.workdir_cache_mb << 20)
        self._usage = UsageSampler()  # CPU, memory and GPU use, sent with each heartbeat
        self.shards = ShardStore(cfg.state_dir)
        self.roots = allowed_roots(cfg.data_roots, str(cfg.state_dir))  # ValueError: a root is not a directory
        self._credentials = None   # grpc.ChannelCredentials of this node's certificate (cfg.tls_dir)
        if cfg.tls_dir:
            from rankctl.security.tls import channel_credentials, load_identity_dir

            self._credentials = channel_credentials(load_identity_dir(cfg.tls_dir))
        self.replicator = Replicator(self.shards, self._credentials)
        self._log = log.bind(node=cfg.name)
        self._py_spy = hangwatch.find_py_spy() if cfg.py_spy is None else cfg.py_spy or None
        self._stacks = asyncio.Semaphore(4)              # stack dumps of stalled ranks at once

    # -- reports -----------------------------------------------------------------------------
    def _report(self, job_id: str, attempt: int, status: pb.RankStatus, result_json: str = "", *,
                step_only: bool = False) -> None:
        self.reports.add(job_id, attempt, status, result_json, step_only=step_only)
        self._wake.set()
        if not step_only:
            self._hurry.set()  # a phase change, exit or error: the writer stops waiting for the tick

    def _send_control(self, msg: pb.NodeMessage) -> None:
        if self._online:
            self._control.append(msg)
            self._wake.set()

    def _report_record(self, run: RunState, rec: RankStatusRecord) -> None:
        status, result_json = to_wire(rec, self.cfg.name)
        previous = run.phase.get(status.rank)
        run.phase[status.rank] = status.phase
        if run.hangs is not None:
            run.hangs.touch(status.rank)
        step_only = status.phase == previous == "running" and not status.error and not result_json
        self._report(run.job_id, run.attempt, status, result_json, step_only=step_only)

    # -- launcher events ---------------------------------------------------------------------
    async def _on_launcher_event(self, ev: dict[str, Any]) -> None:
        run = self.runs.get((ev.get("job_id", ""), int(ev.get("attempt", 0))))
        if run is None:
            return
        rank = int(ev["rank"])
        if ev.get("event") == "started":
            run.alive.add(rank)
            if isinstance(ev.get("pid"), int):
                run.pids[rank] = ev["pid"]
            return
        if ev.get("event") != "exited":
            return
        run.alive.discard(rank)
        self._read_status_lines(run)  # status lines written before the exit go first
        code = exit_code(ev)
        leftovers = int(ev.get("leftovers_killed") or 0)
        notes = ["\n".join(ev.get("log_tail") or [])] if code != 0 else []
        if leftovers:
            notes.append(f"rankctl: {leftovers} leftover process(es) of rank {rank} still ran after it ended; "
                         "they were killed")
        notes.extend(f"rankctl: {note}" for note in ev.get("notes") or [])  # e.g. the OOM killer at a limit
        status = pb.RankStatus(rank=rank, node=self.cfg.name, phase="exited", exited=True, exit_code=code,
                               error="\n".join(notes))
        self._report(run.job_id, run.attempt, status)
        self._log.info("rank exited", job=run.job_id, rank=rank, code=code, leftovers_killed=leftovers)
        if code == 0:
            run.succeeded.add(rank)
            if run.succeeded == run.ranks and run.job_name:
                self._background_task(self._drop_snapshots(run))

    async def _drop_snapshots(self, run: RunState) -> None:
        """Every rank of the run on this node finished its job: its in-memory snapshots (and the copies this
        node keeps for the job's other node) served only restarts; free that memory."""
        try:
            removed = await asyncio.to_thread(self.shards.drop_snapshots, run.job_name, sorted(run.ranks))
        except OSError as exc:
            self._log.warning("snapshots not removed", job=run.job_id, error=str(exc))
            return
        if removed:
            self._log.info("snapshots removed", job=run.job_id, job_name=run.job_name, files=removed)

    async def _pump_launcher(self) -> None:
        """Launcher events in order; when the launcher dies, fail its ranks and start another."""
        quick_deaths = 0  # in a row, each within launcher_stable_s of its start: a crash loop
        while True:
            started = time.monotonic()
            async for ev in self.launcher.events():
                await self._on_launcher_event(ev)
            if self._stopping.is_set():
                return
            await self._launcher_died()
            quick_deaths = quick_deaths + 1 if time.monotonic() - started < self.cfg.launcher_stable_s else 0
            if quick_deaths > self.cfg.launcher_restarts:
                raise LauncherLost(f"the launcher died {quick_deaths} times in a row, each within "
                                   f"{self.cfg.launcher_stable_s:g} s of its start")
            if quick_deaths > 1:
                await asyncio.sleep(self.cfg.launcher_backoff * 2 ** (quick_deaths - 2))
            await self._restart_launcher()

    @property
    def online(self) -> bool:
        """A session with the coordinator is registered."""
        return self._online

    @property
    def launcher_alive(self) -> bool:
        return self._launcher_up.is_set()

    async def _update_health(self) -> None:
        """Tell ``set_serving`` when the node's health changed: SERVING needs a session and a launcher."""
        ok = self._online and self._launcher_up.is_set()
        if ok != self._healthy and self._set_serving is not None:
            self._healthy = ok
            await self._set_serving(ok)

    async def _launcher_died(self) -> None:
        """Report every rank the dead launcher had forked as killed (they died with it)."""
        self._launcher_up.clear()
        await self._update_health()
        proc = getattr(self.launcher, "proc", None)
        if proc is not None:  # its exit status, once reaped
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 2.0)
        why = (f"the launcher on node {self.cfg.name} died ({how_launcher_ended(self.launcher)}); "
               "every rank it had forked was killed with it")
        self._log.error("launcher died; restarting it", status=how_launcher_ended(self.launcher),
                        jobs=sorted({r.job_id for r in self.runs.values() if r.alive}))
        await asyncio.to_thread(_unmount_shm, [r.run_dir for r in self.runs.values() if r.alive])
        for run in list(self.runs.values()):
            self._read_status_lines(run)
            for rank in sorted(run.alive):
                self._report(run.job_id, run.attempt, pb.RankStatus(
                    rank=rank, node=self.cfg.name, phase="exited", exited=True, exit_code=-signal.SIGKILL, error=why))
            run.alive.clear()

    async def _restart_launcher(self) -> None:
        delay, error = self.cfg.launcher_backoff, ""
        for attempt in range(1, self.cfg.launcher_restarts + 1):
            try:
                launcher = await self._start_launcher()
            except (LauncherError, OSError) as exc:
                error = str(exc)
                self._log.warning("launcher did not start", attempt=attempt, error=error, retry_in=delay)
                await asyncio.sleep(delay)
                delay *= 2
                continue
            if self._own_launcher is not None:
                await self._own_launcher.close()  # the dead replacement: reap it
            self.launcher = self._own_launcher = launcher
            self.stats.launcher_restarts += 1
            self._launcher_up.set()
            await self._update_health()
            self._log.info("launcher restarted", pid=launcher.pid, attempt=attempt)
            return
        raise LauncherLost(f"the launcher died and did not restart after {self.cfg.launcher_restarts} tries: {error}")

    # -- polling files -----------------------------------------------------------------------
    def _read_status_lines(self, run: RunState) -> None:
        """Report every status record the run's ranks wrote since the last read."""
        if run.tailer is not None:
            for rec in run.tailer.poll():
                self._report_record(run, rec)

    async def _poll_files(self) -> None:
        loop = asyncio.get_running_loop()
        turns, next_turn = 0, 0.0  # turns of poll_interval (a fast poll at start-up adds none)
        while not self._stopping.is_set():
            for key, run in list(self.runs.items()):
                self._read_status_lines(run)
                if not run.alive:
                    self.runs.pop(key, None)  # every exit reported (the buffer keeps them until stored)
                    if run.workdir_blob:
                        self.workdirs.unpin(run.workdir_blob)  # its tree may now be evicted
            starting = any(run.starting() for run in self.runs.values())
            interval = self.cfg.start_poll_interval if starting else self.cfg.poll_interval
            if loop.time() >= next_turn:
                next_turn = loop.time() + self.cfg.poll_interval - interval / 2
                turns += 1
                await self._every_turn(turns)
            await asyncio.sleep(interval)

    async def _every_turn(self, turns: int) -> None:
        """What the poll loop does every few turns: process states, replica pushes (the launcher
        rotates rank logs as their bytes arrive, ``worker.rankio``)."""
        if turns % WATCH_EVERY == 0:
            self._watch_processes()
        if turns % REPLICATE_EVERY == 0:
            self._replicate()

    def _watch_processes(self) -> None:
        """Report a rank whose process is stopped (SIGSTOP, a debugger), and when it goes on, and a
        running rank whose collective counters stopped moving (``worker.hangwatch``): the coordinator's
        hang detector names them. Per live rank: one read of ``/proc/PID/stat`` and of its counter file."""
        for run in self.runs.values():
            for rank in run.alive:
                pid = run.pids.get(rank)
                state = process_state(pid) if pid else ""
                if state != run.process.get(rank, ""):
                    run.process[rank] = state
                    self._report(run.job_id, run.attempt, pb.RankStatus(rank=rank, node=self.cfg.name,
                                                                        process=state))
                    self._log.warning("rank process state", job=run.job_id, rank=rank, pid=pid,
                                      state=state or "running")
                if run.hangs is None or run.phase.get(rank) != "running" or not pid:
                    continue
                seen = run.hangs.observe(rank, hangwatch.signature(run.run_dir, rank))
                if seen == hangwatch.STALLED:
                    self._stalled(run, rank, pid, state)
                elif seen == hangwatch.MOVED:  # withdraw the evidence: the rank went on
                    self._report(run.job_id, run.attempt, pb.RankStatus(
                        rank=rank, node=self.cfg.name, process=state, collectives=hangwatch.MOVED_JSON))

    def _stalled(self, run: RunState, rank: int, pid: int, state: str) -> None:
        """A rank's counters stopped moving: its counters now (read here), its stack off the loop, one report."""
        still = run.hangs.still_for(rank) if run.hangs is not None else 0.0
        evidence = hangwatch.evidence_json(read_counters(run.run_dir, rank), still)
        self._log.warning("rank stalled", job=run.job_id, rank=rank, pid=pid, still_s=round(still, 1),
                          state=state or "running")
        self._background_task(self._send_evidence(run, rank, pid, state, evidence))

    def _background_task(self, coro: Awaitable[Any]) -> None:
        """Run ``coro`` beside the loop; kept referenced until done (stop() waits for or cancels them)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_evidence(self, run: RunState, rank: int, pid: int, state: str, evidence: str) -> None:
        token = run.hangs.stalled(rank) if run.hangs is not None else None
        try:
            async with self._stacks:
                stack = await hangwatch.stack_of(pid, state == "stopped", log_path(run.run_dir, rank), self._py_spy)
        except OSError as exc:
            stack = f"no stack: {exc}"
        if rank not in run.alive or run.hangs is None or run.hangs.stalled(rank) != token or token is None \
                or self.runs.get((run.job_id, run.attempt)) is not run:
            return  # it exited, or moved again meanwhile: this evidence no longer holds
        state = process_state(pid)
        run.process[rank] = state  # the report carries the process state the coordinator keeps
        self._report(run.job_id, run.attempt, pb.RankStatus(rank=rank, node=self.cfg.name, process=state,
                                                            collectives=evidence, stack=stack))

    # -- coordinator messages ----------------------------------------------------------------
    def _checked(self, msg: pb.Assign) -> tuple[Path, list[RankAssignment]]:
        """The run dir and assignments of an Assign whose every id is safe as a path."""
        run_dir = run_dir_for(self.cfg.state_dir, msg.job_id, msg.attempt)
        gpus = len(getattr(self.launcher, "hardware", {}).get("gpus") or [])
        return run_dir, expand(msg, self.cfg.name, str(run_dir), gpus, self.cfg.advertise_address)

    def _refuse(self, msg: pb.Assign, why: str) -> None:
        """Count and log a refused Assign; its ranks are reported as never started."""
        self.refused += 1
        self._log.error("assignment refused", job=msg.job_id[:80], attempt=msg.attempt, error=why,
                        refused=self.refused)
        for rank in claimed_ranks(msg):
            self._report(msg.job_id, msg.attempt, pb.RankStatus(
                rank=rank, node=self.cfg.name, phase="exited", exited=True, exit_code=1,
                error=f"node {self.cfg.name} refused the assignment: {why}"))

    async def _fetch_blob(self, digest: str):  # noqa: ANN202 - an async iterator of bytes
        if self._channel is None:
            raise FetchFailed("not connected to the coordinator")
        call = pb_grpc.NodeServiceStub(self._channel).FetchBlob(pb.FetchBlobRequest(digest=digest))
        try:
            async for chunk in call:
                yield chunk.data
        except grpc.aio.AioRpcError as exc:
            raise FetchFailed(f"{exc.code().name}: {exc.details()}") from None

    async def _with_workdir(self, assignments: list[RankAssignment]) -> list[RankAssignment]:
        """Each rank's ``workdir``: this node's extracted copy of the job's shipped workdir, fetched once."""
        digests = blobs_of(assignments[0].spec) if assignments else []
        if not digests:
            return assignments
        try:
            path = await self.workdirs.path(digests[0], self._fetch_blob, blob_limit_of(assignments[0].spec),
                                            pin=True)  # unpinned when the run ends (or is refused below)
        except (FetchFailed, OSError) as exc:
            raise Refused(f"cannot fetch the job's workdir {digests[0]}: {exc}") from None
        return [replace(a, workdir=str(path)) for a in assignments]

    async def _assign(self, msg: pb.Assign) -> None:
        try:
            run_dir, assignments = self._checked(msg)
            assignments = await self._with_workdir(assignments)
            first = assignments[0] if assignments else None
            problem = first and assignment_problem(first.spec, self.roots, workdir=first.workdir)
            if problem:
                for digest in blobs_of(first.spec)[:1] if first.workdir else []:
                    self.workdirs.unpin(digest)
                raise Refused(problem)
        except Refused as exc:
            self._refuse(msg, str(exc))
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        ranks = {a.rank for a in assignments}
        name = str((assignments[0].spec or {}).get("name", "")) if assignments else ""
        if name:
            self.shards.revive(name)   # a run of the name here: its peers' snapshot pushes are welcome again
        if msg.restore_peer and name:
            await self._restore(msg.restore_peer, name, sorted(ranks))
        spec = assignments[0].spec if assignments else None
        run = RunState(job_id=msg.job_id, attempt=msg.attempt, run_dir=str(run_dir), ranks=ranks,
                       tailer=StatusTailer(str(run_dir)), job_name=name, replica_peer=msg.replica_peer,
                       hangs=HangWatch(hangwatch.stall_after(spec)),
                       workdir_blob=(blobs_of(spec)[:1] or [""])[0] if spec and assignments[0].workdir else "")
        run.alive |= ranks  # counted alive from the launch on; exits remove them
        self.runs[(msg.job_id, msg.attempt)] = run
        self._log.info("assigned", job=msg.job_id, attempt=msg.attempt, ranks=sorted(ranks))
        await self._launcher_up.wait()
        try:
            custom = self.cfg.log_cap_bytes != GENERATION_BYTES  # the launcher's default otherwise
            await self.launcher.launch(assignments, **({"log_bytes": self.cfg.log_cap_bytes} if custom else {}))
        except LauncherError as exc:  # it just died: _launcher_died reports these ranks
            self._log.warning("launch failed", job=msg.job_id, error=str(exc))

    async def _restore(self, peer: str, name: str, ranks: list[int]) -> None:
        """This node replaces the one that ran ``ranks``: fetch their newest checkpoint step from ``peer``
        (a failure only means the ranks start over)."""
        try:
            step = await restore(self.shards, peer, name, ranks, credentials=self._credentials)
            self._log.info("checkpoint restored from peer", peer=peer, job_name=name, ranks=ranks, step=step)
        except (grpc.aio.AioRpcError, OSError, BadShard) as exc:
            self._log.warning("checkpoint restore failed; the ranks start over", peer=peer, job_name=name,
                              error=exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc))

    def _replicate(self) -> None:
        """Start a push of new checkpoint steps for every run that has a replica peer."""
        for run in self.runs.values():
            if run.replica_peer and run.job_name and run.alive:
                self._background_task(self.replicator.push(run.replica_peer, run.job_name, sorted(run.ranks)))

    async def _cancel(self, msg: pb.Cancel) -> None:
        self._log.info("cancel", job=msg.job_id, reason=msg.reason)
        try:
            await self.launcher.kill(msg.job_id)
        except LauncherError:
            return  # no launcher, so none of its ranks is left
        self._background_task(self._continue_stopped(msg.job_id))

    async def _continue_stopped(self, job_id: str, delay: float = 0.5) -> None:
        """A stopped rank keeps a SIGTERM pending until it goes on: continue the job's stopped ranks once
        the launcher had time to signal them, so that they end now rather than at the SIGKILL after the grace."""
        await asyncio.sleep(delay)
        for run in list(self.runs.values()):
            if run.job_id != job_id:
                continue
            for rank in sorted(run.alive):
                pid = run.pids.get(rank)
                if pid and process_state(pid) == "stopped":
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGCONT)
                        self._log.info("stopped rank continued to end it", job=job_id, rank=rank, pid=pid)

    def _checkpoint(self, msg: pb.CheckpointNow) -> None:
        """Ask the live ranks of the attempt to save a checkpoint at the end of ``msg.step``."""
        run = self.runs.get((msg.job_id, msg.attempt))
        if run is None:
            return
        for rank in sorted(run.alive):
            try:
                write_control(run.run_dir, rank, {"checkpoint_at": int(msg.step)})
            except OSError as exc:
                self._log.warning("checkpoint request not written", job=msg.job_id, rank=rank, error=str(exc))
        self._log.info("checkpoint requested", job=msg.job_id, attempt=msg.attempt, step=msg.step)

    async def _read(self, call: Any) -> None:
        while (msg := await call.read()) is not grpc.aio.EOF:  # read() style only: aio forbids mixing
            body = msg.WhichOneof("body")
            if body == "assign":
                await self._assign(msg.assign)
            elif body == "cancel":
                await self._cancel(msg.cancel)
            elif body == "ack":
                self.reports.acked(msg.ack.last_seq)
            elif body == "checkpoint":
                self._checkpoint(msg.checkpoint)
            elif body == "fetch_logs":
                task = asyncio.create_task(self._answer_fetch(msg.fetch_logs))
                self._answers.add(task)
                task.add_done_callback(self._answers.discard)

    async def _answer_fetch(self, req: pb.FetchLogs) -> None:
        """Read a rank's log file off the loop and send the chunk back."""
        chunk = await asyncio.to_thread(answer_fetch, self.cfg.state_dir, req)
        self.stats.log_lines_shipped += len(chunk.lines)
        self._send_control(pb.NodeMessage(log_chunk=chunk))

    async def _write(self, call: Any) -> None:
        """The only writer of the stream: a due heartbeat first, then answers, then one batch of reports."""
        loop = asyncio.get_running_loop()
        beat, last_batch = 0, 0.0
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._beat.is_set():
                self._beat.clear()
                beat += 1
                # a batch sent within the interval already showed the node alive: skip all but the port beats
                if beat % 5 == 0 or loop.time() - last_batch >= self._heartbeat_interval:
                    ports = free_ports(self.cfg.advertise_address, self.cfg.free_ports) if beat % 5 == 0 else []
                    await call.write(pb.NodeMessage(heartbeat=pb.Heartbeat(
                        ts=loop.time(), free_ports=ports, usage=self._usage.sample())))
            while self._control:
                await call.write(self._control.popleft())
            if not self.reports.unsent:
                continue
            wait = 0.0 if self.reports.urgent else last_batch + self.cfg.report_interval - loop.time()
            if wait > 0:  # step reports made meanwhile coalesce; a phase change or a due heartbeat ends the wait
                if not self._beat.is_set():
                    self._hurry.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._hurry.wait(), wait)
                self._wake.set()
                continue
            last_batch = loop.time()
            batch = self.reports.take(BATCH_REPORTS)
            await call.write(pb.NodeMessage(batch=pb.ReportBatch(reports=batch)))
            self.stats.reports_sent += len(batch)
            if self.reports.unsent:
                self._wake.set()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_interval)
            self._beat.set()
            self._wake.set()
            self._hurry.set()

    # -- session -----------------------------------------------------------------------------
    def _register_msg(self) -> pb.NodeMessage:
        running = [pb.RunningJob(job_id=r.job_id, attempt=r.attempt, ranks=sorted(r.alive))
                   for r in self.runs.values() if r.alive]
        return pb.NodeMessage(register=pb.Register(
            name=self.cfg.name, address=self.cfg.advertise_address, slots=self.cfg.slots,
            hardware=hardware_pb(self.launcher.hardware), running=running, session=self._session,
            peer_port=self.cfg.peer_port,
            free_ports=free_ports(self.cfg.advertise_address, self.cfg.free_ports),
        ))

    async def _session_once(self) -> None:
        channel = (grpc.aio.secure_channel(self.cfg.coordinator, self._credentials) if self._credentials is not None
                   else grpc.aio.insecure_channel(self.cfg.coordinator))
        async with channel:
            self._channel = channel
            call = pb_grpc.NodeServiceStub(channel).Connect()
            await call.write(self._register_msg())
            first = await call.read()
            if first is grpc.aio.EOF or first.WhichOneof("body") != "registered":
                raise ConnectionError("coordinator did not acknowledge registration")
            ack = first.registered
            self._heartbeat_interval = ack.heartbeat_interval or 1.0
            replayed = self.reports.rewind(ack.last_seq)
            self._control.clear()
            self._online = True
            self.stats.registrations += 1
            self._wake.set()
            self.connected.set()
            await self._update_health()
            self._log.info("registered", coordinator=self.cfg.coordinator, replayed=replayed)
            tasks = [asyncio.create_task(c) for c in (self._read(call), self._write(call), self._heartbeats())]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
            finally:
                self._online = False
                self._channel = None
                self.connected.clear()
                for t in (*tasks, *self._answers):
                    t.cancel()
                self._answers.clear()
                call.cancel()
                await self._update_health()  # last: a cancellation here skips nothing else

    async def _connect_loop(self) -> None:
        delay = 0.0  # the previous wait; 0 after a registered session
        while not self._stopping.is_set():
            registered, error = self.stats.registrations, ""
            try:
                await self._session_once()
            except (grpc.aio.AioRpcError, ConnectionError, OSError) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and name_taken(exc):
                    self._log.error("node name taken; stopping", error=exc.details())
                    raise NodeNameTaken(exc.details()) from None
                if isinstance(exc, grpc.aio.AioRpcError) and "revoked" in (exc.details() or ""):
                    self._log.error("the coordinator refuses this node's certificate: it is revoked (ctl certs "
                                    "revoke); retrying at the backoff's pace", error=exc.details())
                self.stats.connect_failures += 1
                error = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            if self.stats.registrations > registered:
                delay = 0.0
            delay = reconnect_delay(delay, self.cfg.backoff_initial, self.cfg.backoff_max, self._rng)
            if error:
                self._log.warning("coordinator unreachable", coordinator=self.cfg.coordinator, error=error,
                                  retry_in=round(delay, 2))
            await asyncio.sleep(delay)

    async def run(self) -> None:
        """Until ``stop()``; raises ``LauncherLost`` or ``NodeNameTaken`` when the daemon must exit."""
        self._session = f"{self.cfg.name}-{os.getpid()}-{id(self):x}"
        self._log.info("rank containment", how=getattr(self.launcher, "containment", "") or "unknown")
        stale = await asyncio.to_thread(shm.unmount_stale, str(self.cfg.state_dir))
        if stale:
            self._log.info("stale job /dev/shm unmounted", mounts=len(stale))
        tasks = [asyncio.create_task(c) for c in (self._connect_loop(), self._pump_launcher(), self._poll_files())]
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopping and not t.cancelled() and t.exception() is not None:
                    raise t.exception()
        finally:
            for t in (stopping, *tasks, *self._background):
                t.cancel()
            await asyncio.gather(*tasks, *self._background, return_exceptions=True)
            if self._own_launcher is not None:
                await self._own_launcher.close()

    def stop(self) -> None:
        self._stopping.set()
