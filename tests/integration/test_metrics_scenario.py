"""Every series of the metrics table against what a scenario did, on a real sidecar.

Two servers on one host, each a real process sending its own events: `llm` (an explicit
name, as `install(server=...)` gives) on GPU-0, and `chat.py` (an automatic `pgid:N/cuda:0`
name, so its label is its program) on GPU-1. The daemon (real socket, real
/proc reads, a fake NVML, a stub Alertmanager) polls them while they compile, recompile,
record CUDA graphs, stall, pad; `chat.py` is killed and started again under a new process
group. Then every family of `metrics.SPECS` is scraped and compared, series by series, with
what the scenario sent or set: a HELP that says "first compiles" must count first compiles, a
per-server family must carry `server`, one server's numbers must never be another's, and the
restarted server keeps its label. The list of series checked is printed (pytest -s).
"""
from __future__ import annotations

import collections
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import psutil
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import with_root
from tests.fakes import Clock
from tests.fakes import FakeNvml
from torch_watchdog.sidecar.config import (AgentSocketConfig, AlertsConfig, Config,
                                           CorrelateConfig)
from torch_watchdog.sidecar.core.forecast import FAIL_FREE_BYTES
from torch_watchdog.sidecar.core.correlate import CAUSES
from torch_watchdog.sidecar.daemon import Daemon
from torch_watchdog.sidecar.present import metrics
from torch_watchdog.sidecar.present.metrics import render
from torch_watchdog.sidecar.sources.nvml import NvmlSource
from torch_watchdog.sidecar.sources.receiver import DROP_REASONS

MB = 1_000_000
MiB = 1 << 20
GPU0, GPU1 = "GPU-scenario-0", "GPU-scenario-1"
POLLS = 50  # llm's growing polls, 1 s apart: 2 recordings and 2 MB each, 10 calls

# One agent: each stdin line is an event (kind and fields) sent as this process, with the
# server name the agent would announce (explicit, else pgid:<its group>/cuda:0).
AGENT = """\
import json, os, sys
from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter
from torch_watchdog.agent.identity import server_name
socket_path, explicit = sys.argv[1], sys.argv[2]
name = server_name(explicit or None, env={} if explicit else {"CUDA_VISIBLE_DEVICES": "0"},
                   read_cgroup=lambda: "")
out = Emitter(socket_path, None)
for line in sys.stdin:
    fields = json.loads(line)
    kind = fields.pop("kind")
    if kind == "hello":
        fields.update(argv=" ".join(sys.argv), server=name)
    out.emit(events.KINDS[kind](pid=os.getpid(), **fields))
    out.drain()
    print("ok", flush=True)
"""


class Agent:
    def __init__(self, script: str, socket_path: str, explicit: str):
        self.proc = subprocess.Popen(
            [sys.executable, script, socket_path, explicit], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, start_new_session=True,
            env=dict(os.environ, PYTHONPATH=with_root()))
        self.pid = self.proc.pid
        self.sent = 0

    def send(self, kind: str, **fields: Any) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"kind": kind, **fields}) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"
        self.sent += 1

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class StubAlertmanager:
    """Accepts every POST and counts the alerts in it."""

    def __init__(self) -> None:
        self.alerts = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                stub.alerts += len(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def hello(agent: Agent, t: float, gpu: str) -> None:
    agent.send("hello", t=t, torch="2.6", agent="scenario", devices=[gpu],
               config={"recompile_limit": 8}, capabilities={}, watched=["model"])


def scraped(text: str) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
    """family name (counters with their _total) -> {labels: value}."""
    out: dict[str, dict[frozenset[tuple[str, str]], float]] = collections.defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[s.name][frozenset(s.labels.items())] = s.value
    return out


def inf(seconds: Any) -> float:
    return math.inf if seconds is None else seconds


def L(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


@pytest.fixture
def scenario(short_tmp):
    """Runs the scenario; returns (scrape, expected, daemon)."""
    llm_py, chat_py = (os.path.join(short_tmp, n) for n in ("llm_server.py", "chat.py"))
    for path in (llm_py, chat_py):
        with open(path, "w") as fh:
            fh.write(AGENT)
    sock = os.path.join(short_tmp, "ev.sock")
    am = StubAlertmanager()
    nvml = FakeNvml([
        {"uuid": GPU0.encode(), "total": 80_000 * MB, "used": 10_000 * MB, "procs": []},
        {"uuid": GPU1.encode(), "total": 40_000 * MB, "used": 5_000 * MB, "procs": []}])
    clock = Clock(time.time())
    cfg = Config(agent=AgentSocketConfig(socket_path=sock),
                 correlate=CorrelateConfig(min_records=10), state_dir=short_tmp,
                 alerts=AlertsConfig(urls=[am.url], instance="box"))
    d = Daemon(cfg, None, structlog.get_logger(), nvml=NvmlSource(nvml), clock=clock,
               serve_metrics=False)
    d.start()
    agents: list[Agent] = []
    try:
        yield from _run(d, nvml, clock, sock, llm_py, chat_py, am, agents)
    finally:
        for a in agents:
            a.stop()
        d.halt()
        am.close()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)


def _run(d, nvml, clock, sock, llm_py, chat_py, am, agents):  # noqa: C901 (one story)
    def tick(dt: float = 0.5):
        clock.t += dt
        return d.tick()

    def gpu(index: int, pid: int, own_mb: int, used_mb: int) -> None:
        nvml.devices[index]["procs"] = [(pid, own_mb * MB)]
        nvml.devices[index]["used"] = used_mb * MB

    llm = Agent(llm_py, sock, "llm")
    chat = Agent(chat_py, sock, "")
    agents += [llm, chat]
    acted: list[tuple[str, str]] = []  # (server name, action), as the daemon carried them out
    carry_out = d.reloads.carry_out
    d.reloads.carry_out = lambda a: (acted.append((a.server, a.kind.value)), carry_out(a))
    t = clock.t
    gpu(0, llm.pid, 2_000, 10_000)
    gpu(1, chat.pid, 1_000, 5_000)
    hello(llm, t, GPU0)
    hello(chat, t, GPU1)
    # llm: two first compiles (two frames), one recompile, a graph break
    llm.send("compile", t=t, compile_id="0/0", function="f", seconds=2.0, fx_cache_hits=3,
             fx_cache_misses=1)
    llm.send("compile", t=t, compile_id="1/0", function="g", seconds=1.5, fx_cache_hits=2,
             fx_cache_misses=0)
    llm.send("recompile", t=t, compile_id="0/1", function="f", seconds=0.5,
             reason="size mismatch at index 0. expected 1, actual 2")
    llm.send("graph_break", t=t, reason="print", location="m.py:3")
    llm.send("cudagraph_record", t=t, phase="warmup", compile_id="0/1", key=[0], shape=None,
             seconds=0.01)
    # chat.py (its first process): a compile, 5 recompiles (a storm), the limit, stalls, an OOM
    chat.send("compile", t=t, compile_id="0/0", function="f", seconds=1.0)
    for i in range(1, 6):
        chat.send("recompile", t=t, compile_id=f"0/{i}", function="f", seconds=0.2,
                  reason=f"size mismatch at index 0. expected {i}, actual {i + 1}")
    chat.send("recompile_limit", t=t, function="f", limit=8, reason="size mismatch",
              compile_id="0/8")
    chat.send("stall", t=t, name="model", shape=[[1, 7]], seconds=1.5, new_shape=True,
              cause="recompile")
    chat.send("oom", t=t, source="exception", device=0, requested_bytes=MB, limit_bytes=None,
              free_bytes=None, message="CUDA out of memory")
    tick()
    clock.t += 20  # past the compiles' settling
    # llm grows: 2 recordings a poll, 2 MB each poll on its GPU; 10 calls a poll, of 3 shapes
    for i in range(POLLS):
        if i < 3:
            llm.send("new_shape", t=clock.t, name="model", shape=[[1, 7 + i]], seconds=0.01,
                     distinct=i + 1)
        for k in (0, 1):
            llm.send("cudagraph_record", t=clock.t, phase="record", compile_id="0/1",
                     key=[i, k], shape=None, seconds=0.01)
        llm.send("calls", t=clock.t, name="model", calls=10, seconds=0.05, stall_calls=0,
                 stall_seconds=0.0, distinct_shapes=3, window_s=0.5)
        gpu(0, llm.pid, 2_000 + 2 * (i + 1), 10_000 + 2 * (i + 1))
        tick(1.0)
    llm.send("stall", t=clock.t, name="model", shape=[[1, 9]], seconds=0.25, new_shape=True,
             cause="cudagraph")
    llm.send("padding", t=clock.t, name="llm", on=True, buckets=[256, 512], calls=40,
             padded_calls=30, real_tokens=900, padding_tokens=100, checks=3,
             check_seconds=0.25, max_error={"float16": 0.002}, recordings_saved=12,
             checks_skipped=2)
    llm.send("oom", t=clock.t, source="allocator", device=0, requested_bytes=MB,
             limit_bytes=None, free_bytes=None, message=None)
    llm.send("heartbeat", t=clock.t, seq=1, uptime_s=30.0, queue_depth=0, errors=0, lost=3)
    tick()
    # chat.py stops and is started again by the same parent, in a new process group
    chat.send("heartbeat", t=clock.t, seq=1, uptime_s=33.0, queue_depth=0, errors=0, lost=0)
    chat.stop()
    nvml.devices[1]["procs"] = []
    tick()
    chat2 = Agent(chat_py, sock, "")
    agents.append(chat2)
    gpu(1, chat2.pid, 1_200, 5_200)
    hello(chat2, clock.t, GPU1)
    chat2.send("compile", t=clock.t, compile_id="0/0", function="f", seconds=0.75)
    for i in range(1, 5):
        chat2.send("recompile", t=clock.t, compile_id=f"0/{i}", function="f", seconds=0.25,
                   reason="size mismatch")
    chat2.send("recompile_limit", t=clock.t, function="f", limit=8, reason="size mismatch",
               compile_id="0/8")
    chat2.send("graph_break", t=clock.t + 1e6, reason="print", location="m.py:3")  # skewed
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:  # not an event
        s.sendto(b"not json", sock)
    tick()
    # until a poll sends no new alert and every alert sent was taken
    while True:
        before = am.alerts
        snap = tick()
        deadline = time.monotonic() + 10
        while any(d.alerting.sender.outbox.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        if am.alerts == before:
            break
    snap = tick()
    text = render(d.registry).decode()
    host = d.host
    servers = {s.label: s for s in host.servers.values() if s.pids}
    assert set(servers) == {"llm", "chat.py/cuda:0"}, set(servers)
    # the forecast's arithmetic is test_forecast's; here: each server's, under its label
    fc = {label: s.forecast.as_dict() for label, s in servers.items()}
    rss = {"llm": psutil.Process(llm.pid).memory_info().rss,
           "chat.py/cuda:0": psutil.Process(chat2.pid).memory_info().rss}

    # -- what the scenario did, series by series ------------------------------------------
    A, B = L(server="llm"), L(server="chat.py/cuda:0")
    # each process group is a session of its own (pgid = pid): chat.py's two names, one label
    labels = {"llm": "llm", f"pgid:{chat.pid}/cuda:0": "chat.py/cuda:0",
              f"pgid:{chat2.pid}/cuda:0": "chat.py/cuda:0"}
    exp: dict[str, dict[frozenset[tuple[str, str]], float]] = {
        "torch_watchdog_gpu_memory_used_bytes": {L(gpu_uuid=GPU0): (10_000 + 2 * POLLS) * MB,
                                                 L(gpu_uuid=GPU1): 5_200 * MB},
        "torch_watchdog_gpu_memory_total_bytes": {L(gpu_uuid=GPU0): 80_000 * MB,
                                                  L(gpu_uuid=GPU1): 40_000 * MB},
        "torch_watchdog_gpu_memory_free_bytes": {L(gpu_uuid=GPU0): (70_000 - 2 * POLLS) * MB,
                                                 L(gpu_uuid=GPU1): 34_800 * MB},
        "torch_watchdog_server_gpu_memory_bytes": {
            L(server="llm", gpu_uuid=GPU0): (2_000 + 2 * POLLS) * MB,
            L(server="chat.py/cuda:0", gpu_uuid=GPU1): 1_200 * MB},
        "torch_watchdog_server_rss_bytes": {A: rss["llm"], B: rss["chat.py/cuda:0"]},
        "torch_watchdog_server_up": {A: 1, B: 1},
        "torch_watchdog_cudagraph_recordings_total": {A: 2 * POLLS, B: 0},
        "torch_watchdog_cudagraph_warmups_total": {A: 1, B: 0},
        # first compiles only; chat.py's count from its new process (1, not 1 + 1)
        "torch_watchdog_compiles_total": {A: 2, B: 1},
        "torch_watchdog_recompiles_total": {A: 1, B: 4},
        "torch_watchdog_recompile_limit_hits_total": {A: 0, B: 1},
        "torch_watchdog_stalls_total": {A: 1, B: 0},
        "torch_watchdog_stall_seconds_total": {A: 0.25, B: 0},
        "torch_watchdog_graph_breaks_total": {A: 1, B: 1},
        "torch_watchdog_ooms_total": {A: 1, B: 0},  # chat.py's was its first process's
        "torch_watchdog_compile_seconds_total": {A: 2.0 + 1.5 + 0.5, B: 0.75 + 4 * 0.25},
        "torch_watchdog_fx_cache_hits_total": {A: 5, B: 0},
        "torch_watchdog_fx_cache_misses_total": {A: 1, B: 0},
        "torch_watchdog_requests_total": {A: 10 * POLLS, B: 0},
        "torch_watchdog_distinct_shapes": {A: 3, B: 0},
        # 2 recordings and 2 MB a poll: 1 MB a graph, a perfect fit
        "torch_watchdog_cudagraph_memory_per_graph_bytes": {A: 1.0 * MB},
        "torch_watchdog_cudagraph_memory_per_graph_confidence_ratio": {A: 1.0},
        "torch_watchdog_memory_explained_by_recordings_bytes": {A: 2 * POLLS * MB, B: 0},
        # every MB of growth came with a recording
        "torch_watchdog_memory_unexplained_bytes": {A: 0, B: 0},
        # each server's own GPU: its used memory against its size less where allocation fails
        "torch_watchdog_memory_budget_bytes": {A: 80_000 * MB - FAIL_FREE_BYTES,
                                               B: 40_000 * MB - FAIL_FREE_BYTES},
        "torch_watchdog_memory_level_bytes": {A: (10_000 + 2 * POLLS) * MB, B: 5_200 * MB},
        # chat.py's memory is flat: no OOM in sight, +Inf
        # llm: 3 shapes, all recorded (a plateau); its linear trend still sees growth
        "torch_watchdog_oom_forecast_seconds": {A: inf(fc["llm"]["seconds_to_oom"]),
                                                B: math.inf},
        "torch_watchdog_oom_forecast_earliest_seconds": {
            A: inf(fc["llm"]["seconds_to_oom_earliest"]), B: math.inf},
        "torch_watchdog_oom_forecast_linear_seconds": {
            A: inf(fc["llm"]["seconds_to_oom_linear"]), B: math.inf},
        "torch_watchdog_memory_plateau_bytes": {
            k: v for k, v in ((A, fc["llm"]["plateau_bytes"]),
                              (B, fc["chat.py/cuda:0"]["plateau_bytes"])) if v is not None},
        "torch_watchdog_shape_space_estimate": {
            k: v for k, v in ((A, fc["llm"]["shape_space_estimate"]),
                              (B, fc["chat.py/cuda:0"]["shape_space_estimate"]))
            if v is not None},
        "torch_watchdog_padding_on": {L(server="llm", model="llm"): 1},
        "torch_watchdog_padding_buckets": {L(server="llm", model="llm"): 2},
        "torch_watchdog_padding_plan": {L(server="llm", model="llm", bucket="256"): 1,
                                        L(server="llm", model="llm", bucket="512"): 1},
        "torch_watchdog_padding_real_tokens_total": {L(server="llm", model="llm"): 900},
        "torch_watchdog_padding_tokens_total": {L(server="llm", model="llm"): 100},
        "torch_watchdog_padding_fraction_ratio": {L(server="llm", model="llm"): 0.1},
        "torch_watchdog_padding_recordings_saved": {L(server="llm", model="llm"): 12},
        "torch_watchdog_padding_checks_total": {L(server="llm", model="llm"): 3},
        "torch_watchdog_padding_check_seconds_total": {L(server="llm", model="llm"): 0.25},
        "torch_watchdog_padding_checks_skipped_total": {L(server="llm", model="llm"): 2},
        "torch_watchdog_padding_checks_stopped": {L(server="llm", model="llm"): 0},
        "torch_watchdog_padding_max_error_ratio": {
            L(server="llm", model="llm", dtype="float16"): 0.002},
        # llm records graphs that cost memory; chat.py (again) recompiles in a storm, to the
        # recompile limit
        "torch_watchdog_cause_active": {
            **{L(server="llm", cause=c): int(c == "cudagraph_per_shape") for c in CAUSES},
            **{L(server="chat.py/cuda:0", cause=c): int(
                c in ("recompile_storm", "recompile_limit_eager_fallback")) for c in CAUSES}},
        "torch_watchdog_actions_total": {
            L(server=label, action=kind): n for (label, kind), n in collections.Counter(
                (labels[name], kind) for name, kind in acted).items()},
        # no forecast here calls for a reload, so none is held back (the held series'
        # values: tests/integration/test_host_view.py, a cooldown)
        "torch_watchdog_reload_held_until_timestamp_seconds": {},
        # policy.remedy is reload here: no freeze asked (the series' values:
        # tests/integration/test_freeze_daemon.py)
        "torch_watchdog_graphs_frozen": {},
        "torch_watchdog_host_info": {L(host=socket.gethostname()): 1},
        "torch_watchdog_source_up": {L(source="nvml"): 1, L(source="process"): 1,
                                     L(source="agent"): 1},
        "torch_watchdog_poll_duration_seconds": {L(): snap.poll_seconds},
        "torch_watchdog_nvml_query_seconds": {L(): snap.nvml_query_seconds},
        "torch_watchdog_reload_record_unreadable": {L(): 0},
        "torch_watchdog_source_errors_total": {},
        "torch_watchdog_events_received_total": {L(): llm.sent + chat.sent + chat2.sent},
        "torch_watchdog_events_skewed_total": {L(): 1},
        "torch_watchdog_events_dropped_total": {
            L(reason=r): int(r == "malformed") for r in (*DROP_REASONS, "backlog")},
        "torch_watchdog_agent_events_lost_total": {L(): 3},
        "torch_watchdog_alerts_sent_total": {L(url=am.url): am.alerts},
        "torch_watchdog_alert_posts_failed_total": {},
        "torch_watchdog_alerts_dropped_total": {},
        "torch_watchdog_poll_errors_total": {},  # no stage raised
        "torch_watchdog_last_poll_timestamp_seconds": {L(): clock.t},
    }
    yield scraped(text), exp, d


def test_every_series_is_what_the_scenario_did(scenario):
    got, expected, d = scenario
    assert {s.name for s in metrics.SPECS} == set(expected), \
        "a family of the table is not checked here"
    checked = []
    for spec in metrics.SPECS:
        want = expected[spec.name]
        have = got.get(spec.name, {})
        if "server" in spec.labels:
            assert all(dict(k).get("server") for k in have), spec.name
        assert set(have) == set(want), (spec.name, sorted(have), sorted(want))
        for labels, value in want.items():
            assert value is not None, (spec.name, dict(labels))
            assert have[labels] == pytest.approx(value, rel=1e-9), (spec.name, dict(labels))
            checked.append(f"{spec.name}{dict(sorted(labels))} = {have[labels]:g}")
        if not want:
            checked.append(f"{spec.name}: absent (none in this scenario)")
    print("\n".join(["series checked:", *checked]))
    # the restarted server kept its label; its actions say so
    assert expected["torch_watchdog_actions_total"][
        L(server="chat.py/cuda:0", action="restart")] == 1
    assert expected["torch_watchdog_alerts_sent_total"][next(iter(
        expected["torch_watchdog_alerts_sent_total"]))] > 0
