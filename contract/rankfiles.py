"""The files a rank process and its node's daemon share (the rank writes, the daemon tails).

A rank appends one JSON object per line to ``{run_dir}/rank-{rank}.status.jsonl``::

    {"ts": 1712.3, "rank": 3, "phase": "running", "step": 12, "metrics": {"loss": 2.1},
     "error": null, "result": null}

Phases, in order: ``rendezvous``, ``groups``, ``running``, then ``done`` (with ``result``)
or ``failed`` (with ``error`` and ``traceback``). Each line is flushed as it is written, so
a reader never sees a torn record except for the line being written, which it keeps
pending until the newline arrives. The rank's stdout and stderr go to
``{run_dir}/rank-{rank}.log``, with rankctl's own records among them, each marked (``contract.logrecords``). Writer: ``runtime.status``; readers: ``worker.status``.

The other way, the daemon writes requests for a rank to ``{run_dir}/rank-{rank}.control.json``
(replaced whole by a rename; the rank polls its mtime once per step)::

    {"checkpoint_at": 17}      # save a checkpoint at the end of step 17 (ctl drain)
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

PHASES = ("rendezvous", "groups", "running", "done", "failed")
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
