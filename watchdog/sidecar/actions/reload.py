"""Graceful reload executors, and the record of reloads that survives a sidecar restart.

Executors (config `reload.method`):
- `signal`: SIGTERM to the server's processes, SIGKILL to those still alive after `grace_s`;
  a pid is signalled only if it is still the process that was seen (pid reuse, below);
- `systemd`: `systemctl restart UNIT` — stop, then start: a HUP-style overlap would hold the
  model twice on the GPU (ops-anchors §4.1);
- `http`: POST to the server's own drain/reload hook;
- `command`: run a command;
- `agent`: ask the server's agents to drain and exit over the control socket
  (actions/control.py, agent/drain.py); their supervisor starts the server again.
One reload runs at a time, on a thread, so the poll loop keeps going. Each decision is written
to `<state_dir>/reloads.json` *before* it is carried out, and marked when its execution starts
(`ReloadLog.executing`), so a sidecar that restarts mid-reload does not reload again (the
cooldown and the hourly maximum count it), while a decision it never got to carry out does
not hold the next reload back for a whole cooldown.

The record is the reload guard rail's memory, so a record that cannot be trusted fails
closed: a file that cannot be read or has the wrong shape is reported (`ReloadLog.unreadable`)
and the hourly maximum counts as reached for an hour from the sidecar's start (on main, 7 of
8 corrupt variants silently emptied the history and allowed a 4th reload inside the hour).
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Optional

import psutil


@dataclass(frozen=True)
class Outcome:
    ok: bool
    detail: str
    seconds: float


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
                     expected_start: Optional[Mapping[int, float]] = None) -> Outcome:
    """SIGTERM `pids`, SIGKILL those alive after `grace_s`. `decided_t` (the decision's
    wall-clock time) and `expected_start` (pid -> `process_start_time` when the pid was seen)
    let it refuse a reused pid (`refusal`)."""
    started = time.monotonic()
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
    skipped = f"; refused {'; '.join(refused)}" if refused else ""
    if not procs:
        return Outcome(False, "no server process to signal" + skipped,
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
        return Outcome(True, f"SIGKILL after {grace_s:.0f} s: {len(alive)} process(es) "
                             f"ignored SIGTERM{skipped}", took)
    return Outcome(True, "exited after SIGTERM" + skipped, took)


def run_command(argv: list[str], timeout_s: float) -> Outcome:
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as e:
        return Outcome(False, f"{argv[0]}: {e}", time.monotonic() - started)
    detail = (done.stderr or done.stdout).strip()[-300:]
    return Outcome(done.returncode == 0, f"exit {done.returncode}" + (f": {detail}" if detail
                                                                       else ""),
                   time.monotonic() - started)


def post_hook(url: str, timeout_s: float) -> Outcome:
    started = time.monotonic()
    req = urllib.request.Request(url, data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return Outcome(True, f"HTTP {resp.status}", time.monotonic() - started)
    except urllib.error.HTTPError as e:
        return Outcome(False, f"HTTP {e.code}", time.monotonic() - started)
    except OSError as e:
        return Outcome(False, f"{type(e).__name__}: {e}", time.monotonic() - started)


def executor(cfg, unit: Optional[str], decided_t: Optional[float] = None,
             expected_start: Optional[Mapping[int, float]] = None, control=None,
             ) -> Optional[Callable[[set[int]], Outcome]]:
    """The configured way to reload, as a function of the server's pids; None for "none".
    `decided_t` and `expected_start`: see `signal_processes`; `control`: the ControlServer
    (method agent)."""
    if cfg.method == "agent":
        if control is None:
            return lambda pids: Outcome(False, "the control socket is not open", 0.0)
        return lambda pids: control.drain(pids, cfg.grace_s, decided_t)
    if cfg.method == "signal":
        return lambda pids: signal_processes(pids, cfg.grace_s, decided_t, expected_start)
    if cfg.method == "systemd":
        return lambda pids: run_command(["systemctl", "restart", cfg.unit or unit],
                                        cfg.timeout_s)
    if cfg.method == "http":
        return lambda pids: post_hook(cfg.url, cfg.timeout_s)
    if cfg.method == "command":
        return lambda pids: run_command(list(cfg.command), cfg.timeout_s)
    return None


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
        at the re-check, or never carried out, did nothing and counts for neither. An
        unreadable record counts as the hourly maximum reached at start, for every server."""
        out = [(e["t"], e.get("server") if isinstance(e.get("server"), str) else None)
               for e in self.entries if e.get("detail") not in (CANCELLED, NOT_CARRIED_OUT)]
        if self.unreadable is not None:
            out += [(self.started, None)] * self._blocks
        return out

    def times(self) -> list[float]:
        return [t for t, _ in self.decisions()]

    # -- writing ------------------------------------------------------------------------------
    def record(self, t: float, outcome: Optional[Outcome], reason: str,
               server: Optional[str] = None) -> None:
        entry = {"t": t, "reason": reason, "server": server,
                 **(asdict(outcome) if outcome else {"ok": None})}
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
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"reloads": self.entries}, fh, indent=1, allow_nan=False)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


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

    def __init__(self, run: Callable[[set[int]], Outcome]):
        self._run = run
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[Outcome] = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, pids: set[int]) -> None:
        def work() -> None:
            try:
                self._result = self._run(set(pids))
            except Exception as e:  # an executor bug must not kill the sidecar
                self._result = Outcome(False, f"{type(e).__name__}: {e}", 0.0)

        self._result = None
        self._thread = threading.Thread(target=work, name="torch-watchdog-reload", daemon=True)
        self._thread.start()

    def poll(self) -> Optional[Outcome]:
        if self._thread is None or self._thread.is_alive():
            return None
        self._thread, result = None, self._result
        return result
