"""The measured failure, reproduced: idle and slow clients on the sidecar's HTTP port. On main
(a ThreadingHTTPServer, no timeout) 400 idle connections held 403 threads, and a slowloris
client (one header byte a second) held a thread for as long as it liked. Now one socket thread
and a fixed pool of render threads serve every connection: /metrics answers in milliseconds
with 400 idle and 50 slowloris connections open, and the thread count does not move."""
from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time
import urllib.request

import psutil
import pytest

from tests.unit.test_status import a_view
from torch_watchdog.sidecar.present import web
from torch_watchdog.sidecar.present.metrics import SnapshotCollector, make_registry, stop

IDLE, SLOW = 400, 50


@pytest.fixture(autouse=True)
def enough_files():
    """450 client sockets and the server's in one process: over a 1024 soft limit with
    pytest's own files; the hard limit is the machine's to give."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 4096) if hard != resource.RLIM_INFINITY else 4096
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def served():
    collector = SnapshotCollector()
    view = a_view()
    collector.update(view.snapshot)
    server, thread = web.serve("127.0.0.1", 0, make_registry(collector), lambda: view)
    yield server
    stop(server, thread)
    assert not thread.is_alive()


def scrape(port: int, path: str = "/metrics") -> tuple[int, bytes, float]:
    started = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        return reply.status, reply.read(), time.monotonic() - started


@contextlib.contextmanager
def idle_and_slowloris(port: int, idle: int = IDLE, slow: int = SLOW):
    """`idle` connections that send nothing and `slow` ones that send a GET's head one byte a
    second (from a thread of their own); all closed on exit."""
    socks: list[socket.socket] = []
    stop_event = threading.Event()
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 64 + b"\r\n\r\n"

    def trickle(slow_socks: list[socket.socket]) -> None:
        deadline = time.monotonic() + 60  # bounded even if the test forgets to stop it
        i = 0
        while not stop_event.wait(1.0) and time.monotonic() < deadline and i < len(head) - 2:
            i += 1
            for s in slow_socks:
                with contextlib.suppress(OSError):
                    s.send(head[i:i + 1])

    driver = None
    try:
        for _ in range(idle):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        slow_socks = []
        for _ in range(slow):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.send(head[:1])
            socks.append(s)
            slow_socks.append(s)
        driver = threading.Thread(target=trickle, args=(slow_socks,), daemon=True)
        driver.start()
        yield driver
    finally:
        stop_event.set()
        if driver is not None:
            driver.join(5)
        for s in socks:
            s.close()


def http_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("torch-watchdog-http")]


def test_metrics_answers_within_a_second_under_idle_and_slowloris_connections(served):
    port = served.server_port
    assert scrape(port)[0] == 200
    before = psutil.Process().num_threads()
    assert len(http_threads()) == 1 + web.WORKERS
    with idle_and_slowloris(port):
        times = []
        until = time.monotonic() + 3.0  # while the slowloris clients trickle 3 more bytes
        while time.monotonic() < until:
            code, body, took = scrape(port)
            assert code == 200 and b"torch_watchdog_cudagraph_recordings_total" in body
            times.append(took)
            time.sleep(0.25)  # a scrape every quarter second, not a busy loop
        assert len(times) >= 5 and max(times) < 1.0, times
        assert scrape(port, "/")[0] == 200 and scrape(port, "/status.json")[0] == 200
        # the server's threads did not move; the process has one more: the trickling driver
        assert len(http_threads()) == 1 + web.WORKERS
        assert psutil.Process().num_threads() <= before + 1
        assert len(served._conns) <= served.max_open  # the oldest idle ones were closed


def server_with(**limits) -> tuple[web.StatusServer, threading.Thread]:
    server = web.StatusServer("127.0.0.1", 0, make_registry(SnapshotCollector()),
                              lambda: None, time.time, **limits)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    return server, thread


def closed_by_server_after(sock: socket.socket, timeout_s: float,
                           every_s: float = 0.0, byte: bytes = b"G") -> float:
    """Seconds until the server closes `sock` (recv returns b"" or the connection resets),
    sending `byte` every `every_s` meanwhile (0: nothing); inf if it stays open."""
    started = time.monotonic()
    sock.settimeout(every_s or timeout_s)
    while time.monotonic() - started < timeout_s:
        try:
            if sock.recv(1) == b"":
                return time.monotonic() - started
        except TimeoutError:
            with contextlib.suppress(OSError):
                sock.send(byte)
        except ConnectionResetError:
            return time.monotonic() - started
    return float("inf")


def test_a_slowloris_client_is_cut_at_the_head_deadline_however_it_trickles():
    server, thread = server_with(head_timeout_s=1.5)
    try:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as s:
            s.send(b"G")
            took = closed_by_server_after(s, 6.0, every_s=0.2)  # 5 bytes a second
        assert 1.4 <= took < 3.0, took
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as s:
            assert 1.4 <= closed_by_server_after(s, 6.0) < 3.0  # idle: the same
        assert scrape(server.server_port)[0] == 200 and server.closed_early == 2
    finally:
        stop(server, thread)


def test_past_the_connection_cap_the_oldest_idle_one_is_closed_for_a_new_one():
    server, thread = server_with(max_open=8)
    socks = []
    try:
        for _ in range(8):
            socks.append(socket.create_connection(("127.0.0.1", server.server_port), timeout=5))
        code, _, took = scrape(server.server_port)  # the 9th: served at once
        assert code == 200 and took < 1.0
        assert closed_by_server_after(socks[0], 3.0) < 3.0   # the oldest made room
        assert len(server._conns) <= 8
    finally:
        for s in socks:
            s.close()
        stop(server, thread)


def test_an_oversized_head_is_refused_not_buffered():
    server, thread = server_with()
    try:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\nX: " + b"a" * (web.MAX_HEAD_BYTES + 10))
            assert s.recv(100).startswith(b"HTTP/1.0 431 ")
    finally:
        stop(server, thread)
