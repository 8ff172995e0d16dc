"""rankctl's own snapshot memory under a bound of its own (issue 24 item 2): ``ctl worker --snapshot-memory-mb``.

At start-up the daemon mounts a tmpfs of that size at ``contract.files.checkpoints.memory_base`` (or resizes
the one a predecessor left, snapshots and all), so the kernel keeps the ranks' snapshots and the copies
kept for peers under it alike. Where the node refuses the mount, the bound is *accounted*: the peer
service refuses a pushed snapshot step that would pass it (``worker.replication.replicas``); the ranks' own writes
are then bounded only by the node's /dev/shm. A clean stop unmounts the tmpfs when no snapshot is left.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from rankctl.contract.files import checkpoints
from rankctl.worker.files import mountreg
from rankctl.worker.files.meminfo import MEMINFO, total_bytes
from rankctl.worker.files import shm

MS_REMOUNT = 32
MOUNTED, RESIZED, ACCOUNTED, NONE = "tmpfs mounted", "tmpfs resized", "accounted by the peer service", "none"
OPTION = "ctl worker --snapshot-memory-mb"
SUBTREES = ("snapshots", "snapshot-replicas")  # what lies under memory_base (contract.checkpoints)


@dataclass(frozen=True, kw_only=True)
class Bound:
    """The bound in force on this node's snapshot memory, and how it is kept."""

    limit: int     # bytes; 0: no bound of rankctl's own
    how: str       # MOUNTED, RESIZED (the kernel keeps it), ACCOUNTED or NONE
    base: str      # memory_base of the daemon's state dir
    why: str = ""  # why the kernel does not keep it

    @property
    def accounted(self) -> bool:
        return self.how == ACCOUNTED and self.limit > 0

    def in_use(self) -> int:
        """Bytes of snapshot files under ``base``: the tmpfs's own figure when rankctl mounted it, else a walk."""
        if self.how in (MOUNTED, RESIZED):
            st = os.statvfs(self.base)
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        return sum(_sizes(os.path.join(self.base, sub)) for sub in SUBTREES)

    def full(self, in_use: int, incoming: int = 0) -> str:
        """Why a snapshot does not fit, naming the bound."""
        arriving = f" and {incoming} more arriving" if incoming else ""
        if self.limit <= 0:
            return (f"snapshot memory full: {in_use} bytes in use under {self.base}{arriving}; rankctl keeps no "
                    f"bound of its own there ({OPTION} 0), the node's memory is full")
        return (f"snapshot memory full: {in_use} bytes in use under {self.base}{arriving} would pass the bound of "
                f"{self.limit} bytes ({OPTION} {self.limit >> 20})")

    def fields(self) -> dict[str, object]:
        """For the start-up log line."""
        out: dict[str, object] = {"limit_mb": self.limit >> 20, "how": self.how, "path": self.base}
        return out | ({"why": self.why} if self.why else {})


def _sizes(root: str) -> int:
    total = 0
    for top, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_size
    return total


def default_mb(meminfo: str = MEMINFO) -> int:
    """A quarter of the node's memory (MemTotal) in MiB; 0 (no bound) when it cannot be read."""
    return total_bytes(meminfo) // (1 << 20) // 4


def _fstype(path: str) -> str:
    """The type of the filesystem mounted at ``path`` (the newest mount there), "" when none is."""
    return next((kind for point, kind in reversed(mountreg.mounts()) if point == path), "")


def _mount_or_resize(base: str, limit_mb: int) -> Bound:
    """A new tmpfs of ``limit_mb`` at ``base`` (or a resize of the one there); OSError when refused."""
    limit, flags = limit_mb << 20, shm.MS_NOSUID | shm.MS_NODEV
    if os.path.ismount(base):
        kind = _fstype(base)
        if kind != "tmpfs":
            return Bound(limit=limit, how=ACCOUNTED, base=base, why=f"a {kind or 'foreign'} mount is there")
        try:
            shm.mount(None, base, None, MS_REMOUNT | flags, f"size={limit_mb}m")
        except OSError as exc:  # tmpfs will not shrink below what it holds
            return Bound(limit=limit, how=ACCOUNTED, base=base,
                         why=f"the tmpfs there keeps its size: a resize to {limit_mb} MiB was refused ({exc.strerror})")
        return Bound(limit=limit, how=RESIZED, base=base)
    os.makedirs(base, mode=0o700, exist_ok=True)
    if os.listdir(base):  # a mount would hide them (snapshots from before the bound)
        return Bound(limit=limit, how=ACCOUNTED, base=base, why="it holds files from before; mounted once empty")
    shm.mount("tmpfs", base, "tmpfs", flags, f"size={limit_mb}m,mode=0700,uid={os.getuid()},gid={os.getgid()}")
    return Bound(limit=limit, how=MOUNTED, base=base)


def apply(state_dir: str, limit_mb: int | None) -> Bound:
    """Put the bound in force before any rank runs (``limit_mb`` None: ``default_mb()``; 0: none)."""
    limit_mb = default_mb() if limit_mb is None else limit_mb
    base = checkpoints.memory_base(state_dir)
    if limit_mb <= 0:
        return Bound(limit=0, how=NONE, base=base, why=f"{OPTION} 0")
    if not base.startswith(checkpoints.SHM + os.sep):
        return Bound(limit=limit_mb << 20, how=ACCOUNTED, base=base, why=f"snapshots are not in {checkpoints.SHM}")
    try:
        bound = _mount_or_resize(base, limit_mb)
        if bound.how in (MOUNTED, RESIZED):
            mountreg.record(base, [os.getpid()])   # a SIGKILLed daemon's is unmounted by the next worker's start
        return bound
    except OSError as exc:
        return Bound(limit=limit_mb << 20, how=ACCOUNTED, base=base, why=str(exc))


def holds_snapshots(base: str) -> bool:
    """Some rank file (complete or not) lies under ``base``; a dropped run's tombstone is not one."""
    return any(checkpoints.RANK_FILE_RE.match(name)
               for sub in SUBTREES for _, _, files in os.walk(os.path.join(base, sub)) for name in files)


def release(bound: Bound) -> bool:
    """On a clean stop: unmount rankctl's tmpfs when it holds no snapshot (a restarted daemon keeps those);
    whether it went."""
    if bound.how not in (MOUNTED, RESIZED) or holds_snapshots(bound.base):
        return False
    try:
        shm.unmount(bound.base)
    except OSError:
        return False
    mountreg.forget(bound.base)
    with contextlib.suppress(OSError):
        os.rmdir(bound.base)
    return True
