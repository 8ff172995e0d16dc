"""Every process of a rank ends with it (issue 24 item 1).

Two ways, chosen once per launcher by ``choose()`` as the node allows:

- ``CgroupContainment``: a cgroup v2 per rank under the launcher's own cgroup; the forked rank
  moves itself in before any user code runs, so nothing it starts (setsid or not) can leave it.
- ``TreeContainment``: the launcher is a child subreaper and so is every rank, so that while a
  rank lives its whole tree hangs under it by PPid links; when it exits, the processes the
  launcher adopts at that moment (and their descendants) are its leftovers.

Either way the launcher reports a rank's exit only once ``members()`` is empty.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time

PR_SET_CHILD_SUBREAPER = 36
CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
BASE_PREFIX = "rankctl-ranks-"  # + the launcher's pid: one directory of rank cgroups per launcher


def become_subreaper() -> None:
    """Orphans of our descendants are re-parented to us, not to init."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(err)}")


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class CgroupContainment:
    """One cgroup v2 directory per rank under ``base`` (a directory of the launcher's own cgroup)."""

    name = "cgroup2"

    def __init__(self, base: str) -> None:
        self.base = base

    def _path(self, key: str) -> str:
        return os.path.join(self.base, key)

    def prepare(self, key: str) -> None:
        """In the launcher, before the fork."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(self._path(key))

    def enter(self, key: str) -> None:
        """In the forked rank, before any user code."""
        with open(os.path.join(self._path(key), "cgroup.procs"), "w") as f:
            f.write("0")

    def adopt(self, key: str, rank_pids: set[int]) -> None:
        """Nothing to do: membership is the kernel's."""

    def members(self, key: str) -> list[int]:
        try:
            with open(os.path.join(self._path(key), "cgroup.procs")) as f:
                return [int(x) for x in f.read().split()]
        except FileNotFoundError:
            return []

    def processes(self, key: str, pid: int) -> list[int]:
        """Every process of the live rank ``pid``."""
        return self.members(key)

    def kill(self, key: str, pids: list[int]) -> None:
        """SIGKILL every member, forks in flight included (``cgroup.kill``, Linux 5.14+)."""
        try:
            with open(os.path.join(self._path(key), "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            signal_all(pids, signal.SIGKILL)

    def release(self, key: str) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(self._path(key))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(self.base)


class TreeContainment:
    """The fallback: a rank's tree by /proc's PPid links, the launcher and the ranks as subreapers."""

    name = "subreaper"

    def __init__(self, launcher_pid: int) -> None:
        self.launcher_pid = launcher_pid
        self.owned: dict[str, set[int]] = {}  # key of a rank that exited -> processes adopted for it

    def prepare(self, key: str) -> None:
        self.owned.pop(key, None)

    def enter(self, key: str) -> None:
        become_subreaper()  # the rank's orphans stay under it while it lives

    def adopt(self, key: str, rank_pids: set[int]) -> None:
        """Processes the launcher adopted and no one owns yet: the leftovers of a rank that just exited."""
        taken = set().union(*self.owned.values()) if self.owned else set()
        mine = self.owned.setdefault(key, set())
        for pid, ppid in _parents().items():
            if ppid == self.launcher_pid and pid not in rank_pids and pid not in taken:
                mine.add(pid)

    def members(self, key: str) -> list[int]:
        roots = self.owned.get(key, set())
        return _descendants(roots) if roots else []

    def processes(self, key: str, pid: int) -> list[int]:
        """Every process of the live rank ``pid``: its tree (a subreaper, its orphans stay in it)."""
        return _descendants([pid])

    def kill(self, key: str, pids: list[int]) -> None:
        signal_all(pids, signal.SIGKILL)

    def release(self, key: str) -> None:
        self.owned.pop(key, None)

    def close(self) -> None:
        self.owned.clear()


Containment = CgroupContainment | TreeContainment


def _parents() -> dict[int, int]:
    """pid -> PPid of every live (non-zombie) process on the node."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] not in (b"Z", b"X"):
            out[int(name)] = int(fields[1])
    return out


def _descendants(roots) -> list[int]:  # noqa: ANN001 - an iterable of pids
    """``roots`` that live and every process below them."""
    children: dict[int, list[int]] = {}
    parents = _parents()
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [p for p in roots if p in parents]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def end_stale(parent: str, wait_s: float = 5.0) -> list[str]:
    """Rank directories of launchers that died (SIGKILL, OOM) beside ours, cgroup v2 or a v1 controller's:
    what still runs in them (a rank's setsid children) is killed (``cgroup.kill``, or SIGKILL of each member
    where there is none), and the directories go. The directories ended."""
    ended = []
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            pid = name.removeprefix(BASE_PREFIX)
            if name.startswith(BASE_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                base = os.path.join(parent, name)
                for key in _subdirs(base):
                    rank = CgroupContainment(base)
                    rank.kill(key, rank.members(key))
                    _wait_empty(lambda k=key, r=rank: r.members(k), wait_s)
                    rank.release(key)
                with contextlib.suppress(OSError):
                    os.rmdir(base)
                ended.append(base)
    return ended


def _subdirs(path: str) -> list[str]:
    with contextlib.suppress(OSError):
        return [e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    return []


def _wait_empty(members, wait_s: float) -> None:  # noqa: ANN001 - () -> list of pids
    end = time.monotonic() + wait_s
    while members() and time.monotonic() < end:
        time.sleep(0.02)


def _cgroup_base(launcher_pid: int) -> str | None:
    """A new directory for ranks in the launcher's own cgroup v2, or None when none can be made."""
    own = ""
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        own = next((line.strip()[3:] for line in f if line.startswith("0::")), "")
    for root in CGROUP_ROOTS:
        if not os.path.exists(os.path.join(root, "cgroup.procs")) or not os.path.exists(
                os.path.join(root, "cgroup.subtree_control")):
            continue
        parent = os.path.join(root, own.lstrip("/"))
        end_stale(parent)
        base = os.path.join(parent, f"{BASE_PREFIX}{launcher_pid}")
        try:
            os.makedirs(base, exist_ok=True)
            probe = os.path.join(base, "probe")
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError:
            continue
        return base
    return None


MODES = ("auto", "cgroup2", "subreaper")


def choose(launcher_pid: int, mode: str = "auto") -> tuple[Containment, str]:
    """The containment ``mode`` asks for ("auto": the best this node allows), and a line for the
    start-up log saying which and why; "cgroup2" where none can be made is an OSError."""
    if mode not in MODES:
        raise ValueError(f"containment {mode!r} is not one of {', '.join(MODES)}")
    become_subreaper()  # either way: leftovers are ours to reap, never init's
    base = _cgroup_base(launcher_pid) if mode != "subreaper" else None
    if base is not None:
        return CgroupContainment(base), f"cgroup2 per rank under {base}"
    if mode == "cgroup2":
        raise OSError(f"containment cgroup2: no writable cgroup v2 under {' or '.join(CGROUP_ROOTS)}")
    why = "asked for" if mode == "subreaper" else "no writable cgroup v2 found"
    return TreeContainment(launcher_pid), f"child subreaper ({why})"
