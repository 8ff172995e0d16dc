"""The files a rank process and its node's daemon share, under the run directory the daemon made.

``rank-R.status.jsonl``: the rank appends one flushed line per status record (``contract.rankstatus``
holds the record and its line); the daemon tails it, keeping a partial last line pending until its newline.
``rank-R.log``: the rank's stdout and stderr, with rankctl's own records among them, each marked
(``contract.logrecords``). ``saved.fifo`` (one per run directory, made by the daemon): a rank writes a byte
into it when one of its checkpoint or snapshot steps is complete, marker included; the daemon pushes the
step to the job's replica peer at once instead of at its next poll turn. ``rank-R.control.json``: the
daemon's requests to the rank, replaced whole by a rename; the rank polls its mtime once per step::

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


def saved_path(run_dir: str) -> str:
    return os.path.join(run_dir, "saved.fifo")


def notify_saved(run_dir: str) -> None:
    """Tell the node's daemon that a save of this rank is complete. Never blocks and never fails: without the
    FIFO (an older daemon, or no run directory: a rank started by hand), a reader or room in the pipe, the
    daemon's poll turn finds the step anyway."""
    if not run_dir:
        return
    try:
        fd = os.open(saved_path(run_dir), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        os.write(fd, b"\1")
    except OSError:
        pass
    finally:
        os.close(fd)
