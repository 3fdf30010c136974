"""Daemon.tick() driven by hand: a fake clock, a fake NVML backend, the real socket, no
process started. With real processes (a server that dies and comes back, reload commands):
tests/integration/test_daemon_processes.py."""
from __future__ import annotations

import os
from typing import Optional
import signal
import socket

import pytest
import structlog

from tests.fakes import Clock
from tests.fakes import FakeNvml, NVMLError_GpuIsLost
from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter
from torch_watchdog.sidecar.config import AgentSocketConfig, Config, CorrelateConfig
from torch_watchdog.sidecar.daemon import Daemon
from torch_watchdog.sidecar.present.metrics import render
from torch_watchdog.sidecar.sources.nvml import NvmlSource

GPU = "GPU-fake-0"
MB = 1_000_000


def one_gpu_daemon(tmp: str, clock: Clock, **cfg_fields):
    """A daemon on a fake GPU that lists this process: (daemon, nvml, config)."""
    nvml = FakeNvml([{"uuid": GPU.encode(), "total": 80_000 * MB, "used": 10_000 * MB,
                      "procs": [(os.getpid(), 2_000 * MB)]}])
    cfg = Config(agent=AgentSocketConfig(socket_path=os.path.join(tmp, "ev.sock")),
                 state_dir=tmp, **cfg_fields)
    return Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml), clock=clock,
                  serve_metrics=False), nvml, cfg


@pytest.fixture
def rig(short_tmp):
    clock = Clock()
    d, nvml, cfg = one_gpu_daemon(short_tmp, clock, correlate=CorrelateConfig(min_records=10))
    d.start()
    sender = Emitter(cfg.agent.socket_path, None)
    yield d, nvml, clock, sender
    d.halt()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def send(sender: Emitter, *evs: events.Event) -> None:
    """As an agent sends: its hello before its first other event (until a hello places a
    pid, its events are held, in no server)."""
    announced = sender.__dict__.setdefault("announced", set())
    for e in evs:
        if e.pid not in announced:
            announced.add(e.pid)
            if not isinstance(e, events.Hello):
                sender.emit(hello(e.t, e.pid))
        sender.emit(e)
    sender.drain()


def hello(t: float, pid: int, server: Optional[str] = None) -> events.Hello:
    return events.Hello(t=t, pid=pid, torch="2.13", agent="test", devices=[], config={},
                        capabilities={}, watched=["m"], argv="serve", server=server)


def test_ticks_fold_agent_events_with_nvml_per_process_memory(rig):
    d, nvml, clock, sender = rig
    me = os.getpid()
    send(sender, events.Compile(t=clock.t, pid=me, compile_id="0/0", function="f", seconds=2.0))
    d.tick()  # the agent's pid is now watched
    clock.t += 20  # past the compile's settling time
    for i in range(30):  # each poll: 2 recordings, +1 MB of the server's GPU memory
        send(sender, *[events.CudagraphRecord(t=clock.t, pid=me, phase="record",
                                              compile_id="0/1", key=[i, k], shape=None,
                                              seconds=0.01) for k in (0, 1)])
        nvml.devices[0]["procs"] = [(me, (2_000 + i + 1) * MB)]
        nvml.devices[0]["used"] = (10_000 + i + 1) * MB
        clock.t += 0.1
        snap = d.tick()
    assert snap.estimates["recordings"] == 60
    assert snap.estimates["mb_per_graph"] == pytest.approx(0.5, rel=1e-6)
    assert snap.server_gpu_bytes == {GPU: 2_030 * MB}
    assert "cudagraph_per_shape" in snap.active_causes
    assert snap.sources_up == {"nvml": True, "process": True, "agent": True}
    assert snap.forecast["will_oom"] is None  # no request counts: no discovery model
    text = render(d.registry).decode()
    assert 'torch_watchdog_cudagraph_recordings_total{server="default"} 60.0' in text
    assert f'torch_watchdog_server_gpu_memory_bytes{{gpu_uuid="{GPU}",server="default"}} ' \
        '2.03e+09' in text


def test_a_lost_gpu_degrades_the_source_and_the_loop_goes_on(rig):
    d, nvml, clock, sender = rig
    assert d.tick().sources_up["nvml"] is True
    nvml.fail["nvmlDeviceGetMemoryInfo"] = NVMLError_GpuIsLost("GPU is lost")
    clock.t += 0.1
    snap = d.tick()
    assert snap.sources_up["nvml"] is False and snap.devices == ()
    del nvml.fail["nvmlDeviceGetMemoryInfo"]
    clock.t += 0.1
    assert d.tick().sources_up["nvml"] is True  # re-initialised on the next poll


def test_garbage_and_spoofed_datagrams_are_counted(rig):
    d, nvml, clock, sender = rig
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(b"{not json", d.cfg.agent.socket_path)
    s.close()
    sender.emit(events.Heartbeat(t=clock.t, pid=os.getpid() + 1, seq=1, uptime_s=1.0,
                                 queue_depth=0, errors=0))
    sender.drain()
    snap = d.tick()
    assert snap.events_dropped_total["malformed"] == 1
    assert snap.events_dropped_total["spoofed"] == 1
    assert snap.events_received_total == 0 and not d.host.pids()


def test_sighup_keeps_the_old_config_when_the_new_one_is_bad(rig, short_tmp):
    d, *_ = rig
    path = os.path.join(short_tmp, "w.yaml")
    d.config_path = path
    with open(path, "w") as fh:
        fh.write("poll_interval_s: 0.5\n")
    d.handle_reload(signal.SIGHUP)
    assert d.cfg.poll_interval_s == 0.5
    with open(path, "w") as fh:
        fh.write("poll_interval_s: [oops]\n")
    d.handle_reload(signal.SIGHUP)
    assert d.cfg.poll_interval_s == 0.5


def test_signals_are_only_queued_then_dispatched_by_the_loop(rig):
    d, *_ = rig
    d._queue_signal(signal.SIGTERM, None)
    assert d.running and list(d.signals) == [signal.SIGTERM]
    d._dispatch_signals()
    assert not d.running


def test_pidfile_pid_is_watched(rig, short_tmp):
    d, *_ = rig
    pidfile = os.path.join(short_tmp, "server.pid")
    with open(pidfile, "w") as fh:
        fh.write(f"{os.getpid()}\n")
    d._configure(Config(agent=d.cfg.agent, server=type(d.cfg.server)(pidfile=pidfile),
                        state_dir=d.cfg.state_dir))
    # the pidfile's pid, and its children (this process's, a previous test's left to reap)
    (pids,) = d.discovery.configured_pids().values()
    assert os.getpid() in pids
    snap = d.tick()
    assert snap.server_alive is True and snap.server_rss_bytes > 0


def test_the_sample_log_replays_to_the_same_estimates(short_tmp):
    from torch_watchdog.sidecar.offline.replay import replay

    me, log = os.getpid(), os.path.join(short_tmp, "samples.jsonl")
    nvml = FakeNvml([{"uuid": GPU.encode(), "total": 80_000 * MB, "used": 10_000 * MB,
                      "procs": [(me, 2_000 * MB)]}])
    clock = Clock()
    cfg = Config(agent=AgentSocketConfig(socket_path=os.path.join(short_tmp, "s.sock")),
                 correlate=CorrelateConfig(min_records=10), sample_log=log, state_dir=short_tmp)
    d = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml), clock=clock,
               serve_metrics=False)
    d.start()
    sender = Emitter(cfg.agent.socket_path, None)
    try:
        send(sender, events.Compile(t=clock.t, pid=me, compile_id="0/0", function="f",
                                    seconds=2.0))
        d.tick()
        clock.t += 20
        for i in range(30):
            send(sender, *[events.CudagraphRecord(t=clock.t, pid=me, phase="record",
                                                  compile_id="0/1", key=[i, k], shape=None,
                                                  seconds=0.01) for k in (0, 1)])
            nvml.devices[0]["procs"] = [(me, (2_000 + i + 1) * MB)]
            clock.t += 0.1
            live = d.tick().estimates
    finally:
        d.halt()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
    replayed = replay([log], cfg)
    assert replayed["replay"]["bad_lines"] == 0
    for key in ("recordings", "mb_per_graph", "compiles", "memory_bytes"):
        assert replayed["estimates"][key] == live[key], key
    assert [f["cause"] for f in replayed["findings"]] == ["cudagraph_per_shape"]


def test_a_replay_of_the_sample_log_keeps_the_cooldown_of_a_reload_before_the_start(short_tmp):
    """A reload decided before the sidecar started holds the server's cooldown live, and in a
    replay of the sample log: the record's decisions enter the log as an observation."""
    import json

    from torch_watchdog.sidecar.offline.replay import run
    from torch_watchdog.sidecar.offline.traces import Reader, read_all

    log, clock = os.path.join(short_tmp, "samples.jsonl"), Clock()
    with open(os.path.join(short_tmp, "reloads.json"), "w") as fh:
        json.dump({"reloads": [{"t": clock.t - 60, "reason": "oom_forecast", "server": "llm",
                                "ok": True, "detail": "exited after SIGTERM",
                                "seconds": 3.0}]}, fh)
    cfg = Config(agent=AgentSocketConfig(socket_path=os.path.join(short_tmp, "s.sock")),
                 sample_log=log, state_dir=short_tmp)
    nvml = FakeNvml([{"uuid": GPU.encode(), "total": 80_000 * MB, "used": 10_000 * MB,
                      "procs": []}])
    d = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml), clock=clock,
               serve_metrics=False)
    d.start()
    try:
        d.tick()
    finally:
        d.halt()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
    assert d.host.server("llm").policy.reloads == [clock.t - 60]
    replayed = run(read_all([Reader(log)]), cfg)
    assert replayed.host.server("llm").policy.reloads == [clock.t - 60]
    assert replayed.host.server("other").policy.reloads == []


def test_a_replay_of_the_sample_log_follows_the_config_changes(short_tmp):
    """SIGHUP mid-run with a tighter budget: the sample log records each config in force, so
    its replay alerts when the live sidecar did; `--config` (follow_config=False) overrides."""
    from torch_watchdog.sidecar.offline.replay import replay

    me, log = os.getpid(), os.path.join(short_tmp, "samples.jsonl")
    path = os.path.join(short_tmp, "w.yaml")

    def write(budget_mb: int) -> None:
        with open(path, "w") as fh:
            fh.write(f"sample_log: {log}\nstate_dir: {short_tmp}\n"
                     f"agent: {{socket_path: {short_tmp}/s.sock}}\n"
                     f"forecast: {{process_budget_bytes: {budget_mb * MB}, window_s: 2}}\n"
                     "policy: {warmup_s: 0}\n")

    write(50_000)
    nvml = FakeNvml([{"uuid": GPU.encode(), "total": 80_000 * MB, "used": 10_000 * MB,
                      "procs": [(me, 2_000 * MB)]}])
    clock = Clock()
    from torch_watchdog.sidecar import config as config_mod
    d = Daemon(config_mod.load(path), path, structlog.get_logger(), nvml=NvmlSource(nvml),
               clock=clock, serve_metrics=False)
    d.start()
    try:
        # compiled 20 s before: the load and the first compile's settling are over
        send(Emitter(d.cfg.agent.socket_path, None),
             events.Compile(t=clock.t - 20, pid=me, compile_id="0/0", function="f", seconds=1.0))
        for i in range(60):
            if i == 30:
                write(2_100)  # the operator tightens the budget
                d.handle_reload(signal.SIGHUP)
            nvml.devices[0]["procs"] = [(me, (2_000 + i) * MB)]
            clock.t += 0.1
            d.tick()
        live = (d.publisher.actions_total["alert"], d.publisher.actions_total["reload"])
    finally:
        d.halt()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
    assert live == (1, 1)  # after the SIGHUP: the oom_forecast alert, a reload decision
    followed = replay([log], Config())
    assert [(a["action"], a["reason"]) for a in followed["actions"]] == [
        ("alert", "oom_forecast"), ("reload", "oom_forecast")]
    assert followed["actions"][0]["t"] >= 1000.0 + 3.1  # after the change, as live
    assert replay([log], Config(), follow_config=False)["actions"] == []


def test_each_tick_publishes_the_status_page_view(rig):
    d, nvml, clock, sender = rig
    me = os.getpid()
    assert d.status is None  # before the first poll: the page says so
    send(sender, events.Compile(t=clock.t, pid=me, compile_id="0/0", function="f", seconds=2.0))
    d.tick()
    clock.t += 20
    for i in range(30):
        send(sender, events.CudagraphRecord(t=clock.t, pid=me, phase="record", compile_id="0/1",
                                            key=[i], shape=None, seconds=0.01))
        nvml.devices[0]["procs"] = [(me, (2_000 + i + 1) * MB)]
        clock.t += 0.1
        snap = d.tick()
    view = d.status
    assert view.snapshot is snap and view.memory_source == "process"
    assert view.points[-1] == (snap.t, 2_030 * MB) and len(view.points) == 31
    assert [k for _, k in view.marks].count("record") == 30
    assert [c["cause"] for c in view.causes] == ["cudagraph_per_shape"]
    assert ("alert", "cudagraph_per_shape") in [(a["action"], a["reason"]) for a in view.actions]
    assert view.info["polls"] == 31


def test_a_status_page_bug_does_not_stop_the_watching(rig, monkeypatch):
    d, nvml, clock, sender = rig

    def broken(*args):
        raise RuntimeError("bug")
    monkeypatch.setattr(d.publisher.history, "update", broken)
    d.tick()
    clock.t += 0.1
    assert d.tick().t == clock.t and d.ticks == 2 and d.status is None


def test_an_event_from_the_far_future_is_counted_and_the_server_is_still_forecast(rig):
    d, _nvml, clock, sender = rig
    me = os.getpid()
    send(sender, events.Compile(t=clock.t, pid=me, compile_id="0/0", function="f", seconds=1.0))
    d.tick()
    send(sender, events.Calls(t=clock.t + 1e9, pid=me, name="m", calls=1, seconds=0.001,
                              stall_calls=0, stall_seconds=0.0, distinct_shapes=1, window_s=1.0))
    clock.t += 0.1
    d.tick()
    assert 'torch_watchdog_events_skewed_total 1.0' in render(d.registry).decode()
    assert d.host.focus().state.now < clock.t + 1  # the state's clock did not move


def test_the_alerts_in_the_book_are_those_built_from_each_servers_firing_and_view(short_tmp):
    """Every poll's firing alerts equal ones built from scratch from each server's `firing`
    and numbers, while a cause fires through still polls and its description moves with new
    recordings."""
    from torch_watchdog.sidecar.actions import alerts
    from torch_watchdog.sidecar.config import AlertsConfig

    me = os.getpid()
    nvml = FakeNvml([{"uuid": GPU.encode(), "total": 80_000 * MB, "used": 10_000 * MB,
                      "procs": [(me, 2_000 * MB)]}])
    clock = Clock()
    cfg = Config(agent=AgentSocketConfig(socket_path=os.path.join(short_tmp, "ev.sock")),
                 correlate=CorrelateConfig(min_records=10), state_dir=short_tmp,
                 alerts=AlertsConfig(urls=["http://127.0.0.1:9"], instance="box"))
    d = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml), clock=clock,
               serve_metrics=False)  # not started: alerts stay in the book and outbox
    d.intake.pending.append((hello(clock.t, me), me))
    d.intake.pending.append((events.Compile(t=clock.t, pid=me, compile_id="0/0", function="f",
                                     seconds=2.0), me))
    d.tick()
    clock.t += 20
    descriptions = set()
    try:
        for i in range(120):
            if i < 30 or 80 <= i < 90:  # recordings that cost memory, then still, then more
                d.intake.pending.extend((events.CudagraphRecord(
                    t=clock.t, pid=me, phase="record", compile_id="0/1", key=[i, k],
                    shape=None, seconds=0.01), me) for k in (0, 1))
                nvml.devices[0]["procs"] = [(me, nvml.devices[0]["procs"][0][1] + MB)]
                nvml.devices[0]["used"] += MB
            clock.t += 0.1
            d.tick()
            fresh: dict = {}
            for name, server in d.host.servers.items():
                labels = {"service": "inference", "instance": "box", "server": name,
                          "host": socket.gethostname(), "gpu_uuid": GPU}
                fresh.update(alerts.build(server.firing,
                                          server.state.estimates(cfg.correlate),
                                          server.forecast.as_dict(), labels))
            kept = {k: t.alert for k, t in d.alerting.book.tracked.items() if t.ends_at is None}
            assert kept == fresh, i
            descriptions |= {a["annotations"]["description"] for a in fresh.values()}
    finally:
        d.nvml.close()
    assert any(("cause", "cudagraph_per_shape") in key for key in d.alerting.book.tracked)  # fired
    assert len(descriptions) > 10  # … and its description moved with the recordings


def test_the_socket_is_read_between_polls_only_once_a_poll_found_it_busy(rig):
    """A datagram a poll (one agent at 1,000 events/s) waits for the poll: no wake for it. A
    poll that takes several datagrams makes the waits read them as they come (the kernel
    queues ~11), until a poll takes fewer again."""
    d, nvml, clock, sender = rig
    me = os.getpid()

    def beat(seq: int) -> None:
        send(sender, events.Heartbeat(t=clock.t, pid=me, seq=seq, uptime_s=1.0, queue_depth=0,
                                      errors=0))

    def poll() -> None:
        clock.t += 0.1
        d.tick()

    send(sender, hello(clock.t, me))
    poll()
    base = d.intake.accepted  # the hello
    beat(0)
    poll()
    assert d.intake.accepted == base + 1 and not d.intake.eager
    beat(1)
    d._wait(0.05)  # the wait does not take it: the poll does
    assert d.intake.pending == [] and d.intake.accepted == base + 1
    poll()
    assert d.intake.accepted == base + 2 and not d.intake.eager
    for seq in range(2, 2 + 5):  # a burst: 5 datagrams before the next poll
        beat(seq)
    poll()
    assert d.intake.accepted == base + 7 and d.intake.eager
    beat(7)
    d._wait(0.05)  # now the wait takes it as it comes
    assert [e.seq for e, _ in d.intake.pending] == [7]
    poll()  # a poll of one datagram: quiet again
    assert d.intake.accepted == base + 8 and not d.intake.eager
    beat(8)
    d._wait(0.05)
    assert d.intake.pending == []


def test_a_hello_the_unit_lookup_does_not_place_looks_the_unit_up_again_sooner(monkeypatch):
    """A restarted server's new process says hello before the 5 s lookup sees it in its
    unit: taken meanwhile for a server of its own, it got an OOM alert and a reload of its
    own (a second restart, under systemd). Its hello brings the lookup forward (1 s)."""
    from torch_watchdog.sidecar import config as config_mod
    from torch_watchdog.sidecar.sources import discovery as discovery_mod
    clock, looked = Clock(100.0), []
    monkeypatch.setattr(discovery_mod.time, "monotonic", clock)
    monkeypatch.setattr(discovery_mod, "_lookup",
                        lambda unit, pidfile: looked.append(clock()) or (7,))
    cfg = config_mod.from_mapping({"server": {"unit": "llm.service"}})
    d = discovery_mod.Discovery(cfg)
    for t, unplaced in ((100.0, False), (100.5, True), (101.0, False), (101.2, True),
                        (104.0, False), (105.0, False)):
        clock.t = t
        assert d.configured_pids(unplaced) == {"llm.service": (7,)}
    assert looked == [100.0, 101.2]


class CountingNotifier:
    """systemd's notify socket, as the daemon sees it: what was sent."""

    def __init__(self) -> None:
        self.pings = 0

    def watchdog(self) -> bool:
        self.pings += 1
        return True

    def ready(self, status: str = "") -> bool:
        return True

    def status(self, text: str) -> bool:
        return True

    def stopping(self) -> bool:
        return True


def test_a_stage_that_raises_is_logged_counted_and_the_next_poll_goes_on(short_tmp, monkeypatch):
    """A bug in the step (or an action) is one poll's: logged with its traceback as text,
    counted by stage, and the loop goes on; systemd's watchdog is pinged only after a poll
    that decided, so a step that always fails restarts the sidecar."""
    from torch_watchdog.sidecar.core import step as step_mod
    from torch_watchdog.sidecar.core.observations import Sample

    me = os.getpid()
    nvml = FakeNvml([{"uuid": GPU.encode(), "total": 80_000 * MB, "used": 10_000 * MB,
                      "procs": [(me, 2_000 * MB)]}])
    clock, notifier, lines = Clock(), CountingNotifier(), []
    log = structlog.wrap_logger(None, processors=[lambda _l, _m, ev: lines.append(ev) or ""],
                                logger_factory=structlog.ReturnLoggerFactory())
    cfg = Config(agent=AgentSocketConfig(socket_path=os.path.join(short_tmp, "ev.sock")),
                 state_dir=short_tmp)
    d = Daemon(cfg, None, log, nvml=NvmlSource(nvml), clock=clock, notifier=notifier,
               serve_metrics=False)
    real, broken = step_mod.step, {"on": True}

    def failing(host, obs, c):
        if broken["on"] and isinstance(obs, Sample):
            raise RuntimeError("a bug in the step")
        return real(host, obs, c)

    monkeypatch.setattr(step_mod, "step", failing)
    d.intake.pending.append((hello(clock.t, me, "llm"), me))
    clock.t += 0.1
    d.tick()
    assert d.poll_errors == {"decide": 1} and notifier.pings == 0
    (failed,) = [e for e in lines if e.get("event") == "poll failed"]
    assert failed["stage"] == "decide" and "RuntimeError: a bug in the step" in failed["traceback"]
    assert "llm" in d.host.servers  # the hello, stepped on its own, was not lost
    broken["on"] = False
    monkeypatch.setattr(d.reloads, "carry_out", lambda action: 1 / 0)
    clock.t += 0.1
    snap = d.tick()
    assert notifier.pings == 1 and snap.poll_errors_total == {"decide": 1}
    assert b'torch_watchdog_poll_errors_total{stage="decide"} 1.0' in render(d.registry)


def test_a_restarted_daemon_knows_the_servers_before_their_next_hello(short_tmp):
    me, clock = os.getpid(), Clock()
    first, nvml, cfg = one_gpu_daemon(short_tmp, clock)
    first.intake.pending.append((hello(clock.t, me, "llm"), me))
    for _ in range(3):
        clock.t += 0.1
        first.tick()
    assert os.path.exists(os.path.join(short_tmp, "servers.json"))
    second = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml), clock=clock,
                    serve_metrics=False)
    assert second.host.owner == {me: "llm"}
    second.intake.pending.append((events.Heartbeat(t=clock.t, pid=me, seq=1, uptime_s=1.0,
                                                   queue_depth=0, errors=0), me))
    clock.t += 0.1
    snap = second.tick()
    assert set(snap.servers) == {"llm"} and "default" not in second.host.servers
