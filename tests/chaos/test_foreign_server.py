"""Issue 28, item 4: another user's process names a server in its hello and grows; with
`reload.method: agent` and no `allowed_uids` (the node-level DaemonSet's config: a 0666
socket, server pods of many uids), the reload must not drain that server.

Real processes: the victim is a real agent (drain_server.py, root, connected to the control
channel, not growing); the attacker, forked and run as uid 65534, sends a hello naming the
victim's server from its own pid (the kernel vouches for the pid, not for the name). The
sidecar is the real daemon (real sockets, its step, its control channel) ticked by hand with
a simulated NVML in which the attacker's memory grows. Before: the attacker joined the
victim's server and the reload drained the victim (exit 75, `drained 1 of 2 ... no drained
reply from pid(s) ...`). Now the attacker is a server of its own, `victim@uid:65534`, and the
reload goes to it alone."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import structlog

from tests.conftest import ROOT, wait_for, with_root
from tests.fakes import Clock
from tests.fakes import FakeNvml
from torch_watchdog import events
from torch_watchdog.sidecar.config import (AgentSocketConfig, Config, ForecastConfig,
                                           PolicyConfig, ReloadConfig)
from torch_watchdog.sidecar.daemon import Daemon
from torch_watchdog.sidecar.sources.nvml import NvmlSource

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root to run the attacker as another uid")
GB, MB = 1 << 30, 1 << 20
NOBODY = 65534
SERVER = os.path.join(ROOT, "tests", "integration", "drain_server.py")


def attacker(sock: str, name: str) -> int:
    """A forked process of uid/gid 65534 that says hello as server `name` every 0.5 s."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for _ in range(240):
            hello = events.Hello(t=time.time(), pid=os.getpid(), torch="2.13", agent="x",
                                 devices=["GPU-0"], config={}, capabilities={},
                                 watched=["m"], argv="attacker", server=name, ppid=1)
            try:
                s.sendto(events.encode(hello), sock)
            except OSError:
                pass
            time.sleep(0.5)
    finally:
        os._exit(0)


def test_another_users_process_naming_a_server_gets_its_own_reload_not_the_servers(short_tmp):
    os.chmod(short_tmp, 0o755)  # the attacker may reach the socket, as in node mode
    sock = os.path.join(short_tmp, "ev.sock")
    cfg = Config(agent=AgentSocketConfig(socket_path=sock, socket_mode=0o666),
                 state_dir=os.path.join(short_tmp, "state"),
                 forecast=ForecastConfig(window_s=2.0, headroom_bytes=0),
                 policy=PolicyConfig(reload_lead_s=30, alert_lead_s=60, hold_polls=1,
                                     warmup_s=0, cooldown_s=600),
                 reload=ReloadConfig(method="agent", grace_s=5, hello_timeout_s=5))
    nvml = FakeNvml([{"uuid": b"GPU-0", "total": 8 * GB, "used": GB, "procs": []}])
    clock = Clock(time.time())
    d = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml), clock=clock,
               serve_metrics=False)
    live: list[dict] = []
    act = d._act
    d._act = lambda a: (live.append(a.as_dict()), act(a))
    d.start()
    progress = os.path.join(short_tmp, "progress")
    env = dict(os.environ, PYTHONPATH=with_root(),
               TORCH_WATCHDOG_RESTART_FILE=os.path.join(short_tmp, "restart-requested"))
    victim = subprocess.Popen([sys.executable, SERVER, "--socket", sock, "--progress", progress,
                               "--event-log", os.path.join(short_tmp, "victim.jsonl"),
                               "--server", "victim", "--busy", "--call-s", "0.05"],
                              cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    bad = None
    level = {"victim": 2 * GB, "attacker": 1 * GB}

    def tick() -> None:
        procs = [(victim.pid, level["victim"])] + ([(bad, level["attacker"])] if bad else [])
        nvml.devices[0]["procs"] = procs
        nvml.devices[0]["used"] = GB // 2 + sum(b for _, b in procs)
        clock.t += 0.1
        d.tick()
        time.sleep(0.01)

    def until(cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tick()
            if cond():
                return
        pytest.fail(f"{what}; servers {d.host.owner}; actions {[a['action'] for a in live]}")

    try:
        until(lambda: victim.pid in d.host.servers.get("victim", d.host.focus()).pids
              and victim.pid in d.reloads.control.connected(), 120,
              "the victim watched and connected")
        bad = attacker(sock, "victim")
        until(lambda: bad in d.host.owner, 30, "the attacker's hello")
        assert d.host.owner[bad] == f"victim@uid:{NOBODY}"
        assert set(d.host.servers["victim"].pids) == {victim.pid}

        def grow() -> bool:
            level["attacker"] += 4 * MB
            return any(a["action"] == "execute" for a in live)

        until(grow, 120, "a reload decided")
        until(lambda: any(a["action"] in ("reload_ok", "reload_failed") for a in live)
              or any(e.get("ok") is not None for e in d.reloads.record.entries), 30,
              "the reload done")
        execute = next(a for a in live if a["action"] == "execute")
        assert execute["server"] == f"victim@uid:{NOBODY}" and execute["pids"] == [bad]
        time.sleep(1.0)
        assert victim.poll() is None, "the victim was drained"
        assert wait_for(lambda: "on_drain" not in open(progress).read(), 1)
    finally:
        d.halt()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        if bad:
            os.kill(bad, signal.SIGKILL)
            os.waitpid(bad, 0)
        victim.kill()
        victim.wait(10)
