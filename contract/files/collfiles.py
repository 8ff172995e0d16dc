"""The collective-counter file a rank keeps and its daemon reads (``runtime.collectives`` writes).

``{run_dir}/rank-{rank}.coll`` is a fixed-size memory-mapped file: a header, then one slot per
process group the rank has used::

    header: magic "RKCL", version, slots in use, slot the rank is in now (-1: none), wait seconds,
            then what the rank is busy with outside collectives (ACTIVITIES: 0 nothing, 1 a checkpoint ...)
    slot:   entered, completed, operation index (OPS), entered at (unix s), wait seconds

``{run_dir}/rank-{rank}.coll.json`` names the slots (``[{"kind": "tp", "members": [2, 3], "size": 2}]``),
replaced whole by a rename when a slot is added. Torch-free: the daemon reads both.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from rankctl.contract.files.rankfiles import replace_json

MAGIC = b"RKCL"
VERSION = 1
MAX_SLOTS = 32
MAX_MEMBERS_SHOWN = 64
HEADER = struct.Struct("<4sIIid")     # magic, version, slots, current slot, wait seconds
SLOT = struct.Struct("<QQIdd")        # entered, completed, op, since, wait seconds
HEADER_BYTES = 32
ACTIVITY = struct.Struct("<I")        # at HEADER.size: an index into ACTIVITIES (the header's spare bytes)
ACTIVITIES = ("", "checkpoint", "snapshot", "restore", "preflight", "busy")
FILE_BYTES = HEADER_BYTES + MAX_SLOTS * SLOT.size

OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
       "broadcast", "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend", "irecv",
       "batch_isend_irecv", "reduce", "gather", "scatter", "all_gather_object", "broadcast_object_list",
       "monitored_barrier")
OP_INDEX = {name: i for i, name in enumerate(OPS)}
ASYNC_ALWAYS = frozenset({"isend", "irecv", "batch_isend_irecv"})
# where the group is when passed by position (everything else takes group= or the default group)
GROUP_ARG = {"all_reduce": 2, "broadcast": 2, "barrier": 0, "send": 2, "recv": 2, "isend": 2, "irecv": 2,
             "all_gather": 2, "all_gather_into_tensor": 2, "reduce_scatter": 3, "reduce_scatter_tensor": 3,
             "all_to_all": 2, "all_to_all_single": 4, "reduce": 3, "gather": 3, "scatter": 3,
             "all_gather_object": 2, "broadcast_object_list": 2, "monitored_barrier": 0}


def counters_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank}.coll")


def meta_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank}.coll.json")


def slot_offset(slot: int) -> int:
    return HEADER_BYTES + slot * SLOT.size


def write_meta(path: str, labels: list[dict[str, Any]]) -> None:
    replace_json(path, {"slots": labels})


def in_collective(raw: bytes | None) -> bool:
    """The counter file's raw bytes say the rank waits in an operation now (its header's current slot)."""
    if raw is None or len(raw) < HEADER.size:
        return False
    magic, version, _, current, _ = HEADER.unpack_from(raw, 0)
    return magic == MAGIC and version == VERSION and current >= 0


def read_counters(run_dir: str, rank: int) -> dict[str, Any] | None:
    """A rank's counters now: ``{"in": slot or -1, "wait_s", "groups": [{kind, members, size, entered,
    completed, op, since, wait_s}], "activity"?: what it is busy with (absent: nothing)}``; None when the rank has none (not started, or not a torch rank)."""
    try:
        with open(counters_path(run_dir, rank), "rb") as f:
            raw = f.read(FILE_BYTES)
    except OSError:
        return None
    if len(raw) < FILE_BYTES:
        return None
    magic, version, slots, current, wait = HEADER.unpack_from(raw, 0)
    if magic != MAGIC or version != VERSION:
        return None
    (activity,) = ACTIVITY.unpack_from(raw, HEADER.size)
    try:
        with open(meta_path(run_dir, rank), encoding="utf-8") as f:
            labels = json.load(f).get("slots") or []
    except (OSError, ValueError):
        labels = []
    groups = []
    for i in range(min(slots, MAX_SLOTS)):
        entered, completed, op, since, waited = SLOT.unpack_from(raw, slot_offset(i))
        label = labels[i] if i < len(labels) and isinstance(labels[i], dict) else {}
        groups.append({"kind": str(label.get("kind", "group")), "members": list(label.get("members") or []),
                       "size": int(label.get("size") or len(label.get("members") or [])),
                       "entered": entered, "completed": completed,
                       "op": OPS[op] if op < len(OPS) else "?", "since": since, "wait_s": waited})
    doing = ACTIVITIES[activity] if activity < len(ACTIVITIES) else "busy"
    return {"in": current, "wait_s": wait, "groups": groups, **({"activity": doing} if doing else {})}
