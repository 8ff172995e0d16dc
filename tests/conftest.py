"""Shared test set-up.

Ranks are forked from the pytest process in several multi-rank tests. Forking is only safe
from a process that has not started gRPC (its threads and locks do not survive a fork: a
forked rank hung joining a thread that only existed in the parent). Modules marked
``grpc_in_process`` (in-process coordinator or client) therefore run after every other test.

Several multi-rank tests fork ranks from the pytest process. A process whose OpenMP thread
pool has started cannot fork safely (the child waits for pool threads that do not exist), so
the test process runs torch single-threaded from the start: no pool is ever created. Ranks
set their own thread count after the fork, as the launcher's ranks do.

Tests live by layer: ``tests/unit/<package>`` (pure: no processes), ``tests/integration`` (processes, gloo ranks,
an in-process gRPC server), ``tests/e2e`` (the real coordinator, daemons and ``ctl``); each test gets its layer's
marker (``unit``, ``integration``, ``e2e``), so ``pytest -m "not e2e"`` runs the first two. The helpers (``cluster``,
``ranks``, ``test_core``'s world ...) are importable from every layer: each test folder is on ``sys.path``.

A worker daemon mounts its snapshot memory (``worker.files.snapmem``) and unmounts it on a clean stop;
one a fault test SIGKILLs leaves it mounted, so the session unmounts what it added.
"""

import contextlib
import fcntl
import os
import shutil
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
LAYERS = ("unit", "integration", "e2e")
for _folder in sorted({p.parent for p in TESTS.rglob("*.py")} - {TESTS / "notorch"}, reverse=True):
    if str(_folder) not in sys.path and "toykind" not in _folder.parts:
        sys.path.insert(0, str(_folder))

os.environ.setdefault("OMP_NUM_THREADS", "1")



import torch  # noqa: E402

torch.set_num_threads(1)


def _snapshot_mounts(base: str) -> set[str]:
    with open("/proc/self/mounts") as f:
        return {fields[1] for fields in (line.split() for line in f)
                if len(fields) > 2 and fields[2] == "tmpfs" and fields[1].startswith(("/dev/shm/rankctl-", base))}


@pytest.fixture(scope="session", autouse=True)
def _unmount_snapshot_memory_left_by_killed_daemons(tmp_path_factory: pytest.TempPathFactory):
    """Snapshot memory (``/dev/shm/rankctl-*``) and jobs' ``/dev/shm`` (a tmpfs in the job's run dir) that daemons
    killed by a test (SIGKILL, or Slurm ending a step) left mounted."""
    base = str(tmp_path_factory.getbasetemp())
    before = _snapshot_mounts(base)
    yield
    from rankctl.contract.files.checkpoints import memory_base
    from rankctl.worker.files import shm

    # Another pytest-xdist worker's daemons may be running: only the snapshot memory of state dirs under this
    # worker's own base temp directory is its to unmount.
    own = {memory_base(os.path.join(top, d)) for top, dirs, _ in os.walk(base) for d in dirs}
    for point in sorted(_snapshot_mounts(base) - before, reverse=True):
        if point.startswith("/dev/shm/") and point not in own:
            continue
        shm.libc().umount2(point.encode(), shm.MNT_DETACH)
        if point.startswith("/dev/shm/"):
            with contextlib.suppress(OSError):
                shutil.rmtree(point)


class _Turns:
    """This xdist worker's hold on the run's lock (``pytest_runtest_protocol``): shared through a module's tests, as
    its clusters live from its first test to its last; exclusive for an ``alone`` test. A turnstile, taken briefly
    by every taker and held by an exclusive one while it waits, keeps shared holders from starving it."""

    def __init__(self, base: str) -> None:
        self.base, self.lock, self.mode = base, None, None

    def take(self, mode: int) -> None:
        if self.mode == mode:
            return
        self.drop()
        with open(self.base + ".turnstile", "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            try:
                self.lock = open(self.base + ".lock", "a")  # noqa: SIM115 - held across tests, closed by drop
                fcntl.flock(self.lock, mode)
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        self.mode = mode

    def drop(self) -> None:
        if self.lock is not None:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            self.lock.close()
        self.lock, self.mode = None, None


_TURNS = pytest.StashKey[_Turns]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under pytest-xdist (the README's ``-n 2``) two test modules run at once. A test marked ``alone`` compares
    times on the machine (a straggler against its peers): it runs while the other worker runs no module (its
    clusters and jobs stopped, not only its tests paused)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    if _TURNS not in item.config.stash:   # the run's base temp dir, above each worker's own (removed with old runs)
        item.config.stash[_TURNS] = _Turns(os.path.join(item.config._tmp_path_factory.getbasetemp().parent, "alone"))
    turns, alone = item.config.stash[_TURNS], item.get_closest_marker("alone") is not None
    turns.take(fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    try:
        yield
    finally:
        if alone or nextitem is None or _module(nextitem) != _module(item):
            turns.drop()


# The longest modules (about 80-170 s each on 2 cores), longest first: pytest-xdist hands whole modules to whichever
# worker is free in this order (``--no-loadscope-reorder`` in pyproject.toml: by default it reorders them by their
# number of tests), so the long ones start early and the short ones fill in around them. Modules with an ``alone``
# test (the straggler check) come last of all: there the other worker has only its last module to finish, where at
# the start it could take a long one first and leave this worker waiting for its lock the whole module.
LONGEST_FIRST = ("test_e2e_slurm", "test_e2e_ha", "test_e2e_parallel", "test_e2e_train", "test_e2e_control", "test_e2e_netns_faults",
                 "test_e2e_restart", "test_e2e_defects", "test_e2e_tls", "test_e2e_drain", "test_e2e_leftovers",
                 # then the longest of the other layers (multi-rank and launcher tests, 5-30 s each)
                 "test_launcher", "test_launcher_faults", "test_tensor_parallel", "test_train_ranks", "test_context_parallel", "test_moe_ranks",
                 "test_layout_megatron", "test_pipeline_ranks", "test_defects_worker", "test_megatron_conformance")


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:  # noqa: ANN001 - pytest hook
    """``-m "not e2e"`` does not even import the end-to-end modules (their collection was a third of the run)."""
    if config.getoption("markexpr", "").replace(" ", "") == "note2e" and collection_path.name == "e2e" \
            and collection_path.parent == TESTS:
        return True
    return None


def _module(item: pytest.Item) -> str:
    return item.module.__name__ if getattr(item, "module", None) is not None else ""


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 - pytest hook
    """Run the modules with a test that starts gRPC inside the pytest process after the others, whole (see above;
    pytest-xdist hands out whole modules), those with an ``alone`` test last of all (they fork no rank from the
    pytest process), and within each part the end-to-end modules first, the longest of them first
    (``LONGEST_FIRST``); order otherwise kept (a stable sort)."""
    for item in items:
        layer = next((part for part in Path(str(item.path)).relative_to(TESTS).parts if part in LAYERS), None)
        if layer is not None:
            item.add_marker(getattr(pytest.mark, layer))
    grpc = {_module(item) for item in items if item.get_closest_marker("grpc_in_process") is not None}
    alone = {_module(item) for item in items if item.get_closest_marker("alone") is not None}

    def order(item: pytest.Item) -> tuple[bool, bool, int]:
        module = _module(item)
        rank = LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)
        return module in alone, module in grpc, rank if module.startswith("test_e2e_") or module in LONGEST_FIRST \
            else rank + 1

    items.sort(key=order)


@pytest.fixture(scope="module")
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The embedded local cluster (2 nodes x 4 slots) that one end-to-end module shares."""
    from test_e2e_train import Runner

    r = Runner(tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_e2e_")))
    yield r
    r.cluster.stop()
