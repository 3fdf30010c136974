"""The real daemon as a subprocess: the real agent sends over the real socket, /metrics is
scraped over HTTP, SIGHUP and SIGTERM are real signals, sd_notify goes to a real socket."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from tests.conftest import free_port, scrape, wait_for, with_root
import torch
import torch._dynamo

import torch_watchdog.agent as agent_mod

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def daemon(short_tmp):
    port = free_port()
    sock = os.path.join(short_tmp, "run", "events.sock")
    cfg = os.path.join(short_tmp, "watchdog.yaml")
    with open(cfg, "w") as fh:
        fh.write(f"metrics_port: {port}\nstate_dir: {short_tmp}\nagent:\n  socket_path: {sock}\n")
    notify_path = os.path.join(short_tmp, "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(10)
    env = dict(os.environ, NOTIFY_SOCKET=notify_path, PYTHONPATH=with_root())
    proc = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar", "--config",
                             cfg], env=env, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    info = {"proc": proc, "port": port, "socket": sock, "config": cfg, "notify": notify}
    try:
        yield info
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        notify.close()


def test_daemon_end_to_end_with_the_real_agent(daemon):
    proc, port = daemon["proc"], daemon["port"]
    assert daemon["notify"].recv(4096) == b"READY=1\nSTATUS=watching"
    assert oct(os.stat(daemon["socket"]).st_mode & 0o777) == "0o660"
    torch._dynamo.reset()
    agent_mod.install(socket_path=daemon["socket"], tick_s=0.05, heartbeat_s=0.2)
    try:
        f = torch.compile(lambda x: x * 2, dynamic=False, backend="eager")
        watched = agent_mod.watch(f, name="double")
        for n in (2, 3, 4):
            watched(torch.ones(n))
        # the recompile and the call's new_shape may reach the sidecar in different polls
        assert wait_for(lambda: (scrape(port)["torch_watchdog_recompiles_total"],
                                 scrape(port)["torch_watchdog_distinct_shapes"]) == (2, 3))
        m = scrape(port)
        assert m["torch_watchdog_compiles_total"] == 1
        assert m['torch_watchdog_source_up{source="agent"}'] == 1
        # no GPU here: host-memory mode watches the agent's process by RSS
        assert m["torch_watchdog_server_rss_bytes"] > 10 << 20
        if not any(k.startswith("torch_watchdog_gpu_memory_used_bytes") for k in m):
            # no GPU stack here: NVML is no source, and its series are left out
            assert "torch_watchdog_nvml_query_seconds" not in m
            assert 'torch_watchdog_source_up{source="nvml"}' not in m
        assert m["torch_watchdog_events_received_total"] >= 7
    finally:
        agent_mod.uninstall()
        torch._dynamo.reset()
    # garbage on the socket is counted, not fatal
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(b"\x00garbage", daemon["socket"])
    s.close()
    assert wait_for(lambda: scrape(port)['torch_watchdog_events_dropped_total{reason="malformed"}']
                    == 1)
    # a completed tick is reported to systemd's watchdog
    assert wait_for(lambda: b"WATCHDOG=1" in daemon["notify"].recv(4096))

    # SIGHUP with a broken file keeps the old config and keeps serving
    with open(daemon["config"], "a") as fh:
        fh.write("poll_interval_s: soon\n")
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert proc.poll() is None and scrape(port)["torch_watchdog_compiles_total"] == 1
    # SIGTERM: one clean exit, socket removed
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
    events = [entry["event"] for entry in logs]
    assert "config reload failed; keeping the old config" in events
    failed = next(e for e in logs if e["event"].startswith("config reload failed"))
    assert any("poll_interval_s" in p for p in failed["problems"])
    assert events[-2:] == ["stopping", "stopped"]
    assert not os.path.exists(daemon["socket"])


def test_bad_config_exits_2_and_busy_port_exits_1(short_tmp):
    bad = os.path.join(short_tmp, "bad.yaml")
    with open(bad, "w") as fh:
        fh.write("metrics_port: 0\nbogus: 1\n")
    env = dict(os.environ, PYTHONPATH=with_root())
    r = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "sidecar", "--config", bad],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bogus" in r.stderr and "metrics_port" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        good = os.path.join(short_tmp, "good.yaml")
        with open(good, "w") as fh:
            fh.write(f"metrics_port: {busy.getsockname()[1]}\nagent:\n  socket_path: "
                     f"{short_tmp}/e.sock\n")
        r = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "sidecar", "--config",
                            good], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot start" in r.stderr
    assert not os.path.exists(f"{short_tmp}/e.sock")
