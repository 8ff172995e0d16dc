"""From a placed job to what each node receives: rendezvous port and per-rank assignments.

Pure: reads job and node records, returns ``RankAssignment``s grouped by node.
"""

from __future__ import annotations

from typing import Iterable

from rankctl.coordinator.records import JobRecord, NodeRecord
from rankctl.kinds.spec import parallel_config, parse_spec
from rankctl.parallel.layout import ParallelConfig, RankLayout
from rankctl.parallel.placement import layout_document, local_rank, ranks_of_node
from rankctl.contract.assignment import RankAssignment


def pick_port(free_ports: Iterable[int], in_use: set[int]) -> int | None:
    """The first port the node reported free that no live job uses on it."""
    return next((p for p in free_ports if p not in in_use), None)


def build_assignments(job: JobRecord, nodes: dict[str, NodeRecord]) -> dict[str, list[RankAssignment]]:
    """node name -> the assignments of its ranks; job node k runs ranks k*S .. k*S+S-1."""
    spec = parse_spec(job.spec)
    layout = RankLayout(parallel_config(spec))
    s = job.slots_per_node
    out: dict[str, list[RankAssignment]] = {}
    for k, name in enumerate(job.nodes):
        gpus = nodes[name].gpu_count
        for rank in ranks_of_node(k, s):
            local = local_rank(rank, s)
            out.setdefault(name, []).append(RankAssignment(
                job_id=job.id, attempt=job.attempt, rank=rank, world_size=job.world_size, local_rank=local,
                node=name, coords=layout.coords(rank), groups=layout.rank_groups(rank),
                rendezvous=job.rendezvous, backend=spec.backend, kind=job.kind,
                spec=job.spec, device=local if gpus else None,
            ))
    return out


def plan_layout(cfg: ParallelConfig, slots_per_node: int) -> dict:
    """The PlanJob document: config and per-kind summary; per-rank lists only for small worlds."""
    return layout_document(RankLayout(cfg), slots_per_node)
