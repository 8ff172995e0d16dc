"""The rank runtime: rendezvous, groups, run one job kind, report status, exit.

``run_rank(assignment)`` is what a rank process runs (the launcher forks it). Job kinds
are functions ``(RankContext) -> dict`` (the result, JSON-serialisable) found by name in
``JOB_KINDS``. A kind is either a callable or a ``"module:function"`` string imported on
first use; add one with ``register_kind("train", "rankctl.kinds.train.loop:run")``.
"""

from __future__ import annotations

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
from rankctl.contract.spec import JobSpec, RestartSpec
from rankctl.kinds import registry
from rankctl.kinds.spec import parse_spec
from rankctl.parallel.groups import ProcessGroups
from rankctl.runtime.rendezvous import init_distributed, is_collective_timeout, victim_line
from rankctl.runtime.status import StatusWriter

TRACEBACK_LINES = 30


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """Everything a job kind receives; no globals behind it."""

    assignment: RankAssignment
    spec: JobSpec  # the typed job spec, validated from the assignment's canonical dict
    groups: ProcessGroups
    device: torch.device
    backend: str
    status: StatusWriter
    log: Any  # structlog BoundLogger with job, node, rank bound


JobFn = Callable[[RankContext], "dict[str, Any] | None"]


def resolve_kind(name: str) -> JobFn:
    """The rank entry of job kind ``name`` (imported on first use)."""
    kind = registry.get(name)
    entry = kind.resolve("entry")
    if entry is None:
        raise ValueError(f"job kind {name!r} has no rank entry")
    return entry


def preload_kinds() -> None:
    """Import every registered kind's rank entry now (the launcher does this so forks start warm)."""
    for name in registry.kinds():
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
    seconds = timeout_s or RestartSpec().collective_timeout  # until the spec is read
    phase = "starting"
    try:
        spec = parse_spec(a.spec)
        seconds = timeout_s or spec.restart.collective_timeout
        timeout = timedelta(seconds=seconds)
        job = resolve_kind(a.kind)
        status.write(phase := "rendezvous")
        log.info("rendezvous", at=a.rendezvous, world_size=a.world_size, timeout_s=seconds)
        backend, device = init_distributed(a, timeout)
        status.write(phase := "groups")
        pgs = ProcessGroups.build(a.rank, a.world_size, a.groups, timeout=timeout)
        log.info("groups", backend=backend, device=str(device), groups=len(pgs.distinct()))
        status.write(phase := "running")
        ctx = RankContext(assignment=a, spec=spec, groups=pgs, device=device, backend=backend, status=status, log=log)
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
