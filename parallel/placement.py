"""Node-major placement (pure): node k of a job gets ranks k*S .. k*S+S-1.

With the order ``tp-cp-ep-dp-pp`` and tp dividing S, every TP group stays inside a node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankctl.contract.limits import PLAN_MAX_RANKS_LISTED
from rankctl.parallel.layout import GroupName, RankLayout

# groups whose traffic is too heavy to cross a node boundary comfortably
INTRA_NODE_GROUPS = (GroupName.TP, GroupName.CP, GroupName.EP)


@dataclass(frozen=True)
class NodeSlots:
    name: str
    free: int


class PlacementError(RuntimeError):
    """Not enough free capacity; the message names what is missing."""


def node_of_rank(rank, slots_per_node: int):
    """The job node (0-based) that runs ``rank``; works element-wise on numpy arrays too."""
    return rank // slots_per_node


def local_rank(rank: int, slots_per_node: int) -> int:
    """The slot index of ``rank`` on its node."""
    return rank % slots_per_node


def ranks_of_node(node: int, slots_per_node: int) -> range:
    """The global ranks job node ``node`` runs: ``node*S .. node*S+S-1``."""
    return range(node * slots_per_node, (node + 1) * slots_per_node)


def group_summary(layout: RankLayout, slots_per_node: int) -> dict[str, dict[str, int]]:
    """group name -> groups, size and cross-node groups; one name's array in memory at a time."""
    out = {}
    for name, groups in layout.iter_groups(cache=False):
        nodes = node_of_rank(groups, slots_per_node)
        cross = int(np.count_nonzero(nodes.min(axis=1) != nodes.max(axis=1)))
        out[name] = {"groups": int(groups.shape[0]), "size": int(groups.shape[1]), "cross_node": cross}
    return out


def layout_document(layout: RankLayout, slots_per_node: int, all_ranks: bool = False) -> dict:
    """The layout as JSON-ready data (``ctl plan --json``, the coordinator's PlanJob).

    Always the config and a per-group-name summary; every group's members and ``node_of_rank`` only up to
    ``PLAN_MAX_RANKS_LISTED`` ranks (or with ``all_ranks``), so the answer stays proportional to a
    question, not to the world.
    """
    world = layout.world_size
    doc: dict = {"config": layout.config.to_dict(), "gpus_per_node": slots_per_node,
                 "kinds": group_summary(layout, slots_per_node)}  # the JSON key stays
    if all_ranks or world <= PLAN_MAX_RANKS_LISTED:
        doc["groups"] = {k: layout.groups(k) for k in layout.names}
        doc["node_of_rank"] = [node_of_rank(r, slots_per_node) for r in range(world)]
    else:
        doc["omitted"] = ["groups", "node_of_rank"]
        doc["note"] = (f"world_size={world} is above {PLAN_MAX_RANKS_LISTED} ranks: per-rank lists are omitted; "
                       "ask for one rank (ctl plan --rank R) or every rank (ctl plan --json --all-ranks)")
    return doc


def place(nodes_needed: int, slots_per_node: int, nodes: list[NodeSlots]) -> list[str]:
    """Pick ``nodes_needed`` nodes with ``slots_per_node`` free slots each, in the given order.

    Returns node names; job node k is ``result[k]``. Raises PlacementError naming the shortfall.
    """
    fits = [n.name for n in nodes if n.free >= slots_per_node]
    if len(fits) >= nodes_needed:
        return fits[:nodes_needed]
    detail = ", ".join(f"{n.name}: {n.free} free" for n in nodes) or "no nodes connected"
    raise PlacementError(
        f"needs {nodes_needed} node(s) with {slots_per_node} free slots each, "
        f"{len(fits)} available ({detail})"
    )
