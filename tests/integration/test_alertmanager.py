"""The daemon's alerts in a real Alertmanager (Debian package prometheus-alertmanager, started
here on loopback): they appear with their labels and annotations, resolve, and survive the
Alertmanager being down for a while."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import ALERTMANAGER, ROOT, am_alerts, free_port, start_alertmanager, \
    wait_for, with_root
from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter

pytestmark = pytest.mark.skipif(ALERTMANAGER is None, reason="needs prometheus-alertmanager "
                                "(.ci/run installs it: apt-get install prometheus-alertmanager)")


def test_alerts_fire_resolve_and_survive_an_alertmanager_outage(short_tmp):
    am_port, port = free_port(), free_port()
    am = start_alertmanager(short_tmp, am_port)
    sock = os.path.join(short_tmp, "events.sock")
    cfg = os.path.join(short_tmp, "watchdog.yaml")
    with open(cfg, "w") as fh:
        fh.write(f"metrics_port: {port}\nstate_dir: {short_tmp}\n"
                 f"agent:\n  socket_path: {sock}\n"
                 f"correlate:\n  storm_recompiles: 3\n  storm_window_s: 4\n"
                 f"alerts:\n  urls: [\"http://127.0.0.1:{am_port}\"]\n  resend_s: 1\n"
                 f"  timeout_s: 1\n  service: test-llm\n  instance: box-1\n")
    daemon = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                               "--config", cfg], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=with_root()))
    try:
        assert wait_for(lambda: os.path.exists(sock), 30)
        em, me = Emitter(sock, None), os.getpid()
        em.emit(events.Hello(t=time.time(), pid=me, torch="2.13", agent="test", devices=[],
                             config={}, capabilities={}, watched=["fwd"], argv="serve"))
        for i in range(1, 4):  # three recompiles: a storm
            em.emit(events.Recompile(t=time.time(), pid=me, compile_id=f"0/{i}", function="fwd",
                                     seconds=6.5, reason="size mismatch"))
        em.drain()
        assert wait_for(lambda: "TorchCompileRecompileStorm" in am_alerts(am_port))
        storm = am_alerts(am_port)["TorchCompileRecompileStorm"]
        assert storm["labels"]["cause"] == "recompile_storm"
        assert storm["labels"]["service"] == "test-llm" and storm["labels"]["instance"] == "box-1"
        assert "3 recompiles" in storm["annotations"]["description"]
        assert storm["annotations"]["fix"]

        am.kill()  # the Alertmanager goes away; the sidecar keeps working and keeps the alert
        am.wait()
        em.emit(events.RecompileLimit(t=time.time(), pid=me, function="fwd", limit=8,
                                      reason="size mismatch", compile_id="0/8"))
        em.drain()
        time.sleep(2)
        assert daemon.poll() is None
        am = start_alertmanager(short_tmp, am_port)
        assert wait_for(lambda: "TorchCompileRecompileLimitEagerFallback" in am_alerts(am_port))
        fallback = am_alerts(am_port)["TorchCompileRecompileLimitEagerFallback"]
        assert "recompile limit 8 reached in fwd" in fallback["annotations"]["description"]
        # the storm ends (no recompile for storm_window_s): its alert resolves
        assert wait_for(lambda: "TorchCompileRecompileStorm" not in am_alerts(am_port), 30)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        failed = [line for line in metrics.splitlines()
                  if line.startswith("torch_watchdog_alert_posts_failed_total{")]
        assert failed and float(failed[0].split()[-1]) >= 1  # the outage was counted
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(15)
        am.kill()
        am.wait()
