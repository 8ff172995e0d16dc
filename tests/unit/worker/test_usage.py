"""The node usage sampler (worker/daemon/usage.py): CPU busy share between samples, memory, GPUs through NVML."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rankctl.worker.daemon.usage import UsageSampler, _load_nvml

MEMINFO = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    4000000 kB\n"


def write_proc(root: Path, busy: int, idle: int, iowait: int = 0) -> None:
    """A /proc with one cpu line (user=busy, idle, iowait) and the meminfo above."""
    (root / "stat").write_text(f"cpu  {busy} 0 0 {idle} {iowait} 0 0 0 0 0\ncpu0 1 0 0 1 0 0 0 0 0 0\n")
    (root / "meminfo").write_text(MEMINFO)


def test_cpu_is_the_busy_share_since_the_previous_sample_and_memory_is_total_minus_available(tmp_path: Path) -> None:
    write_proc(tmp_path, busy=100, idle=300)
    sampler = UsageSampler(proc=tmp_path, nvml=lambda: None, clock=lambda: 1_700_000_000.5)
    first = sampler.sample()
    assert first.cpu_percent == pytest.approx(25.0)                        # since boot: 100 of 400
    write_proc(tmp_path, busy=100 + 90, idle=300 + 5, iowait=5)           # 90 busy of the 100 since
    second = sampler.sample()
    assert second.cpu_percent == pytest.approx(90.0)
    assert second.memory_total_bytes == 16_000_000 * 1024 and second.memory_used_bytes == 12_000_000 * 1024
    assert list(second.gpus) == [] and second.sample_time.seconds == 1_700_000_000
    assert second.sample_time.nanos == 500_000_000
    assert sampler.sample().cpu_percent == 0.0                            # nothing elapsed: not a division by 0


def test_without_proc_files_the_figures_are_zero_not_an_error(tmp_path: Path) -> None:
    usage = UsageSampler(proc=tmp_path / "absent", nvml=lambda: None).sample()
    assert (usage.cpu_percent, usage.memory_used_bytes, usage.memory_total_bytes) == (0.0, 0, 0)


def test_without_pynvml_there_are_no_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert _load_nvml() is None
    write_proc(tmp_path, busy=1, idle=1)
    assert list(UsageSampler(proc=tmp_path).sample().gpus) == []


class FakeNvml:
    """The few pynvml calls the sampler makes, for two GPUs; ``fail`` makes every query raise."""

    def __init__(self) -> None:
        self.fail = False

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if self.fail:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=(h + 1) << 30, total=80 << 30)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=40 + h)


def test_each_gpu_reports_its_utilization_and_memory_and_an_nvml_error_drops_them(tmp_path: Path) -> None:
    write_proc(tmp_path, busy=1, idle=1)
    nvml = FakeNvml()
    sampler = UsageSampler(proc=tmp_path, nvml=lambda: nvml)
    gpus = sampler.sample().gpus
    assert [(g.index, g.utilization, g.memory_used_bytes, g.memory_total_bytes) for g in gpus] == [
        (0, 40.0, 1 << 30, 80 << 30), (1, 41.0, 2 << 30, 80 << 30)]
    nvml.fail = True
    assert list(sampler.sample().gpus) == []
