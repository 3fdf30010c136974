"""The standby launcher: `torch-watchdog run [options] -- python server.py args...`.

A light main process (it never imports torch) for systemd `ExecStart` or a container
entrypoint. It runs the server as a child Python process and, at once, pre-spawns the next
generation: a *standby* child that imports the preload list (torch, torch._dynamo, inductor's
heavy modules, the agent, `--preload` extras) and then waits on a pipe, never touching CUDA.
While it waits it also imports what the serving generation had imported by its first answer
(the agent records it: agent/imports.py; `transformers` for an HF server), so a release skips
the server's own library imports too (`--no-recorded-preload`: the list alone).
When the serving child exits with the drain code (75), the standby is released at once: it
runs the script in the same interpreter (runpy, `__main__`, sys.argv as given), so the next
generation skips the imports, seconds of a fresh server's start before any GPU work
(benchmarks/results/reload_to_ready.md).

Policy:
  * exit 75 (drain): release the standby (or a plain cold start if there is none), pre-spawn
    a new standby.
  * any other exit, `--restart on-drain` (default): the launcher exits with that status (a
    signal death is re-raised on itself), so systemd/kubelet apply their own policy.
    `--restart always`: start again, at least `--min-interval-s` after the last start.
  * SIGTERM/SIGINT to the launcher: forwarded to the serving child, the standby is killed,
    the launcher exits with the child's status. SIGHUP is forwarded only (a server may reload
    on it).
  * a standby that fails a preload or finds CUDA initialised after preloading exits before
    running anything; the launcher logs it and falls back to plain starts (CUDA: for good,
    since a standby must never hold GPU memory; failures: after 3 in a row). A recorded
    module that fails to import is skipped; one that initialises CUDA ends that standby, and
    the next ones skip it. The launcher itself must never be the outage.
  * children get PR_SET_PDEATHSIG (SIGTERM): no orphans if the launcher is killed. The
    launcher is its descendants' subreaper, and a reaper process beside it (its own session,
    deaf to the signals a terminal or a unit's stop sends) notes them every REAP_EVERY_S; when
    the launcher dies, even by SIGKILL, the reaper sends SIGTERM to what is left of them and,
    REAP_GRACE_S later, SIGKILL: a grandchild, or a server that ignores SIGTERM, does not
    outlive it.

The child's side is `python -m torch_watchdog.launcher --child ...` (this same module: light).
"""
from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

from torch_watchdog.procfs import start_ticks

DRAIN_EXIT_CODE = 75
DEFAULT_PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx",
                   "torch_watchdog.agent")
MAX_STANDBY_FAILURES = 3
# a generation that exits sooner than this after its start was quick: starts after quick exits
# back off, doubling from --min-interval-s up to MAX_BACKOFF_S (a server that drains at once
# must not be started ten times a second)
QUICK_EXIT_S = 10.0
MAX_BACKOFF_S = 30.0
STANDBY_WAIT_S = 15.0  # a standby still in its preloads at a release: waited for this long
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
REAP_EVERY_S = 5.0   # a 65-thread server: 0.25 % of a core at 1 s, 0.03 % at 5 s
REAP_GRACE_S = 10.0
# env the child reads: the release pipe's fd, the status pipe's fd, the preload list
ENV_RELEASE_FD = "TORCH_WATCHDOG_STANDBY_FD"
ENV_STATUS_FD = "TORCH_WATCHDOG_STANDBY_STATUS_FD"
ENV_PRELOAD = "TORCH_WATCHDOG_PRELOAD"
ENV_PRELOAD_SKIP = "TORCH_WATCHDOG_PRELOAD_SKIP"  # recorded modules a standby leaves alone
ENV_IMPORTS = "TORCH_WATCHDOG_IMPORTS_FILE"       # agent/imports.py writes it, standbys read it
# set in a released standby: when it was released (time.time()); benchmarks read it
ENV_RELEASED_AT = "TORCH_WATCHDOG_RELEASED_AT"
ENV_LAUNCHER_PID = "TORCH_WATCHDOG_LAUNCHER_PID"


def log(msg: str) -> None:
    """A line on stderr; never an error (stderr closed, its reader gone): the launcher must
    never be the outage."""
    try:
        sys.stderr.write(f"torch-watchdog run: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass


def _prctl(option: int, value: int) -> None:
    """Linux prctl(2), best effort."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def set_pdeathsig(sig: int = signal.SIGTERM) -> None:
    """Linux: the kernel sends `sig` to this process when its parent dies."""
    _prctl(PR_SET_PDEATHSIG, int(sig))


# ---------------------------------------------------------------- the reaper's side

def descendants(root: int, proc: str = "/proc") -> dict[int, int]:
    """Every descendant of `root` with its start time (`procfs.start_ticks`), from the
    kernel's children lists: a handful of reads, not a walk of every process."""
    out: dict[int, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"{proc}/{pid}/task/{task}/children") as fh:
                    kids = [int(k) for k in fh.read().split()]
            except (OSError, ValueError):
                continue
            for kid in kids:
                if kid not in out and kid != root:
                    start = _start_time(kid, proc)
                    if start is not None:
                        out[kid] = start
                        todo.append(kid)
    return out


def _start_time(pid: int, proc: str = "/proc") -> Optional[int]:
    try:
        return start_ticks(pid, proc)
    except (OSError, IndexError, ValueError):
        return None


def _signal_all(pids: dict[int, int], sig: int) -> dict[int, int]:
    """`sig` to each pid that is still the process noted (no pid reuse); those left."""
    left = {}
    for pid, start in pids.items():
        if _start_time(pid) != start:
            continue
        try:
            os.kill(pid, sig)
            left[pid] = start
        except OSError:
            pass
    return left


def reaper_main(launcher: int, watch_fd: int, grace_s: float = REAP_GRACE_S) -> int:
    """Note the launcher's descendants every REAP_EVERY_S until `watch_fd` (the launcher's end
    of a pipe) closes, then stop them: SIGTERM, then SIGKILL after `grace_s`."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    import select

    noted: dict[int, int] = {}
    while True:
        noted = descendants(launcher) or noted
        ready, _, _ = select.select([watch_fd], [], [], REAP_EVERY_S)
        if ready and not os.read(watch_fd, 512):
            break  # EOF: the launcher is gone (exited, or killed)
    noted.pop(os.getpid(), None)
    left = _signal_all(noted, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p: s for p, s in left.items() if _start_time(p) == s}
    _signal_all(left, signal.SIGKILL)
    return 0


# ---------------------------------------------------------------- the child's side

def _status(fd: Optional[int], line: str) -> None:
    if fd is None:
        return
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:
        pass


def child_main(target: list[str]) -> int:
    """Preload, wait for the release, run the target as __main__. `target`: ['-m', mod, args]
    or [script, args]."""
    launcher = int(os.environ.pop(ENV_LAUNCHER_PID, "0") or 0)
    set_pdeathsig()
    if launcher and os.getppid() != launcher:  # the launcher died before prctl took effect
        return 1
    release_fd = os.environ.pop(ENV_RELEASE_FD, None)
    status_fd = os.environ.pop(ENV_STATUS_FD, None)
    status = int(status_fd) if status_fd else None
    preload = [m for m in os.environ.pop(ENV_PRELOAD, "").split(",") if m]
    if release_fd is not None:
        # a standby: Ctrl-C in a terminal reaches the whole process group; not ours yet
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        import importlib
        for mod in preload:
            try:
                importlib.import_module(mod)
            except BaseException as err:  # noqa: BLE001 - any failure: no standby, say why
                _status(status, f"fail preload {mod}: {type(err).__name__}: {err}")
                return 3
        if _cuda_on():
            _status(status, "cuda a preload initialised CUDA")
            return 4
        _status(status, "ready")
        skip = [s for s in os.environ.pop(ENV_PRELOAD_SKIP, "").split(",") if s]
        got = _wait_release(int(release_fd), os.environ.get(ENV_IMPORTS), skip, status)
        if got is None:
            return 4  # a recorded module initialised CUDA (said on status)
        if not got.startswith(b"go"):
            return 0  # the launcher closed the pipe: stop, nothing ran
        os.environ[ENV_RELEASED_AT] = got.split()[1].decode() if len(got.split()) > 1 else ""
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _status(status, "running")
    if status is not None:
        os.close(status)
    import runpy
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]  # runpy sets argv[0] to the module's file
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
        runpy.run_path(target[0], run_name="__main__")
    return 0


def _cuda_on() -> bool:
    """Whether this process has initialised CUDA (a standby must never hold GPU memory)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001
        return False


def _wait_release(fd: int, imports_file: Optional[str], skip: list[str],
                  status: Optional[int]) -> Optional[bytes]:
    """The release line ("go <t>"; b"" when the launcher closed the pipe). Meanwhile, each
    time the serving generation's recorded imports change, import those not imported yet;
    None once one of them initialised CUDA (a standby must never hold GPU memory)."""
    stamp: Optional[tuple] = None
    buf = b""
    try:
        while b"\n" not in buf:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                chunk = os.read(fd, 256)
                if not chunk:
                    break
                buf += chunk
                continue
            now = _stamp(imports_file)
            if now is not None and now != stamp:
                stamp = now
                if not _preload_recorded(imports_file or "", skip, status,
                                         lambda: bool(select.select([fd], [], [], 0)[0])):
                    return None
    finally:
        os.close(fd)
    return buf


def _stamp(path: Optional[str]) -> Optional[tuple]:
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return None if st is None else (st.st_mtime_ns, st.st_size, st.st_ino)


def _preload_recorded(path: str, skip: list[str], status: Optional[int],
                      released: Callable[[], bool]) -> bool:
    """Import the recorded modules not imported yet (a failure skips that one), until
    `released()` (the script imports the rest itself); False, said on status as
    `cuda-by <module>`, once one initialised CUDA."""
    import importlib

    from torch_watchdog.agent import imports

    started, done, failed = time.monotonic(), 0, 0
    for name in imports.read(path):
        if name in sys.modules or any(name == s or name.startswith(s + ".") for s in skip):
            continue
        if released():
            break
        try:
            importlib.import_module(name)
            done += 1
        except BaseException:  # noqa: BLE001 - a module that cannot load here: not preloaded
            failed += 1
        if _cuda_on():
            _status(status, f"cuda-by {name}")
            return False
    if done or failed:
        _status(status, f"recorded {done} {failed} {time.monotonic() - started:.3f}")
    return True


# ---------------------------------------------------------------- the launcher's side

class Gen:
    """One child process: its Popen, its pipes' launcher ends, what it said on status."""

    def __init__(self, popen: subprocess.Popen, release_w: Optional[int], status_r: int):
        self.popen, self.release_w, self.status_r = popen, release_w, status_r
        self.standby = release_w is not None
        self.said: list[str] = []

    def read_status(self) -> list[str]:
        try:
            while True:
                data = os.read(self.status_r, 4096)
                if not data:
                    break
                self.said.extend(x for x in data.decode(errors="replace").splitlines() if x)
        except BlockingIOError:
            pass
        except OSError:
            pass
        return self.said

    def close(self) -> None:
        for fd in (self.release_w, self.status_r):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.release_w = None


class Launcher:
    def __init__(self, python: str, target: list[str], preload: list[str], restart: str,
                 min_interval_s: float, drain_code: int, standby: bool,
                 recorded_preload: bool = True):
        self.python, self.target, self.preload = python, target, preload
        # the serving generation's imports, for the standbys (a private directory)
        self.imports_dir = tempfile.mkdtemp(prefix="torch-watchdog-run-") \
            if recorded_preload and standby else None
        # never the target's own package (`-m pkg.app`: its import may load the model)
        self.skip = {target[1].split(".")[0]} if target[:1] == ["-m"] and len(target) > 1 \
            else set()
        self.restart, self.min_interval_s, self.drain_code = restart, min_interval_s, drain_code
        self.standby_ok = standby
        self.failures = 0
        self.serving: Optional[Gen] = None
        self.standby: Optional[Gen] = None
        self.stopping = False
        self.last_start = 0.0
        self.quick_exits = 0  # generations in a row that exited within QUICK_EXIT_S
        self._standby_to_reap: Optional[Gen] = None  # killed on a stop signal, not yet reaped
        self._reaper_w: Optional[int] = None  # held until the launcher dies: the reaper's cue

    def _spawn(self, standby: bool) -> Gen:
        status_r, status_w = os.pipe()
        os.set_blocking(status_r, False)
        env = dict(os.environ, **{ENV_STATUS_FD: str(status_w), ENV_LAUNCHER_PID: str(os.getpid())})
        if self.imports_dir is not None:
            env[ENV_IMPORTS] = os.path.join(self.imports_dir, "imports")
        fds = [status_w]
        release_r = release_w = None
        if standby:
            release_r, release_w = os.pipe()
            env[ENV_RELEASE_FD] = str(release_r)
            env[ENV_PRELOAD] = ",".join(self.preload)
            env[ENV_PRELOAD_SKIP] = ",".join(sorted(self.skip))
            fds.append(release_r)
        popen = subprocess.Popen([self.python, "-m", "torch_watchdog.launcher", "--child", "--",
                                  *self.target], env=env, pass_fds=fds)
        os.close(status_w)
        if release_r is not None:
            os.close(release_r)
        return Gen(popen, release_w, status_r)

    def _spawn_standby(self) -> None:
        if self.standby_ok and not self.stopping and self.standby is None:
            try:
                self.standby = self._spawn(standby=True)
            except OSError as err:
                log(f"no standby ({err}); plain starts")
                self.standby = None

    def start_next(self) -> None:
        """Release the standby if it is alive and ready, else a plain cold start; then a new
        standby. After quick exits, not before the backoff is over (nor once stopping)."""
        quick = self.last_start and time.monotonic() - self.last_start < QUICK_EXIT_S
        self.quick_exits = self.quick_exits + 1 if quick else 0
        wait = self.last_start + self.min_interval_s - time.monotonic()
        if self.quick_exits > 1:
            wait = max(wait, min(MAX_BACKOFF_S,
                                 self.min_interval_s * 2 ** (self.quick_exits - 1)))
            log(f"{self.quick_exits} quick exits in a row: next start in {wait:.0f} s")
        if wait > 0 and (self.restart == "always" or self.quick_exits > 1):
            deadline = time.monotonic() + wait
            while not self.stopping and (left := deadline - time.monotonic()) > 0:
                time.sleep(min(left, 0.2))
        if self.stopping:
            return
        self.last_start = time.monotonic()
        sb, self.standby = self.standby, None
        if sb is not None and not self._ready(sb):
            # still importing (or hung in) its preloads: a cold start rather than no server
            log(f"standby pid {sb.popen.pid} not ready after {STANDBY_WAIT_S:.0f} s; cold start")
            self._kill(sb)
            sb = None
        if sb is not None and sb.popen.poll() is None and sb.release_w is not None:
            try:
                os.write(sb.release_w, f"go {time.time():.6f}\n".encode())
                os.close(sb.release_w)
                sb.release_w = None
                self.serving = sb
                recorded = [s.split() for s in sb.read_status() if s.startswith("recorded ")]
                log(f"released standby pid {sb.popen.pid}" + (
                    f" (it had imported {sum(int(r[1]) for r in recorded)} more modules the "
                    f"server had, in {sum(float(r[3]) for r in recorded):.1f} s)"
                    if recorded else ""))
            except OSError as err:
                log(f"standby pid {sb.popen.pid} could not be released ({err}); cold start")
                self._kill(sb)
                sb = None
        else:
            if sb is not None:
                self._judge_dead_standby(sb)
            sb = None
        if sb is None:
            self.serving = self._spawn(standby=False)
            log(f"cold start pid {self.serving.popen.pid}")
        self._spawn_standby()

    def _ready(self, sb: Gen) -> bool:
        """The standby said "ready" (its preloads done), or it ended (judged below), within
        STANDBY_WAIT_S; False: it is still preloading, or the launcher is stopping."""
        deadline = time.monotonic() + STANDBY_WAIT_S
        while "ready" not in sb.read_status() and sb.popen.poll() is None:
            if self.stopping or time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _judge_dead_standby(self, sb: Gen) -> None:
        said = sb.read_status()
        why = next((s for s in said if s.startswith(("fail", "cuda"))), None)
        code = sb.popen.poll()
        sb.close()
        if why and why.startswith("cuda-by "):
            self.skip.add(why.split()[1])
            log(f"standby pid {sb.popen.pid}: the recorded import {why.split()[1]} initialised "
                "CUDA; the next standbys skip it")
            return
        if why and why.startswith("cuda"):
            self.standby_ok = False
            log(f"standby pid {sb.popen.pid}: {why[5:]}; standby disabled, plain starts "
                "(a standby must never hold GPU memory)")
            return
        if why is None and code is not None and code < 0:
            # killed (the sidecar's `signal` method SIGTERMs every pid of the unit): not a
            # fault of the preloads, so it does not count towards disabling standbys
            log(f"standby pid {sb.popen.pid} killed by signal {-code}; a new one")
            return
        self.failures += 1
        log(f"standby pid {sb.popen.pid} ended ({why or f'exit {code}'}); "
            f"failure {self.failures}/{MAX_STANDBY_FAILURES}")
        if self.failures >= MAX_STANDBY_FAILURES:
            self.standby_ok = False
            log("standby disabled after repeated failures; plain starts")

    def _kill(self, g: Optional[Gen]) -> None:
        if g is None:
            return
        try:
            g.popen.kill()
            g.popen.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        g.close()

    def on_signal(self, sig: int, _frame) -> None:
        if sig != signal.SIGHUP:
            self.stopping = True
            sb, self.standby = self.standby, None
            if sb is not None:
                try:
                    sb.popen.kill()
                except OSError:
                    pass
                self._standby_to_reap = sb
        if self.serving is not None:
            try:
                self.serving.popen.send_signal(sig)
            except OSError:
                pass

    def _start_reaper(self) -> None:
        """The reaper beside the launcher: not its child (a double fork, before the launcher
        becomes a subreaper), in a session of its own (a terminal's Ctrl-C or a stop does not
        reach it); it holds the read end of a pipe whose write end only the launcher holds, so
        its EOF is the launcher's death. Best effort: without one, no reaping."""
        launcher = os.getpid()
        try:
            r, w = os.pipe()
            pid = os.fork()
        except OSError as err:
            log(f"no reaper ({err}): the server's own children may outlive a killed launcher")
            return
        if pid == 0:  # the intermediate: its child is the reaper, re-parented when it exits
            try:
                os.setsid()
                if os.fork() == 0:
                    os.set_inheritable(r, True)
                    os.execv(self.python, [self.python, "-m", "torch_watchdog.launcher",
                                           "--reaper", str(launcher), str(r)])
            finally:
                os._exit(0)
        os.close(r)
        os.waitpid(pid, 0)
        self._reaper_w = w  # os.pipe() fds are not inherited: no child holds it open
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans stay in the launcher's tree

    def run(self) -> int:
        try:
            return self._run()
        finally:
            if self.imports_dir is not None:
                shutil.rmtree(self.imports_dir, ignore_errors=True)

    def _run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.on_signal)
        self._start_reaper()
        self.start_next()
        while True:
            try:
                pid, wstatus = os.waitpid(-1, 0)
            except ChildProcessError:
                return 1
            except InterruptedError:
                continue
            code = os.waitstatus_to_exitcode(wstatus)
            if self._reaped_standby(pid, code):
                continue
            if self.serving is None or pid != self.serving.popen.pid:
                continue  # a stray (re-parented) child
            g, self.serving = self.serving, None
            if not self._serving_ended(g, pid, code):
                break
        return self._finish(code)

    def _reaped_standby(self, pid: int, code: int) -> bool:
        """True if `pid` was the standby (judged, and a new one started) or the standby killed
        on stopping (closed)."""
        if self.standby is not None and pid == self.standby.popen.pid:
            self.standby.popen.returncode = code
            sb, self.standby = self.standby, None
            self._judge_dead_standby(sb)
            self._spawn_standby()
            return True
        if self._standby_to_reap is not None and pid == self._standby_to_reap.popen.pid:
            self._standby_to_reap.close()
            self._standby_to_reap = None
            return True
        return False

    def _serving_ended(self, g: Gen, pid: int, code: int) -> bool:
        """The serving generation `g` (pid) exited with `code`: True once the next one is
        started (or is to be, after the backoff), False when the launcher ends with it."""
        g.popen.returncode = code
        said = g.read_status()
        g.close()
        if g.standby and "running" not in said:  # released, but refused (CUDA, preload)
            self._judge_dead_standby(g)
            if not self.stopping:
                self.start_next()
                return True
        if self.stopping:
            return False
        if code == self.drain_code:
            log(f"pid {pid} drained (exit {code}); next generation")
        elif self.restart == "always":
            log(f"pid {pid} exited ({code}); --restart always")
        else:
            return False
        self.start_next()
        return self.serving is not None  # None: stopped during the backoff

    def _finish(self, code: int) -> int:
        """Kill the standby, then end as the server did: its exit status, or its signal."""
        self._kill(self.standby)
        self.standby = None
        if self._standby_to_reap is not None:
            self._kill(self._standby_to_reap)
        if code < 0:  # died of a signal: die of it too, as systemd/kubelet expect
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
            return 128 - code
        return code

def build_parser() -> Any:
    import argparse
    p = argparse.ArgumentParser(prog="torch-watchdog run", description=__doc__.splitlines()[0])
    p.add_argument("--preload", default="", help="extra modules for the standby to import, "
                   "comma-separated (e.g. transformers)")
    p.add_argument("--no-default-preload", action="store_true",
                   help=f"preload only --preload (default list: {','.join(DEFAULT_PRELOAD)})")
    p.add_argument("--restart", choices=("on-drain", "always"), default="on-drain",
                   help="on-drain (default): start again after the drain exit code only; any "
                   "other exit ends the launcher with the server's status (systemd or the "
                   "kubelet apply their own policy); always: start again after any exit")
    p.add_argument("--min-interval-s", type=float, default=1.0,
                   help="--restart always: at least this long between starts, in seconds "
                   "(default: %(default)s)")
    p.add_argument("--drain-exit-code", type=int, default=DRAIN_EXIT_CODE,
                   help="the server's exit status that means 'drained: start the next "
                   "generation', the agent's drain_exit_code (default: %(default)s)")
    p.add_argument("--no-standby", action="store_true", help="plain starts only")
    p.add_argument("--no-recorded-preload", action="store_true",
                   help="the standby imports the preload list only, not what the serving "
                   "generation had imported by its first answer")
    return p


def parse(argv: list[str]):
    p = build_parser()
    if "--" in argv:
        i = argv.index("--")
        opts, cmd = argv[:i], argv[i + 1:]
    elif argv and argv[0].startswith("-"):  # options alone (--help), or options without "--"
        opts, cmd = argv, []
    else:
        opts, cmd = [], argv
    a, rest = p.parse_known_args(opts)
    if rest and "--" not in argv:
        p.error(f"{' '.join(rest)}: the server's command comes after `--`: torch-watchdog run "
                "[options] -- python server.py args...")
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if not cmd:
        p.error("usage: torch-watchdog run [options] -- python server.py args... "
                "(or python -m module args...)")
    # a bare `python`/`python3` means this interpreter (the one torch_watchdog is installed
    # in: the child's side is this module); a path to another one is used as given
    python = sys.executable
    if os.path.basename(cmd[0]).startswith("python") and not cmd[0].endswith(".py"):
        python = cmd[0] if os.sep in cmd[0] else sys.executable
        cmd = cmd[1:]
    if not cmd or (cmd[0] == "-m" and len(cmd) < 2):
        p.error("no script or module to run")
    preload = [] if a.no_default_preload else list(DEFAULT_PRELOAD)
    preload += [m.strip() for m in a.preload.split(",") if m.strip()]
    return a, python, cmd, preload


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a, python, cmd, preload = parse(argv)
    return Launcher(python, cmd, preload, a.restart, a.min_interval_s, a.drain_exit_code,
                    not a.no_standby, not a.no_recorded_preload).run()


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child" and sys.argv[2] == "--":
        sys.exit(child_main(sys.argv[3:]))
    if len(sys.argv) == 4 and sys.argv[1] == "--reaper":
        sys.exit(reaper_main(int(sys.argv[2]), int(sys.argv[3])))
    sys.exit(main())
