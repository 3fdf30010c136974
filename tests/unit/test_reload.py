"""Reload executors against real child processes, a real HTTP hook, real commands."""
from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time

import psutil
import pytest

from torch_watchdog.sidecar.actions.reload import (Outcome, Reloader, ReloadLog, post_hook, run_command,
                                     signal_processes)

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


def test_no_process_is_a_failed_reload():
    assert not signal_processes({2 ** 22 + 12345}, grace_s=1).ok


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
    assert post_hook(base + "/drain", 5) == Outcome(True, "HTTP 202", pytest.approx(0, abs=5))
    assert not post_hook(base + "/broken", 5).ok
    assert calls == ["/drain", "/broken"]
    assert not post_hook("http://127.0.0.1:1/drain", 2).ok  # refused


def test_reload_log_survives_a_restart(tmp_path):
    path = str(tmp_path / "state" / "reloads.json")
    log = ReloadLog(path)
    log.record(100.0, None, "oom_forecast")  # the decision, before acting
    assert ReloadLog(path).times() == [100.0]  # a sidecar restarting now sees it
    log.record(100.0, Outcome(True, "exited after SIGTERM", 2.5), "oom_forecast")
    (entry,) = ReloadLog(path).entries
    assert entry["ok"] is True and entry["seconds"] == 2.5


def test_reload_log_tolerates_garbage_and_unwritable_paths(tmp_path):
    bad = tmp_path / "reloads.json"
    bad.write_text("{not json")
    assert ReloadLog(str(bad)).times() == []
    log = ReloadLog("/proc/forbidden/reloads.json")
    log.record(1.0, None, "oom_forecast")
    assert log.error and log.times() == [1.0]


def test_reloader_runs_one_at_a_time_off_the_loop():
    release = threading.Event()
    r = Reloader(lambda pids: (release.wait(5), Outcome(True, f"{sorted(pids)}", 0.1))[1])
    r.start({3, 1})
    assert r.busy and r.poll() is None
    release.set()
    deadline = time.monotonic() + 5
    while r.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.poll() == Outcome(True, "[1, 3]", 0.1) and r.poll() is None
    broken = Reloader(lambda pids: 1 / 0)
    broken.start(set())
    while broken.busy:
        time.sleep(0.01)
    assert not broken.poll().ok


def test_a_cancelled_decision_is_kept_but_not_counted(tmp_path):
    from torch_watchdog.sidecar.actions.reload import CANCELLED
    path = str(tmp_path / "reloads.json")
    log = ReloadLog(path)
    log.record(100.0, Outcome(False, CANCELLED, 0.0), "oom_forecast")
    log.record(200.0, Outcome(True, "exited after SIGTERM", 1.0), "oom_forecast")
    assert len(ReloadLog(path).entries) == 2
    assert ReloadLog(path).times() == [200.0]  # the cooldown counts what was done
