"""A churn soak of the real sidecar (issue 50, part 8): does it last a week?

The real daemon (`python -m torch_watchdog.cli sidecar --config CFG`, a subprocess; host-memory
mode without a GPU) watches hundreds of short-lived "plain-socket agents": small processes, no
torch, that speak to it as the agent does, through the agent's own `Emitter` (a sender thread
every 0.1 s): a `hello` naming their server (re-sent every 30 s, as `hello_every_s`), one
`compile`, a new input size (`new_shape` and a CUDA graph's `cudagraph_record` warm-up and
record, 1 MiB of host memory kept for it) every 2 s for their first 20 s, and a `heartbeat` and
a `calls` report every 2 s, with a few MiB of ballast besides. Each lives a random 20-120 s;
some exit normally (their final heartbeat sent, as the agent's atexit does), some are
SIGKILLed; 8-12 are alive at a time (a target drawn again every 30 s), over a pool of server
names, a name sometimes taken again soon after its process died. The sidecar is SIGTERMed and
started again with the same config (same state_dir) early in the run (`--restart-at`, minutes
into the churn: the last incarnation has the longest stretch, and starts from what
servers.json and reloads.json kept).

The RSS slope is read after a warm-up (`--warmup-min`, 12) of each incarnation: a stopped
server is kept 10 minutes (RETAIN_S, core/lifecycle.py) and an agent lives up to 2, so the
number of servers held grows for the first 12 minutes of churn, then holds (a bounded
state fills its bound first; that fill is no leak). An incarnation too short for it is
fitted over its last 60 %.

`--steady N`: N long-lived servers for the whole run instead, no churn, no kill, no restart.

Every `--sample-s` it samples the sidecar's RSS, CPU, threads and file descriptors (psutil),
and once a minute how many servers its /status.json lists. At the end it prints:

- the RSS slope of each sidecar incarnation after its warm-up (MiB/h, least squares, R²);
- the servers the sidecar holds (/status.json `servers`, by state) against the live agents and
  the servers stopped recently, before the fleet is stopped and after;
- live servers whose counts merged an earlier process's (each agent sends exactly one compile:
  a listed server with `compiles` > 1 counts two processes' as one);
- the sidecar's idle CPU (% of a core, over `--idle-s` with no agent alive), before the churn
  and after it.

Targets (the issue): slope < 5 MiB/h after warm-up; servers held at the end = live plus
recently stopped only; idle CPU unchanged.

    python benchmarks/soak.py [--minutes 26] [--steady N] [--seed 1] [--names 200]
        [--restart-at 2 ...] [--sample-s 5] [--warmup-min 12] [--idle-s 30] [--tracemalloc]
        [--json PATH] [--keep]
    python benchmarks/soak.py --minutes 2          # a smoke run

Figures: benchmarks/results/soak.md.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Optional

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
FUNCTION = "forward"
HELLO_EVERY_S = 30.0      # the agent's hello_every_s default
HEARTBEAT_S = 2.0         # the agent's heartbeat_s default
NEW_SIZES_FOR_S = 20.0    # new input sizes (a CUDA graph each) during this first part of a life
RECENT_S = (60.0, 300.0, 600.0)  # "recently stopped": within these (600: RETAIN_S)
TRACE_EVERY_S = 60.0      # --tracemalloc: a heap snapshot this often


# -- one plain-socket agent (a process of its own) ---------------------------------------------
def agent_main(sock: str, name: str, lifetime: float, seed: int) -> int:
    from torch_watchdog import __version__, events
    from torch_watchdog.agent.emitter import Emitter

    rng = random.Random(seed)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a graceful stop: the last heartbeat
    pid, started = os.getpid(), time.monotonic()
    seq = [0]

    def heartbeat() -> events.Heartbeat:
        seq[0] += 1
        return events.Heartbeat(t=time.time(), pid=pid, seq=seq[0],
                                uptime_s=time.monotonic() - started, queue_depth=0, errors=0,
                                lost=em.lost())

    def hello() -> events.Hello:
        return events.Hello(t=time.time(), pid=pid, torch="2.13.0", agent=__version__,
                            devices=[], config={"recompile_limit": 8},
                            capabilities={"compile": True, "cudagraph": True},
                            watched=[FUNCTION], argv=f"soak-agent {name}", server=name,
                            ppid=os.getppid())

    def hello_again() -> None:
        # as the agent does: a new sidecar at the socket path hears the hello at once
        em.emit(hello())

    kw: dict[str, Any] = {}
    if "on_receiver_change" in inspect.signature(Emitter).parameters:  # older trees: no such
        kw["on_receiver_change"] = hello_again
    em = Emitter(sock, None, tick_s=0.1, reconnect_s=1.0, **kw)
    em.emit(hello())
    em.start()
    ballast = bytearray(rng.randint(4, 24) * MIB)  # written: it counts in RSS and PSS
    ballast[::4096] = b"x" * len(ballast[::4096])
    graphs: list[bytearray] = []
    em.emit(events.Compile(t=time.time(), pid=pid, compile_id="0/0", function=FUNCTION,
                           seconds=round(rng.uniform(2, 9), 3)))
    next_hello = started + HELLO_EVERY_S
    next_beat = started + HEARTBEAT_S
    next_size, calls_since = started + 1.0, started
    while not stop.is_set():
        now = time.monotonic()
        if now - started >= lifetime:
            break
        t = time.time()
        if now >= next_size and now - started < NEW_SIZES_FOR_S:
            next_size = now + 2.0
            n = len(graphs)
            shape = [[1, 64 + 16 * n]]
            graphs.append(bytearray(MIB))
            graphs[-1][::4096] = b"g" * len(graphs[-1][::4096])
            em.emit(events.NewShape(t=t, pid=pid, name=FUNCTION, shape=shape,
                                    seconds=round(rng.uniform(0.05, 0.4), 3), distinct=n + 1))
            for phase in ("warmup", "record"):
                em.emit(events.CudagraphRecord(t=t, pid=pid, phase=phase, compile_id="0/0",
                                               key=[64 + 16 * n], shape=shape,
                                               seconds=round(rng.uniform(0.005, 0.05), 4)))
        if now >= next_beat:
            next_beat = now + HEARTBEAT_S
            em.emit(heartbeat())
            calls = rng.randint(20, 200)
            em.emit(events.Calls(t=t, pid=pid, name=FUNCTION, calls=calls,
                                 seconds=round(calls * rng.uniform(0.002, 0.02), 4),
                                 stall_calls=0, stall_seconds=0.0,
                                 distinct_shapes=max(1, len(graphs)),
                                 window_s=round(now - calls_since, 3)))
            calls_since = now
        if now >= next_hello:
            next_hello = now + HELLO_EVERY_S
            em.emit(hello())
        stop.wait(0.25)
    em.stop(last=heartbeat)
    del ballast, graphs
    return 0


# -- the sidecar -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sidecar:
    """The real daemon, one incarnation after another, on one config and state_dir."""

    def __init__(self, workdir: str, trace_dir: Optional[str] = None):
        self.workdir, self.trace_dir = workdir, trace_dir
        self.port = free_port()
        self.sock = os.path.join(workdir, "ev.sock")
        self.config = os.path.join(workdir, "watchdog.yaml")
        os.makedirs(os.path.join(workdir, "state"), exist_ok=True)
        with open(self.config, "w") as fh:
            fh.write(f"metrics_port: {self.port}\nstate_dir: {workdir}/state\n"
                     f"agent:\n  socket_path: {self.sock}\n")
        self.proc: Optional[subprocess.Popen] = None
        self.ps: Optional[psutil.Process] = None
        self.incarnation = 0
        self.started_at = 0.0   # monotonic, once it answers

    def start(self) -> None:
        self.incarnation += 1
        log = open(os.path.join(self.workdir, f"sidecar-{self.incarnation}.log"), "w")
        cmd = [sys.executable, "-m", "torch_watchdog.cli"]
        if self.trace_dir:  # the daemon itself, under tracemalloc
            cmd = [sys.executable, os.path.abspath(__file__), "--traced-sidecar",
                   os.path.join(self.trace_dir, f"{self.incarnation}"), str(TRACE_EVERY_S)]
        self.proc = subprocess.Popen([*cmd, "sidecar", "--config", self.config], cwd=ROOT,
                                     stderr=log, stdout=subprocess.DEVNULL)
        log.close()
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the sidecar did not start: {self.log_tail()}")
            try:
                self.status()
                break
            except (OSError, ValueError):
                time.sleep(0.2)
        self.started_at = time.monotonic()

    def stop(self, sig: int = signal.SIGTERM) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status.json",
                                    timeout=15) as r:
            return json.loads(r.read())

    def log_tail(self, n: int = 2000) -> str:
        with open(os.path.join(self.workdir, f"sidecar-{self.incarnation}.log")) as fh:
            return fh.read()[-n:]

    def log_counts(self) -> dict[str, int]:
        """Log lines per event over every incarnation (warnings and errors are what matter)."""
        counts: dict[str, int] = {}
        for i in range(1, self.incarnation + 1):
            with open(os.path.join(self.workdir, f"sidecar-{i}.log")) as fh:
                for line in fh:
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        key = "(not JSON)"
                    else:
                        key = f"{entry.get('level')}: {entry.get('event')}"
                        if entry.get("event") == "action":
                            key += f" {entry.get('action')}/{entry.get('reason')}"
                    counts[key] = counts.get(key, 0) + 1
        return counts


# -- the heap's growth (--tracemalloc) ------------------------------------------------------
def traced_sidecar(prefix: str, every: float, argv: list[str]) -> None:
    """The daemon (`python -m torch_watchdog.cli ARGV`) with tracemalloc on (one frame: by
    line), a snapshot dumped to PREFIX-<seconds since start>.snap every `every` seconds."""
    import runpy
    import tracemalloc

    tracemalloc.start(1)
    t0 = time.monotonic()

    def dump() -> None:
        while True:
            time.sleep(every)
            snap = tracemalloc.take_snapshot()
            path = f"{prefix}-{time.monotonic() - t0:07.0f}.snap"
            snap.dump(path + ".tmp")
            os.replace(path + ".tmp", path)

    threading.Thread(target=dump, daemon=True, name="soak-tracemalloc").start()
    sys.argv = ["torch_watchdog.cli", *argv]
    runpy.run_module("torch_watchdog.cli", run_name="__main__", alter_sys=True)


def heap_growth(trace_dir: str, incarnation: int, warmup_s: float, top: int = 12,
                ) -> Optional[dict[str, Any]]:
    """The incarnation's heap growth from its first snapshot after the warm-up to its last, by
    line: the top lines, each with its share of the growth."""
    import tracemalloc

    snaps = sorted(f for f in os.listdir(trace_dir)
                   if f.startswith(f"{incarnation}-") and f.endswith(".snap"))
    timed = [(float(f.split("-")[1].split(".")[0]), f) for f in snaps]
    after = [x for x in timed if x[0] >= warmup_s]
    if len(after) < 2:
        return None
    (t_a, a), (t_b, b) = after[0], after[-1]
    keep = [tracemalloc.Filter(False, tracemalloc.__file__),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    first = tracemalloc.Snapshot.load(os.path.join(trace_dir, a)).filter_traces(keep)
    last = tracemalloc.Snapshot.load(os.path.join(trace_dir, b)).filter_traces(keep)
    diff = last.compare_to(first, "lineno")
    growth = sum(d.size_diff for d in diff)
    return {"from_s": t_a, "to_s": t_b, "heap_first_mib": round(sum(
        s.size for s in first.statistics("filename")) / MIB, 2),
        "growth_mib": round(growth / MIB, 2),
        "growth_mib_per_h": round(growth / MIB / ((t_b - t_a) / 3600), 1),
        "top": [{"where": f"{_short_path(d.traceback[0].filename)}:{d.traceback[0].lineno}",
                 "kib": round(d.size_diff / 1024, 1),
                 "blocks": d.count_diff,
                 "share": round(d.size_diff / growth, 3) if growth > 0 else None}
                for d in diff[:top]]}


def _short_path(path: str) -> str:
    """torch_watchdog/… for the package's files, wherever it was imported from."""
    i = path.rfind("torch_watchdog/")
    return path[i:] if i >= 0 else path


# -- the fleet -----------------------------------------------------------------------------------
class Agent:
    def __init__(self, name: str, proc: subprocess.Popen, born: float, lifetime: float,
                 kill: bool):
        self.name, self.proc, self.born, self.lifetime, self.kill = name, proc, born, lifetime, kill


class Fleet:
    def __init__(self, sock: str, rng: random.Random, names: int):
        self.sock, self.rng = sock, rng
        self.names = [f"srv-{i:03d}" for i in range(names)]
        self.alive: dict[str, Agent] = {}
        self.stopped_at: dict[str, float] = {}   # name -> when its last process ended
        self.used: set[str] = set()
        self.starts: dict[str, int] = {}         # name -> processes started under it
        self.started = self.killed = self.exited = 0
        self.reuse_gaps: list[float] = []        # a name taken again: seconds since it died

    def spawn(self, lifetime: float, kill: bool, reuse_share: float = 0.3) -> Agent:
        now = time.monotonic()
        free = [n for n in self.names if n not in self.alive]
        recent = [n for n in free if now - self.stopped_at.get(n, -1e9) < 120]
        name = self.rng.choice(recent if recent and self.rng.random() < reuse_share else free)
        if name in self.stopped_at:
            self.reuse_gaps.append(now - self.stopped_at[name])
        # a SIGKILLed agent is told to live longer than it will
        told = lifetime + 3600 if kill else lifetime
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--agent", self.sock,
                                 name, f"{told:.1f}", str(self.rng.randrange(1 << 30))],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        agent = self.alive[name] = Agent(name, proc, now, lifetime, kill)
        self.used.add(name)
        self.starts[name] = self.starts.get(name, 0) + 1
        self.started += 1
        return agent

    def reap(self) -> None:
        now = time.monotonic()
        for name, a in list(self.alive.items()):
            if a.kill and a.proc.poll() is None and now - a.born >= a.lifetime:
                a.proc.kill()
                self.killed += 1
            if a.proc.poll() is not None:
                if not a.kill:
                    self.exited += 1
                del self.alive[name]
                self.stopped_at[name] = time.monotonic()

    def stop_all(self, sig: int = signal.SIGTERM) -> None:
        for a in self.alive.values():
            if a.proc.poll() is None:
                a.proc.send_signal(sig)
        deadline = time.monotonic() + 30
        for a in list(self.alive.values()):
            try:
                a.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                a.proc.kill()
                a.proc.wait(10)
        now = time.monotonic()
        for name in self.alive:
            self.stopped_at[name] = now
        self.exited += len(self.alive)
        self.alive.clear()

    def stopped_within(self, seconds: float) -> int:
        now = time.monotonic()
        return sum(1 for n, t in self.stopped_at.items()
                   if n not in self.alive and now - t <= seconds)


# -- sampling --------------------------------------------------------------------------------
class Sampler(threading.Thread):
    """The sidecar's RSS, CPU time, threads and descriptors every `every` seconds; /status.json's
    server count every `status_every` (the page costs the sidecar a render: not every sample)."""

    def __init__(self, sidecar: Sidecar, fleet: Fleet, every: float, status_every: float = 60.0):
        super().__init__(daemon=True)
        self.sidecar, self.fleet, self.every, self.status_every = sidecar, fleet, every, \
            status_every
        self.samples: list[dict[str, Any]] = []
        self.lock = threading.Lock()   # held across a restart: no sample of a dying process
        self.halt = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        next_status = time.monotonic() + self.status_every
        while not self.halt.wait(self.every):
            with self.lock:
                ps = self.sidecar.ps
                try:
                    mem, cpu = ps.memory_info(), ps.cpu_times()
                    sample = {"t": round(time.monotonic() - self.t0, 2),
                              "incarnation": self.sidecar.incarnation,
                              "since_start_s": round(time.monotonic() - self.sidecar.started_at,
                                                     2),
                              "rss": mem.rss, "cpu_s": cpu.user + cpu.system,
                              "threads": ps.num_threads(), "fds": ps.num_fds(),
                              "alive": len(self.fleet.alive)}
                except psutil.Error:
                    continue
                if time.monotonic() >= next_status:
                    next_status = time.monotonic() + self.status_every
                    try:
                        sample["servers_listed"] = len(self.sidecar.status()["servers"])
                    except (OSError, ValueError, KeyError):
                        pass
                self.samples.append(sample)


def fit(points: list[tuple[float, float]]) -> Optional[dict[str, float]]:
    """Least squares y = a + b x: slope b, and R²."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0:
        return None
    b = sxy / sxx
    r2 = (sxy * sxy) / (sxx * syy) if syy > 0 else 1.0
    return {"slope": b, "r2": r2, "n": len(points)}


def slopes(samples: list[dict[str, Any]], warmup_s: float) -> list[dict[str, Any]]:
    """Per incarnation: RSS MiB/h after its warm-up (its first 40 % where it lasted less than
    the warm-up and 5 minutes more), least squares; and its first and last RSS."""
    out = []
    for inc in sorted({s["incarnation"] for s in samples}):
        mine = [s for s in samples if s["incarnation"] == inc]
        span = mine[-1]["since_start_s"] - mine[0]["since_start_s"]
        skip = warmup_s if span >= warmup_s + 300 else 0.4 * span
        kept = [s for s in mine if s["since_start_s"] >= skip]
        f = fit([(s["since_start_s"] / 3600, s["rss"] / MIB) for s in kept])
        out.append({"incarnation": inc, "stretch_min": round(span / 60, 1),
                    "warmup_min": round(skip / 60, 1), "samples": len(kept),
                    "rss_first_mib": round(mine[0]["rss"] / MIB, 1),
                    "rss_after_warmup_mib": round(kept[0]["rss"] / MIB, 1) if kept else None,
                    "rss_last_mib": round(mine[-1]["rss"] / MIB, 1),
                    "slope_mib_per_h": None if f is None else round(f["slope"], 1),
                    "r2": None if f is None else round(f["r2"], 3)})
    return out


def idle_cpu(sidecar: Sidecar, seconds: float) -> float:
    """The sidecar's CPU over `seconds`, % of one core (nothing else asked of it meanwhile)."""
    before, t0 = sidecar.ps.cpu_times(), time.monotonic()
    time.sleep(seconds)
    after, wall = sidecar.ps.cpu_times(), time.monotonic() - t0
    return round(100 * ((after.user + after.system) - (before.user + before.system)) / wall, 2)


def held(sidecar: Sidecar, fleet: Fleet) -> dict[str, Any]:
    """What /status.json lists against the fleet: rows by state, the live agents, the servers
    stopped recently, live servers whose counts merged another process's."""
    rows = sidecar.status()["servers"]
    states: dict[str, int] = {}
    for r in rows:
        states[r["state"]] = states.get(r["state"], 0) + 1
    live = set(fleet.alive)
    reused_live = [n for n in live if fleet.starts.get(n, 0) > 1]
    merged = sorted(r["server"] for r in rows
                    if r["server"] in live and (r.get("compiles") or 0) > 1)
    out = {"listed": len(rows), "by_state": states, "live_agents": len(live),
           "listed_live": sum(1 for r in rows if r["server"] in live),
           "listed_not_ours": sorted(r["server"] for r in rows
                                     if r["server"] not in fleet.used)[:10],
           "live_reused_names": len(reused_live), "live_merged_counts": len(merged),
           "names_used_total": len(fleet.used)}
    for s in RECENT_S:
        out[f"stopped_within_{s:.0f}s"] = fleet.stopped_within(s)
    return out


# -- the run -----------------------------------------------------------------------------------
def run(a: argparse.Namespace, workdir: str) -> dict[str, Any]:
    rng = random.Random(a.seed)
    trace_dir = None
    if a.tracemalloc:
        trace_dir = os.path.join(workdir, "heap")
        os.makedirs(trace_dir)
    sidecar = Sidecar(workdir, trace_dir)
    fleet = Fleet(sidecar.sock, rng, a.names)
    result: dict[str, Any] = {"args": vars(a), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "load_avg_start": os.getloadavg()}
    sidecar.start()
    sampler = Sampler(sidecar, fleet, a.sample_s)
    try:
        time.sleep(a.settle_s)
        result["idle_cpu_before_pct"] = idle_cpu(sidecar, a.idle_s)
        result["rss_idle_before_mib"] = round(sidecar.ps.memory_info().rss / MIB, 1)
        print(f"idle before: {result['idle_cpu_before_pct']} % of a core, "
              f"RSS {result['rss_idle_before_mib']} MiB", flush=True)
        sampler.start()
        churn_s = a.minutes * 60
        t0 = time.monotonic()
        restart_at = [] if a.steady else sorted(m * 60 for m in a.restart_at)
        restarts: list[dict[str, Any]] = []
        if a.steady:
            for _ in range(a.steady):
                fleet.spawn(lifetime=churn_s + 3600, kill=False, reuse_share=0)
                time.sleep(0.5)
        target, next_target, last_report = rng.randint(a.alive_min, a.alive_max), t0, t0
        while (elapsed := time.monotonic() - t0) < churn_s:
            fleet.reap()
            if restart_at and elapsed >= restart_at[0]:
                restart_at.pop(0)
                with sampler.lock:
                    code = sidecar.stop(signal.SIGTERM)
                    sidecar.start()
                restarts.append({"at_min": round(elapsed / 60, 2), "exit_code": code,
                                 "alive_then": len(fleet.alive)})
                print(f"[{elapsed / 60:5.1f} min] sidecar restarted (SIGTERM, exit {code}), "
                      f"{len(fleet.alive)} agents alive", flush=True)
            if not a.steady:
                if time.monotonic() >= next_target:
                    target, next_target = rng.randint(a.alive_min, a.alive_max), \
                        time.monotonic() + 30
                if len(fleet.alive) < target:  # one start per tick: no burst of imports
                    fleet.spawn(lifetime=rng.uniform(a.life_min, a.life_max),
                                kill=rng.random() < a.kill_share)
            if time.monotonic() - last_report >= 60:
                last_report = time.monotonic()
                last = sampler.samples[-1] if sampler.samples else {}
                print(f"[{elapsed / 60:5.1f} min] {len(fleet.alive)} alive, {fleet.started} "
                      f"started, {fleet.killed} killed; sidecar RSS "
                      f"{last.get('rss', 0) / MIB:.1f} MiB", flush=True)
            time.sleep(0.5)
        fleet.reap()
        result["restarts"] = restarts
        result["held_before_stop"] = held(sidecar, fleet)
        fleet.stop_all()
        sampler.halt.set()
        sampler.join(a.sample_s + 20)
        result["fleet"] = {"started": fleet.started, "killed": fleet.killed,
                           "exited": fleet.exited, "names_used": len(fleet.used),
                           "names_reused": len(fleet.reuse_gaps),
                           "reuse_gap_min_s": round(min(fleet.reuse_gaps), 1)
                           if fleet.reuse_gaps else None,
                           "reuse_gap_median_s": round(statistics.median(fleet.reuse_gaps), 1)
                           if fleet.reuse_gaps else None,
                           "alive_mean": round(statistics.fmean(
                               s["alive"] for s in sampler.samples), 1)
                           if sampler.samples else None}
        time.sleep(a.settle_s)
        result["held_after_stop"] = held(sidecar, fleet)
        result["idle_cpu_after_pct"] = idle_cpu(sidecar, a.idle_s)
        result["rss_idle_after_mib"] = round(sidecar.ps.memory_info().rss / MIB, 1)
        result["held_after_idle"] = held(sidecar, fleet)
        result["slopes"] = slopes(sampler.samples, a.warmup_min * 60)
        last = sampler.samples[-1] if sampler.samples else {}
        result["threads_last"], result["fds_last"] = last.get("threads"), last.get("fds")
        result["servers_listed_over_time"] = [(round(s["t"] / 60, 1), s["servers_listed"])
                                              for s in sampler.samples if "servers_listed" in s]
        result["load_avg_end"] = os.getloadavg()
        result["sidecar_log"] = sidecar.log_counts()
        result["samples"] = sampler.samples
        if trace_dir:
            result["heap_growth"] = [heap_growth(trace_dir, i, a.warmup_min * 60)
                                     for i in range(1, sidecar.incarnation + 1)]
    finally:
        sampler.halt.set()
        fleet.stop_all(signal.SIGKILL)
        sidecar.stop()
    return result


def report(r: dict[str, Any]) -> None:
    print("\n== soak:", "steady" if r["args"]["steady"] else "churn", r["args"]["minutes"],
          "min, seed", r["args"]["seed"])
    print("fleet:", json.dumps(r["fleet"]))
    for s in r["slopes"]:
        print(f"sidecar #{s['incarnation']}: {s['stretch_min']} min, RSS {s['rss_first_mib']} -> "
              f"{s['rss_last_mib']} MiB; after {s['warmup_min']} min warm-up: "
              f"{s['slope_mib_per_h']} MiB/h (R² {s['r2']}, {s['samples']} samples)")
    for key in ("held_before_stop", "held_after_stop", "held_after_idle"):
        print(f"{key}: {json.dumps(r[key])}")
    print(f"idle CPU: before {r['idle_cpu_before_pct']} %, after {r['idle_cpu_after_pct']} % of "
          f"a core; RSS idle {r['rss_idle_before_mib']} -> {r['rss_idle_after_mib']} MiB")
    print("servers listed over time (min, rows):", r["servers_listed_over_time"])
    print("sidecar log:", json.dumps(r["sidecar_log"]))
    for i, h in enumerate(r.get("heap_growth") or (), 1):
        if h is None:
            continue
        print(f"heap of sidecar #{i} (tracemalloc), {h['from_s'] / 60:.1f} -> "
              f"{h['to_s'] / 60:.1f} min: {h['heap_first_mib']} MiB, +{h['growth_mib']} MiB "
              f"({h['growth_mib_per_h']} MiB/h); top lines:")
        for x in h["top"]:
            share = "" if x["share"] is None else f", {100 * x['share']:.0f} %"
            print(f"  {x['where']}: {x['kib']:+} KiB, {x['blocks']:+} blocks{share}")
    print("load average: start", [round(x, 2) for x in r["load_avg_start"]], "end",
          [round(x, 2) for x in r["load_avg_end"]])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--traced-sidecar":
        traced_sidecar(sys.argv[2], float(sys.argv[3]), sys.argv[4:])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--agent":
        sock, name, lifetime, seed = sys.argv[2:6]
        return agent_main(sock, name, float(lifetime), int(seed))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=26.0, help="churn (or steady) run length")
    p.add_argument("--steady", type=int, default=0,
                   help="N long-lived servers, no churn, no kill, no sidecar restart")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--names", type=int, default=200, help="server names to draw from")
    p.add_argument("--alive-min", type=int, default=8)
    p.add_argument("--alive-max", type=int, default=12)
    p.add_argument("--life-min", type=float, default=20.0)
    p.add_argument("--life-max", type=float, default=120.0)
    p.add_argument("--kill-share", type=float, default=0.22, help="agents SIGKILLed")
    p.add_argument("--restart-at", type=float, nargs="*", default=[2.0],
                   help="minutes into the churn: a sidecar restart (SIGTERM) at each")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--warmup-min", type=float, default=12.0,
                   help="left out of each incarnation's RSS fit")
    p.add_argument("--idle-s", type=float, default=30.0)
    p.add_argument("--settle-s", type=float, default=10.0,
                   help="before each idle measurement")
    p.add_argument("--tracemalloc", action="store_true",
                   help="the sidecar under tracemalloc: its heap's growth by line (its RSS and "
                        "CPU then are not the daemon's own)")
    p.add_argument("--json", help="write every figure and sample here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    a = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="tw-soak-")
    print(f"work directory: {workdir}", flush=True)
    try:
        r = run(a, workdir)
    finally:
        if not a.keep:
            import shutil
            shutil.rmtree(workdir, ignore_errors=True)
    report(r)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(r, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
