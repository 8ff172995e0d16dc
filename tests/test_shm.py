"""A job attempt's private /dev/shm (worker.shm): mounted per attempt, gone after, stale ones swept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rankctl.worker import shm

pytestmark = pytest.mark.skipif(not shm.can_mount(f"/tmp/rankctl-shm-test-{os.getpid()}"),
                                reason="this machine refuses tmpfs mounts")


def test_a_daemon_that_starts_unmounts_what_a_killed_launcher_left(tmp_path: Path) -> None:
    run_dir = tmp_path / "jobs" / "j-1" / "1"
    point = shm.mount_job_shm(str(run_dir), 8)
    assert os.path.ismount(point)
    (Path(point) / "left").write_bytes(b"x" * 4096)
    assert shm.unmount_stale(str(tmp_path)) == [point]
    assert not os.path.exists(point) and shm.unmount_stale(str(tmp_path)) == []


def test_shm_mb_comes_from_the_spec_with_its_documented_default() -> None:
    from rankctl.contract.spec import DEFAULT_SHM_MB, Resources

    assert shm.shm_mb({"resources": {"shm_mb": 64}}) == 64
    assert shm.shm_mb({}) == DEFAULT_SHM_MB == Resources().shm_mb
    with pytest.raises(ValueError, match="shm_mb"):
        Resources(shm_mb=0)
