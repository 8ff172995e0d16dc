"""The embedded local default: a coordinator and N worker daemons on this machine.

Runs on one background thread with its own event loop, so that callers (``ctl up`` and the
end-to-end tests) use the ordinary synchronous client against ``address``. Each daemon has
its own warm launcher subprocess, started before any gRPC server, as on a real node.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import IO, Sequence

from rankctl.worker.daemon.daemon import DaemonConfig, WorkerDaemon


COMPONENTS_LOG = "components.log"


def component_logs(root: Path, verbose: bool, level: str = "warning", fmt: str = "auto") -> IO[str] | None:
    """Where the embedded coordinator's, daemons' and launchers' log records go (``ctl up``, ``ctl run``): on stderr
    with ``verbose``; else into ``root/components.log`` (returned: the launchers' stderr too), so that the terminal
    shows progress, rankctl's own one-line messages and what the ranks print, never a component's record."""
    from rankctl.worker.launcher.procutil import configure_logging

    if verbose:
        configure_logging(level=level, fmt=fmt)
        return None
    root.mkdir(parents=True, exist_ok=True)
    stream = open(root / COMPONENTS_LOG, "a", buffering=1)   # noqa: SIM115 - open for the command's life
    configure_logging(stream, level=level, fmt="json" if fmt == "auto" else fmt)
    return stream


def kept_log(root: Path, prefix: str, temporary: bool) -> Path | None:
    """Where a failed run's components' log stays: copied out of a temporary state dir (removed next), else where it
    is; None when there is none."""
    import shutil
    import tempfile

    path = root / COMPONENTS_LOG
    if not path.exists():
        return None
    if not temporary:
        return path
    kept = Path(tempfile.mkstemp(prefix=prefix, suffix=".log")[1])
    shutil.copyfile(path, kept)
    return kept


class LocalCluster:
    def __init__(self, nodes: int, slots: int, state_dir: Path, heartbeat_timeout: float = 10.0,
                 name_prefix: str = "local", imports: Sequence[str] = (), data_roots: Sequence[str] = ("/",),
                 idle_warm: bool = True, log: IO[str] | None = None) -> None:
        """``imports``: modules that add job kinds (``kinds.registry.load_module``), here and in every launcher.
        ``data_roots``: where jobs may name node files (the embedded cluster runs as you, for your jobs only:
        anywhere, by default). ``log``: the launchers' stderr (``component_logs``; None: this process's)."""
        self.nodes, self.slots, self.state_dir = nodes, slots, Path(state_dir)
        self.heartbeat_timeout = heartbeat_timeout
        self.imports = list(imports)
        self.data_roots = tuple(data_roots)
        self.idle_warm = idle_warm   # launchers warm every kind when first idle (``ctl worker --no-idle-warm``)
        self.log = log
        self.names = [f"{name_prefix}-{k}" for k in range(nodes)]
        self.address = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, name="rankctl-local", daemon=True)

    def start(self, timeout: float = 120.0) -> "LocalCluster":
        """Start everything; return once every daemon has registered with the coordinator."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"local cluster did not come up within {timeout:.0f} s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced to start()
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        from rankctl.coordinator.app.server import start_coordinator
        from rankctl.worker.runs.launcher_client import Launcher

        from rankctl.kinds import registry

        for module in self.imports:
            registry.load_module(module)
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        stderr = self.log.fileno() if self.log is not None else None
        launchers = await asyncio.gather(*[Launcher.start(imports=self.imports, idle_warm=self.idle_warm,
                                                          stderr=stderr) for _ in range(self.nodes)])
        server = await start_coordinator("127.0.0.1:0", self.state_dir / "coordinator",
                                         heartbeat_timeout=self.heartbeat_timeout)
        self.address = server.address
        daemons = [
            WorkerDaemon(DaemonConfig(coordinator=self.address, name=name, slots=self.slots,
                                      state_dir=self.state_dir / name, data_roots=self.data_roots), launcher)
            for name, launcher in zip(self.names, launchers)
        ]
        tasks = [asyncio.create_task(d.run()) for d in daemons]
        try:
            await asyncio.wait_for(asyncio.gather(*[d.connected.wait() for d in daemons]), timeout=60)
            self._ready.set()
            await self._stop.wait()
        finally:
            server.core.shutdown()  # daemons leaving now is the end of the cluster, not a lost node
            for d in daemons:
                d.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*[lch.close() for lch in launchers], return_exceptions=True)
            await server.stop(0.5)
