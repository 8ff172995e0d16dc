"""What the cluster can hold: free slots per node, whether a job can ever fit, who may pass whom.

Pure functions over node sessions and job records (no store, no clock of their own).

Queue policy (bounded head-of-line wait): pending jobs start in submission order. The
first job that cannot start holds every later job back, but only while it *could* fit the
cluster (enough known nodes with enough slots) and for at most ``head_wait`` seconds; after
that, later jobs that fit start around it (backfill) while it keeps its place at the head.
A job that can never fit (submitted with ``--queue-anyway``) holds nothing back.

A restarted job is placed against its previous attempt (``place_keeping``): each node that can
still run its ranks keeps them (its launcher is warm, its checkpoints are its own) and only the
others are replaced, by spares in name order.
"""

from __future__ import annotations

from typing import Iterable

from rankctl.coordinator.fleet.nodes import NodeSession, NodeStatus
from rankctl.coordinator.model.records import JobRecord
from rankctl.parallel.placement import NodeSlots, place


def free_slots(ready: Iterable[NodeSession], active: Iterable[JobRecord]) -> dict[str, int]:
    """READY node name -> slots not taken by the jobs given (active ones, and ended ones whose ranks are not
    confirmed gone yet); a job takes slots_per_node on each of its nodes."""
    free = {s.name: s.record.slots for s in ready}
    for job in active:
        for name in job.nodes:
            if name in free:
                free[name] -= job.slots_per_node
    return free


def jobs_by_node(holding: Iterable[JobRecord]) -> dict[str, list[str]]:
    """Node name -> the ids of the jobs given (the active ones: ``ctl nodes``' jobs) that run ranks there; at
    most one per slot of the node."""
    out: dict[str, list[str]] = {}
    for job in holding:
        for name in job.nodes:
            out.setdefault(name, []).append(job.id)
    return out


def fitting_nodes(sessions: Iterable[NodeSession], slots_per_node: int) -> int:
    """Known nodes (any state but LOST) with at least ``slots_per_node`` slots."""
    return sum(1 for s in sessions if s.status is not NodeStatus.LOST and s.record.slots >= slots_per_node)


def shortfall(sessions: list[NodeSession], nodes: int, slots_per_node: int) -> str | None:
    """Why a job of ``nodes`` x ``slots_per_node`` can never run on this cluster, or None."""
    have = fitting_nodes(sessions, slots_per_node)
    if have >= nodes:
        return None
    known = [s for s in sessions if s.status is not NodeStatus.LOST]
    most = max((s.record.slots for s in known), default=0)
    return (f"resources: the job needs {nodes} node(s) with {slots_per_node} slots each; the cluster has {have} "
            f"such node(s) ({len(known)} known, at most {most} slots per node)")


def may_pass(head: JobRecord, sessions: list[NodeSession], waited: float, head_wait: float) -> bool:
    """Whether jobs behind ``head`` (which cannot start now) may start before it."""
    return waited >= head_wait or shortfall(sessions, head.nodes_needed, head.slots_per_node) is not None


def place_keeping(previous: list[str], nodes_needed: int, slots_per_node: int, nodes: list[NodeSlots]) -> list[str]:
    """``place``, but job node k stays on ``previous[k]`` where that node still fits; the others are filled
    with the fitting nodes not kept, in the given order. An elastic job's attempt of another size keeps the first
    of its previous nodes that it still needs. Raises PlacementError (from ``place``) on a shortfall."""
    if not previous:
        return place(nodes_needed, slots_per_node, nodes)
    fits = [n.name for n in nodes if n.free >= slots_per_node]
    fitting = set(fits)
    base = previous[:nodes_needed] + [""] * (nodes_needed - len(previous))
    out = [name if name in fitting else "" for name in base]
    kept = set(out)
    spares = iter(name for name in fits if name not in kept)
    for k, name in enumerate(out):
        if not name:
            out[k] = next(spares, "")
            if not out[k]:
                return place(nodes_needed, slots_per_node, nodes)  # the shortfall, named
    return out
