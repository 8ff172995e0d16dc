"""The rank runtime: rendezvous, groups, run one job kind, report status, exit.

``run_rank(assignment)`` is what a rank process runs (the launcher forks it). Job kinds
are functions ``(RankContext) -> dict`` (the result, JSON-serialisable) found by name in
``JOB_KINDS``. A kind is either a callable or a ``"module:function"`` string imported on
first use; add one with ``register_kind("train", "rankctl.worker.train:run")``.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import structlog
import torch
import torch.distributed as dist

from rankctl.contract.assignment import RankAssignment
from rankctl.parallel.groups import ProcessGroups
from rankctl.runtime.rendezvous import collective_timeout_s, init_distributed, is_collective_timeout, victim_line
from rankctl.runtime.status import StatusWriter

TRACEBACK_LINES = 30


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """Everything a job kind receives; no globals behind it."""

    assignment: RankAssignment
    groups: ProcessGroups
    device: torch.device
    backend: str
    status: StatusWriter
    log: Any  # structlog BoundLogger with job, node, rank bound


JobFn = Callable[[RankContext], "dict[str, Any] | None"]

JOB_KINDS: dict[str, "JobFn | str"] = {
    "comm-check": "rankctl.worker.commcheck:run",
    "train": "rankctl.worker.train:run",
}


def register_kind(name: str, fn: "JobFn | str") -> None:
    """Make job kind ``name`` runnable (a callable or a lazily imported ``"module:function"``)."""
    JOB_KINDS[name] = fn


def resolve_kind(name: str) -> JobFn:
    """The function for job kind ``name``; imports it if registered as a string."""
    try:
        target = JOB_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown job kind {name!r}; kinds are {', '.join(sorted(JOB_KINDS))}") from None
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
        JOB_KINDS[name] = target
    return target


def preload_kinds() -> None:
    """Import every registered kind now (the launcher does this so forks start warm)."""
    for name in list(JOB_KINDS):
        resolve_kind(name)


def _error_fields(exc: BaseException, victim: str | None = None) -> dict[str, Any]:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    lines = "".join(tb).splitlines()[-TRACEBACK_LINES:] + ([victim] if victim else [])
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": lines}


def run_rank(assignment: RankAssignment, *, timeout_s: float | None = None) -> int:
    """Run one rank to completion; 0 on success, 1 on failure (the status file says why).

    ``timeout_s`` overrides the job's ``restart.collective_timeout``. On failure the process
    group is left for the process exit to tear down: destroying a communicator whose peers
    are mid-collective can hang.
    """
    a = assignment
    run_dir = a.run_dir or os.getcwd()
    status = StatusWriter(run_dir, a.rank)
    structlog.contextvars.bind_contextvars(job=a.job_id, attempt=a.attempt, node=a.node, rank=a.rank)
    log = structlog.get_logger("rankctl.rank")
    seconds = timeout_s or collective_timeout_s(a.spec)
    timeout = timedelta(seconds=seconds)
    phase = "starting"
    try:
        job = resolve_kind(a.kind)
        status.write(phase := "rendezvous")
        log.info("rendezvous", at=a.rendezvous, world_size=a.world_size, timeout_s=seconds)
        backend, device = init_distributed(a, timeout)
        status.write(phase := "groups")
        pgs = ProcessGroups.build(a.rank, a.world_size, a.groups, timeout=timeout)
        log.info("groups", backend=backend, device=str(device), groups=len(pgs.distinct()))
        status.write(phase := "running")
        ctx = RankContext(assignment=a, groups=pgs, device=device, backend=backend, status=status, log=log)
        result = job(ctx) or {}
        pgs.destroy()
        dist.destroy_process_group()
        status.write("done", result=result)
        log.info("done")
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the status file
        victim = victim_line(a.rank, seconds, phase) if is_collective_timeout(exc) else None
        fields = _error_fields(exc, victim)
        log.error("failed", error=fields["error"], victim=victim is not None)
        print("\n".join(fields["traceback"]), file=sys.stderr, flush=True)  # the last line is the reason
        status.write("failed", **fields)
        return 1
    finally:
        status.close()
