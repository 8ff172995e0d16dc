"""Run one worker daemon: warm launcher first (before any gRPC), health service, session, metrics.

Health (grpc.health.v1): the overall service "" is SERVING while the daemon has a registered
coordinator session and a live launcher (the daemon says when that changes); ``PEER_SERVICE``
is SERVING while this node serves checkpoint shards to its peers (it does not need the coordinator).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rankctl.proto import rankctl_pb2_grpc as pb_grpc
from rankctl.contract.files import checkpoints
from rankctl.security.malformed import RequestGuard
from rankctl.worker.files import mountreg
from rankctl.worker.files import shm
from rankctl.worker.files import snapmem
from rankctl.worker.daemon.daemon import DaemonConfig, WorkerDaemon
from rankctl.worker.uplink.relay import RelayInbox
from rankctl.worker.replication.replicas import PeerServicer
from rankctl.worker.replication.shardstore import ShardStore

log = structlog.get_logger("rankctl.worker")
REAP_EVERY_S = 5.0   # how often a daemon unmounts what dead workers left on its host (``worker.files.mountreg``)


OVERALL = ""                               # the node: coordinator session and launcher
PEER_SERVICE = "rankctl.v1.PeerService"    # served on the advertised address (start_peer)
PEER_MESSAGE_BYTES = 4 << 20   # shard chunks are 1 MiB
SERVER_OPTIONS = (("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", PEER_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", PEER_MESSAGE_BYTES))


def _bind(server: grpc.aio.Server, address: str, identity, require_client_auth: bool) -> int:  # noqa: ANN001
    """Add ``address`` to ``server``: TLS with this node's certificate when ``identity`` (an IdentityDir)."""
    if identity is None:
        return server.add_insecure_port(address)
    creds = grpc.ssl_server_credentials([(identity.key, identity.cert)], root_certificates=identity.ca,
                                        require_client_auth=require_client_auth)
    return server.add_secure_port(address, creds)


def _status(ok: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING


async def start_health(listen: str,
                       identity=None) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:  # noqa: ANN001
    """The gRPC health service, every service NOT_SERVING until told otherwise: (server, bound port,
    servicer); TLS (no client certificate needed: it tells only whether the node serves) when ``identity``."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[RequestGuard()])
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = _bind(server, listen, identity, require_client_auth=False)
    await server.start()
    for service in (OVERALL, PEER_SERVICE):
        await servicer.set(service, _status(False))
    return server, port, servicer


def serving_setter(servicer: health.aio.HealthServicer, service: str = OVERALL) -> Callable[[bool], Awaitable[None]]:
    """``set_serving(ok)`` for one service of ``servicer``."""
    async def set_serving(ok: bool) -> None:
        await servicer.set(service, _status(ok))

    return set_serving


async def start_peer(host: str, state_dir, identity=None,  # noqa: ANN001
                     bound: snapmem.Bound | None = None,
                     relay: RelayInbox | None = None) -> tuple[grpc.aio.Server | None, int]:
    """The PeerService (checkpoint replication, relayed messages) on the advertised address; (None, 0) when it
    cannot bind. With ``identity``: mutual TLS, node certificates only; ``bound``: the node's snapshot memory
    bound; ``relay``: where relayed items for this node go (``worker.uplink.relay``)."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[RequestGuard()])
    identify = None if identity is None else _identify_unrevoked(identity.revocations)
    pb_grpc.add_PeerServiceServicer_to_server(PeerServicer(ShardStore(state_dir), identify, bound, relay), server)
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    try:
        port = _bind(server, f"{host}:0", identity, require_client_auth=True)
    except RuntimeError:
        log.warning("peer service not started: cannot bind", address=host)
        return None, 0
    await server.start()
    return server, port


def _identify_unrevoked(revocations):  # noqa: ANN001, ANN202 - security.revocation.Revocations
    """The peer's identity (``security.tls.peer_identity``); ValueError when its certificate is on the CA's CRL
    (``crl.pem`` in the node's --tls-dir, re-read when it changes)."""
    from rankctl.security.tls import peer_identity, peer_pem, revoked_problem

    def identify(context):  # noqa: ANN001, ANN202
        who = peer_identity(context)
        why = revoked_problem(revocations, peer_pem(context), who)
        if why:
            raise ValueError(why)
        return who
    return identify


@dataclass
class _Services:
    """The daemon's servers beside its coordinator session: health, peer shards, metrics (optional)."""

    health: grpc.aio.Server
    health_port: int
    servicer: health.aio.HealthServicer
    peer: grpc.aio.Server | None
    peer_port: int
    identity: Any = None           # security.tls.IdentityDir: TLS everywhere; None: plain text
    metrics: Any = None            # aiohttp AppRunner of /metrics; None: off
    metrics_port: int = 0
    relay: RelayInbox | None = None  # relayed items for this node, handed by a relay head (``worker.uplink.relay``)

    async def start_metrics(self, listen: str, daemon: WorkerDaemon) -> None:
        """The daemon's Prometheus endpoint (``worker.daemon.metrics``) when ``listen``; OSError when it cannot bind."""
        if listen:
            from rankctl.worker.daemon.metrics import WorkerMetrics, serve_metrics

            self.metrics, self.metrics_port = await serve_metrics(listen, WorkerMetrics(daemon), self.identity)

    async def stop(self) -> None:
        for service in (OVERALL, PEER_SERVICE):
            await self.servicer.set(service, _status(False))
        if self.metrics is not None:
            await self.metrics.cleanup()
        await self.health.stop(0.5)
        if self.peer is not None:
            await self.peer.stop(0.5)


async def _start_services(cfg: DaemonConfig, bound: snapmem.Bound) -> _Services:
    identity = None
    if cfg.tls_dir:
        from rankctl.security.tls import load_identity_dir

        identity = load_identity_dir(cfg.tls_dir)
    health_server, port, servicer = await start_health(cfg.health_listen, identity)
    relay = RelayInbox()   # the daemon binds it to itself
    peer_server, peer_port = await start_peer(cfg.advertise_address, cfg.state_dir, identity, bound, relay)
    await servicer.set(PEER_SERVICE, _status(peer_server is not None))
    return _Services(health_server, port, servicer, peer_server, peer_port, identity, relay=relay)


async def run_worker(cfg: DaemonConfig, stop: asyncio.Event | None = None, launcher=None) -> None:
    """Run until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None); kills every rank on exit.

    Raises ``LauncherLost`` when the launcher died and no new one would start, ``NodeNameTaken``
    when the coordinator refuses the node's name, OSError when the metrics address cannot be bound.
    The snapshot memory bound (``worker.files.snapmem``) is in force before a peer can push or a rank run.
    """
    reaped = mountreg.reap(shm.unmount, keep=[checkpoints.memory_base(str(cfg.state_dir))])
    if reaped:   # what SIGKILLed workers left on this host, whatever their state dir (``worker.files.mountreg``)
        log.info("unmounted what dead workers left", node=cfg.name, paths=reaped)
    bound = snapmem.apply(str(cfg.state_dir), cfg.snapshot_memory_mb)
    log.info("snapshot memory bound", node=cfg.name, **bound.fields())
    reaper = asyncio.create_task(_reap_dead_owners(cfg.name, [checkpoints.memory_base(str(cfg.state_dir))]))
    try:
        await _run_worker(cfg, stop, launcher, bound)
    finally:
        reaper.cancel()
        if snapmem.release(bound):  # empty: it would outlive the daemon for nothing
            log.info("snapshot memory unmounted", node=cfg.name, path=bound.base)


async def _reap_dead_owners(node: str, keep: list[str], every: float = REAP_EVERY_S) -> None:
    """Again every ``every`` seconds: a worker SIGKILLed after this one started leaves mounts whose last owner (its
    launcher) may outlive it by a moment, past the next worker's start; the next turn takes them."""
    while True:
        await asyncio.sleep(every)
        reaped = await asyncio.to_thread(mountreg.reap, shm.unmount, keep)
        if reaped:
            log.info("unmounted what dead workers left", node=node, paths=reaped)


async def _run_worker(cfg: DaemonConfig, stop: asyncio.Event | None, launcher: Any, bound: snapmem.Bound) -> None:
    from rankctl.worker.runs.launcher_client import Launcher

    own_launcher = launcher is None
    if own_launcher:
        launcher = await Launcher.start(python=sys.executable, idle_warm=cfg.idle_warm)
    if cfg.slots < 1:  # one rank per GPU, or one slot on a CPU node
        cfg = replace(cfg, slots=len(launcher.hardware.get("gpus", [])) or 1)
    services = await _start_services(cfg, bound)
    cfg = replace(cfg, peer_port=services.peer_port)
    daemon = WorkerDaemon(cfg, launcher, start_launcher=lambda: Launcher.start(python=sys.executable, idle_warm=cfg.idle_warm),
                          set_serving=serving_setter(services.servicer), relay=services.relay)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    runner: asyncio.Task | None = None
    stopped = asyncio.create_task(stop.wait())
    try:
        await services.start_metrics(cfg.metrics_listen, daemon)
        log.info("worker started", node=cfg.name, slots=cfg.slots, coordinator=cfg.coordinator,
                 health_port=services.health_port, peer_port=services.peer_port, metrics_port=services.metrics_port,
                 gpus=len(launcher.hardware.get("gpus", [])))
        runner = asyncio.create_task(daemon.run())
        await asyncio.wait([runner, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        daemon.stop()
        stopped.cancel()
        try:
            if runner is not None:
                await runner  # re-raises why the daemon ended on its own
        finally:
            if own_launcher:   # ranks gone (the daemon stopped them): a warming launcher need not be waited for
                await launcher.close(idle=not daemon.runs.running_jobs())
            await services.stop()
            log.info("worker stopped", node=cfg.name)
