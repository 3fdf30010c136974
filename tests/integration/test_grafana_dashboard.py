"""config/grafana/torch-watchdog.json against a live sidecar and the real Prometheus: the
daemon (real metrics endpoint, a simulated NVML GPU) watches this process, which sends it a
compile, recompiles, the recompile limit, a graph break, a stall, calls and CUDA-graph
recordings that cost memory; Prometheus (Debian's `prometheus`, on loopback) scrapes it every
second. Every variable's query has values and every panel's every query returns series, with
the variables at "All", as Grafana would send them."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest
import structlog

from tests.conftest import ROOT, free_port, wait_for
from tests.fakes import FakeNvml
from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter
from torch_watchdog.sidecar.config import AgentSocketConfig, Config, CorrelateConfig
from torch_watchdog.sidecar.daemon import Daemon
from torch_watchdog.sidecar.sources.nvml import NvmlSource

PROMETHEUS = os.environ.get("WATCHDOG_PROMETHEUS") or shutil.which("prometheus")
DASHBOARD = os.path.join(ROOT, "config", "grafana", "torch-watchdog.json")
MB = 1_000_000
# series absent by design until the shape-discovery model applies (saturating shapes): the
# panel draws the level and the budget meanwhile
UNTIL_DISCOVERY = ("torch_watchdog_memory_plateau_bytes",)
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian: "
                                "apt-get install prometheus)")


def query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        reply = json.loads(r.read())
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def label_values(port: int, definition: str) -> list:
    """Grafana's `label_values(selector, label)` through Prometheus' label API."""
    inner = definition[len("label_values("):-1]
    selector, label = (x.strip() for x in inner.rsplit(",", 1))
    url = (f"http://127.0.0.1:{port}/api/v1/label/{label}/values?"
           + urllib.parse.urlencode({"match[]": all_of(selector)}))
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())["data"]


def all_of(expr: str) -> str:
    """The query as Grafana sends it with every variable at All."""
    for var in ("$instance", "$server", "$gpu"):
        expr = expr.replace(var, ".*")
    return expr.replace("$__rate_interval", "15s")


def story(pid: int, t: float) -> list:
    evs: list = [events.Compile(t=t, pid=pid, compile_id="0/0", function="f", seconds=2.0)]
    evs += [events.Recompile(t=t, pid=pid, compile_id=f"0/{i}", function="f", seconds=0.5,
                             reason=f"size mismatch at index 0. expected {i}, actual {i + 1}")
            for i in range(1, 6)]
    evs += [events.RecompileLimit(t=t, pid=pid, function="f", limit=8, reason="size mismatch",
                                  compile_id="0/8"),
            events.GraphBreak(t=t, pid=pid, reason="print", location="m.py:3"),
            events.Stall(t=t, pid=pid, name="m", shape=[[1, 7]], seconds=1.5, new_shape=True,
                         cause="recompile")]
    return evs


def test_every_panel_of_the_dashboard_has_series_from_a_live_sidecar(short_tmp):
    dash = json.load(open(DASHBOARD))
    me, metrics_port, prom_port = os.getpid(), free_port(), free_port()
    nvml = FakeNvml([{"uuid": b"GPU-fake-0", "total": 80_000 * MB, "used": 10_000 * MB,
                      "procs": [(me, 2_000 * MB)]}])
    cfg = Config(agent=AgentSocketConfig(socket_path=os.path.join(short_tmp, "ev.sock")),
                 correlate=CorrelateConfig(min_records=10), state_dir=short_tmp,
                 metrics_address="127.0.0.1", metrics_port=metrics_port)
    d = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml), serve_metrics=True)
    d.start()
    sender = Emitter(cfg.agent.socket_path, None)
    stop = threading.Event()

    def serve() -> None:  # the server: calls and recordings that cost memory, every poll
        i = 0
        while not stop.is_set():
            i += 1
            t = time.time()
            sender.emit(events.Calls(t=t, pid=me, name="m", calls=10, seconds=0.01,
                                     stall_calls=0, stall_seconds=0.0, distinct_shapes=i,
                                     window_s=0.1))
            for k in (0, 1):
                sender.emit(events.CudagraphRecord(t=t, pid=me, phase="record",
                                                   compile_id="0/1", key=[i, k], shape=None,
                                                   seconds=0.01))
            sender.drain()
            nvml.devices[0]["procs"] = [(me, (2_000 + i) * MB)]
            nvml.devices[0]["used"] = (10_000 + i) * MB
            d.tick()
            time.sleep(0.1)

    prom_cfg = os.path.join(short_tmp, "prometheus.yml")
    with open(prom_cfg, "w") as fh:
        fh.write("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                 "scrape_configs:\n  - job_name: torch-watchdog\n"
                 f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={prom_cfg}",
                             f"--storage.tsdb.path={short_tmp}/tsdb",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    loop = threading.Thread(target=serve, daemon=True)
    try:
        sender.emit(events.Hello(t=time.time(), pid=me, torch="2.13", agent="test",
                                 devices=["GPU-fake-0"], config={}, capabilities={},
                                 watched=["m"], argv="serve", server="llm"))
        for e in story(me, time.time() - 30):  # compiled 30 s ago: past the settling
            sender.emit(e)
        sender.drain()
        d.tick()
        loop.start()
        up = 'up{job="torch-watchdog"}'
        assert wait_for(lambda: [r for r in query(prom_port, up) if r["value"][1] == "1"],
                        60), "Prometheus never scraped the sidecar"
        time.sleep(20)  # rates over 15 s need scrapes on both sides of it
        missing = []
        for v in dash["templating"]["list"]:
            if v["type"] == "query" and not label_values(prom_port, v["definition"]):
                missing.append(f"variable {v['name']}: {v['definition']}")
        for panel in dash["panels"]:
            for target in panel["targets"]:
                if not query(prom_port, all_of(target["expr"])) and \
                        not target["expr"].startswith(UNTIL_DISCOVERY):
                    missing.append(f"{panel['title']}: {target['expr']}")
    finally:
        stop.set()
        loop.join(10)
        prom.send_signal(signal.SIGTERM)
        prom.wait(30)
        d.halt()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
    assert not missing, missing
    assert any(t["expr"].startswith(UNTIL_DISCOVERY[0]) for p in dash["panels"]
               for t in p["targets"])
    assert {p["title"] for p in dash["panels"]} >= {
        "Server memory vs budget", "Time to OOM", "CUDA-graph recordings",
        "Memory per CUDA graph", "Recompiles and eager fallbacks", "Stalls",
        "Reloads and alerts", "GPU memory", "Server processes"}
