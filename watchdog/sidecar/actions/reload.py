"""Graceful reload executors, and the record of reloads that survives a sidecar restart.

Executors (config `reload.method`):
- `signal`: SIGTERM to the server's processes, SIGKILL to those still alive after `grace_s`;
  a pid is signalled only if it is still the process that was seen (pid reuse, below). A master
  among them (the parent of the server's agents) is left running: it replaces its workers,
  keeps the listening socket, and a master signalled with its workers stops for good
  (`gunicorn --preload`: 285 of 300 requests refused, on main);
- `rolling`: a master's workers one at a time: SIGTERM one, and the next only once its
  replacement's agent said hello (`hello_timeout_s` each, else stop: a failed reload);
- `master-hup`: SIGHUP to the master (gunicorn and uvicorn --workers replace their workers),
  then every old worker gone and as many new ones said hello;
- `systemd`: `systemctl restart UNIT` — stop, then start: a HUP-style overlap would hold the
  model twice on the GPU (ops-anchors §4.1);
- `http`: POST to the server's own drain/reload hook;
- `command`: run a command;
- `evict`: evict the sidecar's own pod through the Kubernetes Eviction API (evict.py);
- `agent`: ask the server's agents to drain and exit over the control socket
  (actions/control.py, agent/drain.py); their supervisor starts the server again.
After any method but `evict` (the sidecar goes with its pod), a reload succeeded only once a
new process of the server said hello within `hello_timeout_s` (else `ReloadOutcome.failed`: the
`reload_failed` outcome, not `reload_ok`; 0 skips the check, for a server without the agent);
the hellos come from the daemon's loop through `Hellos`. One reload runs at a time, on a
thread, so the poll loop keeps going. Each decision is written to `<state_dir>/reloads.json`
*before* it is carried out, and marked when its execution starts (`ReloadLog.executing`), so a
sidecar that restarts mid-reload does not reload again (the cooldown and the hourly maximum
count it), while a decision it never got to carry out does not hold the next reload back for a
whole cooldown.

The record is the reload guard rail's memory, so a record that cannot be trusted fails
closed: a file that cannot be read or has the wrong shape is reported (`ReloadLog.unreadable`)
and the hourly maximum counts as reached for an hour from the sidecar's start (on main, 7 of
8 corrupt variants silently emptied the history and allowed a 4th reload inside the hour).
"""
from __future__ import annotations

import collections
import json
import math
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

import psutil

from torch_watchdog import durable
from torch_watchdog.sidecar.core.observations import ReloadOutcome


# A pid's start time read twice for the same process differs by rounding (clock ticks, 10 ms)
# and by a step of the wall clock in between; a reused pid starts later by far more than this.
START_SLACK_S = 0.5


def process_start_time(pid: int) -> Optional[float]:
    """When `pid` started, wall-clock seconds, to a clock tick (10 ms); None when there is no
    such process. psutil's create_time() adds /proc/stat's btime, whole seconds: up to 1 s
    early (measured: 0.53 s here), enough for a pid reused within that second to look older
    than the decision. The process's age on the boot clock, both read now, is exact."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / _CLK_TCK
        return time.time() - age
    except (OSError, IndexError, ValueError, AttributeError):  # not Linux, or gone
        try:
            return psutil.Process(pid).create_time()
        except psutil.Error:
            return None


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def refusal(pid: int, decided_t: Optional[float] = None,
            expected_start: Optional[float] = None) -> Optional[str]:
    """Why `pid` must not be signalled, or None. Never pid <= 1 (init; 0 and -1 are process
    groups to kill(2)), the sidecar or its parent; never a process that started after the
    decision (`decided_t`, wall-clock time) or at another time than the one seen
    (`expected_start`, `process_start_time` when the pid was seen): the server exited and its
    pid was reused."""
    if pid <= 1:
        return f"pid {pid}: never signalled"
    if pid == os.getpid():
        return f"pid {pid}: the sidecar itself"
    if pid == os.getppid():
        return f"pid {pid}: the sidecar's parent"
    if decided_t is None and expected_start is None:
        return None
    created = process_start_time(pid)
    if created is None:
        return None  # gone: nothing to signal, signal_processes finds out
    if expected_start is not None and abs(created - expected_start) > START_SLACK_S:
        return (f"pid {pid}: started at {created:.2f}, not the server seen (started at "
                f"{expected_start:.2f}): pid reused")
    if decided_t is not None and created > decided_t:
        return (f"pid {pid}: started {created - decided_t:.1f} s after the reload decision: "
                f"pid reused")
    return None


def signal_processes(pids: set[int], grace_s: float, decided_t: Optional[float] = None,
                     expected_start: Optional[Mapping[int, float]] = None,
                     hellos: Optional["Hellos"] = None) -> ReloadOutcome:
    """SIGTERM `pids`, SIGKILL those alive after `grace_s`. `decided_t` (the decision's
    wall-clock time) and `expected_start` (pid -> `process_start_time` when the pid was seen)
    let it refuse a reused pid (`refusal`). A master among `pids` (`master_and_workers`, from
    the agents' `hellos`) is not signalled: its workers are, and it replaces them."""
    started = time.monotonic()
    kept = ""
    if hellos is not None:
        master, workers = master_and_workers(pids, hellos)
        if master in pids and workers:
            pids = set(pids) - {master}
            kept = f"; master {master} not signalled (it replaces its workers)"
    procs, refused = [], []
    for pid in sorted(pids):
        why = refusal(pid, decided_t, (expected_start or {}).get(pid))
        if why is not None:
            refused.append(why)
            continue
        try:
            # psutil remembers this process's start time: send_signal() and kill() below
            # refuse (NoSuchProcess) a pid reused in the meantime
            p = psutil.Process(pid)
            p.send_signal(signal.SIGTERM)
            procs.append(p)
        except psutil.Error:
            continue
    skipped = kept + (f"; refused {'; '.join(refused)}" if refused else "")
    if not procs:
        return ReloadOutcome(False, "no server process to signal" + skipped,
                       time.monotonic() - started)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    took = time.monotonic() - started
    if alive:
        return ReloadOutcome(True, f"SIGKILL after {grace_s:.0f} s: {len(alive)} process(es) "
                             f"ignored SIGTERM{skipped}", took)
    return ReloadOutcome(True, "exited after SIGTERM" + skipped, took)


def run_command(argv: list[str], timeout_s: float) -> ReloadOutcome:
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as e:
        return ReloadOutcome(False, f"{argv[0]}: {e}", time.monotonic() - started)
    detail = (done.stderr or done.stdout).strip()[-300:]
    return ReloadOutcome(done.returncode == 0, f"exit {done.returncode}" + (f": {detail}" if detail
                                                                       else ""),
                   time.monotonic() - started)


def post_hook(url: str, timeout_s: float) -> ReloadOutcome:
    started = time.monotonic()
    req = urllib.request.Request(url, data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return ReloadOutcome(True, f"HTTP {resp.status}", time.monotonic() - started)
    except urllib.error.HTTPError as e:
        return ReloadOutcome(False, f"HTTP {e.code}", time.monotonic() - started)
    except OSError as e:
        return ReloadOutcome(False, f"{type(e).__name__}: {e}", time.monotonic() - started)


# -- the agents' hellos, and masters with workers ----------------------------------------------
@dataclass(frozen=True)
class Heard:
    """A hello as the sidecar received it; `seq` orders arrivals."""
    seq: int
    pid: int
    ppid: Optional[int]
    server: Optional[str]


class Hellos:
    """The agents' hellos, fed by the daemon's loop each poll, read by a reload's thread: who
    said hello (a worker has an agent; a master's other children, inductor's compile workers
    or multiprocessing's resource tracker, have none) and who said it since a reload began.
    Bounded: the last `keep` hellos and the latest of `keep` pids."""

    def __init__(self, keep: int = 4096):
        self._cond = threading.Condition()
        self._seq = 0
        self._keep = keep
        self._recent: collections.deque = collections.deque(maxlen=keep)
        self._last: dict[int, Heard] = {}

    def add(self, hellos: Iterable) -> None:
        hellos = list(hellos)
        if not hellos:
            return
        with self._cond:
            for h in hellos:
                self._seq += 1
                heard = Heard(self._seq, h.pid, h.ppid if isinstance(h.ppid, int) else None,
                              h.server if isinstance(h.server, str) else None)
                self._recent.append(heard)
                self._last.pop(h.pid, None)
                self._last[h.pid] = heard
                if len(self._last) > self._keep:
                    del self._last[next(iter(self._last))]
            self._cond.notify_all()

    def mark(self) -> int:
        with self._cond:
            return self._seq

    def heard(self, pid: int) -> Optional[Heard]:
        with self._cond:
            return self._last.get(pid)

    def since(self, mark: int) -> list[Heard]:
        with self._cond:
            return [h for h in self._recent if h.seq > mark]

    def wait_for(self, match: Callable[[Heard], bool], mark: int, timeout: float,
                 give_up: Callable[[], bool] = lambda: False) -> Optional[Heard]:
        """The first hello after `mark` that `match`es, waiting up to `timeout` seconds for it;
        None on time out or once `give_up()` (checked every 0.2 s)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = next((h for h in self._recent if h.seq > mark and match(h)), None)
                left = deadline - time.monotonic()
                if found is not None or left <= 0 or give_up():
                    return found
                self._cond.wait(min(left, 0.2))


def parent_of(pid: int) -> Optional[int]:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def master_and_workers(pids: set[int], hellos: Hellos) -> tuple[Optional[int], list[int]]:
    """The server's master and its workers. Workers are processes among `pids` whose agents
    said hello and whose parent (read now) is the master: one process among `pids`
    (`gunicorn --preload`, or a configured unit or pidfile whose main pid is the master), else
    the common parent of two or more of them (uvicorn --workers, gunicorn without --preload: a
    master without the agent; one worker alone cannot be told from a shell that started one
    server). (None, []) for a single process, even with children of its own (inductor's
    compile workers say no hello), and when it is ambiguous (parents at several levels)."""
    agents = {pid: parent_of(pid) for pid in pids if hellos.heard(pid) is not None}
    agents = {pid: pp for pid, pp in agents.items() if pp is not None and pp > 1}
    inside = {pp for pp in agents.values() if pp in pids}
    if len(inside) == 1:
        master = inside.pop()
    elif not inside and len(agents) >= 2 and len(set(agents.values())) == 1:
        master = next(iter(agents.values()))
    else:
        return None, []
    return master, sorted(pid for pid, pp in agents.items() if pp == master)


def _signal(pid: int, sig: int) -> Optional[psutil.Process]:
    try:
        p = psutil.Process(pid)
        p.send_signal(sig)
        return p
    except psutil.Error:
        return None


def _gone(p: psutil.Process) -> bool:
    """Exited (a zombie its master has not reaped yet counts as exited)."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _wait_gone(p: psutil.Process, timeout: float) -> bool:
    """Whether `p` exited within `timeout`. A worker is its master's child, not ours: psutil's
    wait sees it alive until the master reaps it, and a busy master (uvicorn's supervisor
    pinging a starting worker) can take seconds to."""
    deadline = time.monotonic() + timeout
    while not _gone(p):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _no_master(method: str, pids: set[int]) -> str:
    return (f"{method}: no master with workers among pids {sorted(pids)} (workers are known from "
            f"their agents' hellos, re-sent every 30 s; a single worker needs its master in "
            f"server.unit or server.pidfile): not carried out")


def rolling(pids: set[int], grace_s: float, hello_timeout_s: float, hellos: Hellos,
            decided_t: Optional[float] = None,
            expected_start: Optional[Mapping[int, float]] = None) -> ReloadOutcome:
    """The master's workers one at a time: SIGTERM (SIGKILL after `grace_s`), the master forks
    a replacement, and the next worker only once the replacement's agent said hello (its ppid
    the master). No hello within `hello_timeout_s`: stop, the other workers still serving, and
    report the reload failed."""
    started = time.monotonic()
    master, workers = master_and_workers(pids, hellos)
    if master is None:
        return ReloadOutcome(False, _no_master("rolling", pids), time.monotonic() - started)
    expected = expected_start or {}
    why = refusal(master, decided_t, expected.get(master))
    if why is not None:
        return ReloadOutcome(False, f"rolling: master {why}: not carried out",
                       time.monotonic() - started)
    old, done = set(pids) | set(workers), []
    for i, pid in enumerate(workers, 1):
        where = f"rolling: worker {pid} ({i} of {len(workers)}, master {master})"
        why = refusal(pid, decided_t, expected.get(pid))
        if why is not None:
            return ReloadOutcome(False, f"{where}: refused {why}", time.monotonic() - started,
                           failed=bool(done))
        mark = hellos.mark()
        p = _signal(pid, signal.SIGTERM)
        killed = ""
        if p is not None and not _wait_gone(p, grace_s):
            try:
                p.kill()
                killed = f" (SIGKILL after {grace_s:g} s)"
            except psutil.Error:
                pass
            _wait_gone(p, 5)
        new = hellos.wait_for(lambda h: h.pid not in old and h.ppid == master, mark,
                              hello_timeout_s, give_up=lambda: not psutil.pid_exists(master))
        if new is None:
            gone = "the master exited" if not psutil.pid_exists(master) else \
                f"no hello from its replacement within {hello_timeout_s:g} s"
            return ReloadOutcome(False, f"{where} stopped{killed}, {gone}; the next workers were "
                                  f"left running", time.monotonic() - started, failed=True)
        old.add(new.pid)
        done.append(f"{pid}->{new.pid}{killed}")
    return ReloadOutcome(True, f"rolling: {len(workers)} workers of master {master} replaced one at a "
                         f"time, each replacement said hello ({', '.join(done)})",
                   time.monotonic() - started)


def master_hup(pids: set[int], grace_s: float, hello_timeout_s: float, hellos: Hellos,
               decided_t: Optional[float] = None,
               expected_start: Optional[Mapping[int, float]] = None) -> ReloadOutcome:
    """SIGHUP to the master, which replaces its workers its own way (gunicorn: starts new ones
    and stops the old at once; uvicorn >= 0.54: one at a time, each replacement ready before
    the old one stops). Done when every old worker has exited and as many new children of the
    master are alive and said hello; failed when that makes no progress (a hello or an exit)
    for `hello_timeout_s` + `grace_s`. Stragglers are the master's to stop: not killed."""
    started = time.monotonic()
    master, workers = master_and_workers(pids, hellos)
    if master is None:
        return ReloadOutcome(False, _no_master("master-hup", pids), time.monotonic() - started)
    why = refusal(master, decided_t, (expected_start or {}).get(master))
    if why is not None:
        return ReloadOutcome(False, f"master-hup: master {why}: not carried out",
                       time.monotonic() - started)
    old = set(pids) | set(workers)
    procs = [p for p in (_try_process(w) for w in workers) if p is not None]
    mark = hellos.mark()
    if _signal(master, signal.SIGHUP) is None:
        return ReloadOutcome(False, f"master-hup: master {master} is gone: not carried out",
                       time.monotonic() - started)
    stall = hello_timeout_s + grace_s
    deadline, progress = time.monotonic() + stall, None
    while True:
        new = sorted({h.pid for h in hellos.since(mark)
                      if h.pid not in old and h.ppid == master and psutil.pid_exists(h.pid)})
        left = [p.pid for p in procs if not _gone(p)]
        if len(new) >= len(workers) and not left:
            return ReloadOutcome(True, f"master-hup: master {master} replaced its {len(workers)} "
                                 f"workers {workers} by {new}, each said hello",
                           time.monotonic() - started)
        if (len(new), len(left)) != progress:
            progress, deadline = (len(new), len(left)), time.monotonic() + stall
        if time.monotonic() >= deadline or not psutil.pid_exists(master):
            what = "the master exited" if not psutil.pid_exists(master) else \
                f"no progress for {stall:g} s"
            return ReloadOutcome(False, f"master-hup: {what}: {len(new)} of {len(workers)} new "
                                  f"workers said hello, old workers {left} still running",
                           time.monotonic() - started, failed=True)
        hellos.wait_for(lambda h: False, hellos.mark(), 0.2)  # wakes early on a hello


def _try_process(pid: int) -> Optional[psutil.Process]:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def back_after(run: Callable[[set[int]], ReloadOutcome], hellos: Optional[Hellos],
               timeout_s: float) -> Callable[[set[int]], ReloadOutcome]:
    """`run`, then wait up to `timeout_s` for a new process of the server to say hello: its
    pid new, and its server name one the old processes' agents gave, or its parent one of the
    old processes or their parent (a supervisor: systemd, a shell loop, a master). No hello in
    time: the reload failed (the server did not come back). `hellos` None or `timeout_s` 0:
    `run` alone."""
    if hellos is None or timeout_s <= 0:
        return run

    def reload_and_wait(pids: set[int]) -> ReloadOutcome:
        started = time.monotonic()
        mark = hellos.mark()
        names = {h.server for h in map(hellos.heard, pids) if h is not None and h.server}
        near = set(pids) | {pp for pp in map(parent_of, pids) if pp is not None and pp > 1}
        near.discard(os.getpid())
        done = run(pids)
        if not done.ok:
            return done
        new = hellos.wait_for(lambda h: h.pid not in pids and (h.server in names or
                                                                h.ppid in near),
                              mark, timeout_s)
        took = time.monotonic() - started
        if new is None:
            return ReloadOutcome(False, f"{done.detail}; no hello from a new process of the server "
                                  f"within {timeout_s:g} s", took, failed=True)
        return ReloadOutcome(True, f"{done.detail}; back: pid {new.pid} said hello", took)

    return reload_and_wait


def executor(cfg, unit: Optional[str], decided_t: Optional[float] = None,
             expected_start: Optional[Mapping[int, float]] = None,
             hellos: Optional[Hellos] = None, control=None,
             ) -> Optional[Callable[[set[int]], ReloadOutcome]]:
    """The configured way to reload, as a function of the server's pids; None for "none".
    `decided_t` and `expected_start`: see `signal_processes`; `hellos`: the agents' hellos,
    for masters and workers and for the server coming back (`back_after`); `control`: the
    ControlServer (method agent)."""
    wait = getattr(cfg, "hello_timeout_s", 0.0)
    if cfg.method in ("rolling", "master-hup"):
        how = rolling if cfg.method == "rolling" else master_hup
        board = hellos if hellos is not None else Hellos()
        return lambda pids: how(pids, cfg.grace_s, wait or DEFAULT_HELLO_TIMEOUT_S, board,
                                decided_t, expected_start)
    if cfg.method == "agent":
        if control is None:
            return lambda pids: ReloadOutcome(False, "the control socket is not open", 0.0)
        return back_after(lambda pids: control.drain(pids, cfg.grace_s, decided_t), hellos,
                          wait)
    if cfg.method == "signal":
        run = lambda pids: signal_processes(pids, cfg.grace_s, decided_t, expected_start,
                                            hellos)
    elif cfg.method == "systemd":
        run = lambda pids: run_command(["systemctl", "restart", cfg.unit or unit],
                                       cfg.timeout_s)
    elif cfg.method == "http":
        run = lambda pids: post_hook(cfg.url, cfg.timeout_s)
    elif cfg.method == "command":
        run = lambda pids: run_command(list(cfg.command), cfg.timeout_s)
    elif cfg.method == "evict":  # Kubernetes fleet mode: the pod's own eviction (evict.py);
        from torch_watchdog.sidecar.actions import evict  # this sidecar goes with the pod
        return evict.executor(cfg.timeout_s)
    else:
        return None
    return back_after(run, hellos, wait)


DEFAULT_HELLO_TIMEOUT_S = 120.0
CANCELLED = "cancelled: the forecast cleared"
NOT_CARRIED_OUT = "not carried out: the sidecar stopped before acting"
OUTCOME_UNKNOWN = "outcome unknown: the sidecar stopped while acting"
FUTURE_SLACK_S = 60.0       # a decision time further ahead of the clock than this is clamped
MAX_FILE_BYTES = 1 << 20    # 100 entries are ~20 KiB; a bigger file is not ours
TEMP_PREFIX = ".reloads."     # a write in progress: <state_dir>/.reloads.XXXXXXXX
BLOCK_ENTRIES = 100         # stand-ins when the caller does not say its max_reloads_per_hour


class ReloadLog:
    """`reloads.json` in the state directory: every reload decision and how it ended.

    Read at start (`now`: the sidecar's clock then). What is found there:
    - missing: a new record;
    - unreadable or of the wrong shape (not JSON, not {"reloads": [...]}, an entry whose `t`
      is not a finite number, `server` not a string or null, `ok` not true/false/null, a
      directory, no permission): `unreadable` and `error` say why, and `decisions()` adds
      `max_per_hour` decisions at `now` for every server, so no reload happens for an hour
      from the start (or until the file is removed and the sidecar restarted). The bad file
      is kept, renamed `<path>.unreadable`, when a later decision is written;
    - a decision time more than 60 s ahead of `now`: clamped to `now` (a clock set back, or
      a hand edit, would otherwise block reloads for good), reported in `repairs`;
    - a decision with no outcome (ok null): the sidecar stopped before the outcome. Not
      marked `executing`: it stopped between deciding and acting; the decision is marked
      `NOT_CARRIED_OUT` and counts for neither the cooldown nor the hourly maximum (it did
      nothing, and the server grows on). Marked `executing`: the server may have been
      signalled or restarted; marked `OUTCOME_UNKNOWN`, it still counts. Both are reported
      in `repairs`.
    Repairs are written back at once.
    """

    def __init__(self, path: str, now: Optional[float] = None,
                 max_per_hour: Optional[int] = None):
        self.path = path
        self.started = time.time() if now is None else now
        self.error: Optional[str] = None         # the last read or write failure
        self.unreadable: Optional[str] = None    # why the record found at start is not used
        self.repairs: list[str] = []             # what was changed in it at start
        self._blocks = BLOCK_ENTRIES if max_per_hour is None else max(max_per_hour, 0)
        self.entries: list[dict] = []
        self._remove_torn_writes()
        try:
            self.entries = self._read()
        except _Unreadable as e:
            self.unreadable = self.error = (
                f"{self.path}: {e}; reloads are suspended for an hour (until "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started + 3600))}"
                f") — remove the file and restart the sidecar to lift this")
            return
        self._repair()

    # -- reading ------------------------------------------------------------------------------
    def _remove_torn_writes(self) -> None:
        """A sidecar killed between the temporary file's creation and its rename leaves it
        behind (the record itself is whole): one per kill, so remove them at start."""
        directory = os.path.dirname(self.path) or "."
        try:
            names = [n for n in os.listdir(directory) if n.startswith(TEMP_PREFIX)]
        except OSError:
            return
        for name in names:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass

    def _read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as fh:
                raw = fh.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise _Unreadable(f"cannot read it ({e.strerror or e})") from e
        if len(raw) > MAX_FILE_BYTES:
            raise _Unreadable(f"over {MAX_FILE_BYTES} bytes")
        if not raw.strip():
            raise _Unreadable("empty (a reload record is never written empty)")
        try:
            data = json.loads(raw.decode("utf-8"))
        except ValueError as e:  # UnicodeDecodeError is one
            raise _Unreadable(f"not JSON ({e})") from e
        if not isinstance(data, dict) or not isinstance(data.get("reloads"), list):
            raise _Unreadable('not {"reloads": [...]}')
        for i, e in enumerate(data["reloads"]):
            why = _entry_problem(e)
            if why:
                raise _Unreadable(f"reloads[{i}]: {why}")
        return data["reloads"]

    def _repair(self) -> None:
        changed = False
        for e in self.entries:
            if e["t"] > self.started + FUTURE_SLACK_S:
                self.repairs.append(f"decision time {e['t']:.0f} is {e['t'] - self.started:.0f}"
                                    f" s in the future: clamped to now")
                e["t"] = self.started
                changed = True
            if e["ok"] is None and e["t"] <= self.started:
                if e.get("executing") is not None:
                    self.repairs.append(f"decision at {e['t']:.0f} (server {e.get('server')}): "
                                        f"the sidecar stopped while carrying it out: counted")
                    e.update(ok=False, detail=OUTCOME_UNKNOWN, seconds=0.0)
                else:
                    self.repairs.append(f"decision at {e['t']:.0f} (server {e.get('server')}) "
                                        f"was never carried out: not counted")
                    e.update(ok=False, detail=NOT_CARRIED_OUT, seconds=0.0)
                changed = True
        if changed:
            self._save()

    # -- what counts --------------------------------------------------------------------------
    def decisions(self) -> list[tuple[float, Optional[str]]]:
        """(when, which server) reloads were decided, for the cooldown and the hourly maximum
        (per server; entries older than servers count for every server); a decision cancelled
        at the re-check, never carried out, or refused for now (retry_after_s), did nothing
        and counts for neither. An
        unreadable record counts as the hourly maximum reached at start, for every server."""
        out = [(e["t"], e.get("server") if isinstance(e.get("server"), str) else None)
               for e in self.entries if e.get("detail") not in (CANCELLED, NOT_CARRIED_OUT)
               and e.get("retry_after_s") is None]  # refused for now: not a reload
        if self.unreadable is not None:
            out += [(self.started, None)] * self._blocks
        return out

    def times(self) -> list[float]:
        return [t for t, _ in self.decisions()]

    # -- writing ------------------------------------------------------------------------------
    def record(self, t: float, outcome: Optional[ReloadOutcome], reason: str,
               server: Optional[str] = None) -> None:
        entry = {"t": t, "reason": reason, "server": server,
                 **(_outcome_entry(outcome) if outcome else {"ok": None})}
        same = [i for i, e in enumerate(self.entries) if e["t"] == t and e.get("server") == server]
        if same:
            self.entries[same[-1]] = entry  # the outcome of the decision recorded before
        else:
            self.entries.append(entry)
        self.entries = self.entries[-100:]
        self._save()

    def executing(self, t: float, server: Optional[str] = None,
                  now: Optional[float] = None) -> None:
        """The decision taken at `t` is being carried out now: if the sidecar stops before
        its outcome, the next start still counts it (the server may be restarting)."""
        for e in reversed(self.entries):
            if e["t"] == t and e.get("server") == server and e["ok"] is None:
                e["executing"] = time.time() if now is None else now
                self._save()
                return

    def _save(self) -> None:
        try:
            if self.unreadable is not None and os.path.isfile(self.path):
                os.replace(self.path, self.path + ".unreadable")  # kept for the post-mortem
            self._write()
            self.error = None
        except OSError as e:  # kept in memory; the daemon logs it and goes on
            self.error = f"{self.path}: {e.strerror or e}"

    def _write(self) -> None:
        """Atomic and durable: a crash or power loss leaves the old file or the new one,
        never a truncated one (the rename is made durable by the directory's fsync)."""
        durable.write_atomic(self.path, json.dumps({"reloads": self.entries}, indent=1,
                                                   allow_nan=False).encode(),
                             prefix=TEMP_PREFIX)


class _Unreadable(Exception):
    pass


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _entry_problem(e: object) -> Optional[str]:
    """Why one entry of reloads.json is not one this module wrote, or None."""
    if not isinstance(e, dict):
        return f"not an object: {e!r:.40}"
    if not _finite(e.get("t")):
        return f"t must be a finite number, got {e.get('t')!r:.40}"
    if not isinstance(e.get("server"), (str, type(None))):
        return f"server must be a string or null, got {e.get('server')!r:.40}"
    if "ok" not in e or not isinstance(e["ok"], (bool, type(None))):
        return f"ok must be true, false or null, got {e.get('ok', '(missing)')!r:.40}"
    if not isinstance(e.get("detail"), (str, type(None))):
        return f"detail must be a string, got {e.get('detail')!r:.40}"
    return None


class Reloader:
    """Runs one reload at a time on a thread; `poll()` returns the finished outcome once."""

    def __init__(self, run: Callable[[set[int]], ReloadOutcome]):
        self._run = run
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[ReloadOutcome] = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, pids: set[int]) -> None:
        def work() -> None:
            try:
                self._result = self._run(set(pids))
            except Exception as e:  # an executor bug must not kill the sidecar
                self._result = ReloadOutcome(False, f"{type(e).__name__}: {e}", 0.0)

        self._result = None
        self._thread = threading.Thread(target=work, name="torch-watchdog-reload", daemon=True)
        self._thread.start()

    def poll(self) -> Optional[ReloadOutcome]:
        if self._thread is None or self._thread.is_alive():
            return None
        self._thread, result = None, self._result
        return result


def _outcome_entry(o: ReloadOutcome) -> dict:
    """An outcome's fields in the record (its decision's time and server are the entry's)."""
    return {"ok": o.ok, "detail": o.detail, "seconds": o.seconds,
            "retry_after_s": o.retry_after_s, "failed": o.failed}
