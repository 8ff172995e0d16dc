"""The files a rank process and its node's daemon share, under the run directory the daemon made.

``rank-R.status.jsonl``: the rank appends one flushed line per status record (``contract.rankstatus``
holds the record and its line); the daemon tails it, keeping a partial last line pending until its newline.
``rank-R.log``: the rank's stdout and stderr, with rankctl's own records among them, each marked
(``contract.logrecords``). ``rank-R.control.json``: the daemon's requests to the rank, replaced whole by a
rename; the rank polls its mtime once per step::

    {"checkpoint_at": 17}      # save a checkpoint at the end of step 17 (ctl drain)
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

STATUS_RE = re.compile(r"^rank-(\d+)\.status\.jsonl$")


def status_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank}.status.jsonl")


def log_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank}.log")


def control_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank}.control.json")


def write_control(run_dir: str, rank: int, request: dict[str, Any]) -> None:
    """Replace the rank's control file with ``request`` (a rename: the rank never reads half of it)."""
    path = control_path(run_dir, rank)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(request, f)
    os.replace(tmp, path)


def read_control(path: str) -> dict[str, Any]:
    """The rank's current control request; {} when there is none or it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
