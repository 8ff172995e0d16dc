"""What a node's hardware is doing, for its heartbeats: CPU busy share, memory in use, each GPU's use.

``UsageSampler().sample()`` is cheap and never blocks: two small reads under /proc and, where ``pynvml``
(nvidia-ml-py) imports and finds a GPU, a few NVML queries per GPU. Without NVML (or a GPU) ``gpus`` is empty.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from rankctl.proto import rankctl_pb2 as pb
from rankctl.contract.gpuhealth import load_nvml
from rankctl.worker.files.meminfo import meminfo

_IDLE_FIELDS = (3, 4)  # /proc/stat's cpu line: user nice system idle iowait irq softirq steal ...; idle, iowait


def _load_nvml() -> Any | None:
    """pynvml, initialised, or None (not installed, no driver, no GPU): ``gpuhealth.load_nvml``'s module."""
    return load_nvml()[0]


class UsageSampler:
    """Samples since the previous ``sample()`` (the first: since boot). ``proc``: where /proc is (tests);
    ``nvml``: a loader returning an initialised pynvml-like module or None."""

    def __init__(self, proc: str | Path = "/proc", nvml: Callable[[], Any | None] = _load_nvml,
                 clock: Callable[[], float] = time.time) -> None:
        self._proc = Path(proc)
        self._nvml = nvml()
        self._clock = clock
        self._last = (0, 0)  # (busy, total) jiffies at the previous sample

    def sample(self) -> pb.NodeUsage:
        msg = pb.NodeUsage(cpu_percent=self._cpu_percent())
        total, available = self._memory()
        msg.memory_total_bytes, msg.memory_used_bytes = total, max(0, total - available)
        msg.gpus.extend(self._gpus())
        msg.sample_time.FromNanoseconds(int(self._clock() * 1e9))
        return msg

    def _cpu_percent(self) -> float:
        try:
            with open(self._proc / "stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return 0.0
        total = sum(fields[:8])  # guest time is already inside user and nice
        busy = total - sum(fields[i] for i in _IDLE_FIELDS if i < len(fields))
        (last_busy, last_total), self._last = self._last, (busy, total)
        return 100.0 * (busy - last_busy) / (total - last_total) if total > last_total else 0.0

    def _memory(self) -> tuple[int, int]:
        """(total, available) bytes from meminfo; (0, 0) where it cannot be read."""
        seen = meminfo(self._proc / "meminfo")
        return seen.get("MemTotal", 0), seen.get("MemAvailable", 0)

    def _gpus(self) -> list[pb.GpuUsage]:
        nv = self._nvml
        if nv is None:
            return []
        out = []
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(handle)
                util = nv.nvmlDeviceGetUtilizationRates(handle)
                out.append(pb.GpuUsage(index=i, utilization=float(util.gpu), memory_used_bytes=int(mem.used),
                                       memory_total_bytes=int(mem.total)))
        except Exception:  # noqa: BLE001 - an NVML error (GPU lost, driver reloaded): no GPU figures this beat
            return []
        return out
