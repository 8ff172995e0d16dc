"""Node-major placement (pure): node k of a job gets ranks k*S .. k*S+S-1.

With the order ``tp-cp-ep-dp-pp`` and tp dividing S, every TP group stays inside a node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankctl.parallel.layout import RankLayout

# kinds whose traffic is too heavy to cross a node boundary comfortably
INTRA_NODE_KINDS = ("tp", "cp", "ep")


@dataclass(frozen=True)
class NodeSlots:
    name: str
    free: int


class PlacementError(RuntimeError):
    """Not enough free capacity; the message names what is missing."""


def node_of_rank(rank: int, slots_per_node: int) -> int:
    return rank // slots_per_node


def cross_node_groups(layout: RankLayout, slots_per_node: int) -> dict[str, int]:
    """How many groups of each kind span more than one node."""
    out = {}
    for kind, groups in layout.iter_groups():
        nodes = groups // slots_per_node
        out[kind] = int(np.count_nonzero(nodes.min(axis=1) != nodes.max(axis=1)))
    return out


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
