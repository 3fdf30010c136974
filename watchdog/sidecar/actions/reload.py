"""Graceful reload executors, and the record of reloads that survives a sidecar restart.

Executors (config `reload.method`):
- `signal`: SIGTERM to the server's processes, SIGKILL to those still alive after `grace_s`;
- `systemd`: `systemctl restart UNIT` — stop, then start: a HUP-style overlap would hold the
  model twice on the GPU (ops-anchors §4.1);
- `http`: POST to the server's own drain/reload hook;
- `command`: run a command.
One reload runs at a time, on a thread, so the poll loop keeps going. Each decision is written
to `<state_dir>/reloads.json` *before* it is carried out, so a sidecar that restarts mid-reload
does not reload again (the cooldown and the hourly maximum count it).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import psutil


@dataclass(frozen=True)
class Outcome:
    ok: bool
    detail: str
    seconds: float


def signal_processes(pids: set[int], grace_s: float) -> Outcome:
    started = time.monotonic()
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.send_signal(signal.SIGTERM)
            procs.append(p)
        except psutil.Error:
            continue
    if not procs:
        return Outcome(False, "no server process to signal", 0.0)
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
                             f"ignored SIGTERM", took)
    return Outcome(True, "exited after SIGTERM", took)


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


def executor(cfg, unit: Optional[str]) -> Optional[Callable[[set[int]], Outcome]]:
    """The configured way to reload, as a function of the server's pids; None for "none"."""
    if cfg.method == "signal":
        return lambda pids: signal_processes(pids, cfg.grace_s)
    if cfg.method == "systemd":
        return lambda pids: run_command(["systemctl", "restart", cfg.unit or unit],
                                        cfg.timeout_s)
    if cfg.method == "http":
        return lambda pids: post_hook(cfg.url, cfg.timeout_s)
    if cfg.method == "command":
        return lambda pids: run_command(list(cfg.command), cfg.timeout_s)
    return None


CANCELLED = "cancelled: the forecast cleared"


class ReloadLog:
    """`reloads.json` in the state directory: every reload decision and how it ended."""

    def __init__(self, path: str):
        self.path = path
        self.error: Optional[str] = None
        self.entries: list[dict] = self._read()

    def _read(self) -> list[dict]:
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
            return [e for e in data.get("reloads", []) if isinstance(e.get("t"), (int, float))]
        except (OSError, ValueError, AttributeError):
            return []  # missing or unreadable: start a new record (the error is the caller's)

    def decisions(self) -> list[tuple[float, Optional[str]]]:
        """(when, which server) reloads were decided, for the cooldown and the hourly maximum
        (per server; entries older than servers count for every server); a decision cancelled
        at the re-check did nothing and counts for neither."""
        return [(e["t"], e.get("server") if isinstance(e.get("server"), str) else None)
                for e in self.entries if e.get("detail") != CANCELLED]

    def times(self) -> list[float]:
        return [t for t, _ in self.decisions()]

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
        try:
            self._write()
            self.error = None
        except OSError as e:  # kept in memory; the daemon logs it and goes on
            self.error = f"{self.path}: {e.strerror or e}"

    def _write(self) -> None:
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".reloads.")
        with os.fdopen(fd, "w") as fh:
            json.dump({"reloads": self.entries}, fh, indent=1)
        os.replace(tmp, self.path)  # atomic: a crash leaves the old file or the new one


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
