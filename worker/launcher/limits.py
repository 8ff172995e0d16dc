"""Per-rank memory and process limits from the job file (issue 24 item 1).

``resources.memory_mb`` and ``resources.pids_max`` hold for each rank with everything it starts.
They are set in the cgroup controllers this launcher may write, found once per launcher by
``find_controllers``: cgroup v2 when the controller is delegated to the launcher's rank directory
(``contain.CgroupContainment``), else the controller's cgroup v1 hierarchy under the launcher's own
v1 cgroup (hybrid nodes). A rank whose limits no controller can enforce is not started: its launch
fails naming the field, so a limit asked for is never silently ignored. After a rank ended, the
controller tells whether the kernel's OOM killer struck inside it (``oom_kills``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from rankctl.contract.spec import Resources
from rankctl.worker.launcher.contain import BASE_PREFIX, end_stale

V1_ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("memory", "pids")
FIELD = {"memory": "resources.memory_mb", "pids": "resources.pids_max"}


@dataclass(frozen=True, kw_only=True)
class RankLimits:
    memory_mb: int | None = None
    pids_max: int | None = None

    @classmethod
    def of(cls, resources: Resources) -> "RankLimits":
        """From a typed spec's ``resources`` (None: no limit)."""
        return cls(memory_mb=resources.memory_mb, pids_max=resources.pids_max)

    def files(self) -> dict[str, tuple[str, str, str]]:
        """controller -> (v2 file, v1 file, value) of each limit set."""
        out = {}
        if self.memory_mb is not None:
            out["memory"] = ("memory.max", "memory.limit_in_bytes", str(self.memory_mb << 20))
        if self.pids_max is not None:
            out["pids"] = ("pids.max", "pids.max", str(self.pids_max))
        return out

    def describe(self, controller: str) -> str:
        value = self.memory_mb if controller == "memory" else self.pids_max
        return f"{FIELD[controller]}={value}"


class Unenforceable(OSError):
    """A limit the job file asks for and no controller on this node can set."""


@dataclass(frozen=True)
class Controller:
    """Where one controller's per-rank directories go: ``base/{key}``, cgroup v1 or v2."""

    name: str
    base: str
    v2: bool

    def path(self, key: str) -> str:
        return os.path.join(self.base, key)


class Limits:
    """The launcher's limit-setting: ``prepare`` before a rank's fork, ``enter`` in the child,
    ``oom_kills`` and ``release`` once every process of the rank is gone."""

    def __init__(self, controllers: dict[str, Controller], why: dict[str, str]) -> None:
        self.controllers = controllers
        self.why = why  # controller -> why none could be used

    def describe(self) -> str:
        have = [f"{c.name} (cgroup {'v2' if c.v2 else 'v1'})" for c in self.controllers.values()]
        return "limits: " + (", ".join(have) if have else "none (" + "; ".join(self.why.values()) + ")")

    def prepare(self, key: str, limits: RankLimits) -> list[str]:
        """Make the rank's directories with its limits set; the directories its child must enter.
        ``Unenforceable`` when a limit asked for has no controller here."""
        wanted = limits.files()
        for name in wanted:
            if name not in self.controllers:
                raise Unenforceable(f"{limits.describe(name)} cannot be enforced on this node: {self.why[name]}")
        dirs = []
        for name, (v2_file, v1_file, value) in wanted.items():
            c = self.controllers[name]
            path = c.path(key)
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)
            _write(os.path.join(path, v2_file if c.v2 else v1_file), value)
            if not c.v2:
                dirs.append(path)
        return dirs

    @staticmethod
    def enter(dirs: list[str]) -> None:
        """In the forked rank, before user code (cgroup v2 directories are entered by containment)."""
        for path in dirs:
            _write(os.path.join(path, "cgroup.procs"), "0")

    def oom_kills(self, key: str) -> int:
        c = self.controllers.get("memory")
        if c is None:
            return 0
        name = "memory.events" if c.v2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError), open(os.path.join(c.path(key), name)) as f:
            for line in f:
                field, _, count = line.partition(" ")
                if field == "oom_kill":
                    return int(count)
        return 0

    def release(self, key: str) -> None:
        for c in self.controllers.values():
            if not c.v2:
                with contextlib.suppress(OSError):
                    os.rmdir(c.path(key))

    def close(self) -> None:
        for c in self.controllers.values():
            if not c.v2:
                with contextlib.suppress(OSError):
                    os.rmdir(c.base)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _v2_controllers(base: str | None) -> tuple[set[str], str]:
    """Controllers enabled for the rank directories under the v2 ``base`` (enabling what is delegated)."""
    if base is None:
        return set(), "no cgroup v2 directory of the launcher's"
    try:
        with open(os.path.join(base, "cgroup.controllers")) as f:
            offered = set(f.read().split()) & set(CONTROLLERS)
    except OSError as exc:
        return set(), f"cgroup v2 unreadable ({exc.strerror})"
    enabled = set()
    for name in offered:
        with contextlib.suppress(OSError):
            _write(os.path.join(base, "cgroup.subtree_control"), f"+{name}")
            enabled.add(name)
    return enabled, f"cgroup v2 at {base} is not delegated that controller"


def _v1_base(name: str, launcher_pid: int) -> str | None:
    """A new directory for ranks under the launcher's own cgroup v1 of controller ``name``."""
    own = None
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if name in names.split(","):
                own = path
    root = os.path.join(V1_ROOT, name)
    if own is None or not os.path.exists(os.path.join(root, "cgroup.procs")):
        return None
    parent = os.path.join(root, own.lstrip("/"))
    end_stale(parent)  # a dead launcher's directories: what still runs there is killed (SIGKILL in v1)
    base = os.path.join(parent, f"{BASE_PREFIX}{launcher_pid}")
    try:
        os.makedirs(base, exist_ok=True)
    except OSError:
        return None
    return base


def find_controllers(launcher_pid: int, v2_base: str | None) -> Limits:
    """What this launcher can limit, and how: v2 where delegated, else v1 where writable."""
    enabled, why_v2 = _v2_controllers(v2_base)
    found: dict[str, Controller] = {}
    why: dict[str, str] = {}
    for name in CONTROLLERS:
        if name in enabled:
            found[name] = Controller(name, v2_base or "", True)
            continue
        v1 = _v1_base(name, launcher_pid)
        if v1 is not None:
            found[name] = Controller(name, v1, False)
        else:
            why[name] = f"no {name} controller rankctl may write ({why_v2}; no writable cgroup v1 {name} hierarchy)"
    return Limits(found, why)
