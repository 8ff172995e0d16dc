"""The daemon's side of the launcher: an asyncio client for the launcher subprocess.

No torch import here: the daemon only speaks JSON lines to ``python -m rankctl.worker.launcher.main``.

    launcher = await Launcher.start()
    launcher.hardware                      # {"hostname", "cpu_count", "gpu_count", ...}
    await launcher.launch(assignments)
    async for event in launcher.events():  # started / exited / error ...
        ...
    await launcher.kill("job-1")
    await launcher.close()

The launcher dies with the thread that started it (``PR_SET_PDEATHSIG``): start it from
the event-loop thread, before any gRPC channel or server exists.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any, AsyncIterator, Iterable, Mapping

from rankctl.contract.assignment import RankAssignment

_EOF: dict[str, Any] = {"event": "eof"}


class LauncherError(RuntimeError):
    """The launcher did not start, or went away."""


IDLE_CLOSE_S = 0.5   # a launcher with no rank alive gets this long to exit on its own before it is killed


class Launcher:
    """A running launcher subprocess; events arrive in order on ``events()``."""

    def __init__(self, proc: asyncio.subprocess.Process, ready: dict[str, Any]) -> None:
        self.proc = proc
        self.hardware: dict[str, Any] = ready.get("hardware", {})
        self.containment: str = str(ready.get("containment", ""))  # how a rank's processes are kept together
        self._events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(
        cls,
        *,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        imports: Iterable[str] = (),
        ready_timeout: float = 120.0,
        stderr: int | None = None,
        containment: str = "auto",
        shm: str = "auto",
        idle_warm: bool = True,
    ) -> "Launcher":
        """Start the launcher and wait for its ``ready`` event (torch import takes seconds).

        ``imports`` are modules the launcher imports at start-up (they may register job kinds);
        ``containment``: "auto", "cgroup2" or "subreaper" (``worker.launcher.contain``); ``shm``: "auto",
        "private" or "tracked" (``worker.files.shm``); ``idle_warm``: warm every job kind in the launcher's first idle
        second with no rank alive (``worker.launcher.warming``).
        """
        args = [python, "-m", "rankctl.worker.launcher.main", "--parent-pid", str(os.getpid()),
                "--containment", containment, "--shm", shm, *(() if idle_warm else ("--no-idle-warm",))]
        for module in imports:
            args += ["--import", module]
        proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr,
            env=dict(env) if env is not None else None, limit=1 << 22,
        )
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), ready_timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise LauncherError(f"launcher not ready after {ready_timeout:.0f} s") from None
        ready = json.loads(line) if line else {}
        if ready.get("event") != "ready":
            proc.kill()
            rc = await proc.wait()
            raise LauncherError(f"launcher exited before ready (exit {rc}); first line: {line[:200]!r}")
        return cls(proc, ready)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            while line := await self.proc.stdout.readline():
                try:
                    await self._events.put(json.loads(line))
                except json.JSONDecodeError:
                    await self._events.put({"event": "error", "message": f"bad event line: {line[:200]!r}"})
        finally:
            await self._events.put(_EOF)

    async def _send(self, command: dict[str, Any]) -> None:
        if self.proc.returncode is not None or self.proc.stdin is None or self.proc.stdin.is_closing():
            raise LauncherError(f"launcher is gone (exit {self.proc.returncode})")
        self.proc.stdin.write((json.dumps(command, separators=(",", ":")) + "\n").encode())
        try:
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise LauncherError(f"launcher is gone: {exc}") from exc

    async def launch(self, assignments: Iterable[RankAssignment], *, timeout_s: float | None = None,
                     threads: int | None = None, log_bytes: int | None = None) -> None:
        """Fork one rank per assignment; ``started``/``exited`` events follow. ``log_bytes``: the
        rotation size of each rank's log (``rankio.GENERATION_BYTES`` when None)."""
        cmd: dict[str, Any] = {"cmd": "launch", "assignments": [a.to_doc() for a in assignments]}
        if timeout_s is not None:
            cmd["timeout_s"] = timeout_s
        if threads is not None:
            cmd["threads"] = threads
        if log_bytes is not None:
            cmd["log_bytes"] = log_bytes
        await self._send(cmd)

    async def kill(self, job_id: str, *, attempt: int | None = None, sig: str | int = "SIGTERM",
                   grace_s: float = 10.0) -> None:
        """Signal every rank of a job; SIGKILL follows after ``grace_s``."""
        sig_name = signal.Signals(sig).name if isinstance(sig, int) else sig
        await self._send({"cmd": "kill", "job_id": job_id, "attempt": attempt, "signal": sig_name,
                          "grace_s": grace_s})

    async def next_event(self, timeout: float | None = None) -> dict[str, Any]:
        """The next event; ``{"event": "eof"}`` once the launcher has exited."""
        event = await asyncio.wait_for(self._events.get(), timeout)
        if event is _EOF:
            self._events.put_nowait(_EOF)  # every later call sees the end too
        return event

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every event until the launcher exits (one consumer at a time)."""
        while (event := await self.next_event()) is not _EOF:
            yield event

    async def close(self, *, grace_s: float = 5.0, timeout: float = 30.0, idle: bool = False) -> int:
        """Shut the launcher down (its ranks are killed); returns its exit code. ``idle``: it runs no rank, so nothing
        is lost by not waiting: one busy warming its kinds reads the shutdown only after that (seconds on a loaded
        node), and is killed after ``IDLE_CLOSE_S`` instead."""
        if self.proc.returncode is None:
            try:
                await self._send({"cmd": "shutdown", "grace_s": grace_s})
                self.proc.stdin.close()
                await asyncio.wait_for(self.proc.wait(), IDLE_CLOSE_S if idle else timeout)
            except (LauncherError, asyncio.TimeoutError):
                if self.proc.returncode is None:
                    self.proc.kill()  # PDEATHSIG takes the ranks with it
        rc = await self.proc.wait()
        await self._reader
        return rc
