"""The files a rank process and its node's daemon share (the rank writes, the daemon tails).

A rank appends one JSON object per line to ``{run_dir}/rank-{rank}.status.jsonl``::

    {"ts": 1712.3, "rank": 3, "phase": "running", "step": 12, "metrics": {"loss": 2.1},
     "error": null, "result": null}

Phases, in order: ``rendezvous``, ``groups``, ``running``, then ``done`` (with ``result``)
or ``failed`` (with ``error`` and ``traceback``). Each line is flushed as it is written, so
a reader never sees a torn record except for the line being written, which it keeps
pending until the newline arrives. The rank's stdout and stderr go to
``{run_dir}/rank-{rank}.log``. Writer: ``runtime.status``; readers: ``worker.status``.
"""

from __future__ import annotations

import os
import re

PHASES = ("rendezvous", "groups", "running", "done", "failed")
STATUS_RE = re.compile(r"^rank-(\d+)\.status\.jsonl$")


def status_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank}.status.jsonl")


def log_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank}.log")
