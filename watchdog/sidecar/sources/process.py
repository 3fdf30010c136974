"""Process source: which server pid to watch (pidfile, systemd unit), its liveness and RSS."""
from __future__ import annotations

import dataclasses
import errno
import math
import os
import select
import subprocess
import time
from typing import Callable, Iterable, NamedTuple, Optional

import psutil

from torch_watchdog.procfs import start_ticks
from torch_watchdog.sidecar.core.observations import ProcessSample

SYSTEMCTL_TIMEOUT_S = 5.0
# A process whose GPU memory NVML gives is metered by that: its RSS (a metric, the status
# page, the sample log) is read this often, its liveness every poll (one poll() over pidfds)
RSS_EVERY_S = 1.0


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

    Each process gets, when its pid is first asked for, a pidfd (readable once the process has
    exited: one poll() a poll says which of them have, zombies included) and its
    /proc/<pid>/statm kept open: a pread() of that is its RSS, far cheaper than psutil's three
    calls. Without pidfds (Linux < 5.3) a kept /proc/<pid>/stat gives both its state and its
    RSS. Both stay bound to the process they were opened for: once it has exited they say so,
    and a pid reused since is opened afresh, so "alive" means that a process has this pid now.
    Where /proc cannot be read (not Linux, hidepid=, another namespace) psutil reads the
    process. A process that NVML meters has its RSS read every `rss_every_s` only, and its
    liveness from the pidfds alone in between.
    """

    def __init__(self, proc: str = "/proc", rss_every_s: float = RSS_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.proc = proc
        self.rss_every_s, self.clock = rss_every_s, clock
        self._rss_due: dict[int, float] = {}            # pid -> when its RSS is read next
        self._out: tuple[ProcessSample, ...] = ()  # the last answer (reused when equal)
        # pid -> (its pidfd, or -1; its statm, or its stat without a pidfd), open
        self._fds: dict[int, tuple[int, int]] = {}
        self._last: dict[int, ProcessSample] = {}       # pid -> its last sample (reused)
        self._meminfo: Optional[int] = None
        self._exits = select.poll() if hasattr(os, "pidfd_open") and \
            hasattr(select, "poll") else None
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
        fds, last, out, due = self._fds, self._last, [], self._rss_due
        exited = {fd for fd, _ in self._exits.poll(0)} if self._exits is not None and fds \
            else set()
        now = self.clock() if gpu else 0.0
        wanted = sorted(pids)
        same = len(wanted) == len(self._out)
        for pid in wanted:
            gpu_bytes = gpu.get(pid) or {}
            prev = last.get(pid)
            entry = fds.get(pid) if gpu_bytes else None
            if entry is not None and entry[0] >= 0 and entry[0] not in exited and \
                    prev is not None and prev.alive and now < due.get(pid, 0.0):
                alive, rss = True, prev.rss_bytes  # alive (its pidfd says), RSS read lately
            else:
                alive, rss = self._stat(pid, exited)
                if gpu_bytes:  # the first read of each spread over the interval
                    due[pid] = now + self.rss_every_s * (1.0 if pid in due else
                                                         (pid % 16 + 1) / 16)
            if prev is None or prev.alive is not alive or prev.rss_bytes != rss \
                    or prev.gpu_bytes != gpu_bytes:
                prev = last[pid] = ProcessSample(pid, alive, rss, dict(gpu_bytes))
                same = False
            out.append(prev)
        if len(fds) > len(wanted) or len(last) > len(wanted) or len(due) > len(wanted):
            keep = set(wanted)
            for pid in [p for p in fds if p not in keep]:
                self._drop(pid)
            for pid in [p for p in last if p not in keep]:
                del last[pid]
            for pid in [p for p in due if p not in keep]:
                del due[pid]
        if same and all(a is b for a, b in zip(out, self._out, strict=False)):
            return self._out  # nothing changed: the same tuple (the step compares it first)
        self._out = tuple(out)
        return self._out

    def host_memory(self) -> tuple[int, int]:
        """(total, available) bytes of the machine: read_host_memory through a descriptor
        kept open."""
        try:
            if self._meminfo is None:
                self._meminfo = os.open(os.path.join(self.proc, "meminfo"),
                                        os.O_RDONLY | os.O_CLOEXEC)
            return _meminfo(os.pread(self._meminfo, 8192, 0))
        except (OSError, IndexError, ValueError):
            return read_host_memory(os.path.join(self.proc, "meminfo"))

    def close(self) -> None:
        for pid in list(self._fds):
            self._drop(pid)
        self._last.clear()
        self._rss_due.clear()
        self._out = ()
        if self._meminfo is not None:
            _close(self._meminfo)
            self._meminfo = None

    def _stat(self, pid: int, exited: set[int]) -> tuple[bool, Optional[int]]:
        # pid 0 means "the caller's process group" to kill() and psutil reports it as existing
        if pid <= 0:
            return False, None
        entry = self._fds.get(pid)
        if entry is not None:
            if entry[0] not in exited:
                try:
                    return self._parse(os.pread(entry[1], 1024, 0), entry[0])
                except (OSError, ValueError, IndexError):  # reaped (ESRCH)
                    pass
            self._drop(pid)  # it has exited: its pid may be another process's now
        return self._open(pid)

    # over the complexity bound: the pidfd and the /proc files, each with its own failure
    def _open(self, pid: int) -> tuple[bool, Optional[int]]:  # noqa: C901
        if not self._page:
            return _read_psutil(pid)
        pidfd = -1
        if self._exits is not None:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError as e:
                if e.errno == errno.ESRCH:    # no such process
                    return False, None
                if e.errno == errno.ENOSYS:   # an older kernel: /proc/<pid>/stat alone
                    self._exits = None
                else:                         # a thread's id (EINVAL), out of descriptors
                    return _read_psutil(pid)
            else:
                if _readable(pidfd):          # exited already: a zombie
                    _close(pidfd)
                    return False, None
        elif not psutil.pid_exists(pid):      # also: not a thread's id
            return False, None
        name = "statm" if pidfd >= 0 else "stat"
        try:
            fd = os.open(f"{self.proc}/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # gone since, or hidden (hidepid=): psutil says which
            if pidfd >= 0:
                _close(pidfd)
            return _read_psutil(pid)
        self._fds[pid] = (pidfd, fd)
        if pidfd >= 0 and self._exits is not None:  # a pidfd: pidfd_open, so poll() too
            self._exits.register(pidfd, select.POLLIN)
        try:
            return self._parse(os.pread(fd, 1024, 0), pidfd)
        except (OSError, ValueError, IndexError):
            self._drop(pid)
            return _read_psutil(pid)

    def _parse(self, data: bytes, pidfd: int) -> tuple[bool, Optional[int]]:
        if pidfd >= 0:  # statm: "size resident shared ..." in pages
            rss = int(data.split(None, 2)[1])
            # no memory at all: it exited (a zombie) since this poll asked the pidfds
            if rss == 0 and _readable(pidfd):
                return False, None
            return True, rss * self._page
        # stat: "pid (comm) S ppid ... rss ...": comm may hold spaces and parentheses, so
        # fields are counted from the last ")"; state is field 3, rss (pages) field 24
        fields = data[data.rindex(b")") + 2:].split(b" ", 22)
        if fields[0] in (b"Z", b"X"):  # a zombie has exited and released its memory; only
            return False, None          # its parent hasn't reaped it yet
        return True, int(fields[21]) * self._page

    def _drop(self, pid: int) -> None:
        pidfd, fd = self._fds.pop(pid)
        if pidfd >= 0:
            if self._exits is not None:
                self._exits.unregister(pidfd)
            _close(pidfd)
        _close(fd)


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


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


def unit_main_pid(unit: str, run: Callable[..., "subprocess.CompletedProcess[str]"] = subprocess.run
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


def unit_pids(unit: str, run: Callable[..., "subprocess.CompletedProcess[str]"] = subprocess.run,
              roots: tuple[str, ...] = CGROUP_ROOTS) -> Optional[tuple[int, ...]]:
    """Every process of a systemd unit: the pids in its cgroup (and the cgroups below it, with
    Delegate=yes), which is what systemd itself stops and signals. None when the unit's cgroup
    cannot be read here (no systemd, a container without the cgroup tree): the caller falls
    back to the MainPID and its children. A process that merely claims the unit (an agent's
    hello) is not in it, and a worker that double-forked away from the MainPID still is."""
    group = unit_cgroup(unit, run)
    if group is None:
        return None
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


def unit_cgroup(unit: str, run: Callable[..., "subprocess.CompletedProcess[str]"] = subprocess.run,
                ) -> Optional[str]:
    """The unit's cgroup path (`/system.slice/llm.service`); None when it is inactive or
    systemctl cannot tell."""
    try:
        result = run(["systemctl", "show", "-p", "ControlGroup", "--value", unit],
                     capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    group = (result.stdout or "").strip() if result.returncode == 0 else ""
    if not group.startswith("/") or ".." in group.split("/"):
        return None  # inactive (empty), or not a cgroup path
    return group


def cgroup_lines(pid: int, proc: str = "/proc") -> Optional[list[tuple[str, str]]]:
    """/proc/<pid>/cgroup as (controllers, path) pairs (`""` for the unified hierarchy's,
    `name=systemd` for v1's named one); None when it cannot be read."""
    try:
        with open(f"{proc}/{pid}/cgroup", "rb") as fh:
            text = fh.read(65536).decode("utf-8", "replace")
    except OSError:
        return None
    return [(parts[1], parts[2]) for parts in (ln.split(":", 2) for ln in text.splitlines())
            if len(parts) == 3]


def in_cgroup(pid: int, group: str, proc: str = "/proc") -> bool:
    """Whether the process is in cgroup `group` or below it, as the kernel says (the unified
    hierarchy's line, or v1's named systemd one)."""
    return any(p == group or p.startswith(group.rstrip("/") + "/")
               for _, p in cgroup_lines(pid, proc) or ())


PSS_EVERY_S = 10.0  # a smaps_rollup read: 4-6 ms a torch process (results/pss_neighbours.md)


def read_pss(pid: int) -> Optional[int]:
    """The process's PSS from /proc/<pid>/smaps_rollup (Linux >= 4.14); None when unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            text = fh.read(4096)
        return int(text.split(b"\nPss:", 1)[1].split(None, 1)[0]) * 1024
    except (OSError, IndexError, ValueError):
        return None


class PssParts(NamedTuple):
    """One read of a process's smaps_rollup, its PSS split by who can share the pages.

    Anonymous pages are shared only across a fork (a master's with its workers: one server's
    processes), so their share (`anon`) moves only as the server's own processes come and go.
    File and shared-memory pages (torch's libraries, an mmapped model) are shared with any
    process on the host that maps them: their share (`mapped`) grows as the host's other
    processes exit, though the server mapped nothing new. `resident` is those pages whole
    (Rss - Anonymous); `started` the process's start (clock ticks: a pid reused is another)."""
    anon: int
    mapped: int
    resident: int
    started: Optional[int] = None


def read_pss_parts(pid: int) -> Optional[PssParts]:
    """The process's PssParts from /proc/<pid>/smaps_rollup; None when unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            text = fh.read(4096)
        started = start_ticks(pid)
    except (OSError, IndexError, ValueError):
        return None
    return parse_smaps_rollup(text, started)


def parse_smaps_rollup(text: bytes, started: Optional[int] = None) -> Optional[PssParts]:
    """A smaps_rollup's PssParts; None without Pss and Rss. A kernel without Pss_Anon (before
    5.3) gives the whole PSS as `mapped` and the RSS as `resident`: all of it held."""
    fields: dict[bytes, int] = {}
    for line in text.split(b"\n")[1:]:
        name, _, rest = line.partition(b":")
        value = rest.split(None, 1)
        if value and value[0].isdigit():
            fields[name] = int(value[0]) * 1024
    if b"Pss" not in fields or b"Rss" not in fields:
        return None
    if b"Pss_Anon" not in fields:
        return PssParts(0, fields[b"Pss"], fields[b"Rss"], started)
    return PssParts(fields[b"Pss_Anon"], fields.get(b"Pss_File", 0) + fields.get(b"Pss_Shmem", 0),
                    max(0, fields[b"Rss"] - fields.get(b"Anonymous", 0)), started)


def read_cgroup_limit(pid: int, root: str = "/sys/fs/cgroup") -> Optional[int]:
    """The memory limit of the process's cgroup and its ancestors (cgroup v2 `memory.max`,
    v1 `memory.limit_in_bytes`), the lowest; None when unlimited or unreadable."""
    lines = cgroup_lines(pid)
    if lines is None:
        return None
    v2 = next((path for controllers, path in lines if controllers == ""), None)
    v1 = next((path for controllers, path in lines if "memory" in controllers.split(",")), None)
    base, path, name = (os.path.join(root, "memory"), v1, "memory.limit_in_bytes") \
        if v1 is not None else (root, v2, "memory.max")
    if path is None:
        return None
    limits, parts = [], [p for p in path.split("/") if p and p != ".."]
    for depth in range(len(parts), -1, -1):
        try:
            with open(os.path.join(base, *parts[:depth], name), "rb") as fh:
                text = fh.read(64).strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1's "unlimited" is ~2^63
            limits.append(int(text))
    return min(limits) if limits else None


class _Held(NamedTuple):
    read_at: float             # when smaps_rollup was read
    base: int                  # the reading then: its anon share and its mapped pages' held
    mapped: int                # of which its file and shared-memory pages' (held)
    resident: int              # those pages whole, then (PssParts.resident)
    rss: int                   # its RSS then (the process reader's)
    started: Optional[int]     # the process's start (a pid reused is another)
    limit: Optional[int]       # its cgroup's memory limit


class PssMeter:
    """A server's own memory for host-memory mode: each process's PSS, with the share of its
    file and shared-memory pages held where the host's other processes exit.

    RSS counts a forked worker's shared pages again in every worker (4 uvicorn workers summed
    to a server 2x its real footprint); PSS splits each page among the processes mapping it.
    But for a file page (torch's libraries) those are any processes on the host: an idle
    server read 566 -> 594 -> 660 MiB as two other servers stopped, its workers' RSS the same,
    and was forecast to OOM in ~1 h 39 min. USS (its private pages) does no better: a library
    page becomes private once the last other process that mapped it exits, and a fork's pages
    are shared, so a preloaded server's workers read a few MiB (benchmarks/pss_neighbours.py).

    So each read of smaps_rollup (PssParts) takes the anonymous pages' share as it is (they
    are shared only across a fork: a server's own processes), and the file and shared-memory
    pages' at most what was held for them: the last read's, plus the pages the process mapped
    since (counted whole), less those it dropped (at their held share). A share that grew
    with the same pages mapped is the host's other processes exiting and is not taken; one that
    fell (a fork of the server's own, another process mapping the same files) is. So a
    neighbour's exit moves no server's reading, and a page the server adds, private or
    mapped, is counted at once; each reading is at most the process's PSS.

    Between reads (every `every_s`) each reading is carried by the process's RSS change (the
    pages it adds or frees are its own). A process that comes or goes changes the others'
    shares of their pages (a fork shares its parent's): then every process is read again:
    carried, a `gunicorn --preload` master's PSS from before its fork counted its shared pages
    whole until its next read (benchmarks/pss_fork.py)."""

    def __init__(self, every_s: float = PSS_EVERY_S,
                 read: Callable[[int], Optional[PssParts]] = read_pss_parts,
                 clock: Callable[[], float] = time.monotonic,
                 limit: Callable[[int], Optional[int]] = read_cgroup_limit):
        self.every_s, self.read, self.clock, self.limit = every_s, read, clock, limit
        self.last: dict[int, _Held] = {}  # pid -> what its last read gave, held
        # the last call's processes, its answer, and its oldest PSS read (None: a read failed,
        # so the next call reads again)
        self._kept: Optional[tuple[tuple[ProcessSample, ...], tuple[ProcessSample, ...],
                                   Optional[float]]] = None
        self._members: frozenset[int] = frozenset()  # the live processes of the last call

    def apply(self, processes: tuple[ProcessSample, ...]) -> tuple[ProcessSample, ...]:
        now = self.clock()
        # the process reader hands back the same tuple when nothing changed: until a PSS
        # read is due, the same answer (no /proc/<pid>/smaps_rollup read)
        kept = self._kept
        if kept is not None and kept[0] is processes and kept[2] is not None and \
                now - kept[2] < self.every_s:
            return kept[1]
        out: list[ProcessSample] = []
        seen: set[int] = set()
        oldest: Optional[float] = math.inf
        members = frozenset(p.pid for p in processes if p.alive and p.rss_bytes is not None)
        changed, self._members = members != self._members, members
        for p in processes:
            if not p.alive or p.rss_bytes is None:
                out.append(p)
                continue
            seen.add(p.pid)
            entry = self.last.get(p.pid)
            if entry is None or changed or now - entry.read_at >= self.every_s:
                got = self._read(p, now, entry)
                if got is None:
                    self.last.pop(p.pid, None)
                    out.append(p)
                    oldest = None
                    continue
                entry = self.last[p.pid] = got
            if oldest is not None and entry.read_at < oldest:
                oldest = entry.read_at
            out.append(dataclasses.replace(
                p, pss_bytes=max(0, entry.base + p.rss_bytes - entry.rss),
                mem_limit_bytes=entry.limit))
        for pid in self.last.keys() - seen:
            del self.last[pid]
        answer = tuple(out)
        self._kept = (processes, answer, oldest)
        return answer

    def _read(self, p: ProcessSample, now: float, held: Optional[_Held]) -> Optional[_Held]:
        assert p.rss_bytes is not None  # only live processes with an RSS are read
        parts = self.read(p.pid)
        if parts is None:
            return None
        mapped = parts.mapped
        if held is not None and held.started == parts.started:
            grown = parts.resident - held.resident
            mapped = min(mapped, held.mapped + grown if grown >= 0 else
                         held.mapped * parts.resident // max(held.resident, 1))
        return _Held(now, parts.anon + mapped, mapped, parts.resident, p.rss_bytes,
                     parts.started, self.limit(p.pid))
