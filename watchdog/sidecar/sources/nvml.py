"""NVML source: device and per-process GPU memory by device UUID (the only pynvml importer)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch_watchdog.sidecar.sources.samples import DeviceSample

# A failed nvmlInit (no driver, no library) is retried at most this often: loading libnvidia-ml and
# probing the driver on every poll would cost more than the poll itself on a GPU-less host.
INIT_RETRY_S = 5.0

# Errors meaning "this binding's call does not exist in the installed driver" (ops-anchors §1.3:
# old drivers lack the _v2 symbols; the unversioned process call turns FunctionNotFound into
# NVMLLibraryMismatchError, which is NOT an NVMLError subclass).
_VERSION_ERRORS = ("NVMLError_FunctionNotFound", "NVMLError_ArgumentVersionMismatch",
                   "NVMLLibraryMismatchError")
# The process list is refused or unsupported (MIG without privileges, containers, vGPU): FACTS #12.
_DENIED_ERRORS = ("NVMLError_NoPermission", "NVMLError_NotSupported")


@dataclass(frozen=True)
class NvmlReading:
    devices: tuple[DeviceSample, ...] = ()
    # pid -> {device uuid: usedGpuMemory bytes, None = NVML does not say}; every requested pid has
    # an entry, and a device appears in it only if NVML listed the pid on that device
    process_gpu_bytes: dict[int, dict[str, Optional[int]]] = field(default_factory=dict)
    up: bool = True
    error: Optional[str] = None
    query_s: float = 0.0  # wall time of the NVML calls (FACTS #11: p99 20-100 ms on a busy host)


class NvmlSource:
    """Reads NVML on demand; every failure becomes an `up=False` reading, never an exception."""

    def __init__(self, backend: Any = None, clock: Callable[[], float] = time.monotonic,
                 init_retry_s: float = INIT_RETRY_S):
        self._nvml = backend  # None: `import pynvml` on the first init attempt
        self._clock = clock
        self._init_retry_s = init_retry_s
        self._initialized = False
        self._devices: list[tuple[Any, str]] = []  # (handle, uuid), enumerated once per init
        self._memory_v2 = True
        self._next_init_at: Optional[float] = None
        self._init_error: Optional[str] = None

    def read(self, pids: set[int]) -> NvmlReading:
        start = time.perf_counter()
        if not self._ensure_init():
            return NvmlReading(up=False, error=self._init_error,
                               query_s=time.perf_counter() - start)
        try:
            devices, per_pid = self._read_all(set(pids))
        except Exception as exc:  # the sidecar must outlive any NVML or binding failure
            # GPU lost, driver reloaded, ...: drop the session; the next read re-inits from scratch
            self._teardown()
            return NvmlReading(up=False, error=f"NVML read failed: {_describe(exc)}",
                               query_s=time.perf_counter() - start)
        return NvmlReading(devices=devices, process_gpu_bytes=per_pid,
                           query_s=time.perf_counter() - start)

    def close(self) -> None:
        self._teardown()

    def _ensure_init(self) -> bool:
        if self._initialized:
            return True
        now = self._clock()
        if self._next_init_at is not None and now < self._next_init_at:
            return False
        try:
            nvml = self._load()
            nvml.nvmlInit()
            self._initialized = True
            self._devices = _enumerate(nvml)
        except Exception as exc:  # includes ImportError: no nvidia-ml-py is "NVML unavailable" too
            self._teardown()
            self._init_error = f"NVML unavailable: {_describe(exc)}"
            self._next_init_at = now + self._init_retry_s
            return False
        self._next_init_at, self._init_error, self._memory_v2 = None, None, True
        return True

    def _load(self) -> Any:
        if self._nvml is None:
            import pynvml  # lazy: importing this module must work without nvidia-ml-py
            self._nvml = pynvml
        return self._nvml

    def _teardown(self) -> None:
        if self._initialized:
            try:
                self._nvml.nvmlShutdown()  # pynvml counts inits; unbalanced ones leak the library
            except Exception:
                pass
        self._initialized = False
        self._devices = []

    def _read_all(self, pids: set[int]):
        nvml = self._nvml
        devices = []
        per_pid: dict[int, dict[str, Optional[int]]] = {pid: {} for pid in pids}
        for handle, uuid in self._devices:
            mem = self._memory_info(nvml, handle)
            total = int(mem.total)
            devices.append(DeviceSample(uuid, int(mem.used), total, int(mem.free)))
            if pids:  # the process list is the slow call; skip it when nobody asks
                for pid, used in _process_memory(nvml, handle, pids, total).items():
                    per_pid[pid][uuid] = used
        return tuple(devices), per_pid

    def _memory_info(self, nvml: Any, handle: Any) -> Any:
        version = getattr(nvml, "nvmlMemory_v2", None)
        if self._memory_v2 and version is not None:
            try:
                # v2 `used` excludes driver-reserved memory and matches nvidia-smi; v1 reads
                # ~900 MB higher on an A100 (ops-anchors §1.3)
                return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            except _errors(nvml, _VERSION_ERRORS):
                self._memory_v2 = False  # old driver: don't pay for the failing call every poll
        return nvml.nvmlDeviceGetMemoryInfo(handle)


def _enumerate(nvml: Any) -> list[tuple[Any, str]]:
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    return [(handle, _text(nvml.nvmlDeviceGetUUID(handle))) for handle in handles]


def _process_memory(nvml: Any, handle: Any, pids: set[int], total: int) -> dict[int, Optional[int]]:
    try:
        infos = _running_processes(nvml, handle)
    except _errors(nvml, _DENIED_ERRORS):
        return {}  # device-level numbers still stand; per-process stays unknown
    found: dict[int, Optional[int]] = {}
    for info in infos:
        pid = int(info.pid)
        if pid not in pids:
            continue
        used = info.usedGpuMemory
        # struct-layout mismatches made bindings read pids or garbage as memory (ops-anchors §1.3)
        if used is not None and not 0 <= used <= total:
            used = None
        if pid in found:  # one entry per MIG/compute instance: sum, unknown if any part is
            used = None if used is None or found[pid] is None else found[pid] + used
        found[pid] = used
    return found


def _running_processes(nvml: Any, handle: Any) -> list:
    # the unversioned call uses _v3; drivers older than the bindings only have _v2
    calls = [getattr(nvml, name, None) for name in
             ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2")]
    for call in filter(None, calls):
        try:
            return call(handle)
        except _errors(nvml, _VERSION_ERRORS):
            continue
    return []  # no usable process call: device-level only


def _errors(nvml: Any, names: tuple[str, ...]) -> tuple[type, ...]:
    # backends (fakes, older bindings) may lack some classes; `except ()` then catches nothing
    return tuple(cls for cls in (getattr(nvml, name, None) for name in names)
                 if isinstance(cls, type) and issubclass(cls, BaseException))


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _describe(exc: BaseException) -> str:
    try:
        message = str(exc)  # pynvml's __str__ may itself call into the (missing) library
    except Exception:
        message = ""
    name = type(exc).__name__
    return f"{name}: {message[:200]}" if message else name
