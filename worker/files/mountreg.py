"""Who owns each tmpfs rankctl mounts on a host, so that the next worker to start there unmounts a dead one's.

A daemon killed with SIGKILL never unmounts its snapshot memory (``worker.files.snapmem``) nor its launcher's
per-attempt ``/dev/shm`` (``worker.files.shm``), and a Slurm worker's state dir (named after the Slurm job) is never
used again, so no restart on it would. Each such mount is recorded in a host-wide registry,
``{SHM}/rankctl-mounts/{hash of the mount point}``: the mount point and its owners (pid and start time: the
daemon, and for an attempt's the launcher that mounted it). A worker's start (``reap``), whatever its state
dir, and again every few seconds while it runs (a launcher may outlive its SIGKILLed daemon past the next worker's
start), unmounts every recorded tmpfs whose owners are all gone; never one with a live owner (a reused pid does
not count as the owner: its start time differs), nor a mount no record names (made before the registry). An owner is
judged gone only where its pid can be judged: a record made in another pid namespace (a container sharing the
host's ``/dev/shm``: its pids mean nothing here), or whose owner's start time could not be read when it was made, is
never this worker's to take (issue 53: one daemon unmounted another cluster's ``/dev/shm`` paths).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from typing import Callable, Iterable, Sequence

from rankctl.contract.files import checkpoints

REGISTRY = "rankctl-mounts"


def registry_dir() -> str | None:
    """The registry directory (made 0700), or None when it cannot be used: not a directory of this user's."""
    path = os.path.join(checkpoints.SHM, REGISTRY)
    with contextlib.suppress(FileExistsError, OSError):
        os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return path if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() else None


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _entry(directory: str, path: str) -> str:
    return os.path.join(directory, hashlib.sha1(path.encode(), usedforsecurity=False).hexdigest()[:20])


def record(path: str, owners: Sequence[int]) -> None:
    """Note that ``owners`` (live pids) own the tmpfs at ``path``; best effort (a registry that cannot be
    written leaves the mount as before: unmounted by its owners or a restart on its state dir)."""
    directory = registry_dir()
    if directory is None:
        return
    doc = {"path": os.path.abspath(path), "owners": [[pid, start_time(pid)] for pid in owners],
           "pidns": pid_namespace()}
    entry = _entry(directory, doc["path"])
    with contextlib.suppress(OSError):
        with open(f"{entry}.tmp-{os.getpid()}", "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(f"{entry}.tmp-{os.getpid()}", entry)


def forget(path: str) -> None:
    """The tmpfs at ``path`` was unmounted by its owner."""
    directory = registry_dir()
    if directory is not None:
        with contextlib.suppress(OSError):
            os.unlink(_entry(directory, os.path.abspath(path)))


def pid_namespace() -> str:
    """This process's pid namespace (``pid:[4026531836]``), "" when unreadable."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _alive(owners: Iterable[Sequence[int | None]]) -> bool:
    """Some owner may live: its pid runs with the start time recorded, or no start time was recorded (then a pid that
    exists counts as it: it cannot be told from another)."""
    return any(start_time(pid) == started if started is not None else os.path.exists(f"/proc/{pid}")
               for pid, started in owners)


def ours_to_judge(doc: dict) -> bool:
    """A record made in this pid namespace (an older one names none: made on this host before the field)."""
    recorded = doc.get("pidns")
    return not recorded or recorded == pid_namespace()


def mounts() -> list[tuple[str, str]]:
    """This host's mount table, oldest first: (mount point, file system type), spaces in points decoded."""
    with open("/proc/self/mounts", encoding="utf-8") as f:
        return [(p[1].replace("\\040", " "), p[2]) for p in (line.split() for line in f) if len(p) > 2]


def reap(unmount: Callable[[str], None], keep: Iterable[str] = ()) -> list[str]:
    """``unmount`` (``worker.files.shm.unmount``) and remove, when empty, every recorded tmpfs whose owners are all
    gone, except at ``keep`` (this daemon's own snapshot memory: it takes over a predecessor's, snapshots and
    all); the paths unmounted."""
    directory = registry_dir()
    if directory is None:
        return []
    keep, gone = {os.path.abspath(k) for k in keep}, []
    mounted = {point for point, kind in mounts() if kind == "tmpfs"}
    for name in os.listdir(directory):
        entry = os.path.join(directory, name)
        try:
            with open(entry, encoding="utf-8") as f:
                doc = json.load(f)
            path, owners = str(doc["path"]), [(int(p), s) for p, s in doc["owners"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue   # a record being written, or not one of ours
        if path in keep or not ours_to_judge(doc) or _alive(owners) or entry != _entry(directory, path):
            continue
        if path in mounted:
            with contextlib.suppress(OSError):
                unmount(path)
                gone.append(path)
        with contextlib.suppress(OSError):
            os.rmdir(path)
        with contextlib.suppress(OSError):
            os.unlink(entry)
    return gone
