"""The reload record (`<state_dir>/reloads.json`) against real kills and a real daemon start.

On main: a sidecar killed between recording a decision and acting on it left a decision that
held the next reload back for the whole cooldown, and 7 of 8 corrupt files silently emptied
the history (a 4th reload inside the hour). tests/unit/test_reload.py holds the table of
corrupt files; here, processes are SIGKILLed while writing and while deciding, and the real
Daemon starts on a corrupt record."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import structlog

from tests.conftest import ROOT, with_root
from tests.fakes import Clock
from tests.fakes import FakeNvml
from torch_watchdog.sidecar.actions.record import NOT_CARRIED_OUT, TEMP_PREFIX, ReloadLog
from torch_watchdog.sidecar.config import AgentSocketConfig, Config, PolicyConfig
from torch_watchdog.sidecar.core import policy
from torch_watchdog.sidecar.core.correlate import State
from torch_watchdog.sidecar.core.forecast import Forecast
from torch_watchdog.sidecar.daemon import Daemon
from torch_watchdog.sidecar.sources.nvml import NvmlSource

WRITER = """
import sys
from torch_watchdog.sidecar.actions.record import ReloadLog
from torch_watchdog.sidecar.core.observations import ReloadOutcome
log = ReloadLog(sys.argv[1])
t = 1000.0
log.record(t, None, "oom_forecast", "a")
print("ready", flush=True)
while True:  # a decision, then its outcome, as fast as the disk allows
    t += 1
    log.record(t, None, "oom_forecast", "a")
    log.record(t, ReloadOutcome(True, "exited after SIGTERM", 1.0), "oom_forecast", "a")
"""

DECIDER = """
import sys, time
from torch_watchdog.sidecar.actions.record import ReloadLog
ReloadLog(sys.argv[1]).record(float(sys.argv[2]), None, "oom_forecast", "a")
print("decided", flush=True)
time.sleep(60)  # killed here: before acting
"""


def child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=with_root()))


def test_a_sidecar_killed_while_writing_always_leaves_a_whole_record(tmp_path):
    path = str(tmp_path / "reloads.json")
    rnd = random.Random(7)
    seen = 0
    for _ in range(12):
        p = child(WRITER, path)
        try:
            assert p.stdout.readline().strip() == "ready"
            time.sleep(rnd.uniform(0.0, 0.05))  # a random point in the write loop
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(10)
        log = ReloadLog(path)  # the next start
        assert log.unreadable is None and log.error is None, log.unreadable
        assert log.entries and all(isinstance(e["t"], float) for e in log.entries)
        assert not [n for n in os.listdir(tmp_path) if n.startswith(TEMP_PREFIX)]
        seen = max(seen, len(log.entries))
    assert seen > 1  # the kills did land inside the write loop


def test_a_decision_whose_sidecar_was_killed_before_acting_does_not_hold_the_next(tmp_path):
    path = str(tmp_path / "reloads.json")
    decided = time.time()
    p = child(DECIDER, path, repr(decided))
    try:
        assert p.stdout.readline().strip() == "decided"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    log = ReloadLog(path, now=decided + 5, max_per_hour=3)
    assert "never carried out: not counted" in log.repairs[0]
    assert log.decisions() == []  # no cooldown: the server may be reloaded at once
    (entry,) = json.load(open(path))["reloads"]
    assert entry["ok"] is False and entry["detail"] == NOT_CARRIED_OUT


@pytest.mark.parametrize("content", [b"{\"reloads\": [{\"t\": 17", b"\x00\x9cgarbage",
                                     b"[]", b""])
def test_the_daemon_starting_on_a_corrupt_record_reloads_nothing_for_an_hour(short_tmp,
                                                                             content):
    with open(os.path.join(short_tmp, "reloads.json"), "wb") as fh:
        fh.write(content)
    clock = Clock(time.time())
    cfg = Config(agent=AgentSocketConfig(socket_path=os.path.join(short_tmp, "ev.sock")),
                 state_dir=short_tmp, policy=PolicyConfig(hold_polls=1, warmup_s=0))
    nvml = FakeNvml([{"uuid": b"GPU-0", "total": 80 << 30, "used": 1 << 30, "procs": []}])
    d = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml), clock=clock,
               serve_metrics=False)
    try:
        assert d.reloads.record.unreadable and "reloads are suspended for an hour" in \
            d.reloads.record.unreadable
        # a forecast calling for a reload every poll, on a server first seen now
        ps = d.host.server("vllm").policy
        fc = Forecast(budget_bytes=1 << 30, level_bytes=1 << 30, seconds_linear=10.0)
        reloads = [t for t in range(int(clock.t), int(clock.t) + 3590, 10)
                   if any(a.kind == "reload" for a in policy.decide(
                       State(first_t=0.0, now=float(t)), fc, ps, cfg.policy))]
        assert reloads == []
    finally:
        d.halt()


def test_a_corrupt_record_is_alerted_for_as_long_as_the_sidecar_runs_and_replays_alike(
        short_tmp):
    """The step decides the `reload_record_unreadable` alert (a host alert, of no one server)
    from an observation the daemon writes to its sample log: a replay of the log fires it too."""
    from torch_watchdog.sidecar.core import step
    from torch_watchdog.sidecar.core.observations import ConfigChange
    from torch_watchdog.sidecar.offline.traces import Reader

    with open(os.path.join(short_tmp, "reloads.json"), "wb") as fh:
        fh.write(b"\x00garbage")
    clock = Clock(time.time())
    log = os.path.join(short_tmp, "samples.jsonl")
    cfg = Config(agent=AgentSocketConfig(socket_path=os.path.join(short_tmp, "ev.sock")),
                 state_dir=short_tmp, sample_log=log)
    nvml = FakeNvml([{"uuid": b"GPU-0", "total": 80 << 30, "used": 1 << 30, "procs": []}])
    d = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml), clock=clock,
               serve_metrics=False)
    posted = []
    d.alerting.sender = type("Sender", (), {"submit": lambda self, batch: posted.extend(batch),
                                            "sent": {}, "failed": {}, "dropped": {},
                                            "stop": lambda self: None,
                                            "start": lambda self: None})()
    try:
        d.start()
        for _ in range(3):
            clock.t += 1.0
            d.tick()
    finally:
        d.halt()
    unreadable = [a for a in posted
                  if a["labels"]["alertname"] == "TorchCompileReloadRecordUnreadable"]
    assert unreadable and "server" not in unreadable[0]["labels"]  # the host's, of no server
    assert "reloads are suspended for an hour" in unreadable[0]["annotations"]["description"]
    host, fired = step.Host(), []
    for obs in Reader(log):
        result = None if isinstance(obs, ConfigChange) else step.step(host, obs, cfg)
        if result is not None and result.poll is not None:
            fired.append(result.poll.host_firing)
    assert fired and all("reload_record_unreadable" in f for f in fired)
    assert "reloads are suspended for an hour" in fired[0]["reload_record_unreadable"]["detail"]
