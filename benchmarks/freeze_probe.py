"""A first measure of the freeze (issue 52) on a GPU: a 12-layer transformer under
`reduce-overhead` served by a worker thread over new sequence lengths, the agent installed; the
freeze asked from another thread (as the control channel's client does) after PHASE_S; then
new lengths keep coming. Prints JSON: recordings, NVML process memory and p50 latency of
recorded and new lengths, before and after the freeze, and errors.

    python3 benchmarks/freeze_probe.py [--phase-s 40] [--layers 12]

Figures: benchmarks/results/freeze.md (H100, torch 2.11); benchmarks/freeze.py measures the
freeze decided by a real sidecar.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import pynvml  # noqa: E402
import torch  # noqa: E402
from record_trace import Model  # noqa: E402

import torch_watchdog.agent as agent  # noqa: E402


def proc_bytes(handle) -> int:
    mine = [p for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()]
    return int(mine[0].usedGpuMemory) if mine and mine[0].usedGpuMemory else 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--phase-s", type=float, default=40.0)
    p.add_argument("--layers", type=int, default=12)
    a = p.parse_args()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    log = os.path.join(tempfile.mkdtemp(), "events.jsonl")
    ag = agent.install(socket_path="", event_log=log)
    model = agent.watch(torch.compile(Model(a.layers).cuda().half().eval(),
                                      mode="reduce-overhead"), name="lm")
    recorded: list[int] = []
    rng = random.Random(1)
    lengths = list(range(16, 1025, 2))
    rng.shuffle(lengths)
    samples: list[tuple[float, str, int, float]] = []   # t, phase, length, ms
    errors: list[str] = []
    mem: list[tuple[float, int]] = []
    frozen_at: list[float] = []
    stop = threading.Event()

    def call(n: int) -> float:
        ids = torch.randint(0, 32000, (1, n), device="cuda")
        t0 = time.perf_counter()
        with torch.no_grad():
            model(ids)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    def serve() -> None:
        i = 0
        while not stop.is_set():
            try:
                phase = "frozen" if frozen_at else "growing"
                if recorded and i % 2:   # every other call a length seen (and recorded) before
                    n = rng.choice(recorded[:8])
                    samples.append((time.monotonic(), phase + "-seen", n, call(n)))
                else:
                    n = lengths[len(recorded) % len(lengths)]
                    ms = call(n)
                    call(n)    # its second call records the graph (a size's first warms up)
                    samples.append((time.monotonic(), phase + "-new", n, ms))
                    recorded.append(n)
                i += 1
            except Exception as e:  # noqa: BLE001 - counted: the point is none
                errors.append(repr(e)[:200])

    worker = threading.Thread(target=serve, name="serving")
    start = time.monotonic()
    worker.start()
    while time.monotonic() - start < 2 * a.phase_s:
        mem.append((time.monotonic(), proc_bytes(handle)))
        if not frozen_at and time.monotonic() - start >= a.phase_s:
            ag.freeze(True)   # what the control channel's client calls, on another thread
            frozen_at.append(time.monotonic())
        time.sleep(0.5)
    stop.set()
    worker.join(30)
    agent.uninstall()
    with open(log) as fh:
        evs = [json.loads(line) for line in fh if line.strip()]
    records = [e["t"] for e in evs if e.get("kind") == "cudagraph_record"]
    ft = frozen_at[0]
    # the events' t is wall time; the samples' monotonic: map by the offset at the freeze
    wall_ft = next((e["t"] for e in evs if e.get("kind") == "mitigation"), None)

    def p50(phase: str) -> float | None:
        v = [ms for _, ph, _, ms in samples if ph == phase]
        return round(statistics.median(v), 3) if v else None

    def mib(t0: float, t1: float) -> float:
        v = [b for t, b in mem if t0 <= t <= t1]
        return round((v[-1] - v[0]) / 2**20, 1) if len(v) > 1 else 0.0

    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
           "layers": a.layers, "phase_s": a.phase_s,
           "mitigations": [(e["name"], e["action"], e["detail"]) for e in evs
                           if e.get("kind") == "mitigation"],
           "records_before": sum(1 for t in records if wall_ft is None or t < wall_ft),
           "records_after": sum(1 for t in records if wall_ft is not None and t >= wall_ft),
           "new_lengths_before": sum(1 for t, ph, _, _ in samples if ph == "growing-new"),
           "new_lengths_after": sum(1 for t, ph, _, _ in samples if ph == "frozen-new"),
           "mem_growth_mib_last_half_before": mib(start + a.phase_s / 2, ft),
           "mem_growth_mib_after_first_s": mib(ft + 1, ft + a.phase_s),
           "p50_ms": {ph: p50(ph) for ph in ("growing-seen", "growing-new", "frozen-seen",
                                             "frozen-new")},
           "errors": len(errors), "first_errors": errors[:3]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
