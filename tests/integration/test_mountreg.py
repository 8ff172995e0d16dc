"""``worker.files.mountreg``: a dead owner's recorded tmpfs is unmounted by the next start; a live one's never is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rankctl.contract.files import checkpoints
from rankctl.worker.files import mountreg
from rankctl.worker.files import shm

pytestmark = pytest.mark.skipif(not shm.can_mount(f"/tmp/rankctl-mountreg-test-{os.getpid()}"),
                                reason="this process may not mount a tmpfs")


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private /dev/shm for the registry (the host's holds other tests' daemons' records)."""
    monkeypatch.setattr(checkpoints, "SHM", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    return tmp_path


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def mounted(path: Path) -> Path:
    path.mkdir()
    shm.mount("tmpfs", str(path), "tmpfs", shm.MS_NOSUID | shm.MS_NODEV, "size=1m")
    return path


def test_start_time_tells_a_live_process_from_a_dead_one() -> None:
    assert mountreg.start_time(os.getpid()) is not None
    assert mountreg.start_time(dead_pid()) is None


def test_a_dead_owners_mount_goes_a_live_owners_stays(registry: Path) -> None:
    dead, live, kept = mounted(registry / "dead"), mounted(registry / "live"), mounted(registry / "kept")
    try:
        mountreg.record(str(dead), [dead_pid()])
        mountreg.record(str(live), [os.getpid(), dead_pid()])   # one live owner is enough to keep it
        mountreg.record(str(kept), [dead_pid()])
        assert mountreg.reap(shm.unmount, keep=[str(kept)]) == [str(dead)]
        assert not dead.exists() and os.path.ismount(live) and os.path.ismount(kept)
        assert mountreg.reap(shm.unmount, keep=[str(kept)]) == []   # its record went with it
    finally:
        for path in (live, kept):
            shm.unmount(str(path))


def test_a_reused_pid_is_not_the_owner(registry: Path) -> None:
    """A record whose pid now names another process (its start time differs) counts as dead."""
    path = mounted(registry / "reused")
    mountreg.record(str(path), [os.getpid()])
    entry = next((registry / "shm" / mountreg.REGISTRY).iterdir())
    doc = json.loads(entry.read_text())
    doc["owners"] = [[os.getpid(), mountreg.start_time(os.getpid()) - 1]]
    entry.write_text(json.dumps(doc))
    assert mountreg.reap(shm.unmount) == [str(path)] and not path.exists()


def test_forget_drops_a_record_and_an_unmounted_path_is_only_tidied(registry: Path) -> None:
    path = mounted(registry / "owned")
    mountreg.record(str(path), [dead_pid()])
    mountreg.forget(str(path))
    assert mountreg.reap(shm.unmount) == [] and os.path.ismount(path)   # no record: never touched
    shm.unmount(str(path))
    mountreg.record(str(path), [dead_pid()])   # unmounted by its owner without forgetting it
    assert mountreg.reap(shm.unmount) == [] and not list((registry / "shm" / mountreg.REGISTRY).iterdir())


def test_a_record_from_another_pid_namespace_or_without_a_start_time_is_never_taken(registry: Path) -> None:
    """Issue 53, item 19: a daemon unmounted another cluster's ``/dev/shm`` paths. A record made in another pid
    namespace (a container sharing /dev/shm: its pids mean nothing here) is left alone, and so is one whose live owner's
    start time could not be read."""
    other, unread = mounted(registry / "other"), mounted(registry / "unread")
    try:
        mountreg.record(str(other), [dead_pid()])
        mountreg.record(str(unread), [os.getpid()])
        for entry in (registry / "shm" / mountreg.REGISTRY).iterdir():
            doc = json.loads(entry.read_text())
            if doc["path"] == str(other):
                doc["pidns"] = "pid:[1]"
            else:
                doc["owners"] = [[os.getpid(), None]]
            entry.write_text(json.dumps(doc))
        assert mountreg.reap(shm.unmount) == [] and os.path.ismount(other) and os.path.ismount(unread)
    finally:
        for path in (other, unread):
            shm.unmount(str(path))
