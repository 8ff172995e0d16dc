"""The coordinator process: grpc.aio server, health service, failure-detection monitor.

``start_coordinator`` binds (``127.0.0.1:0`` picks a free port; ``.port`` is the one
bound), loads the state under ``state_dir`` and starts serving. ``main`` is a small
entry point (``python -m rankctl.coordinator.app.server --listen ... --state-dir ...``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from rankctl.coordinator.batch.allocation_loop import allocation_loop
from rankctl.coordinator.api.auth import Authorizer
from rankctl.coordinator.store.blobs import QUOTA_BYTES, RETENTION_S, BlobStore, collect_loop
from rankctl.coordinator.jobs.core import Coordinator
from rankctl.coordinator.api import reflection
from rankctl.coordinator.ha.etcd import StoreURL
from rankctl.coordinator.ha.replicator import Replicator, snapshots
from rankctl.coordinator.api.gate import LeaderGate
from rankctl.coordinator.app.gcpace import Freezer
from rankctl.coordinator.api.info import VERSION, coordinator_info
from rankctl.coordinator.api.node_service import NodeServiceServicer
from rankctl.coordinator.scheduling.relay import WIDTH as RELAY_WIDTH
from rankctl.coordinator.jobs.intake import FLUSH_S
from rankctl.coordinator.api.servicer import ClientServiceServicer
from rankctl.coordinator.batch.slurm import SlurmAllocator
from rankctl.coordinator.store.database import Store, prune_events, restore
from rankctl.coordinator.app.transport import SERVER_OPTIONS, keepalive_options
from rankctl.proto import rankctl_pb2_grpc
from rankctl.security.malformed import RequestGuard

if TYPE_CHECKING:
    from rankctl.coordinator.ha.etcd import EtcdTLS
    from rankctl.coordinator.ha.switch import HighAvailability
    from rankctl.coordinator.web.app import HttpServer

log = structlog.get_logger("rankctl.coordinator")
SERVICES = ("", "rankctl.v1.ClientService", "rankctl.v1.NodeService")
LEASE_TTL_S = 3  # a replicated store's leader lease: a dead leader is replaced within it
EVENT_RETENTION_S = 30 * 86400  # a finished job's events are kept this long (its last one, and the job, always)
@dataclass
class Leading:
    """What a leading coordinator runs over its store: the core, the blob store and their tasks."""

    core: Coordinator
    store: Store
    blobs: BlobStore
    tasks: list[asyncio.Task] = field(default_factory=list)
    http: "HttpServer | None" = None

    async def stop(self) -> None:
        self.core.shutdown()
        if isinstance(self.store.replica, Replicator):
            self.store.replica.close()
        if self.http is not None:
            await self.http.stop()
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@dataclass
class CoordinatorServer:
    """A running coordinator: ``.port`` and ``.address`` are where it listens; ``.core`` and ``.store`` while it
    leads (always, on the embedded store; ``ha`` is set on a replicated one)."""

    server: grpc.aio.Server
    health: health_aio.HealthServicer
    host: str
    port: int
    settings: "LeaderSettings"
    client: ClientServiceServicer
    node: NodeServiceServicer
    leading: Leading | None = None
    ha: "HighAvailability | None" = None
    http_host: str = ""
    member_id: str = ""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def core(self) -> Coordinator:
        assert self.leading is not None, "this coordinator does not lead"
        return self.leading.core

    @property
    def store(self) -> Store:
        assert self.leading is not None, "this coordinator does not lead"
        return self.leading.store

    @property
    def http(self) -> "HttpServer | None":
        return self.leading.http if self.leading is not None else None

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    @property
    def http_address(self) -> str | None:
        """``host:port`` of the dashboard (None without one); ``http_url`` adds the scheme."""
        if self.http is None:
            return None
        host = f"[{self.http_host}]" if ":" in self.http_host else self.http_host
        return f"{host}:{self.http.port}"

    @property
    def http_url(self) -> str | None:
        return f"{'https' if self.http.tls else 'http'}://{self.http_address}" if self.http is not None else None

    async def lead(self, store: Store) -> None:
        """Lead on ``store``: assemble the core over it and serve (see ``LeaderSettings``)."""
        s = self.settings
        if store.replica is not None:   # a replicated store: its writes are stored behind the loop
            store.replica = Replicator(store.replica, store.serialize(), asyncio.get_running_loop(),
                                       on_refused=lambda exc: self._refused(store))
        core = Coordinator(store, clock=s.clock, heartbeat_timeout=s.heartbeat_timeout, relay_width=s.relay_width,
                           dial=(dial_address(s.listen, self.port, s.advertise), s.identity is not None), **s.core_extra)
        blobs = await asyncio.to_thread(BlobStore, s.state_dir, quota_bytes=s.blob_quota_bytes,
                                        retention_s=s.blob_retention_s, backing=s.blob_backing)
        self.client.core = self.node.core = core
        self.client.blobs = self.node.blobs = blobs
        leading = Leading(core, store, blobs)
        leading.tasks.append(asyncio.create_task(_monitor(core, period=max(0.05, min(0.5, s.heartbeat_timeout / 4)))))
        leading.tasks.append(asyncio.create_task(collect_loop(blobs, core.list, clock=s.clock)))
        leading.tasks.append(asyncio.create_task(allocation_loop(
            (core.allocations, core.pools), SlurmAllocator(Path(s.state_dir)), functools.partial(_archive_logs, core))))
        leading.tasks.append(asyncio.create_task(_prune_events(store, s.clock, s.event_retention_s)))
        if store.replica is not None:
            leading.tasks.append(asyncio.create_task(snapshots(store.replica)))
        self.leading = leading
        if s.http_listen is not None:
            await _start_dashboard(self, s.http_listen, s.identity, s.metrics_per_rank, Path(s.state_dir))
        core.schedule()

    def _refused(self, store: Store) -> None:
        """The replicated store refused writes this leader had committed to its copy: the copy goes back to what
        the store holds, and the core's memory with it (``Coordinator.rewound``)."""
        leading = self.leading
        if leading is None or leading.store is not store or not isinstance(store.replica, Replicator):
            return
        restore(store, store.replica.stored_image()[0])
        leading.core.rewound()

    async def follow(self) -> None:
        """Stop leading (a replicated store's leadership was lost): node streams close, so daemons move on."""
        leading, self.leading = self.leading, None
        if leading is None:
            return
        await leading.stop()
        leading.core.nodes.close_all()
        leading.store.close()
        log.info("coordinator.standing_by", address=self.address)

    def refusal(self) -> tuple[str, str] | None:
        """None while leading; else why not, and the leader's address ("" when none leads)."""
        if self.leading is not None:
            return None
        ha = self.ha
        why = ha.problem() if ha is not None else ""
        leader = (ha.leadership.leader or {}) if ha is not None and not why else {}
        if leader.get("address"):
            return (f"the coordinator at {self.address} is a standby; the leader is {leader['address']}",
                    leader["address"])
        if why:   # cut off from the store, it cannot know: another coordinator may well lead
            return (f"the coordinator at {self.address} is a standby that cannot reach the store, so it cannot tell "
                    f"which coordinator leads (another may: try the others' addresses): {why}", "")
        return (f"the coordinator at {self.address} is a standby and no coordinator leads yet: an election on the "
                f"store {ha.store_url if ha else ''} is under way", "")

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving without failing running jobs (their state stays for the next start)."""
        leading, self.leading = self.leading, None
        if leading is not None:
            await leading.stop()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if leading is not None:
            leading.store.close()
        if self.ha is not None:
            await self.ha.stop()
        log.info("coordinator.stopped", address=self.address)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


@dataclass
class LeaderSettings:
    """How this coordinator leads, whenever it does."""

    listen: str
    state_dir: Path
    heartbeat_timeout: float
    clock: Callable[[], float]
    core_extra: dict
    identity: object
    http_listen: str | None
    metrics_per_rank: bool
    blob_quota_bytes: int
    blob_retention_s: float
    advertise: str | None
    blob_backing: object = None   # where blobs also go on a replicated store (``coordinator.store.blobs``)
    event_retention_s: float = EVENT_RETENTION_S  # events of jobs finished longer ago are pruned
    relay_width: int = RELAY_WIDTH   # nodes a relay head serves in a big Assign fan-out (``coordinator.scheduling.relay``)


LAG_FLOOR_S = 0.25  # loop lag below this is noise, not a stall
GC_THRESHOLDS = (20_000, 50, 100)  # the collector's generation thresholds in a coordinator process


def tune_gc() -> None:
    """For a coordinator process: collect young objects less often and move what is loaded at start
    out of the collector's sight. The coordinator holds hundreds of thousands of long-lived,
    acyclic records (ranks, counters); with the default thresholds, full collections traversing
    them took ~9 % of its CPU at 16,384 ranks. Garbage is still freed by reference counting."""
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()


async def _monitor(core: Coordinator, period: float) -> None:
    """Failure detection: ``core.tick()`` every ``period`` seconds, told how late the loop was;
    and the group commit of rank reports (``core.flush``) every ``FLUSH_S``."""
    loop = asyncio.get_running_loop()
    last_tick = due = loop.time()
    stalled = 0.0
    freezer = Freezer(due)   # the collector kept off the critical path (``coordinator.app.gcpace``)
    while True:
        await asyncio.sleep(FLUSH_S)
        now = loop.time()
        lag = now - due - FLUSH_S  # how much later than asked this turn came: the loop was busy
        due = now
        stalled += lag if lag > LAG_FLOOR_S else 0.0
        try:
            if core.pending_work():
                core.flush()
            if now - last_tick >= period:
                core.tick(loop_lag=stalled)  # stalled time is not held against the nodes
                core.relays.due()            # relays whose head did not answer: their nodes' messages direct
                freezer.turn(now)
                last_tick, stalled = now, 0.0
        except Exception:
            log.exception("coordinator.monitor_failed")


def _bind_problem(listen: str) -> str:
    """Why ``listen`` cannot be bound, as the OS says it (after grpc's bind failed)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        return f"not a usable HOST:PORT ({exc})"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(addr)
        except OSError as exc:
            return "address in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return "grpc could not bind it"


def _listen_host(listen: str) -> str:
    """The host of ``listen`` ("host:port"), brackets off; "" for a wildcard (0.0.0.0, [::])."""
    host = (listen.rsplit(":", 1)[0] if ":" in listen else listen).strip("[]")
    return "" if host in ("0.0.0.0", "::") else host


def _split_listen(listen: str) -> str:
    return _listen_host(listen) or "127.0.0.1"


async def _archive_logs(core: Coordinator, job_id: str) -> int:
    """Keep the rank logs of an ended job whose allocation's nodes are about to leave (``logarchive``)."""
    job = core.book.jobs.get(job_id)
    return 0 if job is None else await core.logarchive.take(core.logfetch, job, core.clock)


def dial_address(listen: str, port: int, advertise: str | None = None) -> str:
    """Where workers on other hosts dial this coordinator: ``advertise``, else the listen host, else (a wildcard
    listen) this host's fully qualified name; with the bound port."""
    host = advertise or _listen_host(listen) or socket.getfqdn()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_coordinator(listen: str, state_dir: Path, heartbeat_timeout: float = 10.0, *,
                            clock: Callable[[], float] = time.time, head_wait: float | None = None,
                            tls_dir: str | Path | None = None, http_listen: str | None = None,
                            metrics_per_rank: bool = False, blob_quota_bytes: int = QUOTA_BYTES,
                            blob_retention_s: float = RETENTION_S, advertise: str | None = None,
                            store_url: str | None = None, etcd_tls: "EtcdTLS | None" = None,
                            lease_ttl: int = LEASE_TTL_S, event_retention_s: float = EVENT_RETENTION_S,
                            max_heartbeat_rate: float | None = None,
                            relay_width: int = RELAY_WIDTH) -> CoordinatorServer:
    """Load state from ``state_dir`` (locked for this process), bind ``listen`` exclusively
    ("host:port", port 0 = any) and serve. OSError when the state dir or the address is taken.

    ``advertise``: the host the workers a scheduler starts dial (``dial_address``).
    ``tls_dir``: the coordinator's identity directory (``ctl certs init``): serve mutual TLS only, every
    call authorized by its client certificate (``coordinator.api.auth``); CertError when it is unusable.
    ``http_listen``: also serve the dashboard and ``/metrics`` (per-rank series with ``metrics_per_rank``) there,
    HTTPS under ``tls_dir`` (``coordinator.web``); the bound address goes to ``state_dir/http_address``.
    ``event_retention_s``: the events of jobs finished longer ago are pruned (each keeps its last).
    ``max_heartbeat_rate``: heartbeats a second from the whole fleet at most (``sessions.MAX_HEARTBEAT_RATE``).
    ``relay_width``: an Assign fan-out to more nodes than this goes through relay heads (0: never).
    ``store_url``: keep the state on etcd (``etcd://HOST:PORT[,...][/prefix]``, TLS with ``etcd_tls``) and lead
    only when elected (``coordinator.ha.switch``); ``state_dir`` then holds this coordinator's local files only."""
    from rankctl.security.tls import load_identity_dir, server_credentials

    identity = load_identity_dir(tls_dir) if tls_dir else None  # before anything is locked or bound
    settings = LeaderSettings(listen, Path(state_dir), heartbeat_timeout, clock,
                              {**({} if head_wait is None else {"head_wait": head_wait}),
                               **({} if max_heartbeat_rate is None else {"max_heartbeat_rate": max_heartbeat_rate})},
                              identity, http_listen,
                              metrics_per_rank, blob_quota_bytes, blob_retention_s, advertise,
                              event_retention_s=event_retention_s, relay_width=relay_width)
    url = StoreURL.parse(store_url) if store_url else None
    store = Store(state_dir) if url is None else None  # the state dir's lock first: a second coordinator fails here
    client, node = ClientServiceServicer(None, None), NodeServiceServicer(None, None)
    holder: list[CoordinatorServer] = []
    server, health = _grpc_server(client, node, identity, LeaderGate(lambda: holder[0].refusal()),
                                  heartbeat_timeout)
    try:
        port = (server.add_secure_port(listen, server_credentials(identity)) if identity is not None
                else server.add_insecure_port(listen))
    except RuntimeError:
        if store is not None:
            store.close()
        raise OSError(f"cannot listen on {listen}: {_bind_problem(listen)}") from None
    coord = CoordinatorServer(server, health, _split_listen(listen), port, settings, client, node,
                              member_id=secrets.token_hex(4))
    holder.append(coord)
    client.info = functools.partial(coordinator_info, coord)
    await server.start()
    for name in SERVICES:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    try:
        if url is None:
            await coord.lead(store)
        else:
            await _stand_by(coord, url, etcd_tls, lease_ttl)
    except BaseException:
        await coord.stop(0)
        raise
    log.info("coordinator.started", address=coord.address, state_dir=str(state_dir), store=str(url or state_dir),
             jobs=len(coord.core.list()) if coord.leading else None, tls=identity is not None, dashboard=coord.http_url)
    return coord


async def _stand_by(coord: CoordinatorServer, url: StoreURL, etcd_tls: "EtcdTLS | None", lease_ttl: int) -> None:
    """Join the coordinators of a replicated store: load its state, campaign, lead when elected."""
    from rankctl.coordinator.ha.etcdblobs import EtcdBlobs
    from rankctl.coordinator.ha.etcd import Etcd
    from rankctl.coordinator.ha.switch import HighAvailability
    from rankctl.coordinator.ha.leadership import Member

    etcd = Etcd(url, etcd_tls)
    me = Member(coord.member_id, dial_address(coord.settings.listen, coord.port, coord.settings.advertise),
                VERSION, time.time())
    coord.ha = HighAvailability(etcd, url.prefix, coord.settings.state_dir, me, lease_ttl, coord.lead, coord.follow)
    coord.settings.blob_backing = EtcdBlobs(etcd, url.prefix, lambda: coord.ha.leadership.fence)
    await coord.ha.start()
    coord.ha.tasks.append(asyncio.create_task(_copy_blobs(coord)))


PRUNE_PERIOD_S = 3600.0
PRUNE_BATCH = 5000


async def _prune_events(store: Store, clock: Callable[[], float], retention_s: float) -> None:
    """Bound the event history: every hour, the events of jobs finished more than ``retention_s`` ago go (their
    last one stays), ``PRUNE_BATCH`` per transaction with the loop free between them."""
    while True:
        try:
            while prune_events(store, clock() - retention_s, PRUNE_BATCH) >= PRUNE_BATCH:
                await asyncio.sleep(0.05)
        except Exception as exc:  # noqa: BLE001 - the store refused: the next round tries again
            log.warning("events.prune_failed", error=str(exc))
        await asyncio.sleep(PRUNE_PERIOD_S)


async def _copy_blobs(coord: CoordinatorServer, period_s: float = 5.0) -> None:
    """While standing by, copy the store's blobs this coordinator lacks, so that it can lead at once."""
    root = coord.settings.state_dir / "blobs"
    (root.parent / "blob-owners").mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    while True:
        if coord.leading is None:
            try:
                await asyncio.to_thread(coord.settings.blob_backing.pull_missing, root, root.parent / "blob-owners")
            except Exception as exc:  # noqa: BLE001 - the store unreachable: next round
                log.debug("blobs.copy_failed", error=str(exc))
        await asyncio.sleep(period_s)


def _grpc_server(client: ClientServiceServicer, node: NodeServiceServicer, identity,  # noqa: ANN001 - tls.Identity
                 gate: LeaderGate, heartbeat_timeout: float) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    """The server with its services (client, node, health, reflection), every call through the RequestGuard
    (undecodable requests refused), the Authorizer (enabled with an ``identity``), then the leader gate; not
    bound yet."""
    from rankctl.security.tls import peer_identity

    server = grpc.aio.server(options=SERVER_OPTIONS + keepalive_options(heartbeat_timeout),
                             interceptors=[RequestGuard(), Authorizer(
                                 peer_identity, enabled=identity is not None,
                                 revocations=identity.revocations if identity is not None else None), gate])
    rankctl_pb2_grpc.add_ClientServiceServicer_to_server(client, server)
    rankctl_pb2_grpc.add_NodeServiceServicer_to_server(node, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    # server reflection, v1 and v1alpha (grpcurl, Postman, Evans): the services' descriptors, no .proto needed
    reflection.enable((*SERVICES[1:], health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server)
    return server, health


async def _start_dashboard(coord: CoordinatorServer, listen: str, identity, metrics_per_rank: bool,  # noqa: ANN001
                           state_dir: Path) -> None:
    """Serve the dashboard on ``listen``; write its bound address to ``state_dir/http_address``. On failure the
    coordinator is stopped again and OSError raised (the CLI says the address cannot be served)."""
    from rankctl.coordinator.web.app import start_http

    try:
        coord.leading.http = await start_http(coord.core, listen, identity, metrics_per_rank)
    except OSError as exc:
        await coord.stop(0)
        raise OSError(f"cannot serve the dashboard on {listen}: {exc.strerror or exc}") from None
    coord.http_host = _split_listen(listen)
    (state_dir / "http_address").write_text(coord.http_address + "\n")

