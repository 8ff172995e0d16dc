"""Rendezvous and timeouts of a rank: the backend and device, the TCPStore, the default group.

A collective that gives up waiting is reported as a *victim* line, since the peer that hung
or died is usually the cause.
"""

from __future__ import annotations

import re
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
    store = dist.TCPStore(
        assignment.rendezvous_host, assignment.rendezvous_port, assignment.world_size,
        is_master=assignment.rank == 0, timeout=timeout,
    )
    dist.init_process_group(
        backend, store=store, rank=assignment.rank, world_size=assignment.world_size, timeout=timeout,
    )
    return backend, device


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
