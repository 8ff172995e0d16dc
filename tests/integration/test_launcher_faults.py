"""The warm launcher's faults: a killed launcher leaves no rank behind, a child that leaves its rank's session and
ignores SIGTERM ends with it (cgroups and the subreaper fallback). Apart from ``test_launcher`` so that the two
halves run side by side (each about 15 s)."""

from __future__ import annotations

import os
import signal

import pytest

from test_launcher import env, launcher, loop, subreaper  # noqa: F401 - fixtures, one set per module
from test_launcher import _child_pids, assignments, pid_alive, wait_events, wait_until
from rankctl.worker.files import shm
from rankctl.worker.launcher.main import Launcher


def test_no_rank_survives_a_killed_launcher(loop, env, tmp_path) -> None:
    other = loop.run_until_complete(Launcher.start(env=env, imports=["rankctl_test_kinds"]))
    loop.run_until_complete(other.launch(assignments("orphan", "test-sleep", str(tmp_path))))
    (started,) = [e for e in wait_events(loop, other, "orphan", "started", 1)]
    wait_until(lambda: len(_child_pids(str(tmp_path), 1)) == 1)
    os.kill(other.pid, signal.SIGKILL)
    assert loop.run_until_complete(other.close()) == -signal.SIGKILL
    wait_until(lambda: not pid_alive(started["pid"]), timeout=5)
    (child,) = _child_pids(str(tmp_path), 1)
    shm.unmount_job_shm(str(tmp_path))  # the daemon does this when its launcher dies
    if not other.containment.startswith("cgroup2"):  # a subreaper's orphans go to init with it
        os.kill(child, signal.SIGKILL)
        pytest.skip(f"containment is {other.containment!r}: only cgroups outlive the launcher")
    # the daemon starts the next launcher, which ends what the dead one's cgroups still hold
    after = loop.run_until_complete(Launcher.start(env=env, imports=["rankctl_test_kinds"]))
    try:
        wait_until(lambda: not pid_alive(child), timeout=10)
    finally:
        loop.run_until_complete(after.close())


@pytest.mark.parametrize("which", ["launcher", "subreaper"])
def test_a_setsid_child_that_ignores_sigterm_ends_with_its_rank(loop, request, which, tmp_path) -> None:
    launcher = request.getfixturevalue(which)
    job = f"orphan-{which}"
    loop.run_until_complete(launcher.launch(assignments(job, "test-orphan", str(tmp_path))))
    (exited,) = [e for e in wait_events(loop, launcher, job, "exited", 1) if e["event"] == "exited"]
    (child,) = _child_pids(str(tmp_path), 1)
    assert exited["exit_code"] == 0 and exited["leftovers_killed"] == 1, exited
    assert not pid_alive(child)  # gone before the exit was reported, not after
    if which == "subreaper":
        assert launcher.containment.startswith("child subreaper"), launcher.containment
