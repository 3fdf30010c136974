"""The measured failure, reproduced: NVML calls taking 200 ms each (FACTS #11 saw p99 100 ms on a
busy host; a GPU under reset or a wedged driver is slower). On main the poll loop called NVML
inline and ran at 1.2 polls/s of 10 Hz; the source's worker thread keeps the loop's cadence."""
from __future__ import annotations

import threading
import time

from tests.conftest import wait_for
from tests.fakes import G0, G1, GiB, two_gpus
from torch_watchdog.sidecar.sources.nvml import NvmlSource

INTERVAL_S = 0.1  # the default poll_interval_s
LATE_S = INTERVAL_S / 2  # a poll that starts more than this after its slot is off cadence


def poll_at_10hz(seconds: float, poll) -> tuple[float, list]:
    """Calls poll() on a fixed 10 Hz schedule (like Daemon.run: a late poll does not shift the
    later slots); returns the fraction of slots whose poll started on time, and the results."""
    start = time.monotonic()
    slots = int(seconds / INTERVAL_S)
    on_time, results = 0, []
    for i in range(slots):
        slot = start + i * INTERVAL_S
        now = time.monotonic()
        if now < slot:
            time.sleep(slot - now)
        elif now - slot > LATE_S:
            continue  # this slot was missed while the previous poll was still running
        on_time += time.monotonic() - slot <= LATE_S
        results.append(poll())
    return on_time / slots, results


def slow_nvml():
    nvml = two_gpus()
    del nvml.devices[1]
    nvml.delay_s = 0.2  # every call: a reading with a process list is 2 calls, 0.4 s
    return nvml


def test_200ms_nvml_calls_do_not_slow_a_10hz_poll_loop():
    nvml = slow_nvml()
    source = NvmlSource(nvml, deadline_s=1.0)
    try:
        on_time, readings = poll_at_10hz(3.0, lambda: source.read({100}))
    finally:
        source.close()
    assert on_time >= 0.9, on_time
    # once the first reading is in (init and enumeration: 4 calls, then 2 per reading), every
    # poll has numbers, all taken within the deadline
    first = next(i for i, r in enumerate(readings) if r.up)
    up = readings[first:]
    assert first <= 15 and all(r.up for r in up), readings
    assert all(r.age_s + r.query_s <= 1.0 and r.devices[0].uuid == G0 for r in up)
    assert all(r.process_gpu_bytes == {100: {G0: 3 * GiB}} for r in up)
    assert nvml.max_in_flight == 1


def test_the_same_backend_called_inline_misses_the_cadence():
    # the control: what the daemon did on main, so the test above can tell the two apart
    nvml = slow_nvml()

    def inline():
        nvml.nvmlDeviceGetMemoryInfo(0, version=nvml.nvmlMemory_v2)
        nvml.nvmlDeviceGetComputeRunningProcesses(0)

    on_time, _ = poll_at_10hz(1.0, inline)
    assert on_time <= 0.5, on_time


def test_a_hung_nvml_call_leaves_the_daemons_polls_on_time_and_says_nvml_is_down(short_tmp):
    """The daemon itself: a 5 s hang of one NVML call; no tick waits for it,
    `source_up{nvml}` is 0 while it lasts, the late reads are counted, then NVML is back."""
    import os
    import signal
    import threading

    import structlog

    from torch_watchdog.sidecar.config import AgentSocketConfig, Config
    from torch_watchdog.sidecar.daemon import Daemon

    nvml = two_gpus()
    release = threading.Event()
    hang = {"on": False}
    real = nvml.nvmlDeviceGetMemoryInfo

    def memory_info(*args, **kw):
        if hang["on"]:
            release.wait(5.0)
        return real(*args, **kw)

    nvml.nvmlDeviceGetMemoryInfo = memory_info
    cfg = Config(agent=AgentSocketConfig(socket_path=os.path.join(short_tmp, "ev.sock")),
                 state_dir=short_tmp)
    d = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml), serve_metrics=False)
    d.start()
    try:
        assert d.tick().sources_up["nvml"]
        hang["on"] = True
        slowest, down = 0.0, 0
        for _ in range(20):
            started = time.monotonic()
            snap = d.tick()
            slowest = max(slowest, time.monotonic() - started)
            down += not snap.sources_up["nvml"]
            time.sleep(INTERVAL_S)
        assert slowest < 1.0 and down >= 15  # the hang is 5 s; a tick never waits for it
        assert snap.source_errors_total.get(("nvml", "late"), 0) >= 1
        hang["on"] = False
        release.set()
        deadline = time.monotonic() + 5
        while not d.tick().sources_up["nvml"] and time.monotonic() < deadline:
            time.sleep(INTERVAL_S)
        assert d.tick().sources_up["nvml"]
    finally:
        release.set()
        d.halt()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)


# A call that hangs (a wedged driver): read() and close() never wait on it (moved from
# tests/unit/test_nvml.py: they wait on real threads)
WAIT = 5.0  # read(wait_s=WAIT) returns as soon as the reading it asked for completes


def test_a_hung_call_never_holds_read_up_and_reads_are_late_until_it_returns():
    nvml = two_gpus()
    source = NvmlSource(nvml, deadline_s=0.3)
    assert source.read({100}, wait_s=WAIT).up
    gate = threading.Event()
    nvml.hang["nvmlDeviceGetMemoryInfo"] = gate  # blocks 20 s unless released
    try:
        slowest, readings, late = 0.0, [], 0
        give_up = time.monotonic() + 10
        while late < 10 and time.monotonic() < give_up:  # ten polls after it is declared late
            started = time.perf_counter()
            reading = source.read({100})
            slowest = max(slowest, time.perf_counter() - started)
            readings.append(reading)
            late += reading.error is not None and reading.error.startswith("NVML read late")
            time.sleep(0.02)
        assert late == 10, readings[-1]
        assert slowest < 0.1  # on main: the first read after the hang began took 20 s
        for r in readings:  # what the forecast could see: fresh numbers or nothing
            assert r.up == bool(r.devices) and (r.devices == () or r.age_s < 0.3)
        last = readings[-1]
        assert not last.up and last.devices == () and last.process_gpu_bytes == {}
        assert set(last.down) == {G0, G1} and last.t is not None
        assert source.errors == {"late": 1}  # one stall, however many polls it spans
        assert nvml.max_in_flight == 1  # one worker, stuck in the one call: nothing piled up
    finally:
        gate.set()
    del nvml.hang["nvmlDeviceGetMemoryInfo"]
    assert wait_for(lambda: source.read({100}).up, 5)  # it came back: readings resume
    back = source.read({100}, wait_s=WAIT)
    assert back.up and len(back.devices) == 2 and back.process_gpu_bytes[100][G0] == 3 * GiB
    assert nvml.inits == 1 and source.errors == {"late": 1}
    source.close()


def test_close_with_a_hung_call_returns_and_no_second_worker_starts():
    nvml = two_gpus()
    source = NvmlSource(nvml, deadline_s=0.2)
    assert source.read(set(), wait_s=WAIT).up
    gate = threading.Event()
    nvml.hang["nvmlDeviceGetMemoryInfo"] = gate
    try:
        source.read(set())
        assert wait_for(lambda: nvml.in_flight == 1, 5)
        started = time.monotonic()
        source.close()
        assert time.monotonic() - started < 2.0  # CLOSE_WAIT_S, not the hang
        assert wait_for(lambda: "late" in (source.read(set()).error or ""), 5)
        assert nvml.max_in_flight == 1
    finally:
        gate.set()
    del nvml.hang["nvmlDeviceGetMemoryInfo"]
    # the stuck worker returns, shuts NVML down and exits; the next read starts a fresh one
    assert wait_for(lambda: source.read(set()).up, 5)
    assert nvml.inits == 2 and nvml.shutdowns == 1 and nvml.max_in_flight == 1
    source.close()
