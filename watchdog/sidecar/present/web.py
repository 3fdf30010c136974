"""The sidecar's HTTP endpoint, one address and port: `/metrics` (Prometheus text), `/` (the status
page), `/status.json` (the same data as JSON); anything else is 404.

A small server of our own (prometheus_client's start_http_server serves only the registry, and
one thread per connection with no timeout). A request reads the latest references the loop
published — the collector's Snapshot and the StatusView — so it never waits for the loop, and
the loop never waits for it; an error while rendering answers 500 and is logged once per path,
never raised.

Idle and slow clients must not take the sidecar down with them (a thread per connection is a
thread per idle or slowloris client, for ever). So one thread owns every socket, non-blocking,
behind a selector: it reads a request's head (a deadline of `HEAD_TIMEOUT_S` from the accept,
however slowly it trickles in), hands the complete head to a fixed pool of `WORKERS` render
threads, and writes their answer back (a deadline of `WRITE_TIMEOUT_S`). At most `MAX_OPEN`
connections are held; a new one closes the oldest still sending its head. With 400 idle and 50
slowloris connections open, /metrics answers in milliseconds and the sidecar runs 1 + WORKERS
HTTP threads (tests/chaos/test_http_faults.py). One request per connection (HTTP/1.0):
Prometheus reconnects each scrape anyway.
"""
from __future__ import annotations

import collections
import errno
import io
import json
import logging
import queue
import selectors
import socket
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from torch_watchdog.sidecar.present.history import StatusView
from torch_watchdog.sidecar.present.page import render_page
from torch_watchdog.sidecar.present.status import build_status

log = logging.getLogger(__name__)

HTML = "text/html; charset=utf-8"
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"

WORKERS = 4               # render threads: a render takes milliseconds, the network none of them
MAX_OPEN = 256            # connections held at once; well under a default 1024-file limit
HEAD_TIMEOUT_S = 10.0     # from the accept to the request's blank line (slowloris)
WRITE_TIMEOUT_S = 10.0    # from the answer being ready to its last byte taken by the client
MAX_HEAD_BYTES = 16384    # a GET's head is a few hundred bytes
BACKLOG = 128             # a burst of connections waits in the kernel, not refused
TOO_LARGE = (b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
             b"Connection: close\r\n\r\n")


class _Conn:
    __slots__ = ("sock", "address", "state", "deadline", "data")

    def __init__(self, sock: socket.socket, address: Any, deadline: float):
        self.sock, self.address, self.deadline = sock, address, deadline
        self.state = "head"          # head -> render (a worker has it) -> write
        self.data = bytearray()      # the head as it arrives; then the answer left to send


class StatusServer:
    """Serves ROUTES on address:port; `serve_forever()` on one thread, `shutdown()` and
    `server_close()` from another (the socketserver names the daemon already uses)."""

    def __init__(self, address: str, port: int, registry: CollectorRegistry,
                 status: Callable[[], Optional[StatusView]], clock: Callable[[], float],
                 workers: int = WORKERS, max_open: int = MAX_OPEN,
                 head_timeout_s: float = HEAD_TIMEOUT_S,
                 write_timeout_s: float = WRITE_TIMEOUT_S):
        self.registry, self.status, self.clock = registry, status, clock
        self.failed_paths: set[str] = set()
        self.workers, self.max_open = workers, max_open
        self.head_timeout_s, self.write_timeout_s = head_timeout_s, write_timeout_s
        self.closed_early = 0        # connections closed for a deadline or to make room
        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((address, port))
            self.socket.listen(BACKLOG)
            self.socket.setblocking(False)
        except OSError:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]
        self._conns: "collections.OrderedDict[socket.socket, _Conn]" = collections.OrderedDict()
        self._jobs: "queue.SimpleQueue[Optional[_Conn]]" = queue.SimpleQueue()
        self._answers: "queue.SimpleQueue[tuple[_Conn, bytes]]" = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._listening_paused_until = 0.0
        self._serving = False

    # -- routes: each returns (content type, body) ------------------------------------------
    # `server`: the drill-down asked for (`?server=NAME`); None: the host view
    def metrics(self, server: Optional[str] = None) -> tuple[str, bytes]:
        return CONTENT_TYPE_LATEST, generate_latest(self.registry)

    def status_json(self, server: Optional[str] = None) -> tuple[str, bytes]:
        body = json.dumps(build_status(self.status(), self.clock(), server), allow_nan=False)
        return JSON, body.encode()

    def page(self, server: Optional[str] = None) -> tuple[str, bytes]:
        now = self.clock()
        return HTML, render_page(build_status(self.status(), now, server), now).encode()

    # -- life cycle -----------------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.2) -> None:
        """The socket thread, until `shutdown()`; starts and ends the render threads."""
        self._serving = True
        workers = [threading.Thread(target=self._work, name=f"torch-watchdog-http-{i}",
                                    daemon=True) for i in range(self.workers)]
        for w in workers:
            w.start()
        sel = selectors.DefaultSelector()
        try:
            sel.register(self.socket, selectors.EVENT_READ, "listen")
            sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            while not self._stop.is_set():
                self._tick(sel, poll_interval)
        finally:
            for conn in list(self._conns.values()):
                self._close(conn, sel)
            for _ in workers:
                self._jobs.put(None)
            for w in workers:
                w.join(5.0)
            sel.close()
            self._stopped.set()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop `serve_forever()` and wait for it (at most `timeout_s`)."""
        self._stop.set()
        self._wake()
        if self._serving:
            self._stopped.wait(timeout_s)

    def server_close(self) -> None:
        for s in (self.socket, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("HTTP request from %s failed", client_address, exc_info=True)

    # -- the socket thread ------------------------------------------------------------------
    def _tick(self, sel: selectors.BaseSelector, poll_interval: float) -> None:
        now = time.monotonic()
        if self._listening_paused_until and now >= self._listening_paused_until:
            self._listening_paused_until = 0.0
            sel.register(self.socket, selectors.EVENT_READ, "listen")
        if self._conns or self._listening_paused_until:
            soonest = min((c.deadline for c in self._conns.values() if c.state != "render"),
                          default=now + poll_interval)
            timeout: Optional[float] = max(0.0, min(poll_interval, soonest - now))
        else:  # nothing due: wait for a client; shutdown() and the render threads wake it
            timeout = None  # (waking every 0.2 s to look was 0.7 ms of CPU a second, idle)
        for key, events in sel.select(timeout):
            if key.data == "listen":
                self._accept(sel)
            elif key.data == "wake":
                self._drain_wake()
            elif events & selectors.EVENT_READ:
                self._read(key.data, sel)
            elif events & selectors.EVENT_WRITE:
                self._send(key.data, sel)
        while True:  # answers the render threads finished
            try:
                conn, answer = self._answers.get_nowait()
            except queue.Empty:
                break
            if conn.sock.fileno() < 0:
                continue
            conn.state, conn.data = "write", bytearray(answer)
            conn.deadline = time.monotonic() + self.write_timeout_s
            sel.register(conn.sock, selectors.EVENT_WRITE, conn)
            self._send(conn, sel)
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.state != "render" and c.deadline <= now]:
            self.closed_early += 1
            self._close(conn, sel)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(64):  # then let the others be served
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS: make room, or wait a little
                if e.errno in (errno.EMFILE, errno.ENFILE) and self._evict(sel):
                    continue
                log.debug("accept failed: %r", e)
                sel.unregister(self.socket)
                self._listening_paused_until = time.monotonic() + 0.1
                return
            if len(self._conns) >= self.max_open:
                self._evict(sel)
            sock.setblocking(False)
            conn = _Conn(sock, address, time.monotonic() + self.head_timeout_s)
            self._conns[sock] = conn
            sel.register(sock, selectors.EVENT_READ, conn)

    def _evict(self, sel: selectors.BaseSelector) -> bool:
        """Close the oldest connection still sending its head (idle or slowloris); a request
        being answered is kept."""
        for conn in self._conns.values():
            if conn.state == "head":
                self.closed_early += 1
                self._close(conn, sel)
                return True
        return False

    def _read(self, conn: _Conn, sel: selectors.BaseSelector) -> None:
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client went away
            self._close(conn, sel)
            return
        conn.data += chunk
        if b"\r\n\r\n" in conn.data or b"\n\n" in conn.data:
            sel.unregister(conn.sock)
            conn.state = "render"
            self._jobs.put(conn)
        elif len(conn.data) > MAX_HEAD_BYTES:
            try:
                conn.sock.send(TOO_LARGE)
            except OSError:
                pass
            self._close(conn, sel)

    def _send(self, conn: _Conn, sel: selectors.BaseSelector) -> None:
        try:
            sent = conn.sock.send(conn.data)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn, sel)
            return
        del conn.data[:sent]
        if not conn.data:
            self._close(conn, sel)

    def _close(self, conn: _Conn, sel: selectors.BaseSelector) -> None:
        self._conns.pop(conn.sock, None)
        try:
            sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"w")
        except OSError:  # full (already woken) or closed
            pass

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    # -- the render threads ---------------------------------------------------------------
    def _work(self) -> None:
        while True:
            conn = self._jobs.get()
            if conn is None:
                return
            out = _Output()
            try:
                # a request read by the socket thread, answered into a buffer (setup() below):
                # not the socket and server BaseHTTPRequestHandler's types name
                _Handler((bytes(conn.data), out), conn.address, self)  # type: ignore[arg-type]
            except Exception:  # a bug here must not kill a render thread
                self.handle_error(None, conn.address)
            self._answers.put((conn, out.getvalue()))
            self._wake()


class _Output(io.BytesIO):
    def close(self) -> None:  # the handler closes its wfile; the answer is read after
        pass


ROUTES: dict[str, Callable[[StatusServer, Optional[str]], tuple[str, bytes]]] = {
    "/metrics": StatusServer.metrics, "/status.json": StatusServer.status_json,
    "/": StatusServer.page, "/index.html": StatusServer.page,
}


class _Handler(BaseHTTPRequestHandler):
    """One request, parsed from the head the socket thread read; the answer goes to a buffer
    the socket thread sends."""
    server: StatusServer  # type: ignore[assignment]
    server_version = "torch-watchdog"

    def setup(self) -> None:
        head, out = self.request
        self.rfile, self.wfile = io.BytesIO(head), out

    def finish(self) -> None:
        pass

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        split = urllib.parse.urlsplit(self.path)
        path = split.path
        server = urllib.parse.parse_qs(split.query).get("server", [None])[0] or None
        route = ROUTES.get(path)
        if route is None:
            self._send(404, TEXT, f"not found: {path} (try /, /status.json, /metrics)\n".encode(),
                       send_body)
            return
        try:
            ctype, body = route(self.server, server)
        except Exception as exc:  # a bug in a view must not look like a dead sidecar
            if path not in self.server.failed_paths:
                self.server.failed_paths.add(path)
                log.warning("rendering %s failed: %r", path, exc, exc_info=True)
            self._send(500, TEXT, f"cannot render {path}: {exc!r}\n".encode(), send_body)
            return
        self._send(200, ctype, body, send_body)

    def _send(self, code: int, ctype: str, body: bytes, send_body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the sidecar's log is JSON on stderr; requests are not worth a line each


def serve(address: str, port: int, registry: CollectorRegistry,
          status: Optional[Callable[[], Optional[StatusView]]] = None,
          clock: Callable[[], float] = time.time) -> tuple[StatusServer, threading.Thread]:
    """Serve on address:port (0: any free port, read `server.server_port`) in a daemon thread;
    raises OSError when the port cannot be bound. `status` returns the latest StatusView (None
    before the first poll)."""
    server = StatusServer(address, port, registry, status or (lambda: None), clock)
    thread = threading.Thread(target=server.serve_forever, name="torch-watchdog-http",
                              kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    return server, thread


def read_status(base_url: str, timeout_s: float = 3.0,
                server: Optional[str] = None) -> dict[str, Any]:
    """GET <base_url>/status.json (`server`: that server's drill-down); raises OSError when
    nothing answers (or answers an error), ValueError when what answers is not a sidecar's
    status."""
    url = base_url.rstrip("/") + "/status.json" + (
        "" if server is None else "?" + urllib.parse.urlencode({"server": server}))
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        data = json.loads(reply.read().decode("utf-8"))
    if not isinstance(data, dict) or "memory" not in data or "forecast" not in data:
        raise ValueError(f"{url} did not answer with a torch-watchdog status")
    return data


def local_url(address: str, port: int) -> str:
    """Where a client on this machine reaches a sidecar bound to address:port."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(address, address)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
