"""Cooperative drain (reload method `agent`): `ready()`, `on_drain()`, the control channel.

The sidecar asks; the agent drains; a supervisor (systemd `RestartForceExitStatus=75`, the
kubelet) starts the server again:

1. the agent's sender thread keeps a stream connection to the sidecar's control socket
   (`<socket_path>.ctl`), connecting with backoff; it never blocks and never raises into
   the server. The agent only ever connects out: no other process can reach it, and it
   trusts the peer only if the kernel says (SO_PEERCRED, read at connect, no race with the
   path) that the socket was bound by root, this process's own uid, `control_uid`, or the
   owner of the socket's directory when only that owner may write there (`dir_owner`);
2. on `{"v":1,"kind":"drain","grace_s":G}` a drain thread: `ready()` turns False (the
   server's health endpoint reads it: the load balancer stops sending work), a watched call
   begun from then on raises `Draining` at once (never waits, never delays the exit: a busy
   server, whose loop always has a call in hand, drains in the time of the call in hand), the
   `on_drain` callbacks run, the calls in hand finish (at most G seconds in all), the compile
   artifacts are saved (warm.py), `restart_file` is written (a Kubernetes exec liveness probe
   fails on it, a backstop should the exit hang), a `drain` event ("drained") goes to the
   sidecar and the reply to the control socket, the events are flushed, and the process
   exits with `drain_exit_code` (75, EX_TEMPFAIL) through os._exit: atexit handlers do not
   run; the server's own cleanup belongs in an on_drain callback.

Whatever the server's code does meanwhile, the drain ends with `drain_exit_code`: a server
that does not catch `Draining` (its main thread dies of it), calls sys.exit, or simply returns
would otherwise end the interpreter, and its daemon threads with it, before the drain thread's
exit, with another status that no supervisor restarts. From the drain's start an atexit hook
(`_hold_exit`) keeps the interpreter from finishing: it waits for the drain thread's own exit,
and past the grace deadline exits with the drain code itself.

A call in hand is seen through inflight.calls_in_flight(): the C path's count of calls in
progress, or a signature on a thread's stack of calls on the Python path. A call's answer is
sent after the call returns (the rest of the request), which the agent cannot see; so the wait
also asks (wait_idle) for the call totals to stand still for QUIET_S of time this process was
scheduled (a stall of the drain thread itself, a loaded machine, does not count), and then for
the server's threads to be seen waiting, not running or runnable or in disk I/O, twice in a row
(HOLD_MAX_S at most: a thread that never waits holds the exit no longer).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Optional, Protocol

from torch_watchdog import durable, events
from torch_watchdog.procfs import start_ticks
from torch_watchdog.agent import inflight, wrapper
from torch_watchdog.agent.forks import _AFTER_FORK

log = logging.getLogger("torch_watchdog.agent")

EX_TEMPFAIL = 75
# no watched call completed for this long, and none in hand: drained. Long enough for the
# server's own loop, descheduled on a loaded machine, to see ready() False between two requests
QUIET_S = 0.25
POLL_S = 0.005
MAX_STEP_S = 0.02       # a longer gap between two polls is a stall of this process: not quiet
HOLD_MAX_S = 2.0        # past the quiet, the longest wait for the server's threads to be idle
AGENT_THREADS = "torch-watchdog"  # the agent's own threads' names begin with it
BACKOFF_MAX_S = 30.0    # reconnect period, doubled from reconnect_s up to this
MAX_LINE = 4096         # a control message is ~60 bytes
MAX_GRACE_S = 3600.0
EXIT_MARGIN_S = 5.0     # past the grace deadline: the drain's own steps (save, flush) overran
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

class _State:
    """This process's side of a drain: `ready` False once one began, `refused` the watched
    calls refused since (Draining)."""

    __slots__ = ("ready", "refused")

    def __init__(self) -> None:
        self.ready = True
        self.refused = 0


_state = _State()
_callbacks: list[Callable[[], Any]] = []
# A serving engine that replaces this process itself (agent/serve.py: Ray Serve, once its
# health check reaches the agent), set by that integration: a drain then refuses no call and
# does not exit, as the engine routes new calls elsewhere, lets those in hand finish and stops
# the process. Its `wait_stopped(deadline)` is True once the engine is stopping it.


class Handover(Protocol):
    """What drain.handover is (serve._Handover); its optional `name` is told in the drain's
    detail."""

    def wait_stopped(self, deadline: float) -> bool: ...


handover: Optional[Handover] = None


class Draining(RuntimeError):
    """Raised by a watched call begun after this process started draining for a reload (the
    sidecar asked; `ready()` is False): the process exits once the calls in hand finish. Turn
    it into a retryable answer: HTTP 503 with `Retry-After` (the load balancer sends the
    request to another replica), a queue worker's nack or requeue."""


def _refuse(*args: Any, **kwargs: Any) -> Any:
    _state.refused += 1
    raise Draining("torch-watchdog: this process is draining for a reload and exits once its "
                   "calls in hand finish; retry on another replica")


def refuse_new_calls() -> None:
    """From now on every watched call raises Draining (Watched._refuse)."""
    for w in list(wrapper.watched):
        try:
            w._refuse(_refuse)
        except Exception:
            pass


def ready() -> bool:
    """False once a drain began: the server's health/readiness endpoint should report it."""
    return _state.ready


def on_drain(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Register `fn()` to run when the sidecar asks this process to drain (on the agent's
    drain thread, before it waits for the calls in hand); usable as a decorator."""
    _callbacks.append(fn)
    return fn


def _reset_after_fork() -> None:
    # a child forked by a draining master starts serving (its own agent)
    _state.ready, _state.refused = True, 0


_AFTER_FORK.append(_reset_after_fork)


def default_path(socket_path: Optional[str]) -> Optional[str]:
    return socket_path + ".ctl" if socket_path else None


def peer_uid(sock: socket.socket) -> Optional[int]:
    """The uid that bound the listening end (Linux SO_PEERCRED; None elsewhere)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        uid: int = _PEERCRED.unpack(raw)[1]
        return uid
    except (OSError, AttributeError):
        return None


def dir_owner(path: str) -> frozenset[int]:
    """The owner of the socket's directory when no one else may create entries in it (no
    group or other write bit) and no one else could have made it (its parent has none
    either): only that uid, or root, can have bound a socket there. The packaged sidecar runs
    as its own user in /run/torch-watchdog (0750, in root's /run): trusted without setting
    `control_uid`; a directory someone made in a sticky /tmp vouches for no one."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st, parent = os.stat(folder), os.stat(os.path.dirname(folder))
    except OSError:
        return frozenset()
    if st.st_mode & 0o022 or parent.st_mode & 0o022:
        return frozenset()
    return frozenset({st.st_uid})


class ControlClient:
    """The agent's end of the control channel, polled by the sender thread every tick."""

    def __init__(self, path: str, trusted_uids: set[int], on_drain_request: Callable[[float], None],
                 on_error: Callable[[BaseException], None], reconnect_s: float = 1.0,
                 on_freeze: Optional[Callable[[bool], None]] = None):
        self.path = path
        self.trusted = frozenset(trusted_uids)
        self._on_request = on_drain_request
        self._on_freeze = on_freeze   # True: stop recording new sizes; False: record again
        self._on_error = on_error
        self._base = max(reconnect_s, 0.05)
        self._backoff = self._base
        self._retry_at = 0.0
        self._sock: Optional[socket.socket] = None
        self._buf = b""
        self._lock = threading.Lock()   # send() runs on the drain thread
        self.refused: Optional[str] = None  # why the last peer was not trusted

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def poll(self) -> None:
        now = time.monotonic()
        if self._sock is None:
            if now < self._retry_at:
                return
            self._connect(now)
            if self._sock is None:
                return
        try:
            data = self._sock.recv(MAX_LINE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the sidecar went away: reconnect from the base period
            self._drop(time.monotonic(), reset=True)
            return
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            self._message(line)
        if len(self._buf) > MAX_LINE:
            self._drop(time.monotonic(), reset=False)

    def _connect(self, now: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setblocking(False)
            sock.connect(self.path)  # a Unix connect completes at once, or fails (EAGAIN)
        except OSError:
            sock.close()
            self._later(now)
            return
        uid = peer_uid(sock)
        if uid is None or uid not in self.trusted | dir_owner(self.path):
            sock.close()
            self.refused = (f"{self.path}: bound by uid {uid}, not one of "
                            f"{sorted(self.trusted)}: not the sidecar, ignored")
            self._later(now)  # backing off as for an absent sidecar: the real one may come
            return
        self.refused = None
        self._sock, self._buf, self._backoff = sock, b"", self._base

    def _later(self, now: float) -> None:
        self._retry_at = now + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)

    def _drop(self, now: float, reset: bool) -> None:
        self.close()
        if reset:
            self._backoff = self._base
        self._later(now)

    def _message(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
            if (isinstance(msg, dict) and msg.get("v") == 1 and msg.get("kind") == "drain"):
                grace = msg.get("grace_s", 30.0)
                if isinstance(grace, bool) or not isinstance(grace, (int, float)) or \
                        not grace >= 0:
                    grace = 30.0
                self._on_request(min(float(grace), MAX_GRACE_S))
            elif (isinstance(msg, dict) and msg.get("v") == 1 and self._on_freeze is not None
                  and msg.get("kind") in ("freeze", "unfreeze")):
                self._on_freeze(msg["kind"] == "freeze")
        except Exception as e:  # a message we cannot read is ignored, never raised
            self._on_error(e)

    def send(self, obj: dict[str, Any]) -> bool:
        """Best effort, from any thread, never waiting: one line to the sidecar (~150 bytes
        into an idle connection's empty buffer; the sender thread may be in recv meanwhile)."""
        with self._lock:
            sock = self._sock
            if sock is None:
                return False
            data = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
            try:
                return sock.send(data) == len(data)
            except OSError:
                return False

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def after_fork(self) -> None:
        """In a forked child: the parent's connection is the parent's (its peer pid)."""
        self.close()  # the child's copy of the descriptor only
        self._lock = threading.Lock()
        self._buf, self._retry_at, self._backoff = b"", 0.0, self._base


def in_flight() -> int:
    """1 while a watched call runs (see the module docstring)."""
    return 1 if inflight.calls_in_flight() else 0


def _total_calls() -> int:
    total = 0
    for w in list(wrapper.watched):
        try:
            total += w.calls
        except Exception:
            pass
    return total


def _server_threads() -> list[int]:
    """The native ids of this process's Python threads but the agent's and the caller's."""
    me = threading.get_ident()
    return [t.native_id for t in threading.enumerate()
            if t.ident != me and t.native_id is not None
            and not t.name.startswith(AGENT_THREADS)]


def thread_state(tid: int) -> str:
    """A thread of this process as the kernel sees it (/proc/self/task/<tid>/stat field 3):
    R running or runnable, D in uninterruptible I/O, S waiting...; "" when gone or unreadable."""
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as fh:
            raw = fh.read(512)
    except OSError:
        return ""
    rest = raw[raw.rfind(b")") + 2:]  # the name may hold spaces and parentheses
    return rest[:1].decode("ascii", "replace")


def threads_busy() -> bool:
    """Whether one of the server's threads runs, waits for a core, or waits on a disk: it may
    be sending the answer of a call that just ended."""
    return any(thread_state(tid) in ("R", "D") for tid in _server_threads())


def wait_idle(deadline: float, quiet_s: float = QUIET_S, hold_s: float = HOLD_MAX_S,
              busy: Callable[[], bool] = threads_busy,
              clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> int:
    """Until no watched call is in hand and none completed for `quiet_s` of time this thread
    was scheduled, and then `busy()` was False twice in a row (or `hold_s` more of such time
    went by), or `deadline` (clock()); returns the calls still in hand then (0 or 1)."""
    last, quiet, clear = _total_calls(), 0.0, 0
    before = clock()
    while True:
        now = clock()
        step, before = min(now - before, MAX_STEP_S), now
        calls = _total_calls()
        if calls != last or in_flight():
            last, quiet, clear = calls, 0.0, 0
        else:
            quiet += step
            if quiet >= quiet_s:
                clear = 0 if busy() else clear + 1
                if clear >= 2 or quiet >= quiet_s + hold_s:
                    return 0
        if now >= deadline:
            return in_flight()
        sleep(POLL_S)


_held: list[int] = []  # the restart file this process wrote, open until its exit


def write_restart_file(path: str, reason: str) -> Optional[str]:
    """The restart request an exec liveness probe reads (deploy/kubernetes/deployment.yaml):
    one line "<pid> <start time in clock ticks, /proc/<pid>/stat field 22> <reason>" naming
    this process, which then holds the file open until it exits. The request stands only while
    the process it names runs *and* holds that very file (`request_stands`): a file naming
    another live process (forged, or a pid 1 that outlives every server) stands for nothing,
    and a pid alone could be reused. None, or why it was not written."""
    try:
        pid = os.getpid()
        line = f"{pid} {start_ticks(pid)} {reason}\n".encode()
        # a new file of a name no one can guess (O_EXCL: never through a link someone
        # planted), renamed over `path` (which replaces a link, never follows it)
        durable.write_atomic(path, line, prefix=".restart-requested.")
        fd, _ = durable.open_trusted(path)
    except (OSError, ValueError, IndexError) as e:
        return f"{path}: {getattr(e, 'strerror', None) or e}"
    try:
        ours = os.pread(fd, 64, 0) == line
    except OSError:
        ours = False
    if not ours:  # replaced meanwhile: not ours to hold
        os.close(fd)
        return f"{path}: replaced by another process as it was written"
    _held.append(fd)
    return None


def _holds(pid: int, st: os.stat_result, limit: int = 1 << 16) -> bool:
    """Whether process `pid` has the file `st` open (its /proc/<pid>/fd, at most `limit`
    descriptors read); False where that is not readable."""
    try:
        with os.scandir(f"/proc/{pid}/fd") as fds:
            for i, fd in enumerate(fds):
                if i >= limit:
                    return False
                try:
                    held = os.stat(fd.path)
                except OSError:
                    continue
                if (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino):
                    return True
    except OSError:
        pass
    return False


def request_stands(path: str) -> tuple[bool, str]:
    """Whether the restart request at `path` stands: a plain file of this uid or root
    (another user's could name any live process), whose pid and start time name a process
    that runs and holds that file open (its writer, see write_restart_file). With why not."""
    try:
        fd, st = durable.open_trusted(path)
    except FileNotFoundError:
        return False, "no request"
    except (OSError, durable.Untrusted) as e:  # a link, a FIFO, another's: stands for nothing
        return False, f"not a request: {getattr(e, 'strerror', None) or e}"
    try:
        pid, ticks = (int(v) for v in os.read(fd, 64).split()[:2])
    except (OSError, ValueError):
        return False, "malformed"
    finally:
        os.close(fd)
    try:
        alive = pid > 0 and start_ticks(pid) == ticks
    except (OSError, ValueError, IndexError):
        alive = False
    if not alive:
        return False, f"pid {pid} (start {ticks}) no longer runs"
    if not _holds(pid, st):
        return False, f"pid {pid} runs but did not write it (it does not hold the file)"
    return True, f"pid {pid} asked and still runs"


def clear_stale_restart_file(path: str) -> None:
    """At install: a request that does not stand (request_stands) is removed, with a warning:
    left by a process that is gone (the volume outlives the container), forged, or our own
    pid's (a restarted container's server is pid 1 again). One that stands is another process
    of this server still exiting: the probe goes on failing for it."""
    stands, why = request_stands(path)
    if stands or why == "no request":
        return
    try:
        os.unlink(path)
    except OSError:
        return
    log.warning("torch-watchdog agent: removed the restart request %s: %s", path, why)


class Drainer:
    """One drain, on its own thread: the steps of the module docstring, then os._exit."""

    def __init__(self, agent: Any, uninstall: Callable[[], None],
                 exit: Callable[[int], None] = os._exit):
        self.agent = agent
        self._uninstall = uninstall  # the package's: flushes the queued events first
        self._exit = exit
        self.thread: Optional[threading.Thread] = None
        self.deadline = 0.0
        self.left = False  # _leave ran (with os._exit: never seen)
        self._begun = threading.Event()  # the drain thread was started
        self.handed: Optional[Handover] = None  # the engine this drain was handed over to

    def start(self, grace_s: float) -> bool:
        if self.thread is not None:
            return False  # one drain per process; a repeated request changes nothing
        self.deadline = time.monotonic() + grace_s + EXIT_MARGIN_S
        self.thread = threading.Thread(target=self._run, args=(grace_s,),
                                       name="torch-watchdog-drain", daemon=True)
        atexit.register(self._hold_exit)  # before the first Draining can end the main thread
        _state.ready = False
        self.handed = handover
        if self.handed is None:
            refuse_new_calls()
        try:
            self.thread.start()
        except RuntimeError:  # no new thread once the interpreter shuts down: on this one
            self.thread = threading.current_thread()
            self._begun.set()
            self._run(grace_s)
            return True
        self._begun.set()
        return True

    def _hold_exit(self) -> None:
        """At interpreter exit during the drain (the server's main thread ended: an uncaught
        Draining, sys.exit, a return): the drain thread goes on to its own exit; this waits
        for it, and exits with the drain code should it overrun. Never returns (a drain handed
        to an engine, which stops the process itself: once drained)."""
        code = self.agent.config.drain_exit_code
        try:
            log.warning("torch-watchdog agent: the server's code is leaving during a drain; "
                        "exiting with %d once drained", code)
            self._begun.wait(max(0.0, self.deadline - time.monotonic()))
            thread = self.thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, self.deadline - time.monotonic()))
        except BaseException:  # a second Ctrl-C, anything: the drain code all the same
            pass
        if not self.left:
            self._leave(code)

    def _run(self, grace_s: float) -> None:
        agent, cfg = self.agent, self.agent.config
        started = time.monotonic()
        deadline = started + grace_s
        pid, notes = os.getpid(), []
        emit = agent.emitter.emit
        try:
            emit(events.Drain(t=time.time(), pid=pid, phase="draining", grace_s=grace_s))
            failed = _run_callbacks(deadline)
            if failed:
                notes.append(failed)
            if self.handed is not None:
                notes.append(self._hand_over(self.handed, deadline))
            left = wait_idle(deadline)
            if _state.refused:
                notes.append(f"{_state.refused} call(s) begun during the drain refused (Draining)")
            if agent.warm is not None:
                note = agent.warm.save("drain")
                if note:
                    notes.append(note)
            if cfg.restart_file and self.handed is None:
                why = write_restart_file(cfg.restart_file, "drain")
                if why:
                    notes.append(f"restart file not written: {why}")
            took = time.monotonic() - started
            detail = "; ".join(notes) or None
            code = cfg.drain_exit_code if self.handed is None else None
            emit(events.Drain(t=time.time(), pid=pid, phase="drained", grace_s=grace_s,
                              seconds=took, in_flight=left, exit_code=code,
                              detail=events.clip(detail, 500)))
            if agent.control is not None:
                agent.control.send({"v": 1, "kind": "drained", "pid": pid, "in_flight": left,
                                    "seconds": round(took, 3),
                                    "exit_code": code, "detail": detail})
        except Exception as e:
            agent.on_error(e)
        finally:
            self._leave(cfg.drain_exit_code)

    def _hand_over(self, handed: Handover, deadline: float) -> str:
        """Wait for the engine to stop this process; past `deadline`, drain as usual."""
        name = getattr(handed, "name", "the engine")
        if handed.wait_stopped(deadline):
            return f"stopped by {name}"
        self.handed = None
        refuse_new_calls()
        return f"{name} did not stop this process within the grace: calls refused, exiting"

    def _leave(self, code: int) -> None:
        self.left = True
        try:
            self._uninstall()  # flushes the queued events (the "drained" one) to the sidecar
        except Exception:
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if self.handed is None:  # else the engine stops the process
            self._exit(code)


def _run_callbacks(deadline: float) -> Optional[str]:
    """Each on_drain callback on its own daemon thread, joined until `deadline`: a callback
    that hangs does not hold the exit. Returns what went wrong, or None."""
    problems = []
    for fn in list(_callbacks):
        error: list[BaseException] = []

        def call(fn: Callable[[], Any] = fn, error: list[BaseException] = error) -> None:
            try:
                fn()
            except BaseException as e:  # the server's code: reported, never propagated
                error.append(e)

        t = threading.Thread(target=call, name="torch-watchdog-on-drain", daemon=True)
        try:
            t.start()
        except RuntimeError:  # no new thread at interpreter shutdown: on this one
            call()
        else:
            t.join(max(0.0, deadline - time.monotonic()))
        name = getattr(fn, "__qualname__", repr(fn))
        if t.is_alive():
            problems.append(f"on_drain {name} still running at the grace deadline")
        elif error:
            problems.append(f"on_drain {name} raised {type(error[0]).__name__}: {error[0]}")
    return "; ".join(problems) or None
