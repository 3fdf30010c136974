"""Daemon.tick() driven by hand (a fake clock, a fake NVML backend, the real socket) with
real processes: servers that die and come back, configured replicas, reloads carried out by a
command. Without processes: tests/unit/test_daemon.py."""
from __future__ import annotations

import os
import signal

import structlog

from tests.fakes import Clock
from tests.unit.test_daemon import GPU, MB, rig, send  # noqa: F401  (the fixture)
from tests.fakes import FakeNvml
from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter
from torch_watchdog.sidecar.config import AgentSocketConfig, Config
from torch_watchdog.sidecar.core.lifecycle import Phase
from torch_watchdog.sidecar.daemon import Daemon
from torch_watchdog.sidecar.present.metrics import render
from torch_watchdog.sidecar.sources.nvml import NvmlSource


CHILD = """
import os, sys, time
from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter
em = Emitter(sys.argv[1], None)
em.emit(events.Hello(t=time.time(), pid=os.getpid(), torch="2.13", agent="0", devices=[],
                     config={}, capabilities={}, watched=[], argv="server",
                     server=sys.argv[3] if len(sys.argv) > 3 else None))
for i in range(int(sys.argv[2])):
    em.emit(events.CudagraphRecord(t=time.time(), pid=os.getpid(), phase="record",
                                   compile_id="0/1", key=[i], shape=None, seconds=0.01))
em.drain()
"""


def test_a_server_that_died_and_came_back_starts_a_fresh_state(rig):  # noqa: F811
    """A crash, then systemd's Restart=: the new process is not the old one's growth."""
    import subprocess
    import sys

    from tests.conftest import with_root
    d, _nvml, _clock, _sender = rig

    def server(records: int) -> None:
        subprocess.run([sys.executable, "-c", CHILD, d.cfg.agent.socket_path, str(records)],
                       env=dict(os.environ, PYTHONPATH=with_root()), check=True, timeout=60)

    def recordings() -> int:
        return int(d.host.servers["default"].state.estimates(d.cfg.correlate)["recordings"])

    server(5)  # runs, records 5 graphs, dies
    d.tick()
    assert recordings() == 5
    server(2)  # the restarted server
    d.tick()
    assert recordings() == 2 and d.publisher.actions_total["restart"] == 1


def test_a_reload_cancelled_at_the_recheck_does_not_block_the_next_one(short_tmp):
    """Decided, then cancelled one poll later (the forecast cleared), then needed again: the
    second decision is carried out — the cancelled one started no cooldown."""
    import json
    import time

    from torch_watchdog.sidecar.config import ForecastConfig, PolicyConfig, ReloadConfig

    me = os.getpid()
    nvml = FakeNvml([{"uuid": GPU.encode(), "total": 80_000 * MB, "used": 10_000 * MB,
                      "procs": [(me, 2_000 * MB)]}])
    clock = Clock()
    cfg = Config(agent=AgentSocketConfig(socket_path=os.path.join(short_tmp, "ev.sock")),
                 state_dir=os.path.join(short_tmp, "state"),
                 forecast=ForecastConfig(process_budget_bytes=2_050 * MB, window_s=1.0),
                 policy=PolicyConfig(reload_lead_s=10, alert_lead_s=20, hold_polls=1,
                                     warmup_s=0, cooldown_s=600),
                 reload=ReloadConfig(method="command", command=["true"], timeout_s=10,
                                     hello_timeout_s=0))
    d = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml), clock=clock,
               serve_metrics=False)
    d.start()
    try:
        # compiled 20 s before: the load and the first compile's settling are over
        send(Emitter(cfg.agent.socket_path, None),
             events.Compile(t=clock.t - 20, pid=me, compile_id="0/0", function="f", seconds=1.0))
        level = 2_000

        def poll(grow: int) -> None:
            nonlocal level
            level += grow
            nvml.devices[0]["procs"] = [(me, level * MB)]
            clock.t += 0.1
            d.tick()

        for _ in range(12):
            poll(0)
        for _ in range(3):  # 15 MB in 3 polls (a trend: more than one rise), 35 MB of room
            poll(5)         # left: OOM in ~1 s, a reload is decided
        assert d.host.servers["default"].reload.phase is Phase.DECIDED
        # the server let go of 1.5 GB: at the re-check the forecast has cleared (the rate is
        # the envelope's, which a drop lowers only 30 s on; the room to the budget is larger)
        poll(-1500)
        (first,) = d.reloads.record.entries
        assert first["ok"] is False and first["detail"].startswith("cancelled")
        for _ in range(310):  # 31 s on: the envelope has let go of the old peak
            poll(0)
        for _ in range(12):  # growing again, fast
            poll(15)
        deadline = time.monotonic() + 10
        entries = d.reloads.record.entries
        while not any(e.get("ok") for e in entries) and time.monotonic() < deadline:
            poll(0)
            time.sleep(0.05)
        with open(os.path.join(short_tmp, "state", "reloads.json")) as fh:
            entries = json.load(fh)["reloads"]
        assert [e["ok"] for e in entries] == [False, True]
    finally:
        d.halt()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)


def test_a_replay_of_the_sample_log_takes_the_same_actions_as_the_live_daemon(short_tmp):
    """A real daemon through a cancelled reload, a SIGHUP, a reload carried out, and another
    server's crash and restart; its sample log replayed: the same actions, at the same times,
    on the same targets (server, pids, GPUs)."""
    import subprocess
    import sys
    import time

    from tests.conftest import with_root
    from torch_watchdog.sidecar import config as config_mod
    from torch_watchdog.sidecar.offline.replay import replay

    me, log = os.getpid(), os.path.join(short_tmp, "samples.jsonl")
    path = os.path.join(short_tmp, "w.yaml")

    def write(alert_lead_s: int) -> None:
        with open(path, "w") as fh:
            fh.write(f"sample_log: {log}\nstate_dir: {short_tmp}/state\n"
                     f"agent: {{socket_path: {short_tmp}/s.sock}}\n"
                     f"forecast: {{process_budget_bytes: {2_050 * MB}, window_s: 1.0}}\n"
                     f"policy: {{reload_lead_s: 10, alert_lead_s: {alert_lead_s}, "
                     "hold_polls: 1, warmup_s: 0, cooldown_s: 600}\n"
                     "reload: {method: command, command: [\"true\"], timeout_s: 10, "
                     "hello_timeout_s: 0}\n")

    write(20)
    nvml = FakeNvml([{"uuid": GPU.encode(), "total": 80_000 * MB, "used": 10_000 * MB,
                      "procs": [(me, 2_000 * MB)]}])
    clock = Clock()
    d = Daemon(config_mod.load(path), path, structlog.get_logger(), nvml=NvmlSource(nvml),
               clock=clock, serve_metrics=False)
    live: list = []
    act = d._act
    d._act = lambda a: (live.append(a.as_dict()), act(a))
    d.start()
    level = 2_000

    def poll(grow: int = 0) -> None:
        nonlocal level
        level += grow
        nvml.devices[0]["procs"] = [(me, level * MB)]
        clock.t += 0.1
        d.tick()

    def server(name: str) -> None:  # a process of another server: says hello, then dies
        subprocess.run([sys.executable, "-c", CHILD, d.cfg.agent.socket_path, "1", name],
                       env=dict(os.environ, PYTHONPATH=with_root()), check=True, timeout=60)

    try:
        # compiled 20 s before: the load and the first compile's settling are over
        send(Emitter(d.cfg.agent.socket_path, None),
             events.Compile(t=clock.t - 20, pid=me, compile_id="0/0", function="f",
                            seconds=1.0))
        for _ in range(12):
            poll()
        for _ in range(3):
            poll(5)  # OOM in ~1 s: a reload is decided …
        poll(-1500)  # … and cancelled at the re-check
        write(30)
        d.handle_reload(signal.SIGHUP)
        for _ in range(310):  # 31 s on: the envelope has let go of the old peak
            poll()
        for _ in range(12):  # growing again, fast: decided, carried out
            poll(15)
        deadline = time.monotonic() + 10
        while not any(a["action"] == "reload_ok" for a in live) and time.monotonic() < deadline:
            poll()
            time.sleep(0.02)
        server("worker")
        poll()
        poll()      # the sample says it is dead
        server("worker")  # systemd's Restart=: a new process says hello
        poll()
    finally:
        d.halt()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
    kinds = [a["action"] for a in live]
    for kind in ("cancel", "execute", "reload_ok", "restart"):
        assert kind in kinds, kinds
    assert [a["server"] for a in live if a["action"] == "restart"] == ["worker"]
    assert [a["pids"] for a in live if a["action"] == "execute"] == [[me]]
    replayed = replay([log], Config())
    assert replayed["replay"]["bad_lines"] == 0
    assert replayed["actions"] == live


def test_configured_servers_each_get_their_own_pids_state_and_metrics(
        rig, short_tmp):  # noqa: F811
    """`servers:` lists replicas by pidfile (or unit): each is a server of its own, with its
    pid and its children, whatever the agents say."""
    import subprocess

    from torch_watchdog.sidecar.config import ServerEntry
    d, *_ = rig
    child = subprocess.Popen(["sleep", "30"])
    try:
        files = {}
        for name, pid in (("a", os.getpid()), ("b", child.pid)):
            files[name] = os.path.join(short_tmp, f"{name}.pid")
            with open(files[name], "w") as fh:
                fh.write(f"{pid}\n")
        d._configure(Config(agent=d.cfg.agent, state_dir=d.cfg.state_dir,
                            servers=[ServerEntry(name=n, pidfile=f) for n, f in files.items()]))
        snap = d.tick()
        assert snap.servers["a"]["pids"][0] == os.getpid()
        assert snap.servers["b"]["pids"] == [child.pid]
        assert 'torch_watchdog_cause_active{cause="recompile_storm",server="b"} 0.0' in \
            render(d.registry).decode()
    finally:
        child.kill()
        child.wait()
