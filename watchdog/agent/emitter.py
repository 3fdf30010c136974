"""Bounded event queue and its sender thread: Unix datagram socket and/or JSON-lines log.

`emit()` runs on the server's threads: it appends to a bounded deque and returns, never
blocking, never raising. Encoding and all I/O happen on one daemon thread, every `tick_s`
(at once for an OOM or a recompile-limit hit), several events to a datagram. A dead or absent
sidecar, a full socket buffer or an unwritable log loses events, counted per reason and
reported in `dropped` events; sinks are retried every `reconnect_s`.

A new receiver at the socket path (the sidecar restarted: a send went through after one failed,
or the sender thread's stat of the path, at most every RECEIVER_STAT_S, found another socket
there) calls `on_receiver_change` once (the agent queues its hello), and what it queued is sent
at once.

Fork: `after_fork()` (the agent's `os.register_at_fork` hook, in the child) gives the child a
fresh emitter: its own queue (the parent's queued events are the parent's to send), its own
Events (a sender thread waiting on one at fork time holds its lock forever in the child), its own
socket and log file (`{pid}` in the log path is each process's pid), and a new sender thread.
"""
from __future__ import annotations

import collections
import os
import socket
import threading
import time
from typing import Any, Callable, Optional

from torch_watchdog import events
from torch_watchdog.jsonl import JsonLines

DROP_REASONS = ("queue_full", "socket", "log")
SENT, FULL, DOWN = "sent", "full", "down"
URGENT = frozenset({"oom", "recompile_limit", "mitigation"})
FULL_RETRY_S = 1.0
LAST_WAIT_S = 0.5   # the final heartbeat's retries on a full receiver, at exit
RECEIVER_STAT_S = 1.0  # the socket path is stat'ed this often for a re-bound sidecar


YIELD_EVERY = 8   # events encoded (~3-5 us each) between two hand-backs of the GIL


def shape_from_text(text: str) -> events.Shape:
    """signature.shape_text's text back as the schema's list of shapes."""
    if not text:
        return []
    return [[int(d) for d in part[1:].split(",")] if len(part) > 1 else []
            for part in text.split(";")]


def _new_shape(t: float, pid: int, name: str, shape: str, seconds: float,
               distinct: int) -> events.NewShape:
    return events.NewShape(t=t, pid=pid, name=name, shape=shape_from_text(shape),
                           seconds=seconds, distinct=distinct)


# emit_later's builders: the kind a queued tuple starts with -> its fields -> the Event
LATER: dict[str, Callable[..., events.Event]] = {"new_shape": _new_shape}


class Emitter:
    def __init__(self, socket_path: Optional[str], log_path: Optional[str], *,
                 queue_size: int = 10_000, tick_s: float = 0.1, reconnect_s: float = 1.0,
                 log_max_bytes: int = 64 << 20, on_tick: Optional[Callable[[], None]] = None,
                 on_error: Callable[[BaseException], None] = lambda e: None,
                 drop_report_s: float = 2.0,
                 on_receiver_change: Optional[Callable[[], None]] = None,
                 on_link: Optional[Callable[[bool], None]] = None):
        # every argument, first thing (nothing else is local yet): after_fork() builds the
        # child's emitter from them, whatever state __init__ comes to hold
        self._init_args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self._queue: collections.deque[Any] = collections.deque()
        self._cap = queue_size
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._tick_s = tick_s
        self._on_tick = on_tick
        self._on_error = on_error
        self._on_receiver_change = on_receiver_change
        self.receiver_changes = 0  # new receivers seen at the socket path (sidecar restarts)
        # told once each, on the sender thread: no receiver at the path (False, at the first
        # send that fails before any went through), a receiver took one (True, the first)
        self._on_link = on_link
        self._linked: Optional[bool] = None
        self._socket = _SocketSink(socket_path, reconnect_s) if socket_path else None
        self._log = (JsonLines(log_path_for(log_path, os.getpid()), reconnect_s, log_max_bytes)
                     if log_path else None)
        self.dropped = dict.fromkeys(DROP_REASONS, 0)  # every lost event, drop reports too
        # drop reports: see _report_drops
        self._report_every = drop_report_s
        self._next_report = 0.0
        self._lost_reports = dict.fromkeys(DROP_REASONS, 0)  # drop reports no sink took
        self._reported = dict.fromkeys(DROP_REASONS, 0)  # drops a delivered report told of
        self._noted = dict.fromkeys(DROP_REASONS, 0)  # drops seen by the last report round
        self._sent_at_loss: Optional[int] = None  # `sent` when a report was last lost
        self.sent = 0
        self._parked: Optional[bytes] = None  # a datagram the receiver had no room for
        self._parked_at = 0.0
        self._parked_n = 0
        self._parked_logged = False  # its events were counted in `sent` by the log
        self._stuck = False
        self._thread: Optional[threading.Thread] = None

    # -- producer side (any thread) -------------------------------------------------------
    def emit(self, event: events.Event) -> None:
        queue = self._queue
        if len(queue) >= self._cap:
            self.dropped["queue_full"] += 1
            return
        queue.append(event)
        if event.kind in URGENT:  # the process may be about to die: send now, not next tick
            self._wake.set()

    def emit_later(self, item: tuple[Any, ...]) -> None:
        """Queue an event as `(kind, *fields)` made of values the GC does not track (str,
        numbers, None), built into its Event by LATER[kind] on the sender
        thread. Why: the queue holds events until the next tick, and a burst of new_shape
        events (a dataclass and its lists each, all tracked) was what the collections inside
        watched calls walked longest (signature.shape_text); such a tuple is untracked by the
        first young collection it meets. Never urgent; never raises."""
        queue = self._queue
        if len(queue) >= self._cap:
            self.dropped["queue_full"] += 1
            return
        queue.append(item)

    def lost(self) -> int:
        """Events lost so far, every reason, less the drop reports that were lost (the
        heartbeat's `lost`; each `dropped` report's `total` per reason)."""
        return sum(self.dropped[r] - self._lost_reports[r] for r in DROP_REASONS)

    def depth(self) -> int:
        """Events not yet sent: queued, plus those in a parked datagram."""
        return len(self._queue) + (self._parked_n if self._parked is not None else 0)

    # -- sender thread ----------------------------------------------------------------------
    def start(self, hand_back: bool = False) -> None:
        """Start the sender thread. `hand_back`: its first act gives the GIL back to the caller
        (the at-fork hook), who would otherwise wait out the 5 ms switch interval in
        Thread.start() while the new thread ticks."""
        self._thread = threading.Thread(target=self._run, args=(hand_back,),
                                        name="torch-watchdog-agent", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0,
             last: Optional[Callable[[], events.Event]] = None) -> None:
        """Flush what is queued (best effort within `timeout`), send `last()` (the agent's
        final heartbeat: built once the queue is flushed, its `lost` counts every drop up to
        then, which no later heartbeat would tell), then close the sinks."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is threading.current_thread():
            self._guard(self.drain)
        elif thread is not None:
            thread.join(timeout)
        if last is not None:
            self._guard(lambda: self._send_last(last(), thread is not None and thread.is_alive()
                                                and thread is not threading.current_thread()))
        for sink in (self._socket, self._log):
            if sink is not None:
                sink.close()

    def _send_last(self, event: events.Event, sender_busy: bool) -> None:
        """One event, sent now and retried on a full receiver for LAST_WAIT_S at most: the
        last word at exit. A sender thread still running (past stop's timeout) keeps its own
        socket and log: this uses a socket of its own and leaves the log alone."""
        data = events.encode(event)
        logged = self._log is not None and not sender_busy and self._log.write(data)
        sent = False
        if self._socket is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            deadline = time.monotonic() + LAST_WAIT_S
            try:
                while not sent:
                    try:
                        sock.sendto(data, self._socket.path)
                        sent = True
                    except BlockingIOError:  # the receiver's queue is full: it reads on
                        if time.monotonic() >= deadline:
                            break
                        time.sleep(0.002)
                    except OSError:  # no sidecar
                        break
            finally:
                sock.close()
        if sent or logged:
            self.sent += 1

    def after_fork(self) -> bool:
        """In a forked child, from the at-fork hook: no inherited lock taken, no I/O but closing
        the child's copies of the parent's descriptors. The parent's sender thread does not
        exist here: True if it ran, and the caller should start() this one (after queueing
        what must go first)."""
        running = self._thread is not None and not self._stop.is_set()
        for sink in (self._socket, self._log):
            if sink is not None:
                sink.close()  # the child's copy of the descriptor only
        self.__init__(**self._init_args)  # type: ignore[misc]
        return running

    def _run(self, hand_back: bool = False) -> None:
        if hand_back:
            time.sleep(0)
        next_tick = time.monotonic()
        while True:
            stopping = self._stop.is_set()
            now = time.monotonic()
            if now >= next_tick and not stopping:
                next_tick = now + self._tick_s
                self._guard(self._on_tick)
                self._guard(self._report_drops)
            self._guard(self.drain)
            if stopping:
                return
            self._guard(self._check_receiver)
            wait = next_tick - time.monotonic()
            self._wake.wait(max(0.0, min(wait, 0.005) if self._parked is not None else wait))
            self._wake.clear()

    def _guard(self, fn: Optional[Callable[[], None]]) -> None:
        if fn is None:
            return
        try:
            fn()
        except Exception as e:  # the sender thread must survive anything
            self._on_error(e)

    def _check_receiver(self) -> None:
        """A new receiver (the sidecar restarted) knows nothing of this process: what
        `on_receiver_change` queues (the agent's hello) is sent now, right behind the events
        that found the new receiver, not at the next hello period."""
        if self._socket is None or not self._socket.changed():
            return
        self.receiver_changes += 1
        if self._on_receiver_change is not None:
            self._on_receiver_change()
        self.drain()

    def drain(self) -> None:
        """Send everything queued, packed as several events per datagram (one per line, up to
        MAX_DATAGRAM_BYTES): the receiver then wakes once for many events. A full receiver
        queue (the kernel holds only ~10 datagrams per Unix socket) parks one datagram and
        ends the round; it is retried every few ms for up to FULL_RETRY_S, then dropped.
        Producers never wait for any of this."""
        if self._parked is not None and not self._retry_parked():
            return
        batch: list[bytes] = []
        queue, size, n = self._queue, 0, 0
        while queue:
            n += 1
            if n % YIELD_EVERY == 0:
                # hand the GIL back to the server's threads: a waiting thread gets it only when
                # this one lets go, else after sys.getswitchinterval() (5 ms), inside its call
                time.sleep(0)
            event = queue.popleft()
            if type(event) is tuple:  # emit_later's
                try:
                    event = LATER[event[0]](*event[1:])
                except Exception as e:
                    self._on_error(e)
                    continue
            if self._log is None and self._socket is not None and not self._socket.ready():
                self.dropped["socket"] += 1  # no sink can take it: don't pay for encoding
                continue
            try:
                data = events.encode(event)
            except (TypeError, ValueError) as e:
                self._on_error(e)
                continue
            if batch and size + len(data) + 1 > events.MAX_DATAGRAM_BYTES:
                if not self._flush(batch):
                    return
                batch, size = [], 0
            batch.append(data)
            size += len(data) + 1
        if batch:
            self._flush(batch)

    def _flush(self, batch: list[bytes]) -> bool:
        """Log and send one datagram's worth; False if it had to be parked."""
        payload, n = b"\n".join(batch), len(batch)
        logged = self._log is not None and self._log.write(payload)
        if self._log is not None and not logged:
            self.dropped["log"] += n
        if self._socket is None:
            self.sent += n if logged else 0
            return True
        result = self._socket.send(payload)
        if self._linked is not True and self._on_link is not None:
            self._tell_link(result != DOWN)
        if result == FULL and not self._stuck:
            self._parked, self._parked_n, self._parked_at = payload, n, time.monotonic()
            self._parked_logged = logged
            self.sent += n if logged else 0
            return False
        self._stuck = self._stuck and result != SENT
        if result == SENT or logged:
            self.sent += n
        if result != SENT:
            self.dropped["socket"] += n
        return True

    def _tell_link(self, up: bool) -> None:
        if self._linked is None or up:
            self._linked = up
            try:
                self._on_link(up)  # type: ignore[misc]
            except Exception as e:  # a callback's bug is the agent's error
                self._on_error(e)

    def _retry_parked(self) -> bool:
        if self._socket is None or self._parked is None:  # parked only by a socket's send
            return True
        result = self._socket.send(self._parked)
        if result == FULL and time.monotonic() - self._parked_at < FULL_RETRY_S:
            return False
        if result != SENT:  # a receiver that stopped reading: drop at once until it reads again
            self.dropped["socket"] += self._parked_n
            self._stuck = True
        elif not self._parked_logged:  # sent at last: its events count as sent now
            self.sent += self._parked_n
        self._parked = None
        return True

    def _report_drops(self) -> None:
        """At most one round of `dropped` events per `drop_report_s` (the heartbeat period),
        and none unless events other than drop reports were lost since the last round.

        Drop reports never sustain themselves: with a log and no sidecar listening, a queued
        report would be dropped by the socket, counted, and reported at the next tick, forever.
        So a report is sent here, not queued, and a report that no sink took is counted apart
        (`_lost_reports`, in `dropped` too) and never makes a report itself; its count is told
        again by the next report, sent once new drops come or once a sink took something since
        (the sidecar is back).
        """
        now = time.monotonic()
        if now < self._next_report:
            return
        recovered = self._sent_at_loss is not None and self.sent > self._sent_at_loss
        due = []
        for reason in DROP_REASONS:
            lost = self.dropped[reason] - self._lost_reports[reason]  # not counting reports
            count = lost - self._reported[reason]
            if count > 0 and (lost > self._noted[reason] or recovered):
                due.append(events.Dropped(t=time.time(), pid=os.getpid(), reason=reason,
                                          count=count, total=lost))
            self._noted[reason] = lost
        if not due:
            return
        self._next_report = now + self._report_every
        self._sent_at_loss = None
        for report in due:
            if self._deliver(report):
                self._reported[report.reason] = report.total
            else:
                self._sent_at_loss = self.sent

    def _deliver(self, report: events.Dropped) -> bool:
        """Log and send one drop report now; False if no sink took it (it is counted in
        `dropped` and `_lost_reports` under the reason it was lost for)."""
        data = events.encode(report)
        logged = self._log is not None and self._log.write(data)
        sent = self._socket is not None and self._socket.send(data) == SENT
        if self._log is not None and not logged:
            self.dropped["log"] += 1
            self._lost_reports["log"] += 1
        if self._socket is not None and not sent:
            self.dropped["socket"] += 1
            self._lost_reports["socket"] += 1
        if logged or sent:
            self.sent += 1
        return logged or sent


def log_path_for(template: str, pid: int) -> str:
    """The event log of process `pid`: `{pid}` replaced by it, so the workers of a forking
    server never write, or rotate, each other's file (nothing else in the path is special)."""
    return template.replace("{pid}", str(pid))


_UNSEEN = (-1, -1, -1)  # the socket path before its first stat


def _bound_at(path: str) -> Optional[tuple[int, int, int]]:
    """The socket at `path` now, as (device, inode, ctime), or None if there is none. A sidecar
    that restarts unlinks the path and binds it again: a new inode, and a new ctime where the
    file system hands the freed inode number out again (a chmod changes the ctime too: at worst
    one hello more)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class _SocketSink:
    """Connection-less, non-blocking datagrams to the sidecar's socket path; tells when the
    receiver there changed (`changed()`)."""

    def __init__(self, path: str, reconnect_s: float):
        self.path = path
        self._reconnect_s = reconnect_s
        self._sock: Optional[socket.socket] = None
        self._retry_at = 0.0
        self.up = False
        self._failed = False  # a send failed since the last one that went through
        self._changed = False  # a new receiver that changed() has not told of yet
        self._bound: Optional[tuple[int, int, int]] = _UNSEEN
        self._look_at = 0.0

    def ready(self) -> bool:
        return self._sock is not None or time.monotonic() >= self._retry_at

    def send(self, data: bytes) -> str:
        now = time.monotonic()
        if self._sock is None:
            if now < self._retry_at:
                return DOWN
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        try:
            self._sock.sendto(data, self.path)
        except BlockingIOError:  # the receiver's queue is full; never wait here
            return FULL
        except OSError:  # absent or dead sidecar: back off, try again later
            self._sock.close()
            self._sock = None
            self._retry_at = now + self._reconnect_s
            self.up = False
            self._failed = True
            return DOWN
        if self._failed:  # down, then taken again: a sidecar (re)started at the path
            self._failed = False
            self._changed = True
            self._look(now)  # this receiver is the one the next stat must compare with
        self.up = True
        return SENT

    def changed(self) -> bool:
        """True once per new receiver at the path: one that took a send after a send failed,
        or another socket bound there (the path stat'ed at most every RECEIVER_STAT_S)."""
        now = time.monotonic()
        if now >= self._look_at:
            before = self._bound
            self._look(now)
            if self._bound not in (before, None) and before is not _UNSEEN:
                self._changed = True
                self._failed = False  # the next send that goes through is this same change
                self._retry_at = 0.0  # send to it now, not at the end of the back-off
        changed, self._changed = self._changed, False
        return changed

    def _look(self, now: float) -> None:
        self._bound = _bound_at(self.path)
        self._look_at = now + RECEIVER_STAT_S

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
