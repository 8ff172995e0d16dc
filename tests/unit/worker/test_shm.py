"""A job attempt's private /dev/shm (worker.shm): mounted per attempt, gone after, stale ones swept."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rankctl.worker.files import shm

pytestmark = pytest.mark.skipif(not shm.can_mount(f"/tmp/rankctl-shm-test-{os.getpid()}"),
                                reason="this machine refuses tmpfs mounts")


def test_a_daemon_that_starts_unmounts_what_a_killed_launcher_left(tmp_path: Path) -> None:
    run_dir = tmp_path / "jobs" / "j-1" / "1"
    point = shm.mount_job_shm(str(run_dir), 8)
    assert os.path.ismount(point)
    (Path(point) / "left").write_bytes(b"x" * 4096)
    assert shm.unmount_stale(str(tmp_path)) == [point]
    assert not os.path.exists(point) and shm.unmount_stale(str(tmp_path)) == []


def test_a_link_planted_at_an_attempts_shm_is_refused_never_mounted_over(tmp_path: Path) -> None:
    """Issue 43 item 1: the attempt's tmpfs goes at ``{run_dir}/shm``; a link there is refused, naming it and the
    rule, and the directory it points at gets no mount (a detach never follows a link either)."""
    from rankctl.contract.files import safepath

    run_dir, outside = tmp_path / "jobs" / "j-1" / "1", tmp_path / "outside"
    run_dir.mkdir(parents=True)
    outside.mkdir()
    (run_dir / "shm").symlink_to(outside)
    with pytest.raises(safepath.UnsafePath, match="is a symbolic link|passes through the symbolic link"):
        shm.mount_job_shm(str(run_dir), 8)
    assert not os.path.ismount(outside)
    shm.mount("tmpfs", str(outside), "tmpfs", shm.MS_NOSUID | shm.MS_NODEV, "size=1m")
    try:
        with pytest.raises(OSError):
            shm.unmount(str(run_dir / "shm"))   # not through the link
        assert os.path.ismount(outside)
    finally:
        shm.unmount(str(outside))


def test_shm_mb_comes_from_the_spec_with_its_documented_default() -> None:
    from rankctl.contract.spec import DEFAULT_SHM_MB, Resources

    assert Resources(shm_mb=64).shm_mb == 64
    assert Resources().shm_mb == DEFAULT_SHM_MB
    with pytest.raises(ValueError, match="shm_mb"):
        Resources(shm_mb=0)


def test_tracked_shm_takes_what_was_held_and_leaves_what_overlapping_jobs_closed(tmp_path) -> None:
    from rankctl.worker.files.shmtrack import ShmTracker

    track = ShmTracker(str(tmp_path))
    track.started(("a", 1))
    track.started(("b", 1))  # two attempts at once: a closed file belongs to neither
    (tmp_path / "closed").write_bytes(b"x")
    held = open(tmp_path / "held-by-a", "wb")
    try:
        track.scan(("a", 1), [os.getpid()])
        track.scan(("b", 1), [os.getpid()])  # seen first by a: a's
    finally:
        held.close()
    assert track.ended(("a", 1)) == [str(tmp_path / "held-by-a")]
    assert track.ended(("b", 1)) == [] and (tmp_path / "closed").exists()


def test_tracked_shm_alone_takes_what_it_created_and_nobody_holds(tmp_path) -> None:
    from rankctl.worker.files.shmtrack import ShmTracker

    (tmp_path / "older").write_bytes(b"x")
    time.sleep(0.05)
    track = ShmTracker(str(tmp_path))
    track.started(("a", 1))
    (tmp_path / "closed").write_bytes(b"x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "inside").write_bytes(b"x")
    (tmp_path / "rankctl-0123456789ab").mkdir()  # rankctl's own memory directory
    still_open = open(tmp_path / "open-elsewhere", "wb")  # someone else still holds it
    try:
        assert track.ended(("a", 1)) == [str(tmp_path / "closed"), str(tmp_path / "dir")]
    finally:
        still_open.close()
    assert sorted(os.listdir(tmp_path)) == ["older", "open-elsewhere", "rankctl-0123456789ab"]
