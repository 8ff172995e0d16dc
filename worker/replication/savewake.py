"""A run's save wake: the FIFO (``contract.files.rankfiles.saved_path``) its ranks write a byte into when a checkpoint
or snapshot step of theirs is complete. Read on the event loop, it has the run's new steps pushed to the job's
replica peer at once: a node lost right after a save then loses no more than the save interval, however short
the steps (the poll turn alone, 0.1 s, let a node lost within a step of a save lose the step before it too).
Only runs with a replica peer get one; the poll turn still finds every step a wake missed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from typing import Any, Callable

from rankctl.contract.files.rankfiles import saved_path
from rankctl.worker.runs.runstate import RunState


class SaveWake:
    """The FIFOs of this daemon's runs; ``on_saved(run)`` when one of its ranks says a save is complete."""

    def __init__(self, on_saved: Callable[[RunState], None], log: Any) -> None:
        self._on_saved = on_saved
        self._log = log
        self._fds: dict[tuple[str, int], int] = {}

    def open(self, run: RunState) -> None:
        """Make and watch the run's FIFO (O_RDWR: it never reads as closed while no rank has it open)."""
        key = (run.job_id, run.attempt)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test driving the runs by hand): the poll turn pushes
            return
        if key in self._fds or not run.replica_peer:
            return
        path = saved_path(run.run_dir)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkfifo(path, 0o600)
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):   # a file a rank planted there: never watched
                os.close(fd)
                raise OSError(f"{path} is not the FIFO the daemon made")
        except OSError as exc:
            self._log.warning("no save wake; new steps are pushed on the poll turn", job=run.job_id, error=str(exc))
            return
        self._fds[key] = fd
        loop.add_reader(fd, self._readable, run, fd)

    def close(self, run: RunState) -> None:
        fd = self._fds.pop((run.job_id, run.attempt), None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _readable(self, run: RunState, fd: int) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(fd, 4096):
                pass
        if run.alive and not run.superseded:
            self._on_saved(run)
