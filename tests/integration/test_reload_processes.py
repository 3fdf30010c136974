"""Reload executors against real child processes, a real HTTP hook, real commands, a real
forking master and its workers. The record and the policy's use of it, without processes:
tests/unit/test_reload.py."""
from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from typing import Optional

import psutil
import pytest

from torch_watchdog.procfs import process_start_time
from torch_watchdog.sidecar.actions.executors import post_hook, run_command, signal_processes
from torch_watchdog.sidecar.core.observations import ReloadOutcome


GRACEFUL = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n" \
           "print('up', flush=True)\ntime.sleep(60)"


STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" \
           "print('up', flush=True)\ntime.sleep(60)"


def child(code: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def test_graceful_server_exits_on_sigterm():
    p = child(GRACEFUL)
    out = signal_processes({p.pid}, grace_s=10)
    assert out.ok and out.detail == "exited after SIGTERM" and out.seconds < 5
    assert p.wait(5) == 0


def test_server_ignoring_sigterm_is_killed_after_the_grace_period():
    p = child(STUBBORN)
    out = signal_processes({p.pid}, grace_s=0.5)
    assert out.ok and "SIGKILL after" in out.detail and out.seconds >= 0.5
    p.wait(5)  # psutil already reaped it, so the return code is not the signal
    assert not psutil.pid_exists(p.pid)


ECHO = ("import signal, sys\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('TERM', flush=True), sys.exit(0)))\n"
        "print('up', flush=True)\n"
        "for line in sys.stdin:\n    print('pong', flush=True)\n")


def echo_child() -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", ECHO], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def answers(p: subprocess.Popen) -> str:
    """What the child says to a ping: "pong", or "TERM" if a SIGTERM reached it first (a
    signal sent before the ping is handled before the child reads it)."""
    p.stdin.write("ping\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


def test_a_pid_reused_after_the_decision_is_not_signalled():
    decided_t = time.time()
    deadline = time.monotonic() + 5
    while time.time() < decided_t + 0.05 and time.monotonic() < deadline:
        time.sleep(0.01)  # past a clock tick (10 ms) of the start-time reading
    p = echo_child()      # the server exited; an unrelated process got its pid
    try:
        out = signal_processes({p.pid}, grace_s=1, decided_t=decided_t)
        assert not out.ok and "no server process to signal" in out.detail
        assert f"pid {p.pid}: started" in out.detail and "after the reload decision: pid " \
            "reused" in out.detail
        assert answers(p) == "pong"  # alive, never signalled
    finally:
        p.kill()
        p.wait(5)


def test_the_process_seen_before_the_decision_is_signalled():
    p = echo_child()
    seen = process_start_time(p.pid)
    assert abs(seen - time.time()) < 5
    out = signal_processes({p.pid}, grace_s=5, decided_t=time.time(),
                           expected_start={p.pid: seen})
    assert out.ok and out.detail == "exited after SIGTERM"
    assert p.stdout.readline().strip() == "TERM" and p.wait(5) == 0


def test_a_pid_that_started_at_another_time_than_the_one_seen_is_refused():
    p = echo_child()
    try:
        out = signal_processes({p.pid}, grace_s=1,
                               expected_start={p.pid: process_start_time(p.pid) - 30})
        assert not out.ok and "not the server seen" in out.detail
        assert answers(p) == "pong"
    finally:
        p.kill()
        p.wait(5)


def test_commands():
    assert run_command(["true"], 5).ok
    bad = run_command([sys.executable, "-c", "import sys; sys.exit('boom')"], 5)
    assert not bad.ok and "exit 1" in bad.detail and "boom" in bad.detail
    assert not run_command(["/no/such/command"], 5).ok
    assert "timed out" in run_command(["sleep", "5"], 0.2).detail


@pytest.fixture
def hook():
    calls = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            calls.append(self.path)
            self.send_response(500 if self.path == "/broken" else 202)
            self.end_headers()

        def log_message(self, *args):
            return None

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", calls
    server.shutdown()
    server.server_close()


def test_http_drain_hook(hook):
    base, calls = hook
    assert post_hook(base + "/drain", 5) == ReloadOutcome(True, "HTTP 202", pytest.approx(0, abs=5))
    assert not post_hook(base + "/broken", 5).ok
    assert calls == ["/drain", "/broken"]
    assert not post_hook("http://127.0.0.1:1/drain", 2).ok  # refused


# -- masters with workers (a real forking master; the hellos fed as the daemon would) --------
MASTER = r"""
import os, signal, sys, time
kids, hup = set(), []

def spawn():
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
        while True:
            time.sleep(1)
    kids.add(pid)

signal.signal(signal.SIGHUP, lambda *a: hup.append(1))
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
for _ in range(2):
    spawn()
print("up", flush=True)
while True:
    if hup:                      # gunicorn's way: new workers first, then the old ones stopped
        hup.clear()
        old = set(kids)
        spawn(); spawn()
        for k in old:
            os.kill(k, signal.SIGTERM)
    try:
        pid = os.waitpid(-1, os.WNOHANG)[0]
    except ChildProcessError:
        pid = 0
    if pid:
        kids.discard(pid)
        if len(kids) < 2 and os.environ.get("RESPAWN") == "1":
            spawn()
    time.sleep(0.02)
"""


class Announcer(threading.Thread):
    """The master's children say hello (ppid: the master) as they appear, like agents, and
    report an answered watched call `serve_after_s` later (None: never, a worker still cold)."""

    def __init__(self, master: int, board, server: str = "llm",
                 serve_after_s: Optional[float] = 0.3):
        super().__init__(daemon=True)
        self.master, self.board, self.server = master, board, server
        self.serve_after_s = serve_after_s
        self.seen: set = set()
        self.hello_at: dict = {}
        self.served: set = set()
        self.stop = threading.Event()

    def run(self) -> None:
        from types import SimpleNamespace
        while not self.stop.is_set():
            try:
                kids = {c.pid for c in psutil.Process(self.master).children()
                        if c.status() != psutil.STATUS_ZOMBIE}
            except psutil.Error:
                return
            self.board.add(SimpleNamespace(kind="hello", pid=k, ppid=self.master,
                                           server=self.server) for k in kids - self.seen)
            now = time.monotonic()
            for k in kids - self.seen:
                self.hello_at[k] = now
            self.seen |= kids
            if self.serve_after_s is not None:
                warm = {k for k, t in self.hello_at.items()
                        if k not in self.served and now - t >= self.serve_after_s}
                self.board.add(SimpleNamespace(kind="calls", pid=k, calls=1) for k in warm)
                self.served |= warm
            time.sleep(0.05)


@pytest.fixture
def master(request):
    respawn = getattr(request, "param", True)
    p = subprocess.Popen([sys.executable, "-c", MASTER], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, RESPAWN="1" if respawn else "0"))
    assert p.stdout.readline().strip() == "up"
    yield p
    for c in psutil.Process(p.pid).children():
        c.kill()
    p.kill()
    p.wait(5)


def announced(master_pid: int, serve_after_s: Optional[float] = 0.3):
    from torch_watchdog.sidecar.actions.hellos import Hellos
    board = Hellos()
    ann = Announcer(master_pid, board, serve_after_s=serve_after_s)
    ann.start()
    deadline = time.monotonic() + 10
    while len(ann.seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    return board, ann, sorted(ann.seen)


def test_rolling_replaces_the_workers_one_at_a_time_and_keeps_the_master(master):
    from torch_watchdog.sidecar.actions.executors import rolling
    board, ann, old = announced(master.pid)
    try:
        done = rolling(set(old), 5, 10, board)
        assert done.ok and not done.failed, done.detail
        new = {c.pid for c in psutil.Process(master.pid).children()}
        assert master.poll() is None and len(new) == 2 and not new & set(old)
        assert all(f"{pid}->" in done.detail for pid in old)
    finally:
        ann.stop.set()


def test_rolling_waits_for_each_replacement_to_answer_before_the_next_worker(master):
    """A replacement says hello at import, cold: the next worker is stopped only once it
    answered a watched call (1.5 s after its hello here)."""
    from torch_watchdog.sidecar.actions.executors import rolling
    board, ann, old = announced(master.pid, serve_after_s=1.5)
    try:
        done = rolling(set(old), 5, 10, board)
        assert done.ok, done.detail
        (first, _), (second, _) = sorted((t, p) for p, t in ann.hello_at.items()
                                         if p not in old)
        assert second - first >= 1.5  # the second worker waited for the first one's answer
        assert "ready in" in done.detail
    finally:
        ann.stop.set()


def test_rolling_stops_at_a_replacement_that_never_answers(master):
    from torch_watchdog.sidecar.actions.executors import rolling
    board, ann, old = announced(master.pid, serve_after_s=None)
    try:
        done = rolling(set(old), 5, 1.0, board)
        assert not done.ok and done.failed
        assert "said hello but answered no watched call within 1 s" in done.detail
        assert psutil.pid_exists(old[1])  # the next worker was left serving
    finally:
        ann.stop.set()


@pytest.mark.parametrize("master", [False], indirect=True)
def test_rolling_stops_at_a_worker_not_replaced_and_reports_failure(master):
    from torch_watchdog.sidecar.actions.executors import rolling
    board, ann, old = announced(master.pid)
    try:
        done = rolling(set(old), 5, 1.0, board)
        assert not done.ok and done.failed
        assert "no hello from its replacement within 1 s" in done.detail
        assert psutil.pid_exists(old[1])  # the next worker was left serving
    finally:
        ann.stop.set()


def test_signal_leaves_the_master_of_the_workers_running(master):
    board, ann, old = announced(master.pid)
    try:
        board.add([type("H", (), {"kind": "hello", "pid": master.pid, "ppid": os.getpid(),
                                  "server": "llm"})])
        done = signal_processes({master.pid, *old}, 5, hellos=board)
        assert done.ok and f"master {master.pid} not signalled" in done.detail
        assert master.poll() is None
    finally:
        ann.stop.set()


def test_master_hup_waits_for_every_new_worker_and_every_old_one_gone(master):
    from torch_watchdog.sidecar.actions.executors import master_hup
    board, ann, old = announced(master.pid)
    try:
        done = master_hup(set(old), 5, 10, board)
        assert done.ok, done.detail
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                       for p in old)
    finally:
        ann.stop.set()


def test_a_single_server_with_children_without_agents_has_no_master():
    """A server with inductor's compile workers: its children said no hello; `signal` signals
    it as before, and `rolling` refuses."""
    from types import SimpleNamespace

    from torch_watchdog.sidecar.actions.hellos import Hellos, master_and_workers
    from torch_watchdog.sidecar.actions.executors import rolling
    server = child(GRACEFUL)
    helper = subprocess.Popen(["sleep", "30"])
    board = Hellos()
    board.add([SimpleNamespace(kind="hello", pid=server.pid, ppid=os.getpid(), server="llm")])
    try:
        assert master_and_workers({server.pid, helper.pid}, board) == (None, [])
        done = rolling({server.pid}, 5, 1, board)
        assert not done.ok and not done.failed and "no master" in done.detail
    finally:
        server.kill()
        helper.kill()
