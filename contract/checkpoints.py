"""Where a train job's sharded checkpoints lie on a node (the rank writes, the daemon replicates).

::

    {state}/checkpoints/{job name}/step-{s:08d}/rank-{r:05d}.pt     one rank's shard of step s
    {state}/checkpoints/{job name}/step-{s:08d}/rank-{r:05d}.done   its done-marker (JSON), written after

Pure paths and directory listing only: the rank side (``kinds.train.checkpoint``) writes and reads
the files, the daemon side (``worker.replicas``) copies complete ones to a peer node and back.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

STEP_RE = re.compile(r"^step-(\d{8})$")


def root_in(state_dir: str, job_name: str) -> str:
    """``{state}/checkpoints/{job name}`` (the name is checked by whoever takes it from a spec)."""
    return os.path.join(state_dir, "checkpoints", job_name)


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def rank_file(root: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(root, step), f"rank-{rank:05d}.pt")


def marker_file(root: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(root, step), f"rank-{rank:05d}.done")


def list_steps(root: str) -> list[int]:
    """Every step that has a directory, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := STEP_RE.match(n)))


def read_marker(root: str, step: int, rank: int) -> dict[str, Any] | None:
    try:
        with open(marker_file(root, step, rank), encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def complete_for(root: str, ranks: list[int] | range, fp: str | None = None) -> list[int]:
    """Steps for which every rank in ``ranks`` has a marker (matching ``fp`` if given)."""
    out = []
    for step in list_steps(root):
        markers = [read_marker(root, step, r) for r in ranks]
        if all(m is not None and (fp is None or m.get("fingerprint") == fp) for m in markers):
            out.append(step)
    return out
