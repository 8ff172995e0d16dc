"""Where a node refuses mounts, what a job attempt's ranks create in ``/dev/shm`` goes with it.

The fallback of ``worker.files.shm`` (issue 24 item 2): ranks share the host's ``/dev/shm``, so the
launcher tracks what each attempt creates there. An entry (a top-level name) is the attempt's when

- one of the attempt's processes was seen holding it (an open descriptor or a mapping; the
  launcher looks every ``SCAN_S`` while the attempt runs), or
- it appeared after the attempt started, while no other attempt ran on the node, and nobody holds
  it when the attempt ends (a file written and closed between two looks).

At the attempt's end its entries are removed. rankctl's own directories (``rankctl-{hash}``, the
snapshot memory) are never taken. What two overlapping attempts create and close between two looks
belongs to neither and stays: the private tmpfs is the exact way, this one is the best effort.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Iterable

SCAN_S = 1.0
CLOCK_SLACK_NS = 10_000_000  # a coarse clock tick is at most 10 ms (HZ=100)
OWN = re.compile(r"rankctl-[0-9a-f]{12}")  # contract.checkpoints.memory_base's directories


@dataclass
class _Attempt:
    started_ns: int
    overlapped: bool = False
    held: set[str] = field(default_factory=set)


class ShmTracker:
    """Entries of ``shm_dir`` by job attempt (``(job_id, attempt)``); see the module doc."""

    def __init__(self, shm_dir: str) -> None:
        self.shm_dir = shm_dir.rstrip(os.sep)
        self.attempts: dict[tuple[str, int], _Attempt] = {}
        self.owner: dict[str, tuple[str, int]] = {}  # entry name -> the attempt seen holding it first

    def started(self, attempt: tuple[str, int]) -> None:
        if attempt in self.attempts:
            return
        others = bool(self.attempts)
        for other in self.attempts.values():
            other.overlapped = True
        self.attempts[attempt] = _Attempt(started_ns=_now_ns(), overlapped=others)

    def scan(self, attempt: tuple[str, int], pids: Iterable[int]) -> None:
        """Entries the attempt's processes ``pids`` hold now become its own."""
        state = self.attempts.get(attempt)
        if state is None:
            return
        for name in held_by(self.shm_dir, pids):
            if name not in self.owner:
                self.owner[name] = attempt
                state.held.add(name)

    def ended(self, attempt: tuple[str, int]) -> list[str]:
        """The attempt's last process on the node is gone: remove its entries; the paths removed."""
        state = self.attempts.pop(attempt, None)
        if state is None:
            return []
        names = set(state.held)
        if not state.overlapped:
            names |= self._created_since(state.started_ns) - set(self.owner) - held_by(self.shm_dir, _all_pids())
        removed = []
        for name in sorted(names):
            self.owner.pop(name, None)
            if OWN.fullmatch(name):
                continue
            path = os.path.join(self.shm_dir, name)
            if _remove(path):
                removed.append(path)
        return removed

    def _created_since(self, since_ns: int) -> set[str]:
        out = set()
        with contextlib.suppress(OSError), os.scandir(self.shm_dir) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_ctime_ns >= since_ns and not OWN.fullmatch(entry.name):
                        out.add(entry.name)
        return out


def held_by(shm_dir: str, pids: Iterable[int]) -> set[str]:
    """Top-level names under ``shm_dir`` that ``pids`` hold open or mapped."""
    prefix = shm_dir + os.sep
    names: set[str] = set()
    for pid in pids:
        for path in _fd_targets(pid) + _mapped(pid, prefix):
            if path.startswith(prefix):
                names.add(path[len(prefix):].split(os.sep, 1)[0].removesuffix(" (deleted)"))
    return names


def _fd_targets(pid: int) -> list[str]:
    out = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def _mapped(pid: int, prefix: str) -> list[str]:
    out = []
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", "rb") as f:
        needle = prefix.encode()
        for line in f:
            at = line.find(needle)
            if at >= 0:
                out.append(line[at:].rstrip(b"\n").decode("utf-8", "replace"))
    return out


def _all_pids() -> list[int]:
    return [int(x) for x in os.listdir("/proc") if x.isdigit()]


def _now_ns() -> int:
    """Now, less the file system clock's coarseness (a ctime stamped just after may read earlier)."""
    return time.time_ns() - CLOCK_SLACK_NS


def _remove(path: str) -> bool:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError:
        return False
    return True
