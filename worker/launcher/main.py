"""The warm launcher: a subprocess of the worker daemon that forks rank processes.

The daemon (asyncio + gRPC) never forks itself; it runs ``python -m rankctl.worker.launcher.main``
(see ``Launcher`` in ``launcher_client``), which imports torch once and then forks one rank
process per assignment, so a rank starts in milliseconds with torch already loaded.

Protocol: one JSON object per line, commands on stdin, events on stdout::

    {"cmd": "launch", "assignments": [RankAssignment as dict, ...], "timeout_s": 300, "threads": 2,
     "log_bytes": 67108864}                        # optional: the rotation size of each rank's log
    {"cmd": "kill", "job_id": "j1", "attempt": 0, "signal": "SIGTERM", "grace_s": 10}
    {"cmd": "shutdown", "grace_s": 5}

    {"event": "ready", "pid": 123, "hardware": {"hostname", "cpu_count", "memory_bytes", "gpu_count", "gpus", ...},
     "containment": "cgroup2 per rank under ..."}
    {"event": "started", "job_id", "attempt", "rank", "pid"}
    {"event": "exited", "job_id", "attempt", "rank", "pid", "exit_code", "signal", "log_tail", "error",
     "leftovers_killed", "notes"}                 # only once every process of the rank is gone; notes:
                                                   # what rankctl saw of its end (e.g. an OOM kill at a limit)
    {"event": "error", "message"}                  # a command it could not carry out
    {"event": "shutdown"}                          # last line before the launcher exits

``exit_code`` is the rank's exit status, or null when a signal ended it (``signal`` names
it) or the fork never happened (``error`` says why). Closing stdin is a ``shutdown``.

Hardware facts never initialise CUDA (NVML-based device count, NVML for names and memory):
a process that has initialised CUDA cannot fork ranks that use it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from rankctl.contract.gpuhealth import NvmlLoader, load_nvml, text  # noqa: E402  (pynvml only when asked)
from rankctl.worker.runs.launcher_client import Launcher, LauncherError  # noqa: E402  (no torch)
from rankctl.worker.files.shm import SHM_MODES  # noqa: E402
from rankctl.worker.files.meminfo import total_bytes  # noqa: E402

__all__ = ["Launcher", "LauncherError", "hardware_facts", "main"]


def _nvml_gpus(nvml_loader: NvmlLoader = load_nvml) -> list[dict]:
    """Each GPU's NVML index, name and total memory; [] where NVML cannot say (no pynvml, driver or GPU)."""
    nv, _ = nvml_loader()
    if nv is None:
        return []
    from pynvml import NVMLError

    gpus = []
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(i)
            gpus.append({"index": i, "name": text(nv.nvmlDeviceGetName(handle)),
                         "memory_bytes": int(nv.nvmlDeviceGetMemoryInfo(handle).total)})
    except NVMLError:
        return []
    return gpus


def _gpus(gpu_count: int, nvml_loader: NvmlLoader = load_nvml) -> list[dict]:
    """The ``gpu_count`` GPUs torch sees, named where NVML agrees; only indexes where it does not or where
    ``CUDA_VISIBLE_DEVICES`` masks some (NVML numbers ignore the mask)."""
    gpus = _nvml_gpus(nvml_loader) if gpu_count else []
    if len(gpus) != gpu_count or "CUDA_VISIBLE_DEVICES" in os.environ:
        gpus = [{"index": i} for i in range(gpu_count)]
    return gpus


def hardware_facts() -> dict:
    """What this node offers, without initialising CUDA in the launcher."""
    import socket

    import torch

    # NVML answers is_available() without the CUDA driver's cuInit, which a fork must never follow: the ranks
    # forked from this process initialise CUDA themselves (device_count() asks NVML first anyway)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = _gpus(gpu_count)
    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count() or 1,
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_bytes": total_bytes(),
        "gpu_count": gpu_count,
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rankctl.worker.launcher.main")
    p.add_argument("--parent-pid", type=int, default=None, help="exit at once if this is not our parent")
    p.add_argument("--import", dest="imports", action="append", default=[],
                   help="module to import at start-up: its KIND (or its register calls) adds a job kind")
    p.add_argument("--no-idle-warm", action="store_true",
                   help="do not warm every job kind in the first idle second with no rank alive")
    p.add_argument("--containment", choices=("auto", "cgroup2", "subreaper"), default="auto",
                   help="how a rank's processes are kept together and ended with it (auto: cgroup v2 if writable)")
    p.add_argument("--shm", choices=SHM_MODES, default="auto",
                   help="a job's /dev/shm: a private tmpfs per job attempt, or the host's with what the job "
                        "creates tracked and removed (auto: private where the node allows mounts)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point: become the launcher and serve stdin until shutdown or EOF."""
    args = _parse_args(argv)
    from rankctl.worker.launcher.procutil import configure_logging, set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL, expected_parent=args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    event_fd = os.dup(1)
    os.set_inheritable(event_fd, False)
    os.dup2(2, 1)  # stray prints (torch warnings) must not reach the event pipe
    sys.stdout = sys.stderr
    configure_logging(sys.stderr)

    from rankctl.kinds import registry
    from rankctl.runtime import rank
    from rankctl.worker.launcher.forker import Forker

    for module in args.imports:
        registry.load_module(module)
    rank.preload_kinds()
    forker = Forker(event_fd, containment=args.containment, shm_mode=args.shm, idle_warm=not args.no_idle_warm)
    forker.emit({"event": "ready", "pid": os.getpid(), "hardware": hardware_facts(),
                 "containment": forker.containment})
    return forker.serve()


if __name__ == "__main__":
    sys.exit(main())
