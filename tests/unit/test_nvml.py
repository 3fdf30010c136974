"""NvmlSource against a fake pynvml-like backend, plus the real bindings on a GPU-less host."""
from __future__ import annotations

import os
import sys
import threading
from types import SimpleNamespace

import pytest

from torch_watchdog.sidecar.sources.nvml import NvmlSource
from torch_watchdog.sidecar.core.observations import DeviceSample
from tests.fakes import (
    G0, G1, FakeNvml, GiB, MiB, NVMLError_DriverNotLoaded, NVMLError_GpuIsLost,
    NVMLError_NoPermission, NVMLError_NotSupported, NVMLError_Uninitialized, NVMLError_Unknown,
    NVMLLibraryMismatchError, two_gpus)

WAIT = 5.0  # read(wait_s=WAIT) returns as soon as the reading it asked for completes


def test_two_devices_report_device_and_per_process_memory_by_uuid():
    nvml = two_gpus()
    source = NvmlSource(nvml, wait_s=WAIT)
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
    reading = NvmlSource(nvml, wait_s=WAIT).read(set())
    assert len(reading.devices) == 2 and reading.process_gpu_bytes == {}
    assert not any(c[0] == "nvmlDeviceGetComputeRunningProcesses" for c in nvml.calls)


def test_unavailable_or_insane_process_memory_is_none_not_zero():
    nvml = two_gpus()
    nvml.devices[0]["procs"] = [(100, None)]           # MIG / WDDM: NVML_VALUE_NOT_AVAILABLE
    nvml.devices[1]["procs"] = [(100, 81 * GiB)]       # larger than the device: garbage struct
    reading = NvmlSource(nvml, wait_s=WAIT).read({100})
    assert reading.up
    assert reading.process_gpu_bytes == {100: {G0: None, G1: None}}


def test_denied_process_list_keeps_device_level_numbers():
    nvml = two_gpus()
    nvml.devices[0]["procs"] = NVMLError_NoPermission("Insufficient Permissions")
    nvml.devices[1]["procs"] = NVMLError_NotSupported("Not Supported")
    reading = NvmlSource(nvml, wait_s=WAIT).read({100, 200})
    assert reading.up and reading.error is None
    assert [d.used_bytes for d in reading.devices] == [10 * GiB, 2 * GiB]
    assert reading.process_gpu_bytes == {100: {}, 200: {}}


def test_denied_on_one_device_only_loses_that_device():
    nvml = two_gpus()
    nvml.devices[0]["procs"] = NVMLError_NoPermission("Insufficient Permissions")
    reading = NvmlSource(nvml, wait_s=WAIT).read({100})
    assert reading.process_gpu_bytes == {100: {G1: 512 * MiB}}


def test_gpu_lost_mid_run_goes_down_then_recovers_with_a_fresh_init():
    nvml = two_gpus()
    source = NvmlSource(nvml, clock=lambda: 0.0, wait_s=WAIT)
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
    source = NvmlSource(nvml, wait_s=WAIT)
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
    reading = NvmlSource(nvml, wait_s=WAIT).read({100})
    assert reading.up and reading.process_gpu_bytes == {100: {G0: 1 * GiB, G1: 2 * GiB}}


def test_failed_init_is_retried_only_after_the_backoff():
    now = [0.0]
    nvml = two_gpus()
    nvml.fail["nvmlInit"] = NVMLError_DriverNotLoaded("Driver Not Loaded")
    source = NvmlSource(nvml, clock=lambda: now[0], backoff_min_s=5.0, wait_s=WAIT)
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
    source = NvmlSource(nvml, wait_s=WAIT)
    source.read(set())
    source.close()
    source.close()  # idempotent: one shutdown per init
    assert nvml.shutdowns == 1
    assert source.read(set()).up and nvml.inits == 2


def test_missing_bindings_are_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    reading = NvmlSource(wait_s=WAIT).read({os.getpid()})
    assert not reading.up and reading.devices == ()
    assert reading.error.startswith("NVML unavailable: ModuleNotFoundError")


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="an NVIDIA driver is present")
def test_real_bindings_without_a_gpu_are_down_not_raising():
    pytest.importorskip("pynvml")
    source = NvmlSource(wait_s=WAIT)
    reading = source.read({os.getpid()})
    source.close()
    assert not reading.up and reading.devices == () and reading.process_gpu_bytes == {}
    assert reading.error.startswith("NVML unavailable: NVMLError_")


# -- faults: a hung call, a failure storm, a GPU that vanishes, one bad device -----------------
def test_a_gpu_lost_on_every_read_for_40_s_reinits_a_few_times_not_every_poll():
    now = [0.0]
    nvml = two_gpus()
    source = NvmlSource(nvml, clock=lambda: now[0], wait_s=WAIT)
    assert source.read({100}).up
    nvml.fail["nvmlDeviceGetMemoryInfo"] = NVMLError_GpuIsLost("GPU is lost")
    readings = []
    for _ in range(400):  # 40 s at 10 Hz
        now[0] += 0.1
        readings.append(source.read({100}))
    assert not any(r.up or r.devices for r in readings)
    assert all(r.down == {G0: "NVMLError_GpuIsLost: GPU is lost",
                          G1: "NVMLError_GpuIsLost: GPU is lost"} for r in readings)
    # main: 399 init/shutdown cycles. Here: at once, then 0.5, 1, 2, 4, 8, 16 s apart
    assert nvml.inits == source.inits == 8
    assert nvml.shutdowns == source.shutdowns == 8
    assert source.errors == {"NVMLError_GpuIsLost": 16}  # both GPUs, once per session
    del nvml.fail["nvmlDeviceGetMemoryInfo"]
    now[0] += 30.0  # the capped backoff
    assert source.read({100}).up and nvml.inits == 9


def test_no_driver_for_40_s_tries_init_with_backoff_and_counts_it():
    now = [0.0]
    nvml = two_gpus()
    nvml.fail["nvmlInit"] = NVMLError_DriverNotLoaded("Driver Not Loaded")
    source = NvmlSource(nvml, clock=lambda: now[0], wait_s=WAIT)
    readings = [source.read({100})]
    for _ in range(400):
        now[0] += 0.1
        readings.append(source.read({100}))
    assert all(not r.up and r.error == "NVML unavailable: NVMLError_DriverNotLoaded: Driver "
               "Not Loaded" for r in readings)
    attempts = [c for c in nvml.calls if c[0] == "nvmlInit"]
    assert len(attempts) == source.inits == 7  # at 0, 0.5, 1.5, 3.5, 7.5, 15.5, 31.5 s
    assert len(nvml.calls) == 7  # nothing else was called: the backoff reads cost no NVML call
    assert source.errors == {"init": 7}


def test_a_lost_gpu_is_down_with_its_reason_the_others_stay_up_then_it_vanishes():
    now = [0.0]
    nvml = two_gpus()
    source = NvmlSource(nvml, clock=lambda: now[0], wait_s=WAIT)
    assert len(source.read({100}).devices) == 2
    nvml.devices[1]["error"] = NVMLError_GpuIsLost("GPU is lost")
    now[0] += 0.1
    lost = source.read({100})
    assert lost.up and [d.uuid for d in lost.devices] == [G0]
    assert lost.down == {G1: "NVMLError_GpuIsLost: GPU is lost"}
    assert lost.process_gpu_bytes == {100: {G0: 3 * GiB}}  # none of G1's last numbers
    assert lost.error == "1 GPU(s) down: NVMLError_GpuIsLost: GPU is lost"
    # the driver drops it: re-enumeration (due at once after a clean run) no longer lists it
    del nvml.devices[1]
    for _ in range(20):
        now[0] += 0.1
        gone = source.read({100})
        assert gone.up and [d.uuid for d in gone.devices] == [G0]
        assert gone.down == {G1: "vanished: not listed after re-enumeration"}
        assert gone.process_gpu_bytes == {100: {G0: 3 * GiB}}
    assert nvml.inits == 2  # one re-enumeration, not one per poll
    assert source.errors == {"NVMLError_GpuIsLost": 1}


def test_the_only_gpu_vanishing_is_down_not_up_with_zero_gpus():
    now = [0.0]
    nvml = two_gpus()
    del nvml.devices[1]
    source = NvmlSource(nvml, clock=lambda: now[0], wait_s=WAIT)
    assert source.read({100}).up
    nvml.devices.clear()  # off the bus, as re-enumeration sees it
    nvml.fail["nvmlDeviceGetMemoryInfo"] = NVMLError_GpuIsLost("GPU is lost")
    for _ in range(5):
        now[0] += 0.1
        reading = source.read({100})
        assert not reading.up and reading.devices == () and reading.process_gpu_bytes == {}
        assert set(reading.down) == {G0}
    assert reading.down[G0] == "vanished: not listed after re-enumeration"
    assert reading.error == "NVML read failed: vanished: not listed after re-enumeration"


def test_one_device_failing_is_down_for_that_reading_only_and_nvml_stays_initialised():
    nvml = two_gpus()
    source = NvmlSource(nvml, wait_s=WAIT)
    nvml.devices[1]["error"] = NVMLError_Unknown("Unknown Error")
    nvml.devices[0]["procs"] = NVMLError_Unknown("Unknown Error")
    reading = source.read({100})
    assert reading.up and [d.uuid for d in reading.devices] == [G0]
    assert reading.down == {G1: "NVMLError_Unknown: Unknown Error"}
    # G0's process list failed: its device numbers stand, the server's share there is unknown
    assert reading.process_gpu_bytes == {100: {}}
    del nvml.devices[1]["error"]
    nvml.devices[0]["procs"] = [(100, 3 * GiB)]
    back = source.read({100})
    assert back.up and len(back.devices) == 2 and back.down == {} and back.error is None
    assert back.process_gpu_bytes == {100: {G0: 3 * GiB, G1: 512 * MiB}}
    assert nvml.inits == 1 and nvml.shutdowns == 0
    assert source.errors == {"NVMLError_Unknown": 2}


def test_driver_gone_mid_run_ends_the_session_and_retries_with_backoff():
    now = [0.0]
    nvml = two_gpus()
    source = NvmlSource(nvml, clock=lambda: now[0], wait_s=WAIT)
    assert source.read(set()).up
    nvml.fail["nvmlDeviceGetMemoryInfo"] = NVMLError_Uninitialized("Uninitialized")
    nvml.fail["nvmlInit"] = NVMLError_DriverNotLoaded("Driver Not Loaded")
    now[0] += 0.1
    down = source.read(set())
    assert not down.up and down.error == "NVML read failed: NVMLError_Uninitialized: Uninitialized"
    assert nvml.shutdowns == 1 and set(down.down) == {G0, G1}
    now[0] += 0.1
    assert source.read(set()).error.startswith("NVML unavailable: NVMLError_DriverNotLoaded")
    del nvml.fail["nvmlInit"], nvml.fail["nvmlDeviceGetMemoryInfo"]
    now[0] += 0.4
    assert not source.read(set()).up  # 0.5 s backoff after the failed retry
    now[0] += 0.1
    assert source.read(set()).up
    assert source.errors == {"NVMLError_Uninitialized": 1, "init": 1}


def test_a_reading_for_other_pids_does_not_claim_pids_it_was_not_taken_for():
    nvml = two_gpus()
    source = NvmlSource(nvml, wait_s=WAIT)
    assert source.read({100}).process_gpu_bytes == {100: {G0: 3 * GiB, G1: 512 * MiB}}
    gate = threading.Event()
    nvml.hang["nvmlDeviceGetMemoryInfo"] = gate
    try:
        stale = source.read({100, 200}, wait_s=0)  # the worker is busy: the previous reading
        assert stale.up and stale.process_gpu_bytes == {100: {G0: 3 * GiB, G1: 512 * MiB}}
    finally:
        gate.set()
    source.close()


def test_down_devices_round_trip_through_the_sample_log_and_healthy_lines_are_unchanged():
    from torch_watchdog.sidecar.core.observations import Sample
    from torch_watchdog.sidecar.offline.sample_log import sample_from_dict, sample_to_dict
    healthy = Sample(t=1.0, devices=(DeviceSample(G0, 1, 2, 1),))
    assert "nvml_down" not in sample_to_dict(healthy)
    assert sample_from_dict(sample_to_dict(healthy)) == healthy
    degraded = Sample(t=2.0, devices=(DeviceSample(G0, 1, 2, 1),),
                      nvml_down={G1: "NVMLError_GpuIsLost: GPU is lost"})
    assert sample_from_dict(sample_to_dict(degraded)) == degraded
