"""The sidecar's end of the control channel: reload method `agent` (cooperative drain).

A Unix stream socket (`reload.control_path`, default `<agent.socket_path>.ctl`, mode
`reload.control_mode`) that each agent connects to (agent/drain.py). Only the sidecar can
use it: the agents connect out and trust the peer only if the kernel says it was bound by
the sidecar's uid (or root); nothing a client sends is ever passed on to another one.

The sidecar knows each connection's peer by SO_PEERCRED (pid and uid at connect, from the
kernel) and its start time: a drain goes only to a pid that is one of the server's watched
pids *and* is still the process that connected (a reused pid is refused, as for signals).
With `agent.allowed_uids`, connections from other uids are closed at once.

A thread accepts and reads (a selector, so no descriptor number is too high for it); the poll
loop never waits on an agent. What a peer sends cannot end that thread: an error is counted
(`errors`) and the thread goes on; connections are bounded in all and per uid, below the
process's descriptor limit. `tell()` sends a one-line request with no reply (`freeze`,
`unfreeze`: the agent answers with a `mitigation` event on the events socket). `drain()` runs
on the reload thread: it sends `{"v":1,"kind":"drain","grace_s":G}` to each connected process
of the server, waits for each one's "drained" reply (or the end of its connection)
for G + REPLY_SLACK_S, then for the processes to exit (EXIT_WAIT_S).
"""
from __future__ import annotations

import errno
import json
import os
import resource
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import psutil
from torch_watchdog.sidecar.actions.identity import refusal
from torch_watchdog.procfs import process_start_time
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core.observations import ReloadOutcome
from torch_watchdog.sidecar.sockets import remove_stale_socket

MAX_PEERS = 1024        # connections held; more are closed (a local flood cannot use up fds)
MAX_PEERS_PER_UID = 256  # a server's workers are many agents of one uid, a flood too
MAX_LINE = 4096
REPLY_SLACK_S = 10.0    # past the grace: the agent saves its bundle and flushes its events
EXIT_WAIT_S = 15.0      # from "drained" to the process gone (its flush is bounded by 2 s)
_PEERCRED = struct.Struct("3i")


@dataclass
class Peer:
    sock: socket.socket
    pid: int
    uid: int
    started: Optional[float]          # process_start_time at accept
    buf: bytes = b""
    replies: list[Any] = field(default_factory=list)
    closed: bool = False


class ControlServer:
    def __init__(self, path: str, mode: int = 0o660, allowed_uids: Optional[set[int]] = None):
        self.path = path
        self.allowed = None if allowed_uids is None else frozenset(allowed_uids)
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o750, exist_ok=True)
        remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(path)
            os.chmod(path, mode)
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._peers: dict[int, Peer] = {}       # by pid: the latest connection of a process
        self._by_fd: dict[int, Peer] = {}
        self._cond = threading.Condition()
        self._wake_r, self._wake_w = os.pipe()
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self.max_peers = _max_peers()
        self.refused = 0                        # connections closed at accept
        self.errors = 0                         # errors the thread survived
        self._running = True
        self._thread = threading.Thread(target=self._run, name="torch-watchdog-control",
                                        daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        return self._sock.fileno()

    def connected(self) -> dict[int, int]:
        """pid -> uid of the agents connected now."""
        with self._cond:
            return {pid: p.uid for pid, p in self._peers.items() if not p.closed}

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while self._running:
            try:
                self._once()
            except Exception:  # nothing a peer does may end the channel: counted, and on
                self.errors += 1
                time.sleep(0.05)

    def _once(self) -> None:
        for key, _ in self._selector.select(0.5):
            fd = key.fd
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 64)
                except OSError:
                    pass
            elif fd == self._sock.fileno():
                self._accept()
            else:
                self._read(fd)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: the backlog waits, the loop breathes
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    time.sleep(0.1)
                return
            try:
                pid, uid, _gid = _PEERCRED.unpack(
                    conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            except OSError:
                conn.close()
                self.refused += 1
                continue
            # pid 0: a peer in another pid namespace; a uid not allowed; too many held
            if pid <= 0 or (self.allowed is not None and uid not in self.allowed) or \
                    len(self._by_fd) >= self.max_peers or \
                    sum(p.uid == uid for p in self._by_fd.values()) >= MAX_PEERS_PER_UID:
                conn.close()
                self.refused += 1
                continue
            try:
                conn.setblocking(False)
                peer = Peer(conn, pid, uid, process_start_time(pid))
                with self._cond:
                    old = self._peers.get(pid)
                    if old is not None:
                        self._forget(old)
                    self._selector.register(conn, selectors.EVENT_READ)
                    self._peers[pid] = peer
                    self._by_fd[conn.fileno()] = peer
            except Exception:
                conn.close()
                raise

    def _read(self, fd: int) -> None:
        with self._cond:
            peer = self._by_fd.get(fd)
        if peer is None:
            return
        try:
            data = peer.sock.recv(MAX_LINE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        with self._cond:
            if not data:
                self._forget(peer)
            else:
                peer.buf += data
                while b"\n" in peer.buf:
                    line, peer.buf = peer.buf.split(b"\n", 1)
                    try:
                        msg = json.loads(line)
                    except (ValueError, RecursionError):  # not JSON, or nested too deep
                        continue
                    if isinstance(msg, dict) and msg.get("kind") == "drained":
                        peer.replies.append(msg)
                if len(peer.buf) > MAX_LINE:
                    self._forget(peer)
            self._cond.notify_all()

    def _forget(self, peer: Peer) -> None:
        """With the condition held."""
        peer.closed = True
        if self._by_fd.pop(peer.sock.fileno(), None) is not None:
            try:
                self._selector.unregister(peer.sock)
            except (KeyError, ValueError, OSError):
                pass
        if self._peers.get(peer.pid) is peer:
            del self._peers[peer.pid]
        try:
            peer.sock.close()
        except OSError:
            pass

    # -- the reload thread ---------------------------------------------------------------------
    def drain(self, pids: set[int], grace_s: float, decided_t: Optional[float] = None
              ) -> ReloadOutcome:
        """Ask each connected process among `pids` to drain; ok once every one asked said
        "drained" and exited."""
        started = time.monotonic()
        notes: list[str] = []
        asked, refused = self._send(pids, {"v": 1, "kind": "drain", "grace_s": grace_s},
                                    decided_t)
        skipped = f"; refused {'; '.join(refused)}" if refused else ""
        if not asked:
            return ReloadOutcome(False, "no agent of the server is connected to the control socket "
                                 f"(pids {sorted(pids)}){skipped}", time.monotonic() - started)
        deadline = started + grace_s + REPLY_SLACK_S
        with self._cond:
            self._cond.wait_for(lambda: all(p.replies or p.closed for p in asked),
                                max(0.0, deadline - time.monotonic()))
            replies = {p.pid: (p.replies[0] if p.replies else None) for p in asked}
        procs = []
        for p in asked:
            try:
                procs.append(psutil.Process(p.pid))
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=EXIT_WAIT_S) if procs else ([], [])
        silent = [pid for pid, r in replies.items() if r is None]
        took = time.monotonic() - started
        if silent:
            notes.append(f"no drained reply from pid(s) {silent}")
        if alive:
            notes.append(f"pid(s) {sorted(p.pid for p in alive)} still running")
        done = [r for r in replies.values() if r is not None]
        left = sum(int(r.get("in_flight") or 0) for r in done)
        codes = sorted({r.get("exit_code") for r in done if isinstance(r.get("exit_code"), int)})
        # no exit code: the process was handed to an engine that stops it (agent/serve.py)
        what = (f"drained {len(done)} of {len(asked)} process(es), "
                + (f"exit code {'/'.join(map(str, codes))}, " if codes else "")
                + ("calls in hand finished" if not left else f"{left} call(s) still in hand "
                   f"at the grace deadline"))
        extra = [r.get("detail") for r in done if r.get("detail")]
        detail = "; ".join([what, *notes, *extra]) + skipped
        return ReloadOutcome(not silent and not alive, detail[:1000], took)

    def tell(self, pids: set[int], kind: str, decided_t: Optional[float] = None
             ) -> tuple[list[int], list[str]]:
        """Send `{"v":1,"kind":kind}` (`freeze`, `unfreeze`) to each connected process among
        `pids`, answered by the agent's events: the pids told, and why others were not."""
        asked, refused = self._send(pids, {"v": 1, "kind": kind}, decided_t)
        return [p.pid for p in asked], refused

    def _send(self, pids: set[int], message: dict[str, Any], decided_t: Optional[float]
              ) -> tuple[list[Peer], list[str]]:
        """One line to each connected process among `pids` that is still the process that
        connected (not a reused pid): the peers it went to, and why the others were skipped."""
        asked, refused = [], []
        with self._cond:
            targets = [self._peers[p] for p in sorted(pids) if p in self._peers]
        line = json.dumps(message).encode() + b"\n"
        for peer in targets:
            why = refusal(peer.pid, decided_t, peer.started)
            if why is not None:
                refused.append(why)
                continue
            try:
                peer.sock.send(line)  # ~40 bytes into an empty buffer: never blocks
                asked.append(peer)
            except OSError as e:
                refused.append(f"pid {peer.pid}: {e.strerror or e}")
        return asked, refused

    def close(self) -> None:
        if not self._running:
            return
        self._running = False
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join(2.0)
        with self._cond:
            for peer in list(self._by_fd.values()):
                self._forget(peer)
        self._selector.close()
        self._sock.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _max_peers() -> int:
    """Connections held at most: MAX_PEERS, and at most half the descriptors the process may
    open, so a flood of connections leaves the sidecar the descriptors it reads its sources
    with (/proc files, NVML, the agents' socket)."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return MAX_PEERS
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return MAX_PEERS
    return max(16, min(MAX_PEERS, soft // 2))


def path_for(cfg: Config) -> str:
    """The control socket of a sidecar config: reload.control_path or <agent.socket_path>.ctl."""
    return cfg.reload.control_path or cfg.agent.socket_path + ".ctl"
