"""GPU health facts from NVML (contract/gpuhealth.py) and the launcher's GPU list: a fake NVML with two GPUs,
and the real pynvml on a machine without a driver."""

from __future__ import annotations

import ctypes
import sys
from types import SimpleNamespace

import pynvml
import pytest

from rankctl.worker.launcher import main as launcher
from rankctl.contract.gpuhealth import GpuFacts, GpuHealth, gpu_health, load_nvml
from rankctl.worker.daemon.usage import _load_nvml


def _has_nvidia_driver() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


no_driver = pytest.mark.skipif(_has_nvidia_driver(), reason="this machine has an NVIDIA driver")


class FakeNvml:
    """The pynvml calls gpuhealth and the launcher make, for two H100s. GPU 1 has 2 uncorrected ECC errors and
    HW slowdown on; neither has retired pages (Ampere and later remap rows instead); ``lost`` loses GPU 1."""

    def __init__(self) -> None:
        self.lost = False

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if self.lost and i == 1:
            raise pynvml.NVMLError_GpuIsLost()
        return i

    def nvmlDeviceGetName(self, h: int) -> str | bytes:
        return "NVIDIA H100 80GB HBM3" if h == 0 else b"NVIDIA H100 80GB HBM3"  # bytes: nvidia-ml-py < 11.5

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=85_520_809_984 + h, used=0)

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return 2 if h == 1 else 0

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        raise pynvml.NVMLError_NotSupported()

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return (0, 0, 0, 0)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int:
        idle, power_cap = pynvml.nvmlClocksThrottleReasonGpuIdle, pynvml.nvmlClocksThrottleReasonSwPowerCap
        return power_cap | (pynvml.nvmlClocksThrottleReasonHwSlowdown if h == 1 else idle)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return 41 + h


def unsupported(*_: object) -> None:
    raise pynvml.NVMLError_NotSupported()


@no_driver
def test_without_a_driver_the_real_library_says_so_and_raises_nothing() -> None:
    health = gpu_health()
    assert health == GpuHealth(available=False, note="no NVIDIA driver: NVML Shared Library Not Found")
    assert _load_nvml() is None and launcher._nvml_gpus() == []


def test_without_pynvml_the_note_says_it_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert load_nvml() == (None, "pynvml (nvidia-ml-py) is not installed")
    assert gpu_health() == GpuHealth(available=False, note="pynvml (nvidia-ml-py) is not installed")


def test_a_loader_that_sees_no_gpu_is_an_absence() -> None:
    assert gpu_health(lambda: (None, "no NVIDIA GPU: NVML sees none")).note == "no NVIDIA GPU: NVML sees none"


def test_ecc_errors_and_hw_slowdown_are_problems_of_that_gpu_only() -> None:
    health = gpu_health(lambda: (FakeNvml(), ""))
    assert health.available and health.note == ""
    assert health.gpus == (
        GpuFacts(index=0, name="NVIDIA H100 80GB HBM3", uncorrected_ecc=0, pages_pending=False, remap_failed=False,
                 throttle=(), temperature_c=41),
        GpuFacts(index=1, name="NVIDIA H100 80GB HBM3", uncorrected_ecc=2, pages_pending=False, remap_failed=False,
                 throttle=("HW slowdown",), temperature_c=42))
    assert health.problems == ("GPU 1: 2 uncorrected ECC errors since the driver loaded",
                               "GPU 1: clocks held down by HW slowdown")


def test_unsupported_queries_are_skipped_and_a_lost_gpu_is_a_problem() -> None:
    nvml = FakeNvml()
    nvml.nvmlDeviceGetRemappedRows = unsupported  # type: ignore[method-assign]  # e.g. a V100, or ECC off
    nvml.nvmlDeviceGetTotalEccErrors = unsupported  # type: ignore[method-assign]
    nvml.lost = True
    health = gpu_health(lambda: (nvml, ""))
    assert health.gpus[0] == GpuFacts(index=0, name="NVIDIA H100 80GB HBM3", temperature_c=41)
    assert health.gpus[1] == GpuFacts(index=1, name="", unreadable=("its handle: GPU is lost",))
    assert health.problems == ("GPU 1: NVML cannot read its handle: GPU is lost",)


def test_pending_and_failed_row_remapping_are_problems() -> None:
    nvml = FakeNvml()
    nvml.nvmlDeviceGetRemappedRows = lambda h: (0, 1, 1, 1) if h == 0 else (0, 0, 0, 0)  # type: ignore[method-assign]
    problems = gpu_health(lambda: (nvml, "")).problems
    assert problems[:2] == ("GPU 0: memory pages retired or remapped, waiting for a GPU reset",
                            "GPU 0: a memory row remapping failed (the GPU needs service)")
    assert [p for p in problems if p.startswith("GPU 1")] == [
        "GPU 1: 2 uncorrected ECC errors since the driver loaded", "GPU 1: clocks held down by HW slowdown"]


def test_the_launcher_names_each_gpu_and_its_memory_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml()
    assert launcher._gpus(2, lambda: (nvml, "")) == [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85_520_809_984},
        {"index": 1, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85_520_809_985}]
    nvml.lost = True                                            # NVML fails: indexes only, as before
    assert launcher._gpus(2, lambda: (nvml, "")) == [{"index": 0}, {"index": 1}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")             # NVML numbers ignore the mask
    assert launcher._gpus(1, lambda: (FakeNvml(), "")) == [{"index": 0}]


@no_driver
def test_the_launcher_without_a_driver_lists_what_torch_counts_by_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert launcher._gpus(0) == []
    assert launcher._gpus(2) == [{"index": 0}, {"index": 1}]
