"""What a poll costs on a big host, as a ratio: 8 GPUs with 8 replicas vs 1 GPU with 1 server.

A poll is the daemon's work: NVML read (a fake backend through the real NvmlSource, so only
the sidecar's own cost counts), the processes' liveness and RSS (real processes: this one and
sleeping children), then the pure step over the sample with every server's state warm (a full
forecast window of samples). CPU time of this thread, median of many polls.

    python benchmarks/host_scale.py [--polls 600]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.unit.test_nvml import FakeNvml  # noqa: E402
from torch_watchdog import events  # noqa: E402
from torch_watchdog.sidecar.config import Config  # noqa: E402
from torch_watchdog.sidecar.core.step import Host, step  # noqa: E402
from torch_watchdog.sidecar.sources.nvml import NvmlSource  # noqa: E402
from torch_watchdog.sidecar.sources.process import ProcessReader  # noqa: E402
from torch_watchdog.sidecar.sources.samples import Sample  # noqa: E402

GB = 1 << 30


def poll_cost(n: int, polls: int, pids: list[int]) -> float:
    """Median CPU seconds of one poll with n GPUs and n servers (one process each)."""
    gpus = [f"GPU-{i:04d}" for i in range(n)]
    nvml = FakeNvml([{"uuid": g.encode(), "total": 80 * GB, "used": 10 * GB,
                      "procs": [(pids[i], 8 * GB)]} for i, g in enumerate(gpus)])
    source, processes = NvmlSource(nvml), ProcessReader()
    cfg, host, t = Config(), Host(), time.time()
    for i in range(n):
        step(host, events.Hello(t=t, pid=pids[i], torch="2.11", agent="bench",
                                devices=[gpus[i]], config={}, capabilities={}, watched=["m"],
                                argv="serve", server=f"replica-{i}"), cfg)
    costs = []
    try:
        source.read(set(pids[:n]), wait_s=5.0)
        for k in range(polls + 700):  # 700 warm-up polls fill the 60 s window at 10 Hz
            t += 0.1
            started = time.thread_time()
            reading = source.read(set(pids[:n]))
            total, available = processes.host_memory()
            sample = Sample(t=t, devices=reading.devices, nvml_up=reading.up,
                            processes=processes.read(set(pids[:n]), reading.process_gpu_bytes),
                            host_total_bytes=total, host_available_bytes=available)
            step(host, sample, cfg)
            if k >= 700:
                costs.append(time.thread_time() - started)
    finally:
        source.close()
        processes.close()
    return statistics.median(costs)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--polls", type=int, default=600)
    a = p.parse_args()
    children = [subprocess.Popen(["sleep", "120"]) for _ in range(7)]
    try:
        pids = [os.getpid()] + [c.pid for c in children]
        one, eight = poll_cost(1, a.polls, pids), poll_cost(8, a.polls, pids)
    finally:
        for c in children:
            c.kill()
            c.wait()
    print(f"poll, 1 GPU + 1 server:   {one * 1e3:.3f} ms CPU (median of {a.polls})")
    print(f"poll, 8 GPUs + 8 servers: {eight * 1e3:.3f} ms CPU")
    print(f"ratio 8/1: {eight / one:.2f}x (target <= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
