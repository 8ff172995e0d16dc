"""A job's ``/dev/shm`` is its own and goes with it (issue 24 item 2).

Per job attempt on a node the launcher mounts a tmpfs of ``resources.shm_mb`` at
``{run_dir}/shm``; each rank of the attempt enters a mount namespace of its own (changes on
the host still reach it, its own never leave) and binds that tmpfs over ``/dev/shm``, so the
attempt's ranks share it (NCCL's shared-memory transport) and nobody else sees it. rankctl's
own snapshot directory (``contract.files.checkpoints.memory_base``) is bound back in from the host,
so that the daemon still reads what the ranks snapshot. When the attempt's last rank on the node
is gone the launcher unmounts it, and its bytes go with it. Where the node refuses a mount
(no CAP_SYS_ADMIN) ranks use the host's ``/dev/shm``, and what each attempt creates there is
tracked and removed with it (``worker.files.shmtrack``); the start-up log says which.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

from rankctl.contract.files import checkpoints

from rankctl.contract.files import safepath
from rankctl.worker.files import mountreg

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_SLAVE = 2, 4, 4096, 16384, 1 << 19
MNT_DETACH, UMOUNT_NOFOLLOW = 2, 8
SHM_MODES = ("auto", "private", "tracked")  # the launcher's --shm; "tracked" is worker.shmtrack


def libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None
    check(libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or fstype} on {target}")


def unmount(path: str) -> None:
    """Detach the mount at ``path`` (lazily: a process still inside keeps it until it leaves); OSError if refused."""
    check(libc().umount2(path.encode(), MNT_DETACH | UMOUNT_NOFOLLOW), f"umount {path}")


def job_shm_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "shm")


def mount_job_shm(run_dir: str, size_mb: int) -> str:
    """In the launcher: the attempt's tmpfs at ``{run_dir}/shm`` (mounted once); OSError when refused."""
    path = job_shm_dir(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    safepath.makedirs(run_dir, path)   # a link planted there is refused (UnsafePath), never mounted over
    if not os.path.ismount(path):
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(size_mb)}m,mode=1777")
        mountreg.record(path, [os.getpid(), os.getppid()])   # the launcher and its daemon (worker.mountreg)
    return path


def unmount_job_shm(run_dir: str) -> None:
    """In the launcher, once no process of the attempt is left: the tmpfs and its bytes are gone."""
    path = job_shm_dir(run_dir)
    if os.path.ismount(path):
        with contextlib.suppress(OSError):
            unmount(path)
    mountreg.forget(path)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def can_mount(scratch: str) -> bool:
    """Whether this process may mount a tmpfs (tried on an empty directory ``scratch``, then undone)."""
    os.makedirs(scratch, exist_ok=True)
    try:
        mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m")
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            unmount(scratch)
        with contextlib.suppress(OSError):
            os.rmdir(scratch)
    return True


def unmount_stale(state_dir: str) -> list[str]:
    """Every job tmpfs under ``{state}/jobs/`` (a daemon that starts has no rank left alive: a mount
    there outlived a launcher killed with its daemon); the mount points removed."""
    prefix = os.path.join(os.path.realpath(state_dir), "jobs") + os.sep
    points = [point for point, kind in mountreg.mounts()
              if kind == "tmpfs" and point.startswith(prefix) and point.endswith(os.sep + "shm")]
    for point in points:
        unmount_job_shm(os.path.dirname(point))
    return points


def enter_private_shm(run_dir: str) -> None:
    """In the forked rank, before user code: its own mount namespace, the attempt's tmpfs on /dev/shm,
    rankctl's snapshot directory bound back in from the host."""
    keep = checkpoints.memory_base(checkpoints.state_dir_of(run_dir))
    inside = keep.startswith(checkpoints.SHM + os.sep)
    if inside:
        os.makedirs(keep, exist_ok=True)
    check(libc().unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_SLAVE)  # host mounts still arrive; ours never leave
    host = os.open(keep, os.O_PATH | os.O_DIRECTORY) if inside else -1
    try:
        mount(job_shm_dir(run_dir), checkpoints.SHM, None, MS_BIND)
        if inside:
            os.makedirs(keep, exist_ok=True)
            mount(f"/proc/self/fd/{host}", keep, None, MS_BIND)
    finally:
        if host >= 0:
            os.close(host)
