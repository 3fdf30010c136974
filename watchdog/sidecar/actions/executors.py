"""The ways to reload a server (config `reload.method`), each a function of its pids that
returns a ReloadOutcome and never raises into the sidecar.

- `signal`: SIGTERM to the server's processes, SIGKILL to those still alive after `grace_s`;
  a pid is signalled only while it is still the process that was seen (actions/identity.py).
  A master among them (the parent of the server's agents) is left running: it replaces its
  workers and keeps the listening socket, and a master signalled with its workers stops for
  good (`gunicorn --preload`);
- `rolling`: a master's workers one at a time: SIGTERM one, and the next only once its
  replacement is ready: its agent said hello and reported an answered watched call (a warm-up
  at import, or a request), `hello_timeout_s` each, else stop: a failed reload;
- `master-hup`: SIGHUP to the master (gunicorn and uvicorn --workers replace their workers),
  then every old worker gone and as many new ones ready;
- `systemd`: `systemctl restart UNIT` — stop, then start: a HUP-style overlap would hold the
  model twice on the GPU, where the reload is for want of its memory;
- `http`: POST to the server's own drain/reload hook;
- `command`: run a command;
- `evict`: evict the sidecar's own pod through the Kubernetes Eviction API (evict.py);
- `agent`: ask the server's agents to drain and exit over the control socket
  (actions/control.py, agent/drain.py); their supervisor starts the server again.
After any method but `evict` (the sidecar goes with its pod), a reload succeeded only once a
new process of the server said hello within `hello_timeout_s` (else `ReloadOutcome.failed`:
the `reload_failed` outcome; 0 skips the check, for a server without the agent).
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from typing import Callable, Mapping, Optional

import psutil
from torch_watchdog import events
from torch_watchdog.sidecar.actions.control import ControlServer
from torch_watchdog.sidecar.actions.hellos import Heard, Hellos, master_and_workers
from torch_watchdog.sidecar.actions.identity import parent_of, refusal
from torch_watchdog.sidecar.config import ReloadConfig
from torch_watchdog.sidecar.core.observations import ReloadOutcome
from torch_watchdog.sidecar.sources.process import in_cgroup, unit_cgroup


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
        except psutil.AccessDenied:  # another user's process, and no CAP_KILL
            refused.append(f"pid {pid}: not permitted (another user's: the sidecar needs "
                           f"CAP_KILL)")
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


def _signal(pid: int, sig: int) -> Optional[psutil.Process]:
    try:
        p = psutil.Process(pid)
        p.send_signal(sig)
        return p
    except psutil.Error:
        return None


def _master_or_worker_gone(master: int, worker: int) -> bool:
    return not psutil.pid_exists(master) or not psutil.pid_exists(worker)


def _gone(p: psutil.Process) -> bool:
    """Exited (a zombie its master has not reaped yet counts as exited)."""
    try:
        return bool(p.status() == psutil.STATUS_ZOMBIE)
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
    a replacement, and the next worker only once the replacement is ready: its agent said
    hello (its ppid the master) and reported an answered watched call. A replacement that
    said hello at import is still cold (its model not loaded, not compiled): stopping the next
    worker then left requests waiting on compiles (26-59 % timed out at 10 requests/s). Not
    ready within `hello_timeout_s`: stop, the other workers still serving, and report the
    reload failed."""
    started = time.monotonic()
    master, workers = master_and_workers(pids, hellos)
    if master is None:
        return ReloadOutcome(False, _no_master("rolling", pids), time.monotonic() - started)
    expected = expected_start or {}
    why = refusal(master, decided_t, expected.get(master))
    if why is not None:
        return ReloadOutcome(False, f"rolling: master {why}: not carried out",
                             time.monotonic() - started)
    old, done = set(pids) | set(workers), list[str]()
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
        began = time.monotonic()
        def master_gone() -> bool:
            return not psutil.pid_exists(master)

        new = hellos.wait_for(lambda h: h.pid not in old and h.ppid == master, mark,
                              hello_timeout_s, give_up=master_gone)
        ready = new is not None and hellos.wait_served(
            new.pid, hello_timeout_s - (time.monotonic() - began),
            give_up=functools.partial(_master_or_worker_gone, master, new.pid))
        if not ready:
            gone = "the master exited" if master_gone() else \
                f"no hello from its replacement within {hello_timeout_s:g} s" if new is None else \
                f"its replacement {new.pid} exited" if not psutil.pid_exists(new.pid) else \
                (f"its replacement {new.pid} said hello but answered no watched call within "
                 f"{hello_timeout_s:g} s (warm the model up at import)")
            return ReloadOutcome(False, f"{where} stopped{killed}, {gone}; the next workers were "
                                  f"left running", time.monotonic() - started, failed=True)
        assert new is not None
        old.add(new.pid)
        done.append(f"{pid}->{new.pid} ready in {time.monotonic() - began:.1f} s{killed}")
    return ReloadOutcome(True, f"rolling: {len(workers)} workers of master {master} replaced one "
                               f"at a time, each replacement ready before the next "
                               f"({', '.join(done)})", time.monotonic() - started)


def master_hup(pids: set[int], grace_s: float, hello_timeout_s: float, hellos: Hellos,
               decided_t: Optional[float] = None,
               expected_start: Optional[Mapping[int, float]] = None) -> ReloadOutcome:
    """SIGHUP to the master, which replaces its workers its own way (gunicorn: starts new ones
    and stops the old at once; uvicorn >= 0.54: one at a time, each replacement ready before
    the old one stops). Done when every old worker has exited and as many new children of the
    master are alive and said hello; failed when that makes no progress (a hello or an exit)
    for `hello_timeout_s` + `grace_s`. New workers count once ready (said hello and answered
    a watched call). Stragglers are the master's to stop: not killed."""
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
        ready = [p for p in new if hellos.served(p)]
        left = [p.pid for p in procs if not _gone(p)]
        if len(ready) >= len(workers) and not left:
            return ReloadOutcome(True, f"master-hup: master {master} replaced its {len(workers)} "
                                 f"workers {workers} by {ready}, each ready",
                                 time.monotonic() - started)
        if (len(new), len(ready), len(left)) != progress:
            progress, deadline = (len(new), len(ready), len(left)), time.monotonic() + stall
        if time.monotonic() >= deadline or not psutil.pid_exists(master):
            what = "the master exited" if not psutil.pid_exists(master) else \
                f"no progress for {stall:g} s"
            return ReloadOutcome(False, f"master-hup: {what}: {len(new)} of {len(workers)} new "
                                  f"workers said hello, {len(ready)} answered a watched call, "
                                  f"old workers {left} still running",
                                 time.monotonic() - started, failed=True)
        hellos.wait_for(lambda h: False, hellos.mark(), 0.2)  # wakes early on a hello


def _try_process(pid: int) -> Optional[psutil.Process]:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def back_after(run: Callable[[set[int]], ReloadOutcome], hellos: Optional[Hellos],
               timeout_s: float, unit: Optional[str] = None,
               ) -> Callable[[set[int]], ReloadOutcome]:
    """`run`, then wait up to `timeout_s` for a new process of the server to say hello: its
    pid new, and, for a server configured by its systemd `unit`, in that unit's cgroup (a
    hello's name is anyone's to give); else its server name one the old processes' agents
    gave, or its parent one of the old processes or their parent (a supervisor: systemd, a
    shell loop, a master) and its name one that changes with each start, of the same kind
    (`events.per_start`: a replica of the same supervisor on other GPUs is not this server).
    No hello in time: the reload failed (the server did not come back). `hellos` None or
    `timeout_s` 0: `run` alone."""
    if hellos is None or timeout_s <= 0:
        return run

    def reload_and_wait(pids: set[int]) -> ReloadOutcome:
        started = time.monotonic()
        mark = hellos.mark()
        group = unit_cgroup(unit) if unit else None
        names = {h.server for h in map(hellos.heard, pids) if h is not None and h.server}
        near = set(pids) | {pp for pp in map(parent_of, pids) if pp is not None and pp > 1}
        near.discard(os.getpid())
        done = run(pids)
        if not done.ok:
            return done
        kinds = {events.per_start(n) for n in names}

        def ours(h: Heard) -> bool:
            if h.pid in pids:
                return False
            if group is not None:
                return in_cgroup(h.pid, group)
            if h.server in names:
                return True
            return h.ppid in near and (not names or (h.server is not None and
                                                     events.per_start(h.server) in kinds - {None}))

        new = hellos.wait_for(ours, mark, timeout_s)
        took = time.monotonic() - started
        if new is None:
            return ReloadOutcome(False, f"{done.detail}; no hello from a new process of the server "
                                  f"within {timeout_s:g} s", took, failed=True)
        return ReloadOutcome(True, f"{done.detail}; back: pid {new.pid} said hello", took)

    return reload_and_wait


def executor(cfg: ReloadConfig, unit: Optional[str], decided_t: Optional[float] = None,
             expected_start: Optional[Mapping[int, float]] = None,
             hellos: Optional[Hellos] = None, control: Optional[ControlServer] = None,
             own_unit: Optional[str] = None,
             ) -> Optional[Callable[[set[int]], ReloadOutcome]]:
    """The configured way to reload, as a function of the server's pids; None for "none".
    `decided_t` and `expected_start`: see `signal_processes`; `hellos`: the agents' hellos,
    for masters and workers and for the server coming back (`back_after`, which takes only a
    process of `own_unit`, the server's configured unit, for it); `control`: the
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
                          wait, own_unit)
    if cfg.method == "signal":
        run = lambda pids: signal_processes(pids, cfg.grace_s, decided_t, expected_start,
                                            hellos)
    elif cfg.method == "systemd":
        run = lambda pids: run_command(["systemctl", "restart", str(cfg.unit or unit)],
                                       cfg.timeout_s)
    elif cfg.method == "http":
        run = lambda pids: post_hook(str(cfg.url), cfg.timeout_s)  # the config requires it
    elif cfg.method == "command":
        run = lambda pids: run_command(list(cfg.command or ()), cfg.timeout_s)
    elif cfg.method == "evict":  # Kubernetes fleet mode: the pod's own eviction (evict.py);
        from torch_watchdog.sidecar.actions import evict  # this sidecar goes with the pod

        return evict.executor(cfg.timeout_s)
    else:
        return None
    return back_after(run, hellos, wait, own_unit)


DEFAULT_HELLO_TIMEOUT_S = 120.0
