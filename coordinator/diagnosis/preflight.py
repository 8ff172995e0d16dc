"""Rank 0's pre-flight outcome as the coordinator keeps it (``runtime.preflight`` measures; pure here).

``parse`` reads the JSON of ``RankStatus.preflight`` once per attempt, bounded: at most ``KINDS`` group
kinds and ``EXCLUDED`` nodes, each reason cut at ``WHY_CHARS``. ``Preflight.figures`` is what ``ctl
status`` shows per group kind (the slowest rank's median all-reduce, ms) and for the links (one-way delay
of the nodes' messages, median and slowest, ms); ``exclude`` names the job nodes (by index into the
attempt's node list) the coordinator excludes for the job before it ends the attempt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

KINDS = 32
EXCLUDED = 16
WHY_CHARS = 300


@dataclass
class Preflight:
    figures: dict[str, float] = field(default_factory=dict)   # "tp": ms, ..., "link_median", "link_max": ms
    note: str = ""                                             # GPUs, the slowest link's node
    exclude: list[tuple[int, str]] = field(default_factory=list)
    handled: bool = False     # the advance acted on it (``JobReconciler.reconcile``)


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def parse(text: str, nodes: list[str]) -> Preflight | None:
    """The outcome rank 0 reported (None: not JSON of the expected shape)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    out = Preflight()
    kinds = doc.get("kinds_ms") if isinstance(doc.get("kinds_ms"), dict) else {}
    for name, ms in list(kinds.items())[:KINDS]:
        if (v := _number(ms)) is not None:
            out.figures[str(name)[:32]] = v
    links = doc.get("links") if isinstance(doc.get("links"), dict) else {}
    notes = []
    for key in ("median_ms", "max_ms"):
        if (v := _number(links.get(key))) is not None:
            out.figures[f"link_{key[:-3]}"] = v
    worst = links.get("max_node")
    if isinstance(worst, int) and 0 <= worst < len(nodes) and "link_max" in out.figures:
        notes.append(f"slowest link from {nodes[worst]}")
    if isinstance(doc.get("gpu"), str) and doc["gpu"]:
        notes.append(f"GPUs: {doc['gpu'][:WHY_CHARS]}")
    out.note = "; ".join(notes)
    excl = doc.get("exclude") if isinstance(doc.get("exclude"), dict) else {}
    for index, why in list(excl.items())[:EXCLUDED]:
        if str(index).isdigit() and int(index) < len(nodes):
            out.exclude.append((int(index), str(why)[:WHY_CHARS]))
    return out
