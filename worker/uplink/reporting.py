"""What the daemon says about its node and its ranks, as the wire carries it: free ports, hardware, exit
statuses, and ``to_wire``, the one conversion of a rank's status record to a ``RankStatus``."""

from __future__ import annotations

import json
import random
import signal
import socket
from collections.abc import Sequence
from typing import Any

from rankctl.contract.files.rankstatus import NOTICE_CHARS, RankStatusRecord, as_number
from rankctl.contract.resultsize import result_json
from rankctl.proto import rankctl_pb2 as pb


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 20000      # below: services' well-known and registered ports
PROBES = 64              # binds tried per call at most


def ephemeral_range(path: str = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections and to binds of port 0 (Linux's default where the
    file cannot be read)."""
    try:
        with open(path, encoding="ascii") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def port_candidates(low: int, high: int) -> range:
    """Ports outside the ephemeral range ``low..high`` to offer for rendezvous stores: the wider of the gap below
    it (from LOWEST_PORT) and the one above it. A port inside the range may be taken by any outgoing connection
    between the heartbeat that offered it and rank 0's bind (a gloo link, a gRPC channel), as CI saw."""
    below, above = range(LOWEST_PORT, low), range(high + 1, 65536)
    return below if len(below) >= len(above) else above


def bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the store's own bind: TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(host: str, count: int, keep: Sequence[int] = (), *, rng: random.Random | None = None,
               low_high: tuple[int, int] | None = None) -> list[int]:
    """``count`` ports a rendezvous store can bind on ``host`` now: those of ``keep`` (the last offer) that still
    are, then random ones outside the ephemeral range; ports the OS hands out (port 0) only where that range
    leaves too few (then a connection may still take one before the store binds it)."""
    candidates = port_candidates(*(low_high or ephemeral_range()))
    ports = [p for p in keep if p in candidates and bindable(host, p)][:count]
    if len(candidates) >= 16 * max(count, 1):
        pick = rng or random.SystemRandom()
        for port in (pick.choice(candidates) for _ in range(PROBES)):
            if len(ports) >= count:
                return ports
            if port not in ports and bindable(host, port):
                ports.append(port)
    return ports + ephemeral_ports(host, count - len(ports))


def ephemeral_ports(host: str, count: int) -> list[int]:
    """Ports the OS hands out right now on ``host`` (binds of port 0)."""
    ports, socks = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
    except OSError:
        pass
    finally:
        for s in socks:
            s.close()
    return ports


MAX_FIGURES = 16          # numbers of a rank's metrics copied into ``RankStatus.figures`` (the first ones)
MAX_NAME = 64            # longer names stay in metrics_json only
STEP_TIME = ("step_time_s", "step_time")   # the typed ``step_time_s``, not a figure
NOT_FIGURES = frozenset(("step", *STEP_TIME))


def to_wire(rec: RankStatusRecord, node: str) -> tuple[pb.RankStatus, str]:
    """A rank's status record as its report carries it: the ``RankStatus`` and its result as JSON ("": none)."""
    error = rec.error or ""
    if rec.traceback:
        error = "\n".join((error, *rec.traceback)).strip()
    status = pb.RankStatus(rank=rec.rank, node=node, phase=rec.phase or "unknown", step=rec.step or 0,
                           metrics_json=json.dumps(rec.metrics), error=error)
    stamp_update(status, rec.ts)
    step_figures(status, rec.metrics)
    if rec.compute_s is not None:  # the step's split (runtime.status); unset: not reported
        status.compute_s = rec.compute_s
    if rec.wait_s is not None:
        status.wait_s = rec.wait_s
    if rec.notice:
        status.notice = rec.notice
    if rec.preflight:
        status.preflight = rec.preflight
    return status, result_json(rec.result) if rec.result is not None else ""


def exit_status(rank: int, node: str, code: int, error: str) -> pb.RankStatus:
    """A rank that ended (or never started: the Assign was refused), as the daemon saw it."""
    return pb.RankStatus(rank=rank, node=node, phase="exited", exited=True, exit_code=code, error=error)


def notice_status(rank: int, node: str, text: str) -> pb.RankStatus:
    """The daemon's line for the job's record (a job event, as a rank's ``notice``) before ``rank`` started, e.g. a
    damaged checkpoint step its restore passed over."""
    return pb.RankStatus(rank=rank, node=node, phase="pending", notice=text[:NOTICE_CHARS])


def step_figures(status: pb.RankStatus, metrics: Any) -> None:
    """Copy the numbers among a rank's metrics into its status (``figures``, at most ``MAX_FIGURES``; the step
    time into ``step_time_s``) so that the coordinator never parses JSON per rank-step: it folds the figures
    its job's kind names (``JobKind.figures``). Not numbers (text, booleans, lists) stay in ``metrics_json``."""
    if not isinstance(metrics, dict):
        return
    for key in STEP_TIME:
        if (v := as_number(metrics.get(key))) is not None:
            status.step_time_s = v
            break
    n = 0
    for key, value in metrics.items():
        v = as_number(value)
        if n < MAX_FIGURES and v is not None and isinstance(key, str) and len(key) <= MAX_NAME \
                and key not in NOT_FIGURES:
            status.figures[key] = v
            n += 1


def stamp_update(status: pb.RankStatus, ts: Any) -> None:
    """Set ``status.update_time`` to the unix seconds ``ts`` the rank wrote (left unset for none or 0)."""
    if isinstance(ts, (int, float)) and not isinstance(ts, bool) and ts > 0:
        status.update_time.FromNanoseconds(int(ts * 1e9))


def exit_code(ev: dict[str, Any]) -> int:
    """A launcher ``exited`` event's status: the exit code, or minus the signal number."""
    if ev.get("exit_code") is not None:
        return int(ev["exit_code"])
    name = str(ev.get("signal") or "")
    return -signal.Signals[name].value if name in signal.Signals.__members__ else -1


def hardware_pb(facts: dict[str, Any]) -> pb.Hardware:
    gpus = [pb.GpuInfo(index=g.get("index", i), name=g.get("name", ""), memory_bytes=int(g.get("memory_bytes", 0)))
            for i, g in enumerate(facts.get("gpus", []))]
    return pb.Hardware(hostname=facts.get("hostname", ""), cpu_count=int(facts.get("cpu_count", 0)),
                       memory_bytes=int(facts.get("memory_bytes", 0)), gpus=gpus)


def how_launcher_ended(launcher: Any) -> str:
    """How a dead launcher ended, in words (``killed by SIGKILL``, ``exit 1``)."""
    rc = getattr(getattr(launcher, "proc", None), "returncode", None)
    return "exit status unknown" if rc is None else how_ended(rc)


def how_ended(rc: int) -> str:
    """A process's return code in words: ``killed by SIGKILL`` for -9, else ``exit N``."""
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 and -rc in signal.valid_signals() else f"exit {rc}"
