"""Reload executors against real child processes, a real HTTP hook, real commands."""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from typing import Optional

import psutil
import pytest

from torch_watchdog.sidecar.actions.record import NOT_CARRIED_OUT, ReloadLog
from torch_watchdog.sidecar.actions.reloading import Reloader
from torch_watchdog.sidecar.actions.executors import post_hook, run_command, signal_processes
from torch_watchdog.sidecar.actions.identity import refusal
from torch_watchdog.procfs import process_start_time
from torch_watchdog.sidecar.config import Config, PolicyConfig
from torch_watchdog.sidecar.core.observations import ReloadHistory, ReloadOutcome
from torch_watchdog.sidecar.core import policy, step
from torch_watchdog.sidecar.core.correlate import State
from torch_watchdog.sidecar.core.forecast import Forecast

GB = 1 << 30

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


@pytest.mark.parametrize("pid, says", [(0, "never signalled"), (1, "never signalled"),
                                       (-1, "never signalled"),
                                       (os.getpid(), "the sidecar itself"),
                                       # (a test run whose parent has exited has init's)
                                       *[(os.getppid(), "the sidecar's parent")] *
                                       (os.getppid() > 1)])
def test_init_the_sidecar_and_its_parent_are_never_signalled(pid, says):
    assert refusal(pid) == f"pid {pid}: {says}"
    assert refusal(pid, decided_t=time.time() + 3600) == f"pid {pid}: {says}"


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


def test_reload_log_survives_a_restart(tmp_path):
    path = str(tmp_path / "state" / "reloads.json")
    log = ReloadLog(path)
    log.record(100.0, None, "oom_forecast")  # the decision, before acting
    log.executing(100.0, None)               # carrying it out
    assert ReloadLog(path, now=200.0).times() == [100.0]  # a sidecar restarting now counts it
    log.record(100.0, ReloadOutcome(True, "exited after SIGTERM", 2.5), "oom_forecast")
    (entry,) = ReloadLog(path, now=200.0).entries
    assert entry["ok"] is True and entry["seconds"] == 2.5


def test_an_unwritable_record_is_kept_in_memory_and_reported():
    log = ReloadLog("/proc/forbidden/reloads.json")
    log.record(1.0, None, "oom_forecast")
    assert log.error and log.error.startswith("/proc/forbidden/reloads.json: ") \
        and log.times() == [1.0]


def test_a_failed_write_leaves_the_old_record_whole(tmp_path, monkeypatch):
    path = tmp_path / "reloads.json"
    log = ReloadLog(str(path))
    log.record(100.0, None, "oom_forecast", "a")
    before = path.read_bytes()

    def crash(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", crash)
    log.record(100.0, ReloadOutcome(True, "exited after SIGTERM", 1.0), "oom_forecast", "a")
    assert log.error.endswith("No space left on device")
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["reloads.json"]


# --- a record that cannot be trusted: loud, and no reload for an hour ----------------------

START = 1_000_000.0
POLICY = PolicyConfig(hold_polls=1, warmup_s=0, cooldown_s=600, max_reloads_per_hour=3)
THREE_IN_THE_HOUR = [{"t": START - d, "reason": "oom_forecast", "server": "a", "ok": True,
                      "detail": "exited after SIGTERM", "seconds": 3.0}
                     for d in (1800.0, 1200.0, 600.0)]


def reload_times(log: ReloadLog, until_s: float, server: str = "a") -> list[float]:
    """When the policy, seeded from `log` as the daemon seeds it, reloads `server` under a
    forecast that calls for a reload every poll (one poll every 10 s from START)."""
    host = step.Host()
    step.step(host, ReloadHistory(START, tuple(log.decisions())), Config())
    ps = host.server(server).policy
    fc = Forecast(budget_bytes=GB, level_bytes=GB, seconds_linear=10.0)
    out = []
    now = START
    while now < START + until_s:
        if any(a.kind == "reload" for a in policy.decide(State(first_t=0.0, now=now), fc,
                                                           ps, POLICY)):
            out.append(now)
        now += 10.0
    return out


def _good() -> str:
    return json.dumps({"reloads": THREE_IN_THE_HOUR})


def _entry(**change) -> str:
    return json.dumps({"reloads": THREE_IN_THE_HOUR[:2] + [{**THREE_IN_THE_HOUR[2], **change}]})


def _unreadable(path):
    path.write_text(_good())
    path.chmod(0)


CORRUPT = {  # name: (how the file is made, what the error says)
    "truncated JSON": (lambda p: p.write_text(_good()[:len(_good()) // 2]), "not JSON"),
    "garbage bytes": (lambda p: p.write_bytes(b"\x00\xff\xfe\x81garbage\x9c" * 10),
                      "not JSON"),
    "empty file": (lambda p: p.write_bytes(b""), "empty"),
    "list at top level": (lambda p: p.write_text(json.dumps(THREE_IN_THE_HOUR)),
                          'not {"reloads": [...]}'),
    "reloads not a list": (lambda p: p.write_text(json.dumps({"reloads": {"t": START}})),
                           'not {"reloads": [...]}'),
    "an entry not an object": (lambda p: p.write_text(json.dumps({"reloads": [START]})),
                               "reloads[0]: not an object"),
    "t a string": (lambda p: p.write_text(_entry(t=str(START))), "reloads[2]: t must be a finite"),
    "t NaN": (lambda p: p.write_text(_entry(t=float("nan"))), "reloads[2]: t must be a finite"),
    "t a bool": (lambda p: p.write_text(_entry(t=True)), "reloads[2]: t must be a finite"),
    "server a number": (lambda p: p.write_text(_entry(server=7)),
                        "reloads[2]: server must be a string"),
    "ok a string": (lambda p: p.write_text(_entry(ok="yes")),
                    "reloads[2]: ok must be true, false or null"),
    "a directory": (lambda p: p.mkdir(), "cannot read it (Is a directory)"),
    "no permission": (_unreadable, "cannot read it (Permission denied)"),
}


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_a_corrupt_record_is_loud_and_allows_no_4th_reload_inside_the_hour(tmp_path, name):
    make, says = CORRUPT[name]
    path = tmp_path / "reloads.json"
    make(path)
    if name == "no permission" and os.access(path, os.R_OK):
        pytest.skip("root reads the file anyway")
    log = ReloadLog(str(path), now=START, max_per_hour=POLICY.max_reloads_per_hour)
    assert log.unreadable == log.error
    assert log.unreadable.startswith(f"{path}: {says}")
    assert "reloads are suspended for an hour" in log.unreadable
    assert "remove the file and restart the sidecar" in log.unreadable
    # 3 reloads in the last hour, then the record broke: the 4th waits a full hour from the
    # start (on main: a reload at once), and reloads resume after it
    assert reload_times(log, 3600 + 120)[0] >= START + 3600
    assert reload_times(log, 3600 + 120, server="b")[0] >= START + 3600  # every server


def test_the_corrupt_file_is_kept_aside_when_the_record_is_next_written(tmp_path):
    path = tmp_path / "reloads.json"
    path.write_text("{garbage")
    log = ReloadLog(str(path), now=START, max_per_hour=3)
    log.record(START + 3700, None, "oom_forecast", "a")
    assert (tmp_path / "reloads.json.unreadable").read_text() == "{garbage"
    assert ReloadLog(str(path), now=START + 3701).unreadable is None


def test_a_good_record_counts_what_it_holds(tmp_path):
    path = tmp_path / "reloads.json"
    path.write_text(_good())
    log = ReloadLog(str(path), now=START, max_per_hour=3)
    assert log.unreadable is None and log.error is None and log.repairs == []
    # the oldest of the three leaves the hour at START + 1800
    assert reload_times(log, 3600)[0] == START + 1800
    assert reload_times(log, 60, server="b") == [START]  # another server's reloads are its own


def test_a_decision_time_in_the_future_is_clamped_not_blocking_for_good(tmp_path):
    path = tmp_path / "reloads.json"
    ahead = START + 30 * 86400  # a clock set back a month, or a hand edit
    path.write_text(json.dumps({"reloads": [{**THREE_IN_THE_HOUR[0], "t": ahead}]}))
    log = ReloadLog(str(path), now=START, max_per_hour=3)
    assert log.unreadable is None
    (repair,) = log.repairs
    assert "in the future: clamped to now" in repair
    assert log.times() == [START]
    assert reload_times(log, 3600)[0] == START + POLICY.cooldown_s  # a cooldown, not a month
    assert json.loads(path.read_text())["reloads"][0]["t"] == START  # written back


def test_a_decision_never_carried_out_does_not_hold_the_next_reload(tmp_path):
    # the sidecar was killed between recording its decision and acting on it
    path = tmp_path / "reloads.json"
    ReloadLog(str(path)).record(START - 30, None, "oom_forecast", "a")
    log = ReloadLog(str(path), now=START, max_per_hour=3)
    (repair,) = log.repairs
    assert "never carried out: not counted" in repair
    assert reload_times(log, 60) == [START]  # at once, not after the cooldown
    (entry,) = json.loads(path.read_text())["reloads"]
    assert entry["ok"] is False and entry["detail"] == NOT_CARRIED_OUT
    assert ReloadLog(str(path), now=START + 1).repairs == []  # resolved once


def test_a_decision_being_carried_out_when_the_sidecar_stopped_still_counts(tmp_path):
    path = tmp_path / "reloads.json"
    first = ReloadLog(str(path))
    first.record(START - 30, None, "oom_forecast", "a")
    first.executing(START - 30, "a")  # SIGTERM may have gone out
    log = ReloadLog(str(path), now=START, max_per_hour=3)
    assert "stopped while carrying it out: counted" in log.repairs[0]
    assert reload_times(log, 3600)[0] == START - 30 + POLICY.cooldown_s


def test_reloader_runs_one_at_a_time_off_the_loop():
    release = threading.Event()
    r = Reloader(lambda pids: (release.wait(5), ReloadOutcome(True, f"{sorted(pids)}", 0.1))[1])
    r.start({3, 1})
    assert r.busy and r.poll() is None
    release.set()
    deadline = time.monotonic() + 5
    while r.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.poll() == ReloadOutcome(True, "[1, 3]", 0.1) and r.poll() is None
    broken = Reloader(lambda pids: 1 / 0)
    broken.start(set())
    while broken.busy:
        time.sleep(0.01)
    assert not broken.poll().ok


def test_a_cancelled_decision_is_kept_but_not_counted(tmp_path):
    from torch_watchdog.sidecar.actions.record import CANCELLED
    path = str(tmp_path / "reloads.json")
    log = ReloadLog(path)
    log.record(100.0, ReloadOutcome(False, CANCELLED, 0.0), "oom_forecast")
    log.record(200.0, ReloadOutcome(True, "exited after SIGTERM", 1.0), "oom_forecast")
    assert len(ReloadLog(path).entries) == 2
    assert ReloadLog(path).times() == [200.0]  # the cooldown counts what was done


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


@pytest.mark.parametrize("heard, back", [((50,), None), ((50, 77), 77)])
def test_a_unit_server_is_back_only_when_a_process_of_its_cgroup_says_hello(monkeypatch, heard,
                                                                            back):
    """A hello naming the server is anyone's to send: for a server configured by its unit,
    only a new process in the unit's cgroup (pid 77 here; 50 is outside) brings it back."""
    from torch_watchdog import events
    from torch_watchdog.sidecar.actions import executors
    from torch_watchdog.sidecar.actions.hellos import Hellos
    from torch_watchdog.sidecar.core.observations import ReloadOutcome
    monkeypatch.setattr(executors, "unit_cgroup", lambda unit: f"/system.slice/{unit}")
    monkeypatch.setattr(executors, "in_cgroup",
                        lambda pid, group: pid == 77 and group == "/system.slice/llm.service")
    board = Hellos()

    def hello(pid: int) -> events.Hello:
        return events.Hello(t=time.time(), pid=pid, torch="", agent="", devices=[], config={},
                            capabilities={}, watched=[], argv="", server="llm.service", ppid=1)

    board.add([hello(40)])  # the old process

    def restart(pids):
        board.add([hello(pid) for pid in heard])
        return ReloadOutcome(True, "exit 0", 0.0)

    done = executors.back_after(restart, board, 1.0, unit="llm.service")({40})
    if back is None:
        assert not done.ok and done.failed, done.detail
    else:
        assert done.ok and done.detail == f"exit 0; back: pid {back} said hello", done.detail


def test_a_reload_that_cannot_start_ends_failed_not_executing_for_good(tmp_path, monkeypatch):
    """An executor that raised before its thread started left no outcome: the server stayed
    "executing" and was never reloaded again. The next poll reads a failed outcome naming
    the error."""
    from torch_watchdog.sidecar.actions import executors
    from torch_watchdog.sidecar.actions.reloading import Reloads
    from torch_watchdog.sidecar.config import Config
    from torch_watchdog.sidecar.core.results import Execute
    from torch_watchdog.sidecar.sources.discovery import Discovery

    class Log:
        def __init__(self):
            self.lines = []

        def exception(self, msg, **kw):
            self.lines.append(msg)
        warning = error = info = exception

    cfg = Config(state_dir=str(tmp_path))
    log = Log()
    reloads = Reloads(cfg, log, Discovery(cfg), now=START)

    def broken(*a, **kw):
        raise OSError("no such unit")
    monkeypatch.setattr(executors, "executor", broken)
    reloads.carry_out(Execute(START, "oom_forecast", {}, "llm", (4242,), (), "oom_forecast",
                              False, START - 0.1))
    deadline = time.monotonic() + 5
    outcomes = []
    while not outcomes and time.monotonic() < deadline:
        outcomes = reloads.outcomes(START + 1)
        time.sleep(0.01)
    (outcome,) = outcomes
    assert not outcome.ok and "OSError: no such unit" in outcome.detail
    assert outcome.server == "llm" and "reload not started" in log.lines
