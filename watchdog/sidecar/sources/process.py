"""Process source: which server pid to watch (pidfile, systemd unit), its liveness and RSS."""
from __future__ import annotations

import os
import subprocess
from typing import Callable, Iterable, Optional

import psutil

from torch_watchdog.sidecar.sources.samples import ProcessSample

SYSTEMCTL_TIMEOUT_S = 5.0


def read_host_memory(path: str = "/proc/meminfo") -> tuple[int, int]:
    """(total, available) bytes of the machine. /proc/meminfo's two lines directly: psutil
    parses every field, a third of an idle poll's time (0.17 ms of 0.5 ms)."""
    try:
        with open(path, "rb") as fh:
            return _meminfo(fh.read())
    except (OSError, IndexError, ValueError):  # not Linux, or a kernel older than 3.14
        vm = psutil.virtual_memory()
        return vm.total, vm.available


def _meminfo(text: bytes) -> tuple[int, int]:
    total = int(text.split(b"MemTotal:", 1)[1].split(None, 1)[0]) * 1024
    available = int(text.split(b"MemAvailable:", 1)[1].split(None, 1)[0]) * 1024
    return total, available


def read_processes(pids: set[int],
                   gpu: Optional[dict[int, dict[str, Optional[int]]]] = None
                   ) -> tuple[ProcessSample, ...]:
    """One sample per pid, sorted by pid; vanished or foreign processes never raise. One-shot:
    the daemon keeps a ProcessReader, which holds the files open from poll to poll."""
    reader = ProcessReader()
    try:
        return reader.read(pids, gpu)
    finally:
        reader.close()


class ProcessReader:
    """The watched processes' liveness and RSS, and the host's memory, once per poll.

    Each process is one pread() of its /proc/<pid>/stat, through a descriptor opened when the
    pid is first asked for and kept while it is: its state (a zombie has exited) and its RSS
    in one read. psutil took three calls and ~50 us per process (pid_exists, status,
    memory_info: 5.5x the poll's cost with 8 servers, benchmarks/host_scale.py); the pread is
    ~2-4 us. A descriptor of /proc/<pid>/ stays bound to the process it was opened for: once
    that process is reaped its reads fail (ESRCH), and a pid reused since is opened afresh, so
    "alive" means, as before, that a process has this pid now. Where /proc cannot be read (not
    Linux, hidepid=, another namespace) the process is read through psutil as before.
    """

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self._fds: dict[int, int] = {}                  # pid -> its stat file, open
        self._last: dict[int, ProcessSample] = {}       # pid -> its last sample (reused)
        self._meminfo: Optional[int] = None
        try:
            self._page = os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            self._page = 0                              # no /proc reads: psutil for all

    def read(self, pids: Iterable[int],
             gpu: Optional[dict[int, dict[str, Optional[int]]]] = None
             ) -> tuple[ProcessSample, ...]:
        """One sample per pid, sorted by pid; vanished or foreign processes never raise. A
        process whose numbers did not change gets its last sample back (frozen): a poll
        allocates nothing for it."""
        gpu = gpu or {}
        fds, last, out = self._fds, self._last, []
        wanted = sorted(pids)
        for pid in wanted:
            alive, rss = self._stat(pid)
            gpu_bytes = gpu.get(pid) or {}
            prev = last.get(pid)
            if prev is None or prev.alive is not alive or prev.rss_bytes != rss \
                    or prev.gpu_bytes != gpu_bytes:
                prev = last[pid] = ProcessSample(pid, alive, rss, dict(gpu_bytes))
            out.append(prev)
        if len(fds) > len(wanted) or len(last) > len(wanted):
            keep = set(wanted)
            for pid in [p for p in fds if p not in keep]:
                _close(fds.pop(pid))
            for pid in [p for p in last if p not in keep]:
                del last[pid]
        return tuple(out)

    def host_memory(self) -> tuple[int, int]:
        """(total, available) bytes of the machine: read_host_memory through a descriptor
        kept open (4 us a poll instead of 11)."""
        try:
            if self._meminfo is None:
                self._meminfo = os.open(os.path.join(self.proc, "meminfo"), os.O_RDONLY)
            return _meminfo(os.pread(self._meminfo, 8192, 0))
        except (OSError, IndexError, ValueError):
            return read_host_memory(os.path.join(self.proc, "meminfo"))

    def close(self) -> None:
        for fd in self._fds.values():
            _close(fd)
        self._fds.clear()
        self._last.clear()
        if self._meminfo is not None:
            _close(self._meminfo)
            self._meminfo = None

    def _stat(self, pid: int) -> tuple[bool, Optional[int]]:
        # pid 0 means "the caller's process group" to kill() and psutil reports it as existing
        if pid <= 0:
            return False, None
        fd = self._fds.get(pid)
        if fd is not None:
            try:
                return self._parse(os.pread(fd, 1024, 0))
            except (OSError, ValueError, IndexError):  # reaped (ESRCH): its pid may be reused
                _close(self._fds.pop(pid))
        if not self._page or not psutil.pid_exists(pid):  # also: not a thread's id
            return _read_psutil(pid)
        try:
            fd = os.open(f"{self.proc}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # gone since, or hidden (hidepid=): psutil says which
            return _read_psutil(pid)
        try:
            result = self._parse(os.pread(fd, 1024, 0))
        except (OSError, ValueError, IndexError):
            _close(fd)
            return _read_psutil(pid)
        self._fds[pid] = fd
        return result

    def _parse(self, stat: bytes) -> tuple[bool, Optional[int]]:
        # "pid (comm) S ppid ... rss ...": comm may hold spaces and parentheses, so fields are
        # counted from the last ")"; state is field 3, rss (pages) field 24 (proc(5))
        fields = stat[stat.rindex(b")") + 2:].split(b" ", 22)
        if fields[0] in (b"Z", b"X"):  # a zombie has exited and released its memory; only
            return False, None          # its parent hasn't reaped it yet
        return True, int(fields[21]) * self._page


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _read_psutil(pid: int) -> tuple[bool, Optional[int]]:
    # pid 0 means "the caller's process group" to kill() and psutil reports it as existing
    if pid <= 0 or not psutil.pid_exists(pid):
        return False, None
    try:
        proc = psutil.Process(pid)
        # a zombie has exited and released its memory; only its parent hasn't reaped it yet
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False, None
    except psutil.NoSuchProcess:  # also ZombieProcess: it exited between the two calls
        return False, None
    except psutil.AccessDenied:  # hidepid=/proc or another user's process: it exists
        return True, None
    return True, _rss(proc)


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
