"""From a placed job to what each node receives: rendezvous port and one compact Assign per node.

Pure: reads job records, returns protobuf messages.
"""

from __future__ import annotations

import json
from typing import Iterable

from rankctl.coordinator.model.records import JobRecord
from rankctl.kinds.spec import parallel_config
from rankctl.parallel.layout import ParallelConfig, shared_layout
from rankctl.parallel.placement import layout_document, ranks_of_node
from rankctl.proto import rankctl_pb2 as pb


def pick_port(free_ports: Iterable[int], in_use: set[int]) -> int | None:
    """The first port the node reported free that no live job uses on it."""
    return next((p for p in free_ports if p not in in_use), None)


def assign_messages(job: JobRecord, nodes: list[str], rendezvous: str, peers: list[str] | None = None,
                    restores: list[str] | None = None) -> list[pb.CoordinatorMessage]:
    """One compact Assign per job node (job node k runs ranks k*S .. k*S+S-1), in ``nodes`` order.

    Each is the same size whatever the job's size: the spec is serialised once and every rank
    computes its own coordinates and groups on its node. Raises when the stored spec no longer
    lays out (checked here once, so that no node is sent a job it cannot run). ``peers[k]`` is job
    node k's PeerService address: node k's checkpoint steps are copied to node k+1 (its replica peer);
    ``restores[k]`` names where node k fetches its ranks' checkpoints from before they start.
    """
    spec = job.spec.on_nodes(len(nodes))   # an elastic job's attempt on fewer nodes runs a smaller world
    shared_layout(parallel_config(spec)).rank_groups(0)
    spec_json = json.dumps(spec.to_dict(), separators=(",", ":"))
    s, n = job.slots_per_node, len(nodes)
    peers = peers or [""] * n
    restores = restores or [""] * n
    return [pb.CoordinatorMessage(assign=pb.Assign(
        job_id=job.id, attempt=job.attempt, world_size=job.world_size, first_rank=ranks_of_node(k, s).start,
        rank_count=s, rendezvous=rendezvous, backend=spec.backend, kind=job.kind, spec_json=spec_json,
        restart=job.attempt > 1, replica_peer=peers[(k + 1) % n] if n > 1 else "", restore_peer=restores[k]))
        for k in range(n)]


def plan_layout(cfg: ParallelConfig, slots_per_node: int) -> dict:
    """The PlanJob document: config and per-kind summary; per-rank lists only for small worlds."""
    return layout_document(shared_layout(cfg), slots_per_node)
