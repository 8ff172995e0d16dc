"""One rank's assignment, shared by the daemon, the launcher and the rank.

The daemon builds these from the coordinator's compact Assign (``worker.runs.assign.expand``), with the typed
spec it validated once; it hands them to its launcher as JSON lines (``to_doc``), which reads them back once
(``from_doc``, with the kinds' spec parser) and forks a rank process that receives exactly that object.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

from rankctl.contract.spec import JobSpec


@dataclass(frozen=True, kw_only=True)
class RankAssignment:
    job_id: str
    attempt: int
    rank: int
    world_size: int
    local_rank: int                      # index of the slot on its node
    node: str
    coords: dict[str, int]               # tp, cp, ep, dp, pp, etp, edp
    groups: dict[str, list[int]]         # group name -> members (ascending), only this rank's groups
    rendezvous: str                      # "host:port" of the TCPStore (rank 0 hosts it)
    backend: str                         # "auto" | "nccl" | "gloo"
    kind: str                            # the job kind ("train", "comm-check", "python", ...)
    spec: JobSpec                        # the typed job spec, validated once in this process (or inherited)
    run_dir: str = ""                    # where the rank writes its status and log files
    device: int | None = None            # CUDA device index on GPU nodes
    workdir: str = ""                    # set by the daemon: where a shipped workdir lies on this node
    restart: bool = False                # an automatic restart of the same job (attempt > 1)
    node_address: str = ""               # the node's advertised address: collectives bind there ("": unknown)
    roots: tuple[str, ...] = ()          # where ranks may create and delete: the worker's roots (contract.safepath)

    def to_doc(self) -> dict[str, Any]:
        """Plain data for a process edge (the launcher's pipe); the spec as its canonical dict."""
        doc = asdict(replace(self, spec=None))  # type: ignore[arg-type] - asdict would not copy a model
        doc["spec"] = self.spec.to_dict()
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_doc(), separators=(",", ":"))

    @classmethod
    def from_doc(cls, doc: dict[str, Any], parse_spec: Callable[[dict[str, Any]], JobSpec]) -> "RankAssignment":
        """Back from ``to_doc``: ``parse_spec`` (``kinds.spec.parse_spec``) validates the spec, once."""
        fields = {k: v for k, v in doc.items() if k != "spec"}
        fields["roots"] = tuple(fields.get("roots", ()))
        return cls(**fields, spec=parse_spec(doc["spec"]))

    @property
    def rendezvous_host(self) -> str:
        return self.rendezvous.rsplit(":", 1)[0]

    @property
    def rendezvous_port(self) -> int:
        return int(self.rendezvous.rsplit(":", 1)[1])
