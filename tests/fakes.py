"""Fakes the tests share (issue 53): what more than one test file built for itself.

Clock: monotonic time that moves only when the test moves it. Call it for the time (pass it
where the code under test takes a `clock=`), set `t`, or move it on with `advance()`; pass
`clock.sleep` where the code would sleep: it advances the clock and returns at once.

FakeNvml: the slice of pynvml the NVML source uses, with pynvml's error classes by name, faults
on request (a call that raises, hangs or is slow) and `two_gpus()`, a host of two. The agent
socket receiver (Collector) is tests/conftest.py's `collector` fixture.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace


class Clock:
    """Seconds on a clock the test moves: `clock()` is now; `clock.t` may be set."""

    def __init__(self, t: float = 1000.0):
        self.t = float(t)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        """Move on `seconds`; the new time."""
        self.t += seconds
        return self.t

    def sleep(self, seconds: float) -> None:
        """A sleep that takes no time: the clock moves on `seconds`."""
        self.advance(seconds)


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


class NVMLError_Uninitialized(NVMLError):
    """A fake of pynvml's class of the same name."""


class NVMLError_Unknown(NVMLError):
    """A fake of pynvml's class of the same name."""


class NVMLLibraryMismatchError(Exception):  # like pynvml: not an NVMLError
    """A fake of pynvml's class of the same name."""


class FakeNvml:
    """The slice of the pynvml API the source uses; `fail[name]` makes that call raise,
    `hang[name]` (an Event) makes it block until the event is set (20 s at most), `delay_s`
    makes every call that slow, and a device's "error" makes its memory call raise."""
    NVMLError = NVMLError
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_Unknown = NVMLError_Unknown
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    nvmlMemory_v2 = 0x02000028
    RESERVED = 300 * MiB  # v1 `used` includes driver-reserved memory, v2 does not

    def __init__(self, devices):
        self.devices = devices  # [{uuid: bytes, total, used, procs: [(pid, used)] or an exception}]
        self.fail: dict[str, Exception] = {}
        self.has_v2 = True
        self.inits = self.shutdowns = 0
        self.calls: list[tuple] = []
        self.hang: dict[str, threading.Event] = {}
        self.delay_s = 0.0
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()

    def _call(self, name, *args):
        self.calls.append((name,) + args)
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            if name in self.hang:
                self.hang[name].wait(20.0)
            if name in self.fail:
                raise self.fail[name]
        finally:
            with self._lock:
                self.in_flight -= 1

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
        if "error" in d:
            raise d["error"]
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
