"""Rendezvous and timeouts of a rank: the backend and device, the TCPStore, the default group.

Rank 0's store listens on the rendezvous address only (rank 0's node's advertised address), not on every
interface as TCPStore binds by itself. A collective that gives up waiting is reported as a *victim* line, since
the peer that hung or died is usually the cause.
"""

from __future__ import annotations

import errno
import re
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from rankctl.contract.assignment import RankAssignment

_TIMEOUT_RE = re.compile(r"timed? ?out|timeout", re.IGNORECASE)


def resolve_backend(assignment: RankAssignment) -> tuple[str, torch.device]:
    """(backend, device): nccl with the assigned GPU when CUDA is there, gloo on CPU otherwise."""
    backend = assignment.backend
    cuda = assignment.device is not None and torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"unknown backend {backend!r}; backends are auto, nccl, gloo")
    if backend == "nccl" and not cuda:
        raise RuntimeError(f"backend nccl needs a CUDA device, but device={assignment.device} "
                           f"and torch.cuda.is_available()={torch.cuda.is_available()}")
    device = torch.device("cuda", assignment.device) if cuda else torch.device("cpu")
    return backend, device


def init_distributed(assignment: RankAssignment, timeout: timedelta) -> tuple[str, torch.device]:
    """Rendezvous through a TCPStore hosted by rank 0 and create the default group.

    The device is set but deliberately not bound (no ``device_id``): see ``parallel.groups``.
    """
    backend, device = resolve_backend(assignment)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = open_store(assignment, timeout)
    dist.init_process_group(
        backend, store=store, rank=assignment.rank, world_size=assignment.world_size, timeout=timeout,
    )
    return backend, device


def open_store(assignment: RankAssignment, timeout: timedelta) -> dist.TCPStore:
    """The job's TCPStore: rank 0 hosts it on the rendezvous address only, the others connect to it.

    The rendezvous host is the address rank 0's node advertises (the one every rank connects to); the store
    listens there rather than on every interface (TCPStore's own bind), through a socket bound here and
    handed over (``master_listen_fd``; the store then owns it, so a store that fails to start leaves the socket
    to the rank's exit rather than risk closing a descriptor twice).
    """
    host, port = assignment.rendezvous_host, assignment.rendezvous_port
    if assignment.rank != 0:
        await_listener(host, port, timeout.total_seconds())
        return dist.TCPStore(host, port, assignment.world_size, is_master=False, timeout=timeout)
    listener = listen_on(host, port)
    return dist.TCPStore(host, port, assignment.world_size, is_master=True, timeout=timeout,
                         master_listen_fd=listener.detach())


def await_listener(host: str, port: int, timeout_s: float, every_s: float = 0.005) -> None:
    """Return once ``host:port`` accepts a connection (or after ``timeout_s``, leaving the error to the store).

    A TCPStore client that finds no listener retries with a jittered back-off of its own: a rank that starts a
    few milliseconds before rank 0 (as every rank of a restart may) waited 0.25-0.75 s for a store that was up
    after 20 ms. Probing here every 5 ms connects within milliseconds of rank 0's ``listen``.
    """
    deadline = time.monotonic() + timeout_s
    address = (host.strip("[]"), port)
    while True:
        try:
            socket.create_connection(address, timeout=max(0.1, min(1.0, deadline - time.monotonic()))).close()
            return
        except socket.gaierror:
            return  # the store names the unresolvable host itself
        except OSError:
            if time.monotonic() + every_s >= deadline:
                return
            time.sleep(every_s)


def listen_on(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (a name is resolved here, its first address taken); a host
    that is no address of this machine is a clear error, never a wider bind."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise RuntimeError(f"cannot resolve the rendezvous host {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own bind: a TIME_WAIT port
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        hint = " (the node's --advertise-address must be an address of this host)" \
            if exc.errno == errno.EADDRNOTAVAIL else ""
        raise RuntimeError(f"rank 0 cannot host the rendezvous store on {host}:{port}: {exc.strerror}{hint}") from None
    return sock


def is_collective_timeout(exc: BaseException) -> bool:
    """A store or collective that gave up waiting (gloo, TCPStore), anywhere in the chain."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (RuntimeError, TimeoutError)) and _TIMEOUT_RE.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def victim_line(rank: int, timeout_s: float, phase: str) -> str:
    """The last line of a timed-out rank's error (the job's failure reason quotes it)."""
    return (f"CollectiveTimeout: rank {rank} timed out after {timeout_s:g} s waiting in a collective ({phase}); "
            "it is a victim, not necessarily the cause: a peer in its group may have hung or died")
