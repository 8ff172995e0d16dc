"""The workload of ``bench/peers.py``, the same under every system: each step an all-reduce of a small tensor over
every rank, then ``STEP_S`` of sleep, then one status line (JSON) with the rank's wall clock (``time.time()``) in a
file of its own process: ``OUT/rank-R-PID.jsonl``. Imports torch only (the peers' rank scripts import this and their
own library, never rankctl). No checkpoint on any side: a restarted rank starts again at step 1 (torchft's replacement
takes the survivors' step count from them, its own way)."""

from __future__ import annotations

import json
import os
import time

STEP_S = 0.05
STEPS = 100_000   # the bench ends every run itself


class Status:
    """One process's status file; ``started`` is the process's own start (taken by the script before torch loads)."""

    def __init__(self, out: str, rank: int, started: float, **fixed) -> None:  # noqa: ANN003
        os.makedirs(out, exist_ok=True)
        self.f = open(os.path.join(out, f"rank-{rank}-{os.getpid()}.jsonl"), "a", buffering=1)
        self.fixed = {"rank": rank, "pid": os.getpid(), "started": started, **fixed}

    def write(self, step: int, **extra) -> None:  # noqa: ANN003
        self.f.write(json.dumps({**self.fixed, "step": step, "ts": time.time(), **extra}) + "\n")
        self.f.flush()


def tensor(step: int):  # noqa: ANN201
    import torch

    return torch.ones(4) * step


def loop(allreduce, status: Status, steps: int = STEPS, each=None) -> None:  # noqa: ANN001
    """``steps`` steps of all-reduce, sleep, status line; ``each(step, value)`` after each line (heartbeats, reports)."""
    for step in range(1, steps + 1):
        t = tensor(step)
        allreduce(t)
        time.sleep(STEP_S)
        status.write(step)
        if each is not None:
            each(step, float(t[0]))
