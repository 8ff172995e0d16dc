"""Why ranks that all wait inside operations cannot go on: the evidence that makes a deadlock or a cut link certain.

``blocked`` follows, from one waiting rank, whom each waits for (the members of its group that never entered the
operation it is in) until the walk closes a cycle (a deadlock), finds members of one group inside different
operations at the same count (a mismatch: a deadlock too), or ends at a group every member of which is inside its
operation or past it on two nodes (a cut link, or a slow transfer: ``coordinator.diagnosis.pace`` makes it certain
only with data seen lost). Bounded: ``WALK_MAX`` ranks' evidence, parsed on first use.
"""

from __future__ import annotations

from typing import Mapping

from rankctl.coordinator.diagnosis.hangs import Evidences, Waiting, group_key, link_of, waiting_of
from rankctl.coordinator.model.records import RankRecord

WALK_MAX = 1024   # ranks followed along the waits, at most


def blocked(ranks: Mapping[int, RankRecord], start: list[int]) -> str:
    """Why ranks that all wait inside operations cannot go on, followed from ``start`` along whom each waits for:
    ``"deadlock"`` (a cycle of waits, or members of one group in different operations at the same count: certain),
    ``"link"`` (a group every member of which is inside its operation or past it, on two nodes: a cut link or a
    slow transfer; certain only with data seen lost), or ``""`` (the evidence cannot tell: a member without
    evidence, a group larger than its shown members, one node). Bounded: ``WALK_MAX`` ranks' evidence."""
    evidence = Evidences(ranks)
    seen: set[int] = set()
    rank = start[0] if start else None
    while rank is not None and len(seen) < WALK_MAX:
        if rank in seen:
            return "deadlock"
        seen.add(rank)
        ev = evidence.get(rank)
        if ev is None or ev.waits_in is None:
            return ""
        step = _waits_for(waiting_of(ev), evidence)
        if isinstance(step, str):
            if step == "inside":
                return "link" if link_of(waiting_of(ev), ranks) is not None else ""
            return step
        rank = step
    return ""


def _waits_for(w: Waiting, evidence: Evidences) -> int | str:
    """The first member of ``w`` that never entered its operation (the rank it waits for), or what the group says:
    ``"deadlock"`` (a member inside another operation at the same count), ``"inside"`` (every member inside it or
    past it), ``""`` (unknown)."""
    if w.size > len(w.members):
        return ""
    for m in w.members:
        if m == w.ranks[0]:
            continue
        ev = evidence.get(m)
        if ev is None:
            return ""
        mine = ev.group(w.key)
        inside = ev.waits_in is not None and group_key(ev.waits_in) == w.key
        if w.p2p:
            if not inside:
                return m
            continue
        entered = int(mine.get("entered") or 0) if mine is not None else 0
        completed = int(mine.get("completed") or 0) if mine is not None else 0
        if inside and entered == w.seq and str(ev.waits_in.get("op", "?")) != w.op:   # type: ignore[union-attr]
            return "deadlock"
        if entered < w.seq and completed < w.seq:
            return m
    return "inside"
