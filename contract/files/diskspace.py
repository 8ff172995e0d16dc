"""A full disk: its errnos (``DISK_FULL``, one home for every package), and words for it: which file, on which
file system, how much room it has (issue 43).

A rank that dies with ENOSPC said only "[Errno 28] No space left on device"; the coordinator reads a full disk
as its node's fault (``coordinator.model.faults``), and an operator needs the path and the file system to make room.
"""

from __future__ import annotations

import errno
import os

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def file_system_of(path: str, mounts: str = "/proc/mounts") -> tuple[str, str]:
    """(type, mount point) of the file system ``path`` lies on: the longest mount point above it."""
    real = os.path.realpath(path)
    best = ("unknown", "/")
    try:
        with open(mounts, encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                above = real == point or real.startswith(point.rstrip("/") + "/")
                if above and len(point) >= len(best[1]):
                    best = (fields[2], point)
    except OSError:
        pass
    return best


def disk_full_line(exc: BaseException) -> str | None:
    """``OSError: [Errno 28] No space left on device: '/x/f' (file system tmpfs mounted at /x: 0 B of 48.0 MiB
    free)`` for a full-disk OSError in ``exc`` or what caused it; None for any other error."""
    seen: BaseException | None = exc
    while seen is not None and not (isinstance(seen, OSError) and seen.errno in DISK_FULL):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    path = seen.filename
    if not path:
        return f"OSError: [Errno {seen.errno}] {seen.strerror}"
    kind, point = file_system_of(os.path.dirname(os.path.abspath(path)))
    try:
        st = os.statvfs(point)
        room = f": {_size(st.f_bavail * st.f_frsize)} of {_size(st.f_blocks * st.f_frsize)} free"
    except OSError:
        room = ""
    return f"OSError: [Errno {seen.errno}] {seen.strerror}: {str(path)!r} (file system {kind} mounted at {point}{room})"
