"""Each GPU's health from NVML (``pynvml``, nvidia-ml-py): uncorrected ECC errors, memory pages retired or
remapped and waiting for a reset, clock throttling that signals a fault, temperature.

``gpu_health()`` never raises: without pynvml, a driver or a GPU it answers ``available=False`` and a
one-line ``note``. A query the GPU does not support is skipped (its fact stays ``None``); any other NVML
error on a query is itself a problem. ``load_nvml`` is the one NVML loader the worker uses (the usage
sampler and the launcher's hardware facts too). NVML never initialises CUDA, so the launcher may ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

NvmlLoader = Callable[[], tuple[Any | None, str]]  # load_nvml's shape

_UNCORRECTED, _VOLATILE = 1, 0  # NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC (since the driver loaded)
_GPU_SENSOR = 0                 # NVML_TEMPERATURE_GPU
# nvmlClocksThrottleReason* bits that mean something is wrong (not idle, power cap or application clocks)
FAULT_THROTTLES = ((0x08, "HW slowdown"), (0x40, "HW thermal slowdown"), (0x80, "HW power brake"),
                   (0x20, "SW thermal slowdown"))


@dataclass(frozen=True, kw_only=True)
class GpuFacts:
    """One GPU as NVML sees it (NVML's index: it ignores ``CUDA_VISIBLE_DEVICES``); ``None``: not supported."""

    index: int
    name: str
    uncorrected_ecc: int | None = None   # volatile count: since the driver loaded; None where ECC is off
    pages_pending: bool | None = None    # retired pages or remapped rows that wait for a GPU reset
    remap_failed: bool | None = None     # a row remapping failed: the GPU needs service
    throttle: tuple[str, ...] = ()       # the FAULT_THROTTLES active now
    temperature_c: int | None = None
    unreadable: tuple[str, ...] = ()     # "fact: NVML error" for queries that failed other than unsupported


@dataclass(frozen=True, kw_only=True)
class GpuHealth:
    """The node's GPUs and what is wrong with them; ``available=False`` with ``note`` where NVML cannot say."""

    available: bool
    note: str = ""
    gpus: tuple[GpuFacts, ...] = ()
    problems: tuple[str, ...] = ()       # one line each, naming the GPU's index and the fact


def load_nvml() -> tuple[Any | None, str]:
    """(pynvml initialised and seeing a GPU, "") or (None, why not). Never shut down: NVML counts its inits,
    and the usage sampler holds its own for the daemon's life."""
    try:
        import pynvml
    except ImportError:
        return None, "pynvml (nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded) as e:
        return None, f"no NVIDIA driver: {e}"
    except Exception as e:  # noqa: BLE001 - any other NVMLError (or a broken library): no facts, said why
        return None, f"NVML did not start: {e}"
    return (pynvml, "") if count > 0 else (None, "no NVIDIA GPU: NVML sees none")


def gpu_health(nvml_loader: NvmlLoader = load_nvml) -> GpuHealth:
    """Every GPU's health facts and the problems among them. ``nvml_loader``: ``load_nvml`` or a test's fake
    (a pynvml-like object raising pynvml's own errors)."""
    nv, note = nvml_loader()
    if nv is None:
        return GpuHealth(available=False, note=note)
    from pynvml import NVMLError

    try:
        count = nv.nvmlDeviceGetCount()
    except NVMLError as e:
        return GpuHealth(available=False, note=f"NVML cannot count the GPUs: {e}")
    if count == 0:
        return GpuHealth(available=False, note="no NVIDIA GPU: NVML sees none")
    gpus = tuple(read_gpu(nv, i) for i in range(count))
    return GpuHealth(available=True, gpus=gpus, problems=tuple(p for g in gpus for p in problems_of(g)))


def read_gpu(nv: Any, index: int) -> GpuFacts:
    """GPU ``index``'s facts from an initialised pynvml-like ``nv``; raises nothing NVML raises."""
    from pynvml import NVMLError, NVMLError_FunctionNotFound, NVMLError_NotSupported

    unreadable: list[str] = []

    def ask(fact: str, query: Callable[..., Any], *args: Any) -> Any:
        try:
            return query(*args)
        except (NVMLError_NotSupported, NVMLError_FunctionNotFound):  # this GPU or driver has no such fact
            return None
        except NVMLError as e:
            unreadable.append(f"{fact}: {e}")
            return None

    handle = ask("its handle", nv.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        return GpuFacts(index=index, name="", unreadable=tuple(unreadable))
    name = ask("its name", nv.nvmlDeviceGetName, handle)
    ecc = ask("its ECC errors", nv.nvmlDeviceGetTotalEccErrors, handle, _UNCORRECTED, _VOLATILE)
    retired = ask("its retired pages", nv.nvmlDeviceGetRetiredPagesPendingStatus, handle)  # pre-Ampere
    remap = ask("its remapped rows", nv.nvmlDeviceGetRemappedRows, handle)  # (corr, uncorr, pending, failed)
    reasons = ask("its throttle reasons", nv.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
    temperature = ask("its temperature", nv.nvmlDeviceGetTemperature, handle, _GPU_SENSOR)
    return GpuFacts(
        index=index, name=text(name) if name is not None else "",
        uncorrected_ecc=None if ecc is None else int(ecc),
        pages_pending=None if retired is None and remap is None else bool(retired) or bool(remap and remap[2]),
        remap_failed=None if remap is None else bool(remap[3]),
        throttle=() if reasons is None else tuple(n for bit, n in FAULT_THROTTLES if int(reasons) & bit),
        temperature_c=None if temperature is None else int(temperature),
        unreadable=tuple(unreadable))


def problems_of(gpu: GpuFacts) -> list[str]:
    """What is wrong with ``gpu``, one line each, naming its index."""
    at = f"GPU {gpu.index}"
    out = []
    if gpu.uncorrected_ecc:
        s = "" if gpu.uncorrected_ecc == 1 else "s"
        out.append(f"{at}: {gpu.uncorrected_ecc} uncorrected ECC error{s} since the driver loaded")
    if gpu.pages_pending:
        out.append(f"{at}: memory pages retired or remapped, waiting for a GPU reset")
    if gpu.remap_failed:
        out.append(f"{at}: a memory row remapping failed (the GPU needs service)")
    if gpu.throttle:
        out.append(f"{at}: clocks held down by {', '.join(gpu.throttle)}")
    out.extend(f"{at}: NVML cannot read {fact}" for fact in gpu.unreadable)
    return out


def text(value: str | bytes) -> str:
    """An NVML string: ``str`` from nvidia-ml-py 11.5 on, ``bytes`` before."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
