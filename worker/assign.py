"""A node's part of a job, from the coordinator's compact Assign to one ``RankAssignment`` per rank.

The Assign names the node's rank range, the rendezvous and the spec (serialised once); each
rank's coordinates and groups are computed here from the spec's parallel config
(``RankLayout.rank_groups``: cost independent of the world size), so that what crosses the
network per node does not grow with the job. Everything is checked before any rank starts:
a bad Assign raises ``Refused`` with the reason, and its ranks are reported as never started.
"""

from __future__ import annotations

import json
from dataclasses import replace

from rankctl.contract.assignment import RankAssignment
from rankctl.contract.limits import MAX_SLOTS_PER_NODE, MAX_WORLD_SIZE
from rankctl.kinds.spec import parallel_config, parse_spec
from rankctl.parallel.layout import RankLayout
from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.paths import Refused, check_assignment


def claimed_ranks(msg: pb.Assign) -> list[int]:
    """The ranks an Assign gives this node, as far as they can be read (to report a refusal against)."""
    count = min(max(msg.rank_count, 0), MAX_SLOTS_PER_NODE)
    return [r for r in range(msg.first_rank, msg.first_rank + count) if r >= 0]


def expand(msg: pb.Assign, node: str, run_dir: str, gpus: int, address: str = "") -> list[RankAssignment]:
    """The node's rank assignments; raises ``Refused`` naming what is wrong with the Assign.

    ``address`` is the node's advertised address, where its ranks bind their collectives (``runtime.netif``).
    """
    out = _compact(msg, node, gpus)
    for a in out:
        check_assignment(a, msg.job_id, msg.attempt)
    return [replace(a, run_dir=run_dir, node_address=address) for a in out]


def _compact(msg: pb.Assign, node: str, gpus: int) -> list[RankAssignment]:
    world, first, count = msg.world_size, msg.first_rank, msg.rank_count
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise Refused(f"world_size={world} must be between 1 and {MAX_WORLD_SIZE}")
    if not 1 <= count <= MAX_SLOTS_PER_NODE or first < 0 or first + count > world:
        raise Refused(f"ranks {first}..{first + count - 1} (rank_count={count}) do not lie in a world of {world}")
    try:
        spec_doc = json.loads(msg.spec_json)
        spec = parse_spec(spec_doc)
        layout = RankLayout(parallel_config(spec))
    except Exception as exc:  # noqa: BLE001 - any defect of the spec refuses the Assign
        raise Refused(f"unreadable job spec: {str(exc)[:300]}") from None
    if layout.world_size != world:
        raise Refused(f"the spec's layout has {layout.world_size} ranks, the Assign says world_size={world}")
    return [RankAssignment(
        job_id=msg.job_id, attempt=msg.attempt, rank=rank, world_size=world, local_rank=rank - first, node=node,
        coords=layout.coords(rank), groups=layout.rank_groups(rank), rendezvous=msg.rendezvous,
        backend=msg.backend, kind=msg.kind, spec=spec_doc, device=(rank - first) if gpus else None,
        restart=msg.restart,
    ) for rank in range(first, first + count)]
