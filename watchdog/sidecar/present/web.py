"""The sidecar's HTTP endpoint, one address and port: `/metrics` (Prometheus text), `/` (the
status page), `/status.json` (the same data as JSON); anything else is 404.

A small ThreadingHTTPServer of our own (prometheus_client's start_http_server serves only the
registry). A request reads the latest references the loop published — the collector's Snapshot
and the StatusView — so it never waits for the loop, and the loop never waits for it; an error
while rendering answers 500 and is logged once per path, never raised.
"""
from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from torch_watchdog.sidecar.present.history import StatusView
from torch_watchdog.sidecar.present.page import render_page
from torch_watchdog.sidecar.present.status import build_status

log = logging.getLogger(__name__)

HTML = "text/html; charset=utf-8"
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"


class StatusServer(ThreadingHTTPServer):
    daemon_threads = True           # a slow client never holds up the sidecar's exit
    request_queue_size = 16

    def __init__(self, address: str, port: int, registry: CollectorRegistry,
                 status: Callable[[], Optional[StatusView]], clock: Callable[[], float]):
        self.registry, self.status, self.clock = registry, status, clock
        self.failed_paths: set[str] = set()
        self.address_family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
        super().__init__((address, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind asks the resolver for our FQDN, which can hang on a host
        # without DNS; the name is only used in CGI environments
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("HTTP request from %s failed", client_address, exc_info=True)

    # -- routes: each returns (content type, body) ------------------------------------------
    def metrics(self) -> tuple[str, bytes]:
        return CONTENT_TYPE_LATEST, generate_latest(self.registry)

    def status_json(self) -> tuple[str, bytes]:
        body = json.dumps(build_status(self.status(), self.clock()), allow_nan=False)
        return JSON, body.encode()

    def page(self) -> tuple[str, bytes]:
        now = self.clock()
        return HTML, render_page(build_status(self.status(), now), now).encode()


ROUTES: dict[str, Callable[[StatusServer], tuple[str, bytes]]] = {
    "/metrics": StatusServer.metrics, "/status.json": StatusServer.status_json,
    "/": StatusServer.page, "/index.html": StatusServer.page,
}


class _Handler(BaseHTTPRequestHandler):
    server: StatusServer
    server_version = "torch-watchdog"

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        path = urllib.parse.urlsplit(self.path).path
        route = ROUTES.get(path)
        if route is None:
            self._send(404, TEXT, f"not found: {path} (try /, /status.json, /metrics)\n".encode(),
                       send_body)
            return
        try:
            ctype, body = route(self.server)
        except Exception as exc:  # a bug in a view must not look like a dead sidecar
            if path not in self.server.failed_paths:
                self.server.failed_paths.add(path)
                log.warning("rendering %s failed: %r", path, exc, exc_info=True)
            self._send(500, TEXT, f"cannot render {path}: {exc!r}\n".encode(), send_body)
            return
        self._send(200, ctype, body, send_body)

    def _send(self, code: int, ctype: str, body: bytes, send_body: bool) -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if send_body:
                self.wfile.write(body)
        except OSError:  # the client went away
            pass

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


def read_status(base_url: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """GET <base_url>/status.json; raises OSError when nothing answers (or answers an error),
    ValueError when what answers is not a sidecar's status."""
    url = base_url.rstrip("/") + "/status.json"
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        data = json.loads(reply.read().decode("utf-8"))
    if not isinstance(data, dict) or "memory" not in data or "forecast" not in data:
        raise ValueError(f"{url} did not answer with a torch-watchdog status")
    return data


def local_url(address: str, port: int) -> str:
    """Where a client on this machine reaches a sidecar bound to address:port."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(address, address)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
