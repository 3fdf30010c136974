"""NvmlSource against a fake pynvml-like backend, plus the real bindings on a GPU-less host."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from torch_watchdog.sidecar.sources.nvml import NvmlSource
from torch_watchdog.sidecar.sources.samples import DeviceSample

GiB, MiB = 1 << 30, 1 << 20
G0, G1 = "GPU-00000000-aaaa", "GPU-11111111-bbbb"


class NVMLError(Exception):
    """A fake of pynvml's class of the same name."""


class NVMLError_NoPermission(NVMLError):
    """A fake of pynvml's class of the same name."""


class NVMLError_NotSupported(NVMLError):
    """A fake of pynvml's class of the same name."""


class NVMLError_GpuIsLost(NVMLError):
    """A fake of pynvml's class of the same name."""


class NVMLError_FunctionNotFound(NVMLError):
    """A fake of pynvml's class of the same name."""


class NVMLError_DriverNotLoaded(NVMLError):
    """A fake of pynvml's class of the same name."""


class NVMLLibraryMismatchError(Exception):  # like pynvml: not an NVMLError
    """A fake of pynvml's class of the same name."""


class FakeNvml:
    """The slice of the pynvml API the source uses; `fail[name]` makes that call raise."""
    NVMLError = NVMLError
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    nvmlMemory_v2 = 0x02000028
    RESERVED = 300 * MiB  # v1 `used` includes driver-reserved memory, v2 does not

    def __init__(self, devices):
        self.devices = devices  # [{uuid: bytes, total, used, procs: [(pid, used)] or an exception}]
        self.fail: dict[str, Exception] = {}
        self.has_v2 = True
        self.inits = self.shutdowns = 0
        self.calls: list[tuple] = []

    def _call(self, name, *args):
        self.calls.append((name,) + args)
        if name in self.fail:
            raise self.fail[name]

    def nvmlInit(self):
        self._call("nvmlInit")
        self.inits += 1

    def nvmlShutdown(self):
        self._call("nvmlShutdown")
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        self._call("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        self._call("nvmlDeviceGetHandleByIndex", i)
        return i

    def nvmlDeviceGetUUID(self, handle):
        self._call("nvmlDeviceGetUUID", handle)
        return self.devices[handle]["uuid"]

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        self._call("nvmlDeviceGetMemoryInfo", handle, version)
        if version is not None and not self.has_v2:
            raise NVMLError_FunctionNotFound("Function Not Found")
        d = self.devices[handle]
        used = d["used"] if version else d["used"] + self.RESERVED
        return SimpleNamespace(total=d["total"], used=used, free=d["total"] - used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self._call("nvmlDeviceGetComputeRunningProcesses", handle)
        procs = self.devices[handle]["procs"]
        if isinstance(procs, Exception):
            raise procs
        return [SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in procs]


def two_gpus():
    return FakeNvml([
        {"uuid": G0.encode(), "total": 80 * GiB, "used": 10 * GiB,
         "procs": [(100, 3 * GiB), (300, 5 * GiB)]},
        {"uuid": G1.encode(), "total": 80 * GiB, "used": 2 * GiB,
         "procs": [(100, 512 * MiB), (200, 256 * MiB)]},
    ])


def test_two_devices_report_device_and_per_process_memory_by_uuid():
    nvml = two_gpus()
    source = NvmlSource(nvml)
    reading = source.read({100, 200, 400})
    assert reading.up and reading.error is None and reading.query_s >= 0
    assert reading.devices == (DeviceSample(G0, 10 * GiB, 80 * GiB, 70 * GiB),
                               DeviceSample(G1, 2 * GiB, 80 * GiB, 78 * GiB))
    # pid 300 was not asked for; pid 400 asked for but on no GPU gets an empty mapping
    assert reading.process_gpu_bytes == {100: {G0: 3 * GiB, G1: 512 * MiB},
                                         200: {G1: 256 * MiB}, 400: {}}
    source.read({100})
    assert nvml.inits == 1  # initialised once, not per read
    versions = [c[2] for c in nvml.calls if c[0] == "nvmlDeviceGetMemoryInfo"]
    assert versions == [FakeNvml.nvmlMemory_v2] * 4  # v2 preferred when the driver has it


def test_no_pids_skips_the_process_list():
    nvml = two_gpus()
    reading = NvmlSource(nvml).read(set())
    assert len(reading.devices) == 2 and reading.process_gpu_bytes == {}
    assert not any(c[0] == "nvmlDeviceGetComputeRunningProcesses" for c in nvml.calls)


def test_unavailable_or_insane_process_memory_is_none_not_zero():
    nvml = two_gpus()
    nvml.devices[0]["procs"] = [(100, None)]           # MIG / WDDM: NVML_VALUE_NOT_AVAILABLE
    nvml.devices[1]["procs"] = [(100, 81 * GiB)]       # larger than the device: garbage struct
    reading = NvmlSource(nvml).read({100})
    assert reading.up
    assert reading.process_gpu_bytes == {100: {G0: None, G1: None}}


def test_denied_process_list_keeps_device_level_numbers():
    nvml = two_gpus()
    nvml.devices[0]["procs"] = NVMLError_NoPermission("Insufficient Permissions")
    nvml.devices[1]["procs"] = NVMLError_NotSupported("Not Supported")
    reading = NvmlSource(nvml).read({100, 200})
    assert reading.up and reading.error is None
    assert [d.used_bytes for d in reading.devices] == [10 * GiB, 2 * GiB]
    assert reading.process_gpu_bytes == {100: {}, 200: {}}


def test_denied_on_one_device_only_loses_that_device():
    nvml = two_gpus()
    nvml.devices[0]["procs"] = NVMLError_NoPermission("Insufficient Permissions")
    reading = NvmlSource(nvml).read({100})
    assert reading.process_gpu_bytes == {100: {G1: 512 * MiB}}


def test_gpu_lost_mid_run_goes_down_then_recovers_with_a_fresh_init():
    nvml = two_gpus()
    source = NvmlSource(nvml, clock=lambda: 0.0)
    assert source.read({100}).up
    nvml.fail["nvmlDeviceGetMemoryInfo"] = NVMLError_GpuIsLost("GPU is lost")
    down = source.read({100})
    assert not down.up and down.devices == () and down.process_gpu_bytes == {}
    assert down.error == "NVML read failed: NVMLError_GpuIsLost: GPU is lost"
    assert nvml.shutdowns == 1  # the broken session is closed, so inits stay balanced
    del nvml.fail["nvmlDeviceGetMemoryInfo"]
    back = source.read({100})  # no backoff after a run-time failure: re-init right away
    assert back.up and back.error is None and len(back.devices) == 2
    assert nvml.inits == 2


def test_missing_v2_memory_call_falls_back_to_v1_once():
    nvml = two_gpus()
    nvml.has_v2 = False
    source = NvmlSource(nvml)
    reading = source.read(set())
    assert reading.up
    assert reading.devices[0].used_bytes == 10 * GiB + FakeNvml.RESERVED  # v1 numbers
    source.read(set())
    versions = [c[2] for c in nvml.calls if c[0] == "nvmlDeviceGetMemoryInfo"]
    # one failed v2 probe, then v1 only: an old driver doesn't cost a failing call per poll
    assert versions == [FakeNvml.nvmlMemory_v2] + [None] * 4  # 2 devices x 2 reads


def test_process_call_newer_than_driver_falls_back_to_v2_struct():
    nvml = two_gpus()

    def unversioned(handle):
        raise NVMLLibraryMismatchError("use a versioned function such as ..._v2")

    nvml.nvmlDeviceGetComputeRunningProcesses = unversioned
    nvml.nvmlDeviceGetComputeRunningProcesses_v2 = (
        lambda handle: [SimpleNamespace(pid=100, usedGpuMemory=(handle + 1) * GiB)])
    reading = NvmlSource(nvml).read({100})
    assert reading.up and reading.process_gpu_bytes == {100: {G0: 1 * GiB, G1: 2 * GiB}}


def test_failed_init_is_retried_only_after_the_backoff():
    now = [0.0]
    nvml = two_gpus()
    nvml.fail["nvmlInit"] = NVMLError_DriverNotLoaded("Driver Not Loaded")
    source = NvmlSource(nvml, clock=lambda: now[0], init_retry_s=5.0)
    first = source.read({100})
    assert not first.up and first.devices == ()
    assert first.error == "NVML unavailable: NVMLError_DriverNotLoaded: Driver Not Loaded"
    del nvml.fail["nvmlInit"]  # the driver comes back...
    now[0] = 4.9
    again = source.read({100})
    assert not again.up and again.error == first.error and nvml.inits == 0  # ...but no retry yet
    now[0] = 5.0
    assert source.read({100}).up


def test_close_shuts_nvml_down_and_a_later_read_reinits():
    nvml = two_gpus()
    source = NvmlSource(nvml)
    source.read(set())
    source.close()
    source.close()  # idempotent: one shutdown per init
    assert nvml.shutdowns == 1
    assert source.read(set()).up and nvml.inits == 2


def test_missing_bindings_are_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    reading = NvmlSource().read({os.getpid()})
    assert not reading.up and reading.devices == ()
    assert reading.error.startswith("NVML unavailable: ModuleNotFoundError")


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="an NVIDIA driver is present")
def test_real_bindings_without_a_gpu_are_down_not_raising():
    pytest.importorskip("pynvml")
    source = NvmlSource()
    reading = source.read({os.getpid()})
    source.close()
    assert not reading.up and reading.devices == () and reading.process_gpu_bytes == {}
    assert reading.error.startswith("NVML unavailable: NVMLError_")
