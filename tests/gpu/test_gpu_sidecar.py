"""On a real GPU: the sidecar daemon watches a real reduce-overhead server process (the agent
sends over the real socket) and its /metrics shows the recordings and the NVML growth."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from tests.conftest import scrape, wait_for, with_root

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _answers(port: int) -> bool:
    try:
        scrape(port)
        return True
    except OSError:  # the socket is bound a moment before the metrics port listens
        return False


def test_sidecar_sees_recordings_and_nvml_growth(short_tmp):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = os.path.join(short_tmp, "events.sock")
    cfg = os.path.join(short_tmp, "c.yaml")
    with open(cfg, "w") as fh:
        fh.write(f"metrics_port: {port}\nstate_dir: {short_tmp}\nagent:\n  socket_path: {sock}\n")
    env = dict(os.environ, PYTHONPATH=with_root())
    daemon = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                               "--config", cfg], env=env, cwd=ROOT, stderr=subprocess.PIPE,
                              text=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            assert daemon.poll() is None, daemon.stderr.read()
            assert time.monotonic() < deadline, "the sidecar did not bind its socket"
            time.sleep(0.05)
        assert wait_for(lambda: _answers(port), 30), "the sidecar's /metrics did not answer"
        first = scrape(port)
        server = subprocess.Popen([sys.executable, os.path.join(HERE, "scenario.py"), "--dynamic",
                                   "none", "--traffic", "variable", "--socket", sock,
                                   "--linger", "3"], env=env, stdout=subprocess.PIPE, text=True)
        line = json.loads(server.stdout.readline() or "{}")
        assert line.get("lingering"), "the server scenario failed before serving"
        time.sleep(1.5)  # a few polls with the server alive and idle
        m = scrape(port)
        out = server.communicate(timeout=120)[0]
        result = json.loads(out.strip().splitlines()[-1])
        out_dir = os.environ.get("WATCHDOG_GPU_RESULTS")
        if out_dir:
            with open(os.path.join(out_dir, "sidecar-metrics.json"), "w") as fh:
                json.dump({"scenario": result, "metrics": m, "before": first}, fh, indent=1)
        assert m["torch_watchdog_cudagraph_recordings_total"] == result["truth"]["nodes"]
        assert m['torch_watchdog_source_up{source="nvml"}'] == 1
        uuid = result["devices"][0]
        server_mem = sum(v for k, v in m.items()  # the one server's, labelled server too
                         if k.startswith("torch_watchdog_server_gpu_memory_bytes{")
                         and f'gpu_uuid="{uuid}"' in k)
        assert server_mem > 100 << 20  # the server's own NVML memory, by process
        assert m[f'torch_watchdog_gpu_memory_used_bytes{{gpu_uuid="{uuid}"}}'] >= server_mem
        # this one-layer model's graphs cost less than the allocator's own steps: the estimate
        # may stay unknown, never negative (the 12-layer reload scenario checks its value)
        assert m.get("torch_watchdog_cudagraph_memory_per_graph_bytes", 1) > 0
        assert m["torch_watchdog_events_dropped_total{reason=\"spoofed\"}"] == 0
    finally:
        daemon.terminate()
        daemon.wait(15)
