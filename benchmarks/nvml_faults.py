"""NVML faults against the poll loop: polls/s achieved at 10 Hz, NVML called inline in the loop
(what the daemon did on main) vs through NvmlSource's worker thread (ratios, not pass/fail).

(a) a healthy fake backend; (b) every NVML call takes 200 ms; (c) one call hangs 5 s (20 s in
the measured incident, shortened); (d) no driver: CPU seconds per wall second of an NvmlSource
read at 10 Hz (the real bindings when installed, else a fake whose init fails).

    python benchmarks/nvml_faults.py [--scale 1.0]     # ~23 s at scale 1
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from torch_watchdog.sidecar.sources.nvml import NvmlSource  # noqa: E402

INTERVAL_S = 0.1
GiB = 1 << 30


class FakeNvml:
    """Two GPUs; every call sleeps `delay_s`; the first memory call after `hang_at` (monotonic)
    blocks for `hang_s`."""

    def __init__(self, delay_s: float = 0.0, hang_at: float = float("inf"), hang_s: float = 0.0):
        self.delay_s, self.hang_at, self.hang_s = delay_s, hang_at, hang_s
        self.init_fails = False

    def _call(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)

    def nvmlInit(self):
        self._call()
        if self.init_fails:
            raise RuntimeError("driver not loaded")

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        self._call()
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        self._call()
        return i

    def nvmlDeviceGetUUID(self, handle):
        self._call()
        return f"GPU-{handle}"

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        self._call()
        if time.monotonic() >= self.hang_at:
            self.hang_at = float("inf")
            threading.Event().wait(self.hang_s)  # blocks like a wedged driver call
        return SimpleNamespace(total=80 * GiB, used=10 * GiB, free=70 * GiB)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self._call()
        return [SimpleNamespace(pid=100, usedGpuMemory=3 * GiB)]


def inline_read(nvml: FakeNvml):
    """main's poll: every device's memory and process list, in the loop's thread."""
    for handle in (0, 1):
        nvml.nvmlDeviceGetMemoryInfo(handle)
        nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    return True


def loop(seconds: float, poll) -> dict:
    """Daemon.run's schedule: a poll every INTERVAL_S; a late one does not queue up more."""
    start = time.monotonic()
    next_poll, polls, fresh, longest = start, 0, 0, 0.0
    while (now := time.monotonic()) < start + seconds:
        if now >= next_poll:
            t0 = time.monotonic()
            fresh += bool(poll())
            longest = max(longest, time.monotonic() - t0)
            polls += 1
            next_poll = max(next_poll + INTERVAL_S, time.monotonic())
        time.sleep(max(0.0, next_poll - time.monotonic()))
    wall = time.monotonic() - start
    return {"polls_s": polls / wall, "fresh": fresh / max(polls, 1), "longest_s": longest}


def scenario(name: str, seconds: float, make) -> None:
    nvml = make()
    old = loop(seconds, lambda: inline_read(nvml))
    source = NvmlSource(make(), deadline_s=2 * INTERVAL_S)
    try:
        source.read({100}, wait_s=5.0)  # init and enumeration are not what is measured
        make_fresh = lambda: source.read({100}).up  # noqa: E731
        new = loop(seconds, make_fresh)
    finally:
        source.close()
    print(f"{name:<22} {old['polls_s']:6.1f} {new['polls_s']:6.1f} "
          f"{new['polls_s'] / old['polls_s']:6.1f}x   longest poll {old['longest_s']:6.2f} s -> "
          f"{new['longest_s']:5.3f} s   polls with numbers {old['fresh']:4.0%} -> "
          f"{new['fresh']:4.0%}   errors {source.errors}")


def no_driver(seconds: float) -> None:
    try:
        import pynvml  # noqa: F401
        backend, what = None, "real bindings"
    except ImportError:
        backend, what = FakeNvml(), "fake"
        backend.init_fails = True
    source = NvmlSource(backend)
    cpu0, wall0 = time.process_time(), time.monotonic()
    result = loop(seconds, lambda: source.read({100}).up)
    cpu = time.process_time() - cpu0
    wall = time.monotonic() - wall0
    source.close()
    print(f"(d) no driver ({what}): {result['polls_s']:.1f} polls/s, CPU {cpu / wall:.4f} s/s "
          f"for the loop and the source together, {source.inits} init attempts in {wall:.0f} s, "
          f"error: {source.read(set()).error}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every duration")
    k = ap.parse_args().scale
    print("10 Hz poll loop; polls/s: inline (main) vs NvmlSource, ratio. 'polls with numbers':\n"
          "NvmlSource hands out only numbers taken within its deadline (0.2 s); inline ones\n"
          "were as old as the calls were slow (0.8 s per poll in (b), 5 s after the hang).")
    scenario("(a) healthy", 2 * k, FakeNvml)
    scenario("(b) 200 ms per call", 2.5 * k, lambda: FakeNvml(delay_s=0.2))
    scenario("(c) one 5 s hang", 6 * k,
             lambda: FakeNvml(hang_at=time.monotonic() + 0.5 * k, hang_s=5 * k))
    no_driver(2 * k)


if __name__ == "__main__":
    main()
