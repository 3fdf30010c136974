"""Sidecar cost, measured in one run (ratios and rates, not pass/fail):

1. CPU of the real daemon (a subprocess, 10 Hz polling): idle; with 1,000 events/s sent by
   the agent's emitter (several per datagram); with 1,000 single-event datagrams/s — CPU
   seconds per wall second (target < 0.01).
2. Ingest capacity: events/s it takes in when a sender floods it (blocking sends, so the kernel
   queue throttles the sender instead of dropping).
3. Replay speed: trace seconds per wall second on the recorded traces in tests/fixtures.
4. Decode: microseconds to decode and validate one of the events sent in 1. (in this process),
   one line at a time, and as the receiver takes the agent's packed datagrams (100 a datagram).

    python benchmarks/sidecar_cost.py [--seconds 20] [--neighbour]

`--neighbour`: a process beside the daemon copies 64 MB back and forth for the whole run (it
takes the other core, the memory bus and the shared cache: a busy host), which the daemon,
waking 10 times a second with caches another process has filled, pays for.

Measured 2026-12-01 on the 2-core VM (shared: other jobs ran beside it; CPU times come in 10 ms
ticks, so idle reads 0.005 or 0.006), `--seconds 10`, three runs of this branch interleaved with
three of main's code of the same day (before -> after, each run's CPU-s per s):
- idle: 0.006 / 0.006 / 0.005 -> 0.006 / 0.005 / 0.005; two daemons side by side over 20 s,
  CPU from /proc/<pid>/task/*/schedstat (ns): 0.0068 -> 0.0054 (0.0060 -> 0.0055 in another)
- 1,000 events/s from an agent: 0.0269 / 0.0229 / 0.0199 -> 0.0219 / 0.0169 / 0.0179 (median
  0.0229 -> 0.0179, target 0.01)
- 1,000 single-event datagrams/s: 0.076 / 0.077 / 0.067 -> 0.081 / 0.074 / 0.063 (a wake per
  datagram: what it costs is the wake's, not the event's)
What went: each line of a packed datagram parsed by orjson where installed (first as one JSON
array, which let two lines that are not JSON alone pass as one event) and each event
built by one generated function per kind (in a hot loop 4.8 -> 2.5 us an event), the poll's
events folded as one batch (step.fold_events, ~3 -> ~1.3 us), new_shape's fold (2.6 -> 1.2 us),
an idle poll's recvmsg when the wait found the socket empty, the empty focus's numbers. What is
left (cProfile and thread CPU in the daemon, under this load): per event ~4.5 us receiving and
decoding, ~2 us folding (1.8x a hot loop's: a daemon that wakes 20 times a second runs cold);
per poll ~500 us of Python at 10 Hz when idle (the NVML and /proc reads ~100 us, the sample's
step ~20 us, the snapshot, views and status ~150 us) and, with a server, ~120 us more for the
sample's full fold (its state changes with every event) and ~150 us of views and status.
Later on 2026-12-01 (branch daemoncost), three runs each in turn with the code before it
(016e692): idle 0.0060 / 0.0050 / 0.0060 -> 0.0050 / 0.0050 / 0.0050; 1,000 events/s from an
agent 0.0209 / 0.0229 / 0.0229 -> 0.0209 / 0.0209 / 0.0199; 1,000 datagrams/s 0.080 / 0.087 /
0.078 -> 0.078 / 0.092 / 0.073 (noise). Per thread (schedstat, the daemon in-process): the
status page's socket thread woke every 0.2 s to look for a stop, 0.7 ms/s of an idle daemon's
~5 ms/s, now it sleeps until a client or its wake (the daemon in-process, all threads, 8 s,
2 runs each in turn: no server 6.28 / 6.26 -> 4.83 / 4.76 ms/s, one server in host-memory
mode 8.99 / 9.85 -> 8.37 / 8.10 ms/s); each server's view, its alerts, the
snapshot's per-process sums are built again only when their inputs changed, and the
Snapshot made by filling its dict (5.3 -> 0.6 us hot). Why idle did not drop more: a poll is
~70 us hot but ~400 us cold (after 100 ms asleep on this shared VM, a cold clock_gettime is
~9 us): the sources (the NVML hand-off ~50 us, /proc/meminfo ~35-60 us, the processes ~20-60
us), the step (~170 us a host-memory server's poll: without GPUs no poll repeats, the RSS and
PSS are read and folded every poll) and the loop's wake-up dominate. With 1,000 events/s
(100 a poll), per poll in the daemon: intake (receive + decode) ~0.7 ms, their fold ~0.3 ms,
the sample's step ~0.17 ms, the status history's marks over the events ~0.08 ms, the views
~0.07 ms (their estimates change every poll then): the events' own cost is 1 % of a core,
so the 1 % target needs a cheaper intake and fold, not a cheaper presentation.
Later (session of 2026-12-01 morning), thread CPU of the daemon per phase (time.thread_time
around each, the daemon under this load): a wake after 100 ms asleep costs ~80-100 us of CPU
on this VM whatever it does, and a first recvmsg that raises BlockingIOError ~60 us more. So:
the socket is read at each poll and, between polls, only after a poll that took >= 3
datagrams (daemon.EAGER_DATAGRAMS; one agent at 1,000 events/s sends ~1 a poll: before, each
woke the loop, and BATCH_S later again); each read first asks poll(0); the packed path builds
with builders that skip isfinite (orjson never gives inf or nan). 1,000 events/s from an agent,
two runs: 0.0199 (start of the session) -> 0.0160 / 0.0159; idle 0.0050 -> 0.0050. Left per
poll (~1.4 ms of CPU): decode ~4.3 us an event in place (2.4 hot), fold ~2 us an event, the
sample's step, views, snapshot and history ~0.3 ms, the sources ~0.2 ms (NVML absent: ~50 us).
Later on 2026-12-01 (branch sidecarcost, a quieter and faster 2-core VM: idle reads
0.0010-0.0030 here), the real Daemon in-process under this load (the agent's emitter at 1,000
events/s for 10 s; time.thread_time around each phase, all threads' CPU from
/proc/self/task/*/schedstat), four runs each in turn with the code before it (5b9b795): all
threads 8.03 / 7.43 / 8.09 / 7.93 -> 7.08 / 7.73 / 6.44 / 5.24 ms per s (median 7.98 -> 6.76,
-15 %); the poll 731 / 671 / 714 / 697 -> 626 / 693 / 563 / 464 us. What went: the fold of a
poll's events, now in runs of one process (step.fold_events looks a run's server up once,
correlate.fold_events folds it in one call): 113 / 101 / 97 / 99 -> 69 / 70 / 69 / 61 us a
poll; the PSS meter's answer kept while the process reader hands back the same tuple (64 of 67
polls) and no PSS read is due: 18 / 16 / 18 / 17 -> 7 / 8 / 8 / 7 us; the heard pids mapped in
C (5.5 -> 3.8 us hot). Not changed: receiving and decoding, 251 / 261 / 277 / 269 -> 253 / 289
/ 233 / 187 us a poll (noise). Tried and dropped (hot loops, best of 7): decode 1.25 us an
event (orjson.loads 0.42, the builder 0.51, the loop ~0.3); one comprehension and all() instead
of the loop 1.25-1.30 -> 1.23-1.29 (noise); a builder that unpacks the values in the wire's
order 0.43 -> 0.51 us (slower); the orjson dict taken whole as the instance's __dict__ 0.205 ->
0.197 us; a datagram's events paired with their sender by zip() when all are its own 3.18 ->
3.35 us for 100 events and 0.09 -> 0.35 us for one (slower: reverted; the runs above had it);
gc: ~1 young collection a second, ~14 us a poll. `--seconds 20`, three runs each in turn: 1,000
events/s from an agent 0.0105 / 0.0045 / 0.0065 -> 0.0080 / 0.0050 / 0.0055 (10 ms ticks: a
change of this size is under the noise), idle 0.0030 / 0.0030 / 0.0030 -> 0.0025 / 0.0015 /
0.0010.
2026-12-01 (session 3, the same kind of VM, busier: idle 0.30-0.40 %), the receiver's C parser
(watchdog/sidecar/sources/_intake.c) against the Python paths (TORCH_WATCHDOG_PURE_PYTHON=1),
runs in turn, `--seconds 20`, two each without and with `--neighbour` (Python -> C):
- decode in a 100-event datagram: 1.26 / 1.32 / 1.33 / 1.31 -> 0.41 / 0.43 / 0.44 / 0.43 us
  an event (3.0x);
- 1,000 events/s from an agent: 0.0085 / 0.0090 -> 0.0080 / 0.0090; with the neighbour
  0.0095 / 0.0095 -> 0.0090 / 0.0090 (10 ms ticks: 0.0005 is one tick in 20 s);
- idle 0.0030-0.0040 either way; 1,000 single-event datagrams/s 0.022-0.024 either way.
In the daemon (in-process, time.thread_time around each phase, all threads from schedstat),
three runs each in turn: the decode phase 307 / 250 / 284 -> 142 / 98 / 139 us a poll (cold:
~1.2 us an event against 0.4 in a hot loop), all threads 10.7 / 9.1 / 10.3 -> 8.6 / 6.3 /
8.2 ms per s. Left per poll: the fold ~70 us, the sample's step ~50-90 us, receiving besides
decoding ~70 us (recvmsg ~30 us cold), the wake, the views, publish and snapshot ~100 us.
The same day on the H200 host (16-core Xeon, CPython 3.12, NVML present: the worker's queries
run every poll), `--seconds 10`, two runs each in turn: 1,000 events/s from an agent 0.0150 /
0.0160 -> 0.0120 / 0.0120, idle 0.0070-0.0080 either way (the NVML reads and the host's
samples at 10 Hz: a floor the 2-core VM, without NVML, does not have); decode in a datagram
1.87 / 1.98 -> 0.71 / 1.15 us. In the daemon there (in-process, phases timed as above, all threads):
15.6 -> 12.1 ms per s at 1,000 events/s, the decode phase 417 -> 155 us a poll; with 1 event
a poll 9.95 ms per s (C), of which ~3.5 ms per s outside the poll's thread (the NVML worker).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from torch_watchdog import events  # noqa: E402
from torch_watchdog.sidecar.config import Config  # noqa: E402
from torch_watchdog.sidecar.offline.replay import replay  # noqa: E402


def received(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    line = next(x for x in text.splitlines() if x.startswith("torch_watchdog_events_received"))
    return float(line.split()[-1])


def event_bytes(i: int) -> bytes:
    kinds = [
        events.Heartbeat(t=time.time(), pid=os.getpid(), seq=i, uptime_s=1.0, queue_depth=0,
                         errors=0),
        events.NewShape(t=time.time(), pid=os.getpid(), name="m", shape=[[1, 32 + i % 2000]],
                        seconds=0.05, distinct=i),
        events.CudagraphRecord(t=time.time(), pid=os.getpid(), phase="record", compile_id="0/1",
                               key=[i], shape=[[1, i]], seconds=0.007),
    ]
    return events.encode(kinds[i % 3])


def send_at(path: str, rate: float, seconds: float) -> int:
    """Blocking sends at `rate` events/s (rate=None: as fast as the receiver drains)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sent, start = 0, time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        due = sent + 1000 if rate is None else int((now - start) * rate)
        while sent < due:
            s.sendto(event_bytes(sent), path)
            sent += 1
        if rate is not None:
            time.sleep(0.001)
    s.close()
    return sent


def emit_at(path: str, rate: float, seconds: float) -> int:
    """Events at `rate` through the agent's own emitter (it packs them per datagram)."""
    from torch_watchdog.agent.emitter import Emitter

    em = Emitter(path, None)
    em.start()
    sent, start = 0, time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        while sent < int((now - start) * rate):
            em.emit(events.decode(event_bytes(sent)))
            sent += 1
        time.sleep(0.001)
    em.stop()
    return sent


def decode_us(rounds: int = 20000) -> float:
    """Microseconds per events.decode of the events sent above (the best of 3 rounds)."""
    lines = [event_bytes(i) for i in range(3)]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(rounds):
            for line in lines:
                events.decode(line)
        best = min(best, (time.perf_counter() - t0) / (rounds * len(lines)))
    return best * 1e6


def decode_packed_us(rounds: int = 200) -> float:
    """Microseconds per event to decode and validate a 100-event datagram as the receiver
    takes the agent's (the best of 3 rounds)."""
    from torch_watchdog.sidecar.sources import receiver

    data = b"\n".join(event_bytes(i) for i in range(100))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(rounds):
            assert len(receiver._decode_packed(data)) == 100
        best = min(best, (time.perf_counter() - t0) / (rounds * 100))
    return best * 1e6


NEIGHBOUR = """
src, dst = bytearray(64 << 20), bytearray(64 << 20)
while True:
    dst[:] = src
    src[:] = dst
"""


def cpu_ratio(proc: psutil.Process, seconds: float, work=None) -> float:
    """CPU seconds (user + system) of `proc` per wall second while `work` runs."""
    before, t0 = proc.cpu_times(), time.monotonic()
    if work:
        work()
    else:
        time.sleep(seconds)
    after, wall = proc.cpu_times(), time.monotonic() - t0
    user, system = after.user - before.user, after.system - before.system
    print(f"  (user {user / wall:.4f}, system {system / wall:.4f} CPU-s per s)")
    return (user + system) / wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--neighbour", action="store_true",
                   help="a process copying 64 MB back and forth beside the daemon (a busy host)")
    a = p.parse_args()
    results: dict = {"neighbour": a.neighbour}
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if a.neighbour else None
    try:
        return measure(a, results)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def measure(a: argparse.Namespace, results: dict) -> int:
    with tempfile.TemporaryDirectory(prefix="tw-bench-") as d:
        port = 19000 + os.getpid() % 1000
        sock = os.path.join(d, "events.sock")
        cfg = os.path.join(d, "c.yaml")
        with open(cfg, "w") as fh:
            fh.write(f"metrics_port: {port}\nstate_dir: {d}\nagent:\n  socket_path: {sock}\n")
        daemon = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                                   "--config", cfg], cwd=ROOT, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(sock):
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the sidecar did not start (try: torch-watchdog sidecar)")
                time.sleep(0.05)
            time.sleep(1.0)
            proc = psutil.Process(daemon.pid)
            results["cpu_idle"] = round(cpu_ratio(proc, a.seconds), 4)
            n0 = received(port)
            results["cpu_1000_events_per_s"] = round(
                cpu_ratio(proc, a.seconds, lambda: emit_at(sock, 1000, a.seconds)), 4)
            time.sleep(0.5)
            results["events_received_at_1000_per_s"] = received(port) - n0
            n0 = received(port)
            results["cpu_1000_datagrams_per_s"] = round(
                cpu_ratio(proc, a.seconds, lambda: send_at(sock, 1000, a.seconds)), 4)
            time.sleep(0.5)
            results["datagrams_received_at_1000_per_s"] = received(port) - n0
            n1, t = received(port), time.monotonic()
            send_at(sock, None, 5.0)  # flood: as fast as the kernel queue lets us
            time.sleep(0.5)
            results["ingest_events_per_s"] = round((received(port) - n1) / (time.monotonic() - t))
        finally:
            daemon.terminate()
            daemon.wait(10)
    speeds = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "fixtures", "*.jsonl.gz"))):
        r = replay([path], Config())["replay"]
        speeds[os.path.basename(path)] = r["speed"]
    results["replay_trace_seconds_per_wall_second"] = speeds
    results["decode_us_per_event"] = round(decode_us(), 2)
    results["decode_packed_us_per_event"] = round(decode_packed_us(), 2)
    print(f"sidecar CPU, idle at 10 Hz: {results['cpu_idle']:.4f} CPU-s per s")
    print(f"sidecar CPU, 10 Hz + 1,000 events/s from an agent: "
          f"{results['cpu_1000_events_per_s']:.4f} CPU-s per s (target < 0.01); received "
          f"{results['events_received_at_1000_per_s']:.0f}")
    print(f"sidecar CPU, 10 Hz + 1,000 single-event datagrams/s: "
          f"{results['cpu_1000_datagrams_per_s']:.4f} CPU-s per s")
    print(f"ingest capacity (flooding sender): {results['ingest_events_per_s']} events/s")
    for name, speed in speeds.items():
        print(f"replay {name}: {speed}x real time")
    print(f"decode + validate: {results['decode_us_per_event']} us per event, "
          f"{results['decode_packed_us_per_event']} us in a 100-event datagram")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
