"""The /metrics view of a Snapshot served over real HTTP (the server's thread), and its text as
promtool reads it. The view itself: tests/unit/test_metrics.py."""
from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest

from tests.unit.test_metrics import GIB, parse, snapshot, value
from torch_watchdog.sidecar.present.metrics import SnapshotCollector, make_registry, render, \
    serve, stop


def _serve_on_free_port(registry):
    server, thread = serve("127.0.0.1", 0, registry)  # port 0: any free one
    return server, thread, server.server_port


def test_http_scrape_serves_the_latest_snapshot():
    collector = SnapshotCollector()
    server, thread, port = _serve_on_free_port(make_registry(collector))
    try:
        collector.update(snapshot())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert reply.status == 200
            body = reply.read().decode()
        s = parse(body)
        assert value(s, "torch_watchdog_gpu_memory_used_bytes", gpu_uuid="GPU-aaa") == 30 * GIB
        collector.update(snapshot(active_causes=()))  # the next scrape sees the new tick
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            s = parse(reply.read().decode())
        assert value(s, "torch_watchdog_cause_active", cause="cudagraph_per_shape") == 0
    finally:
        stop(server, thread)
    if thread is not None:
        assert not thread.is_alive()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_the_exposition():
    text = render(make_registry(_updated(snapshot())))
    done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _updated(snap):
    collector = SnapshotCollector()
    collector.update(snap)
    return collector
