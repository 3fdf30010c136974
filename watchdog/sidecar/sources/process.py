"""Process source: which server pid to watch (pidfile, systemd unit), its liveness and RSS."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from typing import Callable, Optional

import psutil

from torch_watchdog.sidecar.sources.samples import ProcessSample

SYSTEMCTL_TIMEOUT_S = 5.0


def read_host_memory(path: str = "/proc/meminfo") -> tuple[int, int]:
    """(total, available) bytes of the machine. /proc/meminfo's two lines directly: psutil
    parses every field, a third of an idle poll's time (0.17 ms of 0.5 ms)."""
    try:
        with open(path, "rb") as fh:
            text = fh.read()
        total = int(text.split(b"MemTotal:", 1)[1].split(None, 1)[0]) * 1024
        available = int(text.split(b"MemAvailable:", 1)[1].split(None, 1)[0]) * 1024
        return total, available
    except (OSError, IndexError, ValueError):  # not Linux, or a kernel older than 3.14
        vm = psutil.virtual_memory()
        return vm.total, vm.available


def read_processes(pids: set[int],
                   gpu: Optional[dict[int, dict[str, Optional[int]]]] = None
                   ) -> tuple[ProcessSample, ...]:
    """One sample per pid, sorted by pid; vanished or foreign processes never raise."""
    gpu = gpu or {}
    return tuple(_read_one(pid, dict(gpu.get(pid, {}))) for pid in sorted(pids))


def _read_one(pid: int, gpu_bytes: dict[str, Optional[int]]) -> ProcessSample:
    # pid 0 means "the caller's process group" to kill() and psutil reports it as existing
    if pid <= 0 or not psutil.pid_exists(pid):
        return ProcessSample(pid, False, None, gpu_bytes)
    try:
        proc = psutil.Process(pid)
        # a zombie has exited and released its memory; only its parent hasn't reaped it yet
        if proc.status() == psutil.STATUS_ZOMBIE:
            return ProcessSample(pid, False, None, gpu_bytes)
    except psutil.NoSuchProcess:  # also ZombieProcess: it exited between the two calls
        return ProcessSample(pid, False, None, gpu_bytes)
    except psutil.AccessDenied:  # hidepid=/proc or another user's process: it exists
        return ProcessSample(pid, True, None, gpu_bytes)
    return ProcessSample(pid, True, _rss(proc), gpu_bytes)


def _rss(proc: "psutil.Process") -> Optional[int]:
    try:
        return int(proc.memory_info().rss)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def read_pidfile(path: str) -> Optional[int]:
    """The pid on a pidfile's first line; None if the file is missing, unreadable or garbage."""
    try:
        with open(path, encoding="ascii") as f:
            first = f.readline(64).strip()  # bounded: a pidfile is one short line
        pid = int(first)
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    return pid if pid > 0 else None


def unit_main_pid(unit: str, run: Callable[..., "subprocess.CompletedProcess"] = subprocess.run
                  ) -> Optional[int]:
    """The MainPID of a systemd unit; None when it isn't running or systemctl can't tell."""
    try:
        result = run(["systemctl", "show", "-p", "MainPID", "--value", unit],
                     capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):  # no systemctl binary, or it hung (e.g. on D-Bus)
        return None
    if result.returncode != 0:
        return None
    try:
        pid = int((result.stdout or "").strip())
    except ValueError:
        return None
    return pid if pid > 0 else None  # 0: the unit is inactive


def children_of(pid: int) -> list[int]:
    """A server's worker processes (a pidfile's or a unit's main pid forks them); [] when the
    pid is gone or not ours to see."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except (psutil.Error, ValueError):
        return []


CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/systemd")  # v2 (unified), v1 (named)
MAX_CGROUP_PIDS = 65_536  # a unit's processes, read from the kernel; more is not a server


def unit_pids(unit: str, run: Callable[..., "subprocess.CompletedProcess"] = subprocess.run,
              roots: tuple[str, ...] = CGROUP_ROOTS) -> Optional[tuple[int, ...]]:
    """Every process of a systemd unit: the pids in its cgroup (and the cgroups below it, with
    Delegate=yes), which is what systemd itself stops and signals. None when the unit's cgroup
    cannot be read here (no systemd, a container without the cgroup tree): the caller falls
    back to the MainPID and its children. A process that merely claims the unit (an agent's
    hello) is not in it, and a worker that double-forked away from the MainPID still is."""
    try:
        result = run(["systemctl", "show", "-p", "ControlGroup", "--value", unit],
                     capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    group = (result.stdout or "").strip() if result.returncode == 0 else ""
    if not group.startswith("/") or ".." in group.split("/"):
        return None  # inactive (empty), or not a cgroup path
    for root in roots:
        top = os.path.join(root, group.lstrip("/"))
        if not os.path.isfile(os.path.join(top, "cgroup.procs")):
            continue
        pids: set[int] = set()
        for folder, _dirs, files in os.walk(top):
            if "cgroup.procs" not in files:
                continue
            try:
                with open(os.path.join(folder, "cgroup.procs"), encoding="ascii") as f:
                    pids.update(int(line) for line in f if line.strip())
            except (OSError, ValueError):
                return None
            if len(pids) > MAX_CGROUP_PIDS:
                return None
        return tuple(sorted(p for p in pids if p > 0))
    return None


PSS_EVERY_S = 10.0  # smaps_rollup costs ~5 ms for a 400 MB torch process (measured here)


def read_pss(pid: int) -> Optional[int]:
    """The process's PSS from /proc/<pid>/smaps_rollup (Linux >= 4.14); None when unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            text = fh.read(4096)
        return int(text.split(b"\nPss:", 1)[1].split(None, 1)[0]) * 1024
    except (OSError, IndexError, ValueError):
        return None


class PssMeter:
    """PSS for host-memory mode, without paying smaps_rollup every poll: each process's PSS is
    read every `every_s` and carried between reads by its RSS change (the pages it adds or
    frees are its own). RSS counts a forked worker's shared pages again in every worker: 4
    uvicorn workers summed to a server 2x its real footprint."""

    def __init__(self, every_s: float = PSS_EVERY_S, read: Callable[[int], Optional[int]] = read_pss,
                 clock: Callable[[], float] = time.monotonic):
        self.every_s, self.read, self.clock = every_s, read, clock
        self.last: dict[int, tuple[float, int, int]] = {}  # pid -> (read at, pss, rss then)

    def apply(self, processes: tuple[ProcessSample, ...]) -> tuple[ProcessSample, ...]:
        now, out, seen = self.clock(), [], set()
        for p in processes:
            if not p.alive or p.rss_bytes is None:
                out.append(p)
                continue
            seen.add(p.pid)
            entry = self.last.get(p.pid)
            if entry is None or now - entry[0] >= self.every_s:
                pss = self.read(p.pid)
                if pss is None:
                    self.last.pop(p.pid, None)
                    out.append(p)
                    continue
                entry = self.last[p.pid] = (now, pss, p.rss_bytes)
            _, pss, rss_then = entry
            out.append(dataclasses.replace(p, pss_bytes=max(0, pss + p.rss_bytes - rss_then)))
        for pid in self.last.keys() - seen:
            del self.last[pid]
        return tuple(out)
