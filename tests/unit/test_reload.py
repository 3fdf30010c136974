"""The reload record (reloads.json) and what the policy makes of it, whom a reload never
signals, the reload's thread, a unit server's return: no process started. The executors
against real child processes, a real HTTP hook, real commands:
tests/integration/test_reload_processes.py."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from torch_watchdog.sidecar.actions.record import NOT_CARRIED_OUT, ReloadLog
from torch_watchdog.sidecar.actions.reloading import Reloader
from torch_watchdog.sidecar.actions.executors import signal_processes
from torch_watchdog.sidecar.actions.identity import refusal
from torch_watchdog.sidecar.config import Config, PolicyConfig
from torch_watchdog.sidecar.core.observations import ReloadHistory, ReloadOutcome
from torch_watchdog.sidecar.core import policy, step
from torch_watchdog.sidecar.core.correlate import State
from torch_watchdog.sidecar.core.forecast import Forecast

GB = 1 << 30


def test_no_process_is_a_failed_reload():
    assert not signal_processes({2 ** 22 + 12345}, grace_s=1).ok


@pytest.mark.parametrize("pid, says", [(0, "never signalled"), (1, "never signalled"),
                                       (-1, "never signalled"),
                                       (os.getpid(), "the sidecar itself"),
                                       # (a test run whose parent has exited has init's)
                                       *[(os.getppid(), "the sidecar's parent")] *
                                       (os.getppid() > 1)])
def test_init_the_sidecar_and_its_parent_are_never_signalled(pid, says):
    assert refusal(pid) == f"pid {pid}: {says}"
    assert refusal(pid, decided_t=time.time() + 3600) == f"pid {pid}: {says}"


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
    r._thread.join(5)  # the reload's thread ends
    assert not r.busy
    assert r.poll() == ReloadOutcome(True, "[1, 3]", 0.1) and r.poll() is None
    broken = Reloader(lambda pids: 1 / 0)
    broken.start(set())
    broken._thread.join(5)
    assert not broken.poll().ok


def test_a_cancelled_decision_is_kept_but_not_counted(tmp_path):
    from torch_watchdog.sidecar.actions.record import CANCELLED
    path = str(tmp_path / "reloads.json")
    log = ReloadLog(path)
    log.record(100.0, ReloadOutcome(False, CANCELLED, 0.0), "oom_forecast")
    log.record(200.0, ReloadOutcome(True, "exited after SIGTERM", 1.0), "oom_forecast")
    assert len(ReloadLog(path).entries) == 2
    assert ReloadLog(path).times() == [200.0]  # the cooldown counts what was done


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

    # the hellos are on the board as restart returns: a short wait decides as a long one
    done = executors.back_after(restart, board, 0.1, unit="llm.service")({40})
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
    reloader, _ = reloads._running["llm"]
    reloader._thread.join(5)  # the thread that hands over the failed outcome ends
    (outcome,) = reloads.outcomes(START + 1)
    assert not outcome.ok and "OSError: no such unit" in outcome.detail
    assert outcome.server == "llm" and "reload not started" in log.lines
