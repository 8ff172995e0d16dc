"""The node's memory from ``/proc/meminfo``: the one reader of it (the launcher's hardware facts, the daemon's usage
samples, the snapshot memory's default bound)."""

from __future__ import annotations

from pathlib import Path

MEMINFO = "/proc/meminfo"


def meminfo(path: str | Path = MEMINFO, keys: tuple[str, ...] = ("MemTotal", "MemAvailable")) -> dict[str, int]:
    """Bytes of each of ``keys`` that ``path`` states (a missing or unreadable file: none)."""
    seen: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in keys:
                    seen[key] = int(rest.split()[0]) * 1024
                    if len(seen) == len(keys):
                        break
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return {}
    return seen


def total_bytes(path: str | Path = MEMINFO) -> int:
    """MemTotal in bytes; 0 when it cannot be read."""
    return meminfo(path, ("MemTotal",)).get("MemTotal", 0)
