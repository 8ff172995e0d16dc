"""The rank runtime: rendezvous, groups, run one job kind, report status, exit.

``run_rank(assignment)`` is what a rank process runs (the launcher forks it). A kind's entry
is a function ``(RankContext) -> dict`` (the result, JSON-serialisable) from ``kinds.registry``.
Before it runs, the runtime creates the default group and the rank's groups, unless the entry
declares ``own_rendezvous`` (the ``python`` kind: the user's script creates the default group).
The context is ``rankctl.context()`` while the entry runs. rankctl's own records share the rank's
log with what the program prints, each marked (``contract.files.logrecords``), from a logger of their own:
structlog's global configuration stays the user's. ``ctl logs`` shows the program's lines unless asked
for the records too.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import structlog

from rankctl.contract.assignment import RankAssignment
from rankctl.contract.files.diskspace import disk_full_line
from rankctl.contract.files.logrecords import RECORD_MARK
from rankctl.kinds import registry
from rankctl.kinds.context import RankExit
from rankctl.runtime.collectives import CollectiveCounters, install
from rankctl.runtime.context import RankContext, set_current
from rankctl.runtime.preflight import EXCLUDE_GRACE_S, PreflightFailed, preflight_on
from rankctl.runtime.rendezvous import is_collective_timeout, victim_line
from rankctl.runtime.status import StatusWriter
from rankctl.contract.logformat import record_logger

TRACEBACK_LINES = 30
# An entry with this attribute set true creates the default group itself (``python``: the user's
# ``init_process_group``); the runtime then builds no group before it, ``RankContext.group`` does on first use.


JobFn = Callable[[RankContext], "dict[str, Any] | None"]


def _preflight(ctx: RankContext, status: StatusWriter, log: Any) -> None:
    """``runtime.preflight`` before the first step; rank 0 reports its outcome. A node to exclude: the
    coordinator ends the attempt; the ranks wait for that, then fail themselves."""
    from rankctl.runtime import preflight

    with ctx.busy("preflight"):
        t0 = time.perf_counter()
        outcome = preflight.run(ctx)
        log.info("preflight", seconds=round(time.perf_counter() - t0, 3), kinds_ms=outcome.to_json())
        if ctx.rank == 0:
            status.write("groups", preflight=outcome.to_json())
        if outcome.exclude:
            why = "; ".join(f"job node #{i}: {w}" for i, w in sorted(outcome.exclude.items()))
            log.warning("preflight excludes", nodes=why)
            time.sleep(EXCLUDE_GRACE_S)
            raise PreflightFailed(f"pre-flight: {why}")


def resolve_kind(name: str) -> JobFn:
    """The rank entry of job kind ``name`` (imported on first use)."""
    kind = registry.get(name)
    entry = kind.resolve("entry")
    if entry is None:
        raise ValueError(f"job kind {name!r} has no rank entry")
    return entry


def warm_kind(name: str) -> None:
    """The kind's ``warm`` hook, once per process (the launcher calls it before it forks the kind's ranks)."""
    hook = registry.get(name).resolve("warm")
    if hook is not None:
        hook()


def preload_kinds() -> None:
    """Import every registered kind's rank entry now (the launcher does this so forks start warm)."""
    for name in registry.kinds():
        resolve_kind(name)


_OWN_CODE = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, "<frozen runpy>")


def user_traceback(exc: BaseException) -> list[str]:
    """The exception's traceback from the user's first frame on: rankctl's own frames and runpy's that run the
    user's script come first and say nothing to its author (torchrun's error file shows the user's frames too); all
    of them when no frame is the user's (a failure inside rankctl). The whole traceback is in the rank's log."""
    frames = traceback.extract_tb(exc.__traceback__)
    first = next((i for i, f in enumerate(frames) if not f.filename.startswith(_OWN_CODE)
                  and not f.filename.endswith(f"{os.sep}runpy.py")), None)
    if first is None or first == 0:
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
    text = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames[first:])) + \
        "".join(traceback.format_exception_only(type(exc), exc))
    return text.splitlines()


def _error_fields(exc: BaseException, victim: str | None = None) -> dict[str, Any]:
    full = disk_full_line(exc)   # the path and its file system: the last line, the reason
    extra = ([victim] if victim else []) + ([full] if full else [])
    return {"error": full or f"{type(exc).__name__}: {exc}", "traceback": user_traceback(exc)[-TRACEBACK_LINES:] + extra}


def _stack_on_sigusr1() -> bool:
    """SIGUSR1 writes every thread's Python stack to stderr (the rank's log): the daemon's way to see
    where a stalled rank is when py-spy is not installed. False when stderr has no file descriptor."""
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, OSError, ValueError, RuntimeError):
        return False
    return True


def run_rank(assignment: RankAssignment, *, timeout_s: float | None = None) -> int:
    """Run one rank to completion; 0 on success, 1 on failure (the status file says why), or the code a
    program asked for (``kinds.context.RankExit``).

    ``timeout_s`` overrides the job's ``restart.collective_timeout``. On failure the process
    group is left for the process exit to tear down: destroying a communicator whose peers
    are mid-collective can hang.
    """
    a = assignment
    run_dir = a.run_dir or os.getcwd()
    status = StatusWriter(run_dir, a.rank)
    structlog.contextvars.bind_contextvars(job=a.job_id, attempt=a.attempt, node=a.node, rank=a.rank)
    log = record_logger(sys.stderr, "rankctl.rank", RECORD_MARK)  # apart from what the program prints
    seconds = timeout_s or a.spec.restart.collective_timeout
    phase = "starting"
    counters = CollectiveCounters(run_dir, a.rank, a.world_size, a.groups)
    uncount = install(counters)  # hang attribution and wait time (the daemon reads the counters)
    status.counters = counters
    dumps = _stack_on_sigusr1()
    try:
        spec = a.spec  # typed: validated once by the launcher this rank was forked from
        timeout = timedelta(seconds=seconds)
        kind = registry.get(a.kind)
        job = resolve_kind(a.kind)
        ctx = RankContext(assignment=a, spec=spec, status=status, log=log, timeout=timeout)
        if not kind.own_rendezvous:
            status.write(phase := "rendezvous")
            log.info("rendezvous", at=a.rendezvous, world_size=a.world_size, timeout_s=seconds)
            ctx.init_default_group()
            status.write(phase := "groups")
            log.info("groups", backend=ctx.backend, device=str(ctx.device), groups=len(ctx.groups.distinct()))
            if preflight_on(spec):
                _preflight(ctx, status, log)
        status.write(phase := "running")
        set_current(ctx)
        result = job(ctx) or {}
        ctx.close()
        status.write("done", result=result)
        log.info("done")
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the status file
        victim = victim_line(a.rank, seconds, phase) if is_collective_timeout(exc) else None
        # a program's own exit (sys.exit(3)) is one line, no traceback: python prints none
        fields = {"error": str(exc), "traceback": []} if isinstance(exc, RankExit) else _error_fields(exc, victim)
        log.error("failed", error=fields["error"], victim=victim is not None)
        if fields["traceback"]:   # the whole traceback in the log, then from the user's first frame: the one shown
            print("rankctl: the whole traceback, rankctl's frames included:", file=sys.stderr)
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        print("\n".join(fields["traceback"] or [fields["error"]]), file=sys.stderr, flush=True)   # last: the reason
        status.write("failed", **fields)
        return exc.code if isinstance(exc, RankExit) else 1
    finally:
        if dumps:
            faulthandler.unregister(signal.SIGUSR1)
        uncount()
        status.close()
        counters.close()
