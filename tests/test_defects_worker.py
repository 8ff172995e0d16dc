"""The worker daemon against misbehaving parts: a launcher that will not start again, ...

No coordinator process here: fakes stand in for the parts around the daemon.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rankctl.worker.daemon import DaemonConfig, LauncherLost, WorkerDaemon
from rankctl.worker.launcher_client import LauncherError

pytestmark = [pytest.mark.timeout(120), pytest.mark.grpc_in_process]


class DeadLauncher:
    """A launcher whose process has already exited: no events, nothing to launch."""

    hardware: dict = {}
    pid = 0

    async def events(self):
        return
        yield

    async def launch(self, assignments) -> None:
        raise LauncherError("launcher is gone")

    async def kill(self, job_id: str) -> None:
        raise LauncherError("launcher is gone")

    async def close(self) -> int:
        return 0


def config(state: Path, coordinator: str = "127.0.0.1:1", **kw) -> DaemonConfig:
    return DaemonConfig(coordinator=coordinator, name="node-a", slots=2, state_dir=state, backoff_initial=0.05,
                        **kw)


def test_daemon_gives_up_when_no_new_launcher_starts(tmp_path: Path) -> None:
    serving: list[bool] = []

    async def main() -> None:
        async def start() -> None:
            raise LauncherError("launcher exited before ready (exit 1)")

        async def set_serving(ok: bool) -> None:
            serving.append(ok)

        daemon = WorkerDaemon(config(tmp_path, launcher_restarts=3, launcher_backoff=0.01), DeadLauncher(),
                              start_launcher=start, set_serving=set_serving)
        with pytest.raises(LauncherLost, match="did not restart after 3 tries: launcher exited before ready"):
            await asyncio.wait_for(daemon.run(), 30)

    asyncio.run(main())
    assert serving == [False]
