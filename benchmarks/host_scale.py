"""What a poll costs on a big host, as a ratio: 8 GPUs with 8 replicas vs 1 GPU with 1 server.

A poll is the daemon's work: NVML read (a fake backend through the real NvmlSource and its
worker thread: `LeanNvml`, so only the sidecar's own cost counts; `--test-fake`: the tests'
FakeNvml as it is, its call log and lock ~2 us a GPU more), the processes' liveness and RSS
(real processes: this one and sleeping children), then the pure step over the sample with
every server's state warm (a full forecast window of samples). CPU time of the process per
poll (this thread's and the NVML worker's, which read() waits for; this thread's alone is
printed too: it left the worker's per-GPU work out), median of many polls; the two hosts are
polled in turn (so a shared machine's other load weighs on both alike, and each poll finds its
caches as cold as the daemon's, 0.1 s apart, do), or with --sequential one after the other.

Memory: static (every GPU's and process's numbers the same each poll: an idle replica), or
changing on half of the GPUs, as a live host's do (`--changing half`: GPUs 0, 2, 4, 6 of the
8, and the single GPU of the 1-GPU host, move by 2 MiB a poll, up for 8 polls then down: an
allocator's wobble, below the forecast's one-poll jump), or on all of them (`--changing all`).
`--calls`: each server's agent also reports its requests every 2 s (a `calls` event, as the
agent's heartbeat does), folded in the poll that receives it.

    python benchmarks/host_scale.py [--polls 600] [--sequential] [--test-fake]
                                    [--changing none|half|all] [--calls] [--daemon]

`--daemon`: the same hosts polled through a real Daemon's whole tick (each server's view for
the metrics and the status page, the snapshot, the status history; no HTTP server, alert
sender or sample log). Figures: benchmarks/results/host_scale.md.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.unit.test_nvml import FakeNvml  # noqa: E402
from torch_watchdog import events  # noqa: E402
from torch_watchdog.sidecar.config import Config  # noqa: E402
from torch_watchdog.sidecar.core.step import Host, step  # noqa: E402
from torch_watchdog.sidecar.sources.nvml import NvmlSource  # noqa: E402
from torch_watchdog.sidecar.sources.process import read_host_memory, read_processes  # noqa
try:
    from torch_watchdog.sidecar.sources.process import ProcessReader
except ImportError:  # older code: one-shot reads
    ProcessReader = None
from torch_watchdog.sidecar.core.observations import Sample  # noqa: E402

GB = 1 << 30
MIB2 = 2 << 20


class LeanNvml(FakeNvml):
    """The tests' fake NVML without its own cost: no call log that grows every call, no lock
    taken twice, no fault injection, and its answers (the memory struct, the process list)
    built again only when the device's numbers change. That cost (~2 us a GPU and poll with
    the tests' fake, `--test-fake`) is neither the sidecar's nor NVML's: the sidecar's own
    work (the worker's loop, the samples it builds, the presentation) is what is measured. A
    real binding's calls (ctypes, the driver's ioctl) cost their own CPU on top on a GPU host.
    """

    def _call(self, name, *args):
        pass

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        d = self.devices[handle]
        key = (d["used"], d["total"])
        kept = d.get("_memory")
        if kept is None or kept[0] != key:
            kept = d["_memory"] = (key, SimpleNamespace(total=d["total"], used=d["used"],
                                                        free=d["total"] - d["used"]))
        return kept[1]

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        d = self.devices[handle]
        procs, kept = d["procs"], d.get("_procs")
        if kept is None or kept[0] is not procs:
            kept = d["_procs"] = (procs, [SimpleNamespace(pid=p, usedGpuMemory=u)
                                          for p, u in procs])
        return kept[1]


class Poller:
    """One simulated host with n GPUs and n servers (one process each), warm."""

    def __init__(self, n: int, pids: list[int], changing: str = "none", calls: bool = False,
                 fake: type = LeanNvml):
        self.pids, self.calls, self.pid_list = set(pids[:n]), calls, pids[:n]
        gpus = [f"GPU-{i:04d}" for i in range(n)]
        self.nvml = nvml = fake([{"uuid": g.encode(), "total": 80 * GB, "used": 10 * GB,
                          "procs": [(pids[i], 8 * GB)]} for i, g in enumerate(gpus)])
        self.source, self.processes = NvmlSource(nvml), _processes()
        self.cfg, self.host, self.t = Config(), Host(), time.time()
        self.moving = [] if changing == "none" else \
            nvml.devices if changing == "all" else nvml.devices[::2]
        self.polls, self.steps, self.main = 0, [], []
        for i in range(n):
            step(self.host, events.Hello(t=self.t, pid=pids[i], torch="2.11", agent="bench",
                                         devices=[gpus[i]], config={}, capabilities={},
                                         watched=["m"], argv="serve", server=f"replica-{i}"),
                 self.cfg)
        self.source.read(self.pids, wait_s=5.0)
        for _ in range(700):  # 700 warm-up polls fill the 60 s window at 10 Hz
            self.poll()

    def poll(self) -> float:
        """CPU seconds of the process for one poll: this thread's and the NVML worker's, which
        read() waits for (`self.main`: this thread's alone, `self.steps`: the pure step's)."""
        self.t += 0.1
        self.polls += 1
        _move(self.moving, self.polls)
        started, cpu = time.thread_time(), time.process_time()
        for i, pid in enumerate(self.pid_list if self.calls else ()):
            if (self.polls + i) % 20 == 0:  # every 2 s, the servers' reports spread out
                step(self.host, events.Calls(t=self.t, pid=pid, name="m", calls=200,
                                             seconds=0.5, stall_calls=0, stall_seconds=0.0,
                                             distinct_shapes=4, window_s=2.0), self.cfg)
        reading = self.source.read(self.pids)
        total, available = self.processes.host_memory()
        sample = Sample(t=self.t, devices=reading.devices, nvml_up=reading.up,
                        processes=self.processes.read(self.pids, reading.process_gpu_bytes),
                        host_total_bytes=total, host_available_bytes=available)
        stepping = time.thread_time()
        step(self.host, sample, self.cfg)
        done, cpu_done = time.thread_time(), time.process_time()
        self.steps.append(done - stepping)
        self.main.append(done - started)
        return cpu_done - cpu

    def close(self) -> None:
        self.source.close()
        self.processes.close()


class DaemonPoller:
    """`--daemon`: the same host polled by a real Daemon's tick (no HTTP server, no alert
    sender, no sample log): the sources and the step as above, plus what the daemon does with
    each server every poll (its view for the metrics and the status page, the snapshot, the
    status history). The agents' hellos come in as received events."""

    def __init__(self, n: int, pids: list[int], changing: str = "none", calls: bool = False,
                 fake: type = LeanNvml, state_dir: str = "/tmp"):
        import structlog

        from torch_watchdog.sidecar.config import AgentSocketConfig
        from torch_watchdog.sidecar.daemon import Daemon
        structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
        gpus = [f"GPU-{i:04d}" for i in range(n)]
        nvml = fake([{"uuid": g.encode(), "total": 80 * GB, "used": 10 * GB,
                      "procs": [(pids[i], 8 * GB)]} for i, g in enumerate(gpus)])
        self.moving = [] if changing == "none" else \
            nvml.devices if changing == "all" else nvml.devices[::2]
        self.t, self.polls, self.steps, self.main = time.time(), 0, [], []
        self.calls, self.pid_list = calls, pids[:n]
        cfg = Config(agent=AgentSocketConfig(socket_path=os.path.join(state_dir, f"ev{n}.sock")),
                     state_dir=os.path.join(state_dir, f"state{n}"))
        self.daemon = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml),
                             clock=lambda: self.t, serve_metrics=False)
        self.daemon.start()
        for i in range(n):
            self.daemon.intake.pending.append((events.Hello(
                t=self.t, pid=pids[i], torch="2.11", agent="bench", devices=[gpus[i]],
                config={}, capabilities={}, watched=["m"], argv="serve",
                server=f"replica-{i}"), pids[i]))
        for _ in range(700):
            self.poll()

    def poll(self) -> float:
        self.t += 0.1
        self.polls += 1
        _move(self.moving, self.polls)
        for i, pid in enumerate(self.pid_list if self.calls else ()):
            if (self.polls + i) % 20 == 0:
                self.daemon.intake.pending.append((events.Calls(
                    t=self.t, pid=pid, name="m", calls=200, seconds=0.5, stall_calls=0,
                    stall_seconds=0.0, distinct_shapes=4, window_s=2.0), pid))
        started, main = time.process_time(), time.thread_time()
        self.daemon.tick()
        self.main.append(time.thread_time() - main)
        return time.process_time() - started

    def close(self) -> None:
        self.daemon.halt()


def _move(devices: list, polls: int) -> None:
    """The fake's numbers of the moving GPUs: the NVML worker reads them at read()."""
    move = MIB2 if polls % 16 < 8 else -MIB2
    for d in devices:
        pid, used = d["procs"][0]
        d["used"] += move
        d["procs"] = [(pid, used + move)]


class _OneShot:
    """The process source before it kept its files open (to measure older code alike)."""

    def read(self, pids, gpu):
        return read_processes(pids, gpu)

    def host_memory(self):
        return read_host_memory()

    def close(self):
        pass


def _processes():
    return ProcessReader() if ProcessReader is not None else _OneShot()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--polls", type=int, default=600)
    p.add_argument("--sequential", action="store_true",
                   help="one host's polls, then the other's (warmer caches, but a shared "
                        "machine's load can change in between)")
    p.add_argument("--changing", choices=("none", "half", "all"), default="none",
                   help="GPUs whose memory moves every poll (half: every other one)")
    p.add_argument("--calls", action="store_true",
                   help="the agents report their requests every 2 s, as they do")
    p.add_argument("--daemon", action="store_true",
                   help="the whole tick of a real Daemon (its per-server views, snapshot and "
                        "status history too), not only the sources and the step")
    p.add_argument("--test-fake", action="store_true",
                   help="the tests' FakeNvml as it is (its call log and lock: ~2 us a GPU)")
    a = p.parse_args()
    fake = FakeNvml if a.test_fake else LeanNvml
    tmp = tempfile.TemporaryDirectory(prefix="tw-hs-")
    kind = functools.partial(DaemonPoller, state_dir=tmp.name) if a.daemon else Poller
    children = [subprocess.Popen(["sleep", "120"]) for _ in range(7)]
    try:
        pids = [os.getpid()] + [c.pid for c in children]
        costs: tuple[list, list] = ([], [])
        mains: tuple[list, list] = ([], [])
        steps: tuple[list, list] = ([], [])
        if a.sequential:  # as measured before: all of one host's polls, then the other's
            for i, n in enumerate((1, 8)):
                host = kind(n, pids, a.changing, a.calls, fake)
                host.steps.clear()
                host.main.clear()
                costs[i].extend(host.poll() for _ in range(a.polls))
                steps[i].extend(host.steps)
                mains[i].extend(host.main)
                host.close()
        else:
            small = kind(1, pids, a.changing, a.calls, fake)
            big = kind(8, pids, a.changing, a.calls, fake)
            for _ in range(a.polls):
                costs[0].append(small.poll())
                costs[1].append(big.poll())
            for i, host in enumerate((small, big)):
                steps[i].extend(host.steps[-a.polls:])
                mains[i].extend(host.main[-a.polls:])
                host.close()
    finally:
        for c in children:
            c.kill()
            c.wait()
        tmp.cleanup()
    one, eight = statistics.median(costs[0]), statistics.median(costs[1])
    main1, main8 = statistics.median(mains[0]), statistics.median(mains[1])
    print(f"memory changing: {a.changing}; agents' calls reports: {a.calls}; "
          f"{'the daemon' + chr(39) + 's whole tick' if a.daemon else 'sources and step'}")
    print(f"poll, 1 GPU + 1 server:   {one * 1e3:.3f} ms CPU of the process (median of "
          f"{a.polls}; main thread alone {main1 * 1e3:.3f} ms)")
    print(f"poll, 8 GPUs + 8 servers: {eight * 1e3:.3f} ms CPU of the process (main thread "
          f"alone {main8 * 1e3:.3f} ms)")
    print(f"ratio 8/1: {eight / one:.2f}x (linear: 8x; main thread alone "
          f"{main8 / main1:.2f}x); 8 GPUs + 8 servers at 10 Hz: {eight * 10 * 100:.2f} % of a "
          f"core")
    if steps[0]:
        print(f"of which the pure step: {statistics.median(steps[0]) * 1e3:.3f} ms and "
              f"{statistics.median(steps[1]) * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
