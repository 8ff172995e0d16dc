"""The collectives a comm-check times and their nccl-tests bus-bandwidth factors (pure)."""

from __future__ import annotations

from typing import Callable

OPS = ("allreduce", "allgather")
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
}
