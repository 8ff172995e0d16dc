"""Run one worker daemon: warm launcher first (before any gRPC), health service, session."""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import replace
from typing import Awaitable, Callable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rankctl.proto import rankctl_pb2_grpc as pb_grpc
from rankctl.worker.daemon import DaemonConfig, WorkerDaemon
from rankctl.worker.replicas import PeerServicer, ShardStore

log = structlog.get_logger("rankctl.worker")


SERVICES = ("", "rankctl.v1.Worker")
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


async def start_health(listen: str, identity=None) -> tuple[grpc.aio.Server, int, Callable[[bool], Awaitable[None]]]:  # noqa: ANN001
    """The gRPC health service: (server, bound port, ``set_serving(ok)``); TLS (no client certificate
    needed: it tells only whether the node serves) when ``identity``."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = _bind(server, listen, identity, require_client_auth=False)
    await server.start()

    async def set_serving(ok: bool) -> None:
        state = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in SERVICES:
            await servicer.set(service, state)

    await set_serving(True)
    return server, port, set_serving


async def start_peer(host: str, state_dir, identity=None) -> tuple[grpc.aio.Server | None, int]:  # noqa: ANN001
    """The PeerService (checkpoint replication) on the advertised address; (None, 0) when it cannot bind.
    With ``identity``: mutual TLS, node certificates only."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    identify = None
    if identity is not None:
        from rankctl.security.tls import peer_identity as identify
    pb_grpc.add_PeerServiceServicer_to_server(PeerServicer(ShardStore(state_dir), identify), server)
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    try:
        port = _bind(server, f"{host}:0", identity, require_client_auth=True)
    except RuntimeError:
        log.warning("peer service not started: cannot bind", address=host)
        return None, 0
    await server.start()
    return server, port


async def run_worker(cfg: DaemonConfig, stop: asyncio.Event | None = None, launcher=None) -> None:
    """Run until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None); kills every rank on exit.

    Raises ``LauncherLost`` when the launcher died and no new one would start, ``NodeNameTaken``
    when the coordinator refuses the node's name.
    """
    from rankctl.worker.launcher_client import Launcher

    own_launcher = launcher is None
    if own_launcher:
        launcher = await Launcher.start(python=sys.executable)
    if cfg.slots < 1:  # one rank per GPU, or one slot on a CPU node
        cfg = replace(cfg, slots=len(launcher.hardware.get("gpus", [])) or 1)
    identity = None
    if cfg.tls_dir:
        from rankctl.security.tls import load_identity_dir

        identity = load_identity_dir(cfg.tls_dir)
    health_server, port, set_serving = await start_health(cfg.health_listen, identity)
    peer_server, peer_port = await start_peer(cfg.advertise_address, cfg.state_dir, identity)
    cfg = replace(cfg, peer_port=peer_port)
    daemon = WorkerDaemon(cfg, launcher, start_launcher=lambda: Launcher.start(python=sys.executable),
                          set_serving=set_serving)
    log.info("worker started", node=cfg.name, slots=cfg.slots, coordinator=cfg.coordinator, health_port=port,
             gpus=len(launcher.hardware.get("gpus", [])))
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    runner = asyncio.create_task(daemon.run())
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([runner, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        daemon.stop()
        stopped.cancel()
        try:
            await runner  # re-raises why the daemon ended on its own
        finally:
            if own_launcher:
                await launcher.close()
            await set_serving(False)
            await health_server.stop(0.5)
            if peer_server is not None:
                await peer_server.stop(0.5)
            log.info("worker stopped", node=cfg.name)
