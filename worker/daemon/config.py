"""A worker daemon's settings (``ctl worker``'s options), read by the daemon and each of its parts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rankctl.worker.runs.rankio import GENERATION_BYTES


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    coordinator: str
    name: str
    slots: int
    state_dir: Path
    advertise_address: str = "127.0.0.1"
    health_listen: str = "127.0.0.1:0"
    poll_interval: float = 0.1
    start_poll_interval: float = 0.02  # ... while a run's ranks are starting (their phase changes are the start-up)
    report_interval: float = 0.2  # at most one ReportBatch this often (reports in between coalesce)
    log_cap_bytes: int = GENERATION_BYTES  # the launcher rotates a rank log at this size as bytes arrive
    peer_port: int = 0            # where this node's PeerService listens (on advertise_address); 0: none
    backoff_initial: float = 0.2
    backoff_max: float = 5.0      # retries at least this often (the coordinator's RECONNECT_GRACE_S counts on it)
    free_ports: int = 8
    launcher_restarts: int = 4  # tries to start a new launcher before the daemon gives up
    launcher_backoff: float = 1.0  # seconds before the second try; doubles each time
    launcher_stable_s: float = 30.0  # a launcher that dies sooner than this counts towards giving up
    py_spy: str | None = None  # py-spy for a stalled rank's stack; None: on PATH or beside python; "": never
    tls_dir: str | None = None  # this node's identity directory: mutual TLS to the coordinator and to peers
    data_roots: tuple[str, ...] = ()  # where a job's data and other node paths may lie (besides the state dir)
    metrics_listen: str = ""      # HOST:PORT of the Prometheus /metrics endpoint (worker.metrics); "": none
    workdir_cache_mb: int = 20480  # the node's cache of extracted workdirs; least recently used evicted past it
    pool: str = ""                # the allocation this daemon serves (ctl slurm's batch script); "": the general pool
    snapshot_memory_mb: int | None = None  # bound on rankctl's snapshot memory (worker.snapmem); None: a quarter
                                           # of the node's memory, 0: none of rankctl's own
    idle_warm: bool = True        # the launcher warms every job kind in its first idle second (worker.warming)

    @property
    def rank_threads(self) -> int:
        """Intra-op threads of each rank: the node's cores over its slots (a rank's share of the node, whatever
        else runs beside it). Ranks of jobs that share a node would otherwise each take every core, and
        OpenMP's spinning barriers then slow all of them many times over (two 1-rank jobs on 2 cores: 60x)."""
        return cpu_share(self.slots)


def cpu_share(slots: int) -> int:
    """The cores this process may run on (its affinity, as a container or ``taskset`` sets it) over ``slots``."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, slots))

