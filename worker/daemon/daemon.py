"""The worker daemon, one per node, assembled from parts with one job each:

``worker.uplink.session`` (the stream to the coordinator: registration, heartbeats, acks, reconnects),
``worker.runs.supervisor`` (the warm launcher: its events, its restarts), ``worker.runs.runs`` (the attempts here:
status files, exits, hang evidence, replication) and ``worker.runs.assign`` (Assign admission). They share an
outbox of rank reports (``worker.uplink.outbox``); this module builds them, routes the coordinator's requests
and says when the node is healthy: a registered session and a live launcher. This process never forks.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any, Awaitable, Callable

import grpc
import structlog

from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.runs import hangwatch
from rankctl.worker.files import shm
from rankctl.worker.runs.assign import Admission
from rankctl.worker.files.blobs import WorkdirCache
from rankctl.worker.daemon.config import DaemonConfig
from rankctl.worker.runs.inplace import InPlace
from rankctl.worker.runs.launcher_client import Launcher, LauncherError
from rankctl.worker.daemon.metrics import DaemonFigures, DaemonStats
from rankctl.worker.uplink.outbox import Outbox
from rankctl.worker.uplink import relay as relays
from rankctl.worker.replication.shardstore import ShardStore
from rankctl.worker.replication.replication import Replication
from rankctl.worker.runs.runs import Runs
from rankctl.worker.files.sandbox import allowed_roots, write_roots
from rankctl.worker.uplink.session import CoordinatorSession, NodeNameTaken
from rankctl.worker.runs.supervisor import LauncherLost, LauncherSupervisor, RestartPolicy
from rankctl.worker.daemon.tasks import Background
from rankctl.worker.runs.watch import ProcessWatch

__all__ = ["DaemonConfig", "LauncherLost", "NodeNameTaken", "WorkerDaemon"]  # run() raises the two errors

log = structlog.get_logger("rankctl.worker")

MAX_BUFFERED_REPORTS = 200_000


class WorkerDaemon:
    """Runs until ``stop()``; ``launcher`` is a started ``worker.runs.launcher_client.Launcher``.

    ``start_launcher`` starts a replacement when the launcher dies (the daemon closes those it
    started); ``set_serving`` hears the node's health when it changes (True while a session is
    registered and a launcher runs); ``rng`` jitters the reconnect waits (tests pass a seeded one).
    """

    def __init__(self, cfg: DaemonConfig, launcher: Any, *,
                 start_launcher: Callable[[], Awaitable[Any]] | None = None,
                 set_serving: Callable[[bool], Awaitable[None]] | None = None,
                 rng: random.Random | None = None, relay: relays.RelayInbox | None = None) -> None:
        self.cfg = cfg
        self.stats = DaemonStats()
        self._set_serving = set_serving
        self._healthy: bool | None = None  # what set_serving was last told
        self.released = ""  # why the coordinator released this daemon (its allocation ended); "": not released
        self._stopping = asyncio.Event()
        self._log = node_log = log.bind(node=cfg.name)
        self._credentials = credentials = _credentials(cfg.tls_dir)
        self.relay = relay or relays.RelayInbox()   # relayed Assigns for this node (its PeerService's, when served)
        roots = allowed_roots(cfg.data_roots, str(cfg.state_dir))  # ValueError: a root is not a directory
        writable = tuple(write_roots(cfg.data_roots, str(cfg.state_dir)))  # where its ranks may create files
        workdirs = WorkdirCache(cfg.state_dir, cfg.workdir_cache_mb << 20)
        self.outbox = Outbox(MAX_BUFFERED_REPORTS)
        self._background = Background()
        self.replication = replication = Replication(ShardStore(cfg.state_dir), credentials=credentials,
                                                     background=self._background, log=node_log)
        py_spy = hangwatch.find_py_spy() if cfg.py_spy is None else cfg.py_spy or None
        self.runs = Runs(
            node=cfg.name, outbox=self.outbox, replication=replication, background=self._background,
            watch=ProcessWatch(node=cfg.name, outbox=self.outbox, background=self._background, py_spy=py_spy,
                               log=node_log),
            release_workdir=workdirs.unpin, poll_interval=cfg.poll_interval,
            start_poll_interval=cfg.start_poll_interval, log=node_log)
        self.supervisor = LauncherSupervisor(
            launcher, start=start_launcher or Launcher.start, node=cfg.name, listener=self.runs,
            policy=RestartPolicy(restarts=cfg.launcher_restarts, backoff=cfg.launcher_backoff,
                                 stable_s=cfg.launcher_stable_s),
            on_change=self._update_health, stopping=self._stopping, stats=self.stats, log=node_log)
        self.session = CoordinatorSession(
            cfg, outbox=self.outbox, inbound=self, running=self._running,
            hardware=lambda: self.supervisor.hardware, on_change=self._update_health, credentials=credentials,
            stats=self.stats, rng=rng or random.Random(), session_id=f"{cfg.name}-{os.getpid()}-{id(self):x}",
            data_roots=writable, log=node_log)
        uplink = self.session.uplink
        uplink.wake, uplink.online = self.outbox.wake.set, lambda: self.session.online
        self.relay.bind(cfg.name, self.assign, node_log, uplink)
        self.admission = Admission(cfg, runs=self.runs, launcher=self.supervisor, replication=replication,
                                   workdirs=workdirs, roots=roots, write_roots=writable,
                                   fetch_blob=self.session.fetch_blob,
                                   outbox=self.outbox, log=node_log)
        self.inplace = InPlace(node=cfg.name, runs=self.runs, kill=self.supervisor.kill, admit=self.admission.admit,
                               outbox=self.outbox, log=node_log)

    @property
    def connected(self) -> asyncio.Event:
        """Set while a session with the coordinator is registered."""
        return self.session.connected

    def _running(self) -> list[pb.RunningJob]:
        """What a registration lists: the attempts with live ranks here, and those whose start waits for them."""
        return self.runs.running_jobs() + self.inplace.waiting()

    @property
    def online(self) -> bool:
        return self.session.online

    @property
    def refused(self) -> int:
        """Assign messages refused."""
        return self.admission.refused

    def figures(self) -> DaemonFigures:
        """What ``worker.daemon.metrics`` shows of this daemon."""
        return DaemonFigures(node=self.cfg.name, slots=self.cfg.slots, stats=self.stats, online=self.online,
                             launcher_alive=self.supervisor.alive, refused=self.refused,
                             buffered=len(self.outbox.buffer), dropped=self.outbox.buffer.dropped,
                             live_phases=self.runs.live_phases())

    # -- the coordinator's requests (worker.session.Inbound) ---------------------------------
    async def assign(self, msg: pb.Assign) -> None:
        if not self.relay.fresh(msg):   # a copy once, whichever way it came (``worker.uplink.relay``)
            self._log.info("assign not taken", job=msg.job_id, attempt=msg.attempt, why="again")
            return
        if self.inplace.cancelled(msg.job_id, msg.attempt):   # a relayed one that came after its Cancel
            self._log.info("assign not taken", job=msg.job_id, attempt=msg.attempt, why="cancelled")
            self.inplace.never_started(msg)
            return
        if not self.inplace.assign(msg):  # else a restart in place: the new ranks start once the old are gone
            await self.admission.admit(msg)

    def relay_through(self, msg: pb.Relay) -> None:
        """This node heads a relay group: forward the items beside the session, then answer the coordinator."""
        async def run() -> None:
            done = await relays.forward(msg, self.relay, self._credentials)
            if done.failed:
                self._log.warning("relay: not delivered", nodes=len(done.failed), error=done.error)
            self.session.answer(pb.NodeMessage(relay_done=done))
        self._background.spawn(run())

    async def cancel(self, msg: pb.Cancel) -> None:
        """Stop the job's ranks here: of ``msg.attempt`` and older ones, never of a newer attempt assigned since
        (a late Cancel of an attempt this node already replaced in place); every attempt's when it names none."""
        self._log.info("cancel", job=msg.job_id, attempt=msg.attempt, reason=msg.reason)
        self.inplace.cancel(msg)
        live = self.runs.live_attempts(msg.job_id)
        # None: every attempt here; else only those up to the Cancel's (a newer one was assigned since)
        attempts = [a for a in live if a <= msg.attempt] if msg.attempt and any(a > msg.attempt for a in live) \
            else None
        self.runs.stopping(msg.job_id, attempts, msg.reason)
        try:
            if attempts is not None:
                for attempt in attempts:
                    await self.supervisor.kill(msg.job_id, attempt)
            else:
                await self.supervisor.kill(msg.job_id)
        except LauncherError:
            return  # no launcher, so none of its ranks is left
        self.runs.continue_stopped(msg.job_id)

    def checkpoint(self, msg: pb.CheckpointNow) -> None:
        self.runs.request_checkpoint(msg)

    def release(self, msg: pb.Release) -> None:
        """This daemon's allocation ended (``--pool``): stop, ranks and launcher with it, and exit 0, so that the
        scheduler's job (a Slurm job step) completes."""
        self._log.info("released", pool=self.cfg.pool, reason=msg.reason)
        self.released = msg.reason
        self.stop()

    # -- life --------------------------------------------------------------------------------
    async def _update_health(self) -> None:
        """Tell ``set_serving`` when the node's health changed: SERVING needs a session and a launcher."""
        ok = self.session.online and self.supervisor.alive
        if ok != self._healthy and self._set_serving is not None:
            self._healthy = ok
            await self._set_serving(ok)

    async def run(self) -> None:
        """Until ``stop()``; raises ``LauncherLost`` or ``NodeNameTaken`` when the daemon must exit."""
        self._log.info("rank containment", how=getattr(self.supervisor.launcher, "containment", "") or "unknown")
        stale = await asyncio.to_thread(shm.unmount_stale, str(self.cfg.state_dir))
        if stale:
            self._log.info("stale job /dev/shm unmounted", mounts=len(stale))
        tasks = [asyncio.create_task(c) for c in (self.session.run(), self.supervisor.run(), self.runs.poll_loop())]
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopping and not t.cancelled() and t.exception() is not None:
                    raise t.exception()
        finally:
            for t in (stopping, *tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._background.cancel()
            await self.relay.close()
            await self.replication.close()
            await self.inplace.close()
            await self.supervisor.close()

    def stop(self) -> None:
        self._stopping.set()


def _credentials(tls_dir: str | None) -> grpc.ChannelCredentials | None:
    """This node's certificate for the coordinator and its peers (mutual TLS); None: plain text."""
    if not tls_dir:
        return None
    from rankctl.security.tls import channel_credentials, load_identity_dir

    return channel_credentials(load_identity_dir(tls_dir))
