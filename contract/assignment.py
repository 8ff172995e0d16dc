"""The wire contract between coordinator, daemon and rank: one rank's assignment, as plain data.

The coordinator builds these (one per rank, sent only to the rank's node); the daemon
hands them to its launcher, which forks a rank process that receives exactly this.
JSON-serialisable so that it crosses process boundaries as one line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class RankAssignment:
    job_id: str
    attempt: int
    rank: int
    world_size: int
    local_rank: int                      # index of the slot on its node
    node: str
    coords: dict[str, int]               # tp, cp, ep, dp, pp, etp, edp
    groups: dict[str, list[int]]         # kind -> members (ascending), only this rank's groups
    rendezvous: str                      # "host:port" of the TCPStore (rank 0 hosts it)
    backend: str                         # "auto" | "nccl" | "gloo"
    kind: str                            # "comm-check" | "train"
    spec: dict[str, Any] = field(default_factory=dict)  # the validated job spec
    run_dir: str = ""                    # where the rank writes its status and log files
    device: int | None = None            # CUDA device index on GPU nodes
    workdir: str = ""                    # set by the daemon: where a shipped workdir lies on this node
    restart: bool = False                # an automatic restart of the same job (attempt > 1)
    node_address: str = ""               # the node's advertised address: collectives bind there ("": unknown)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @property
    def rendezvous_host(self) -> str:
        return self.rendezvous.rsplit(":", 1)[0]

    @property
    def rendezvous_port(self) -> int:
        return int(self.rendezvous.rsplit(":", 1)[1])
