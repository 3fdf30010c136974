"""The sidecar's end of the agent's Unix datagram socket: drain, check sender, decode, count."""
from __future__ import annotations

import json
import os
import select
import socket
import struct
import time
from dataclasses import replace
from typing import Any, Callable, Optional

from torch_watchdog import events
from torch_watchdog.events import EventDecodeError, decode
from torch_watchdog.sidecar.sockets import remove_stale_socket

DROP_REASONS = ("malformed", "oversized", "version", "foreign", "spoofed")
RCVBUF_BYTES = 4 << 20
_UCRED = struct.Struct("iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid (Linux)
# a plain int: `flags & socket.MSG_TRUNC` would build an enum.IntFlag object per datagram
_MSG_TRUNC = int(socket.MSG_TRUNC)
# orjson where installed, and the guard for what json alone reads: events.py's (see there)
_fast_loads, _DIGITS, _LONG_INT = events._fast_loads, events._DIGITS, events._LONG_INT


class Receiver:
    """Binds `path` (Linux only: SO_PASSCRED) and hands out (event, sender_pid) pairs.

    `receive()` never blocks and never raises for anything a peer can put in a datagram;
    bad datagrams are dropped and counted in `dropped` by reason."""

    def __init__(self, path: str, allowed_uids: Optional[set[int]] = None, mode: int = 0o660,
                 max_batch: int = 10000,
                 ns_ids: Optional[Callable[[int], Optional[tuple[int, int]]]] = None):
        self.path = path
        # a sender in a child pid namespace (a container, the node-level mode): its pid as it
        # knows it, and its parent's as the sidecar knows it, read from /proc once per sender
        self._ns_ids = ns_ids or namespace_ids
        self._inner: dict[int, tuple[int, int]] = {}
        self.allowed_uids = None if allowed_uids is None else frozenset(allowed_uids)
        self.max_batch = max_batch
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.received = 0
        self.datagrams = 0  # taken from the socket, good or not
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, mode=0o750, exist_ok=True)  # an existing dir (e.g. /run) keeps its mode
        remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            # On Linux a Unix datagram queue holds 11 datagrams
            # (net.unix.max_dgram_qlen = 10) whatever SO_RCVBUF says, and the sender's
            # SO_SNDBUF bounds the bytes in flight (one 60 KB event fills the default). So a
            # burst survives only if the daemon drains promptly via fileno(); the large
            # buffer is requested anyway: it costs nothing where the kernel ignores it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(path)
            # Until chmod the socket has umask permissions; a private parent dir closes that gap.
            os.chmod(path, mode)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._ancbufsize = socket.CMSG_SPACE(_UCRED.size)
        # asked before each read: an empty queue answers [] where recvmsg would raise
        # BlockingIOError, which costs far more in a daemon that wakes cold
        self._ready = select.poll()
        self._ready.register(sock, select.POLLIN)

    def fileno(self) -> int:
        return self._sock.fileno()

    # over the complexity bound: the per-datagram path (thousands a second) in one frame
    def receive(self, max_events: Optional[int] = None,  # noqa: C901
                deadline: Optional[float] = None) -> list[tuple[events.Event, int]]:
        """Drain up to `max_batch` pending datagrams, fewer once `max_events` good events are in
        or time.monotonic() passes `deadline` (a datagram is taken whole: at most 64 KB);
        return the good events with sender pids."""
        good: list[tuple[events.Event, int]] = []
        ready, hello = self._ready.poll, events.Hello
        for _ in range(self.max_batch):
            if (max_events is not None and len(good) >= max_events) or \
                    (deadline is not None and time.monotonic() >= deadline) or not ready(0):
                break
            try:
                # A buffer of exactly MAX_EVENT_BYTES: anything longer comes back with MSG_TRUNC.
                data, ancdata, flags, _ = self._sock.recvmsg(events.MAX_EVENT_BYTES,
                                                             self._ancbufsize)
            except (BlockingIOError, InterruptedError):
                break
            self.datagrams += 1
            if flags & _MSG_TRUNC:
                self.dropped["oversized"] += 1
                continue
            cred = _credentials(ancdata)
            # Without credentials the sender cannot be attributed, so it is treated as foreign.
            if cred is None or (self.allowed_uids is not None
                                and cred[1] not in self.allowed_uids):
                self.dropped["foreign"] += 1
                continue
            sender = cred[0]
            if not data:  # an empty datagram: not an event
                self.dropped["malformed"] += 1
                continue
            batch = _decode_packed(data)  # every line a valid event (the common case)
            if batch is None:  # a datagram carries one or more events, each judged alone
                batch = []
                for line in data.split(b"\n"):
                    if not line:  # blank lines between events are allowed
                        continue
                    try:
                        batch.append(decode(line))
                    except EventDecodeError:
                        self.dropped[_rejection(line)] += 1
                    except Exception:  # the schema promises EventDecodeError only; a bug
                        self.dropped["malformed"] += 1  # there must not stop us
            for sent in batch:
                if sent.pid != sender:
                    event = self._attribute(sent, sender)
                    if event is None:
                        self.dropped["spoofed"] += 1
                        continue
                elif isinstance(sent, hello):
                    event = replace(sent, ppid=_parent_of(sender, sent.ppid))
                else:  # the common case: the sender's own event, not a hello
                    good.append((sent, sender))
                    continue
                if isinstance(event, hello):  # who may join a server: the kernel's word
                    event = replace(event, uid=cred[1])
                good.append((event, sender))
        self.received += len(good)
        return good

    def _attribute(self, event: events.Event, sender: int) -> Optional[events.Event]:
        """`event`, whose pid is not the kernel's `sender`, told in the sidecar's pids; None
        for a lie about who sent it.

        The kernel reports the pid in the sidecar's pid namespace. A server in a child pid
        namespace (a container seen from a node-level sidecar) reports its own: the pid the
        kernel gives for the sender's innermost namespace must be that one, and the event
        is then told in the sidecar's pids. Any other pid is a lie about who sent it."""
        inner = self._inner.get(sender)
        if inner is None or inner[0] != event.pid:
            inner = self._ns_ids(sender)
            if inner is None or inner[0] != event.pid:
                return None
            if len(self._inner) >= MAX_NS_SENDERS:
                self._inner.clear()
            self._inner[sender] = inner
        ppid = inner[1] if isinstance(event, events.Hello) and event.ppid is not None else None
        return replace(event, pid=sender, **({"ppid": ppid} if ppid is not None else {}))

    def close(self) -> None:
        """Close the socket and remove its path (idempotent)."""
        if self._sock.fileno() != -1:
            self._ready.unregister(self._sock)
            self._sock.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


MAX_NS_SENDERS = 4096


def _parent_of(pid: int, told: Optional[int]) -> Optional[int]:
    """The kernel's parent of `pid` (hellos are rare: one /proc read each), else what the agent
    told when the process is already gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read(4096).rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return told


def namespace_ids(pid: int) -> Optional[tuple[int, int]]:
    """(its pid in its own innermost pid namespace, its parent's pid here) for a process in a
    child pid namespace; None when it is in ours, gone, or unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            status = fh.read(8192)
        nspid = status.split(b"\nNSpid:", 1)[1].split(b"\n", 1)[0].split()
        ppid = int(status.split(b"\nPPid:", 1)[1].split(None, 1)[0])
    except (OSError, IndexError, ValueError):
        return None
    if len(nspid) < 2 or int(nspid[0]) != pid:
        return None
    return int(nspid[-1]), ppid


def _credentials(ancdata: list[Any]) -> Optional[tuple[int, int, int]]:
    for level, kind, payload in ancdata:
        if (level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
                and len(payload) >= _UCRED.size):
            return _UCRED.unpack_from(payload)
    return None


def _decode_packed(data: bytes) -> Optional[list[events.Event]]:
    """Every event of a datagram whose lines are all valid events, each line parsed on its own
    by orjson; None otherwise (no orjson, a blank line, a bad line, a number orjson would read
    otherwise than json): the caller then takes the lines one at a time with json, counting
    each bad one. Each line alone, never the datagram joined into one JSON array: joined, a
    string or a list may span two lines that are not JSON on their own (`"name":"x}` +
    `{y"...`), and the pair would pass as one event."""
    if _fast_loads is None or _LONG_INT in data.translate(_DIGITS):
        return None
    lines = data.split(b"\n")
    if len(data) > events.MAX_EVENT_BYTES and \
            max(map(len, lines)) > events.MAX_EVENT_BYTES:
        return None  # an oversized line: counted as such by the line path
    try:  # one loop in C over the lines
        return list(map(events.from_dict, map(_fast_loads, lines)))
    except Exception:  # orjson's error, a bad event, or a bug: the line path decides
        return None


def _rejection(data: bytes) -> str:
    """'version' for a JSON event of another schema version or an unknown kind (a newer or
    older agent: worth its own counter), 'malformed' for anything else."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return "malformed"
    if not isinstance(obj, dict):
        return "malformed"
    version, kind = obj.get("v"), obj.get("kind")
    if not isinstance(version, int) or isinstance(version, bool) or not isinstance(kind, str):
        return "malformed"
    foreign_schema = version != events.SCHEMA_VERSION or kind not in events.KINDS
    return "version" if foreign_schema else "malformed"
