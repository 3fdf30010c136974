"""gpu.attribution: in a pod without hostPID NVML lists host pids that match none of the
server's; the sidecar then meters the pod's GPU as a whole and its status page says so.
Daemon.tick() driven by hand: a fake clock, a fake NVML backend, the real socket."""
from __future__ import annotations

import os
import signal

import pytest
import structlog

from tests.fakes import Clock
from tests.fakes import FakeNvml
from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter
from torch_watchdog.sidecar.config import AgentSocketConfig, Config, GpuConfig
from torch_watchdog.sidecar.daemon import Daemon
from torch_watchdog.sidecar.present.page import render_page
from torch_watchdog.sidecar.present.status import build_status, format_terminal
from torch_watchdog.sidecar.sources.nvml import NvmlSource

GPU = "GPU-pod-0"
MB = 1_000_000
HOST_PID = 4_000_000  # the server as the host sees it: no pid in this namespace


@pytest.fixture
def run(short_tmp):
    made = []

    def start(attribution: str, procs: list) -> dict:
        me = os.getpid()
        nvml = FakeNvml([{"uuid": GPU.encode(), "total": 80_000 * MB, "used": 30_000 * MB,
                          "procs": procs}])
        clock = Clock(1000.0)
        cfg = Config(agent=AgentSocketConfig(socket_path=os.path.join(short_tmp, "ev.sock")),
                     state_dir=short_tmp, gpu=GpuConfig(attribution=attribution))
        d = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml),
                   clock=clock, serve_metrics=False)
        made.append(d)
        d.start()
        sender = Emitter(cfg.agent.socket_path, None)
        sender.emit(events.Hello(t=clock(), pid=me, torch="2.13", agent="0", devices=[GPU],
                                 config={}, capabilities={}, watched=[], argv="server"))
        sender.drain()
        for _ in range(5):
            d.tick()
            clock.advance(0.1)
        return build_status(d.status, clock())

    yield start
    for d in made:
        d.halt()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def test_auto_without_the_servers_pids_meters_the_pods_gpu_and_says_so(run):
    status = run("auto", [(HOST_PID, 29_000 * MB)])
    memory = status["memory"]
    assert memory["source"] == "device"
    assert memory["level_bytes"] == 30_000 * MB  # the GPU's used memory, not nothing
    assert "hostPID" in memory["attribution"]
    assert "hostPID" in render_page(status, status["t"])
    assert "hostPID" in format_terminal(status, "http://x", status["t"])


def test_auto_with_the_servers_pid_listed_stays_per_process(run):
    status = run("auto", [(os.getpid(), 29_000 * MB)])
    assert status["memory"]["source"] == "process"
    assert status["memory"]["level_bytes"] == 29_000 * MB
    assert status["memory"]["attribution"] is None


def test_process_never_takes_the_device_for_the_server(run):
    status = run("process", [(HOST_PID, 29_000 * MB)])
    assert status["memory"]["source"] is None and status["memory"]["level_bytes"] is None
    assert "node-level" in status["memory"]["attribution"]


def test_device_uses_the_device_even_when_nvml_names_the_server(run):
    status = run("device", [(os.getpid(), 29_000 * MB)])
    assert status["memory"]["source"] == "device"
    assert status["memory"]["level_bytes"] == 30_000 * MB
    assert "gpu.attribution device" in status["memory"]["attribution"]


def test_an_unknown_attribution_is_a_config_error():
    from torch_watchdog.sidecar.config import ConfigError, from_mapping
    with pytest.raises(ConfigError, match="gpu.attribution"):
        from_mapping({"gpu": {"attribution": "pod"}})
