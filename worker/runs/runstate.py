"""One job attempt with ranks on this node, as the daemon's parts see it (the runs, Assign admission,
hang evidence, replication): its ranks, their last phases and processes, where its files lie."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rankctl.contract.files.rankstatus import PHASES
from rankctl.worker.runs.hangwatch import HangWatch
from rankctl.worker.runs.status import StatusTailer

STARTED_PHASES = PHASES[PHASES.index("running"):]   # a rank that wrote one of these has started its work
FAST_POLL_S = 10.0  # a run's status files are polled at start_poll_interval at most this long


@dataclass
class RunState:
    """One job attempt with ranks on this node."""

    job_id: str
    attempt: int
    run_dir: str
    ranks: set[int]
    alive: set[int] = field(default_factory=set)
    tailer: StatusTailer | None = None                   # reads the ranks' status lines
    phase: dict[int, str] = field(default_factory=dict)  # rank -> phase of its last report
    pids: dict[int, int] = field(default_factory=dict)   # rank -> pid, from the launcher's "started"
    job_name: str = ""                                   # the spec's name: its checkpoints' directory
    replica_peer: str = ""                               # where its checkpoint steps are copied
    process: dict[int, str] = field(default_factory=dict)  # rank -> last reported process state
    hangs: HangWatch | None = None                       # whose collective counters stopped moving
    succeeded: set[int] = field(default_factory=set)     # ranks that exited 0
    stepped: set[int] = field(default_factory=set)       # ranks that reported a step (their first is never coalesced)
    started: bool = False                                # every rank reported running (or ended)
    workdir_blob: str = ""                               # the shipped workdir its ranks run in (pinned in the cache)
    assigned_at: float = field(default_factory=time.monotonic)
    superseded: bool = False                             # a newer attempt's Assign came: stopped, reported no more
    stop_reason: str = ""                                # the coordinator's Cancel stops it: why (its ranks' exits say)

    def starting(self) -> bool:
        """Some rank is on its way to running, within ``FAST_POLL_S`` of the assignment (a long rendezvous
        wait for other nodes is polled at the usual pace); one look per rank until every one is there."""
        if not self.started:
            self.started = time.monotonic() - self.assigned_at > FAST_POLL_S or all(
                self.phase.get(r) in STARTED_PHASES or r not in self.alive for r in self.ranks)
        return not self.started
