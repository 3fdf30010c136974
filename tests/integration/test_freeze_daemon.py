"""The freeze remedy end to end (issue 52): a real daemon (a fake clock and NVML, the real
sockets) watching a child process with the real agent installed. Graph growth toward the
budget: the daemon asks the agent to freeze over the control channel, the agent stops
recording and says so, the reload is held while the memory stays flat, the freeze is shown
(alert, metric, status); `torch-watchdog unfreeze` ends it, and growth that goes on is
reloaded."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import structlog

from tests.conftest import with_root
from tests.fakes import Clock, FakeNvml
from torch_watchdog.sidecar import config as config_mod
from torch_watchdog.sidecar.actions.requests import write_request
from torch_watchdog.sidecar.daemon import Daemon
from torch_watchdog.sidecar.present.metrics import render
from torch_watchdog.sidecar.present.status import build_status, format_terminal
from torch_watchdog.sidecar.sources.nvml import NvmlSource

MB = 1_000_000
GPU = "GPU-fake-0"

# the server: the real agent; each stdin line "rec T K" records size K at time T (as the
# cudagraph log hook does on a GPU: the budget notes the key, the event goes out), answered
# "ok" once sent; what torch reads on every call (another thread) is printed when it changes
SERVER = r"""
import os, sys, threading, time
import torch
import torch_watchdog.agent as agent
from torch_watchdog import events
a = agent.install(socket_path=sys.argv[1], tick_s=0.02)
triton = torch._inductor.config.triton
def state():
    sizes = getattr(triton, "cudagraph_capture_sizes", "n/a")
    return None if sizes is None else "eager" if sizes == "n/a" else len(sizes)
def watch():
    seen = state()
    while True:
        if state() != seen:
            seen = state()
            print("now", seen, flush=True)
        time.sleep(0.01)
threading.Thread(target=watch, daemon=True).start()
print("serving", flush=True)
for line in sys.stdin:
    word, t, k = line.split()
    a.budget.note_key(int(k))
    a.emitter.emit(events.CudagraphRecord(t=float(t), pid=os.getpid(), phase="record",
                                          compile_id="0/1", key=[int(k)], shape=None,
                                          seconds=0.01))
    time.sleep(0.06)   # the agent's sender sends every tick_s (0.02 s)
    print("ok", flush=True)
"""


def test_graph_growth_is_frozen_held_shown_unfrozen_by_hand_then_reloaded(short_tmp):
    path = os.path.join(short_tmp, "w.yaml")
    with open(path, "w") as fh:
        fh.write(f"state_dir: {short_tmp}/state\n"
                 f"agent: {{socket_path: {short_tmp}/s.sock}}\n"
                 f"forecast: {{process_budget_bytes: {2_120 * MB}, window_s: 1.0}}\n"
                 "correlate: {min_records: 10}\n"
                 "policy: {reload_lead_s: 10, alert_lead_s: 20, hold_polls: 1, warmup_s: 0, "
                 "remedy: freeze_then_reload}\n"
                 "reload: {method: command, command: [\"true\"], timeout_s: 10, "
                 "hello_timeout_s: 0}\n")
    cfg = config_mod.load(path)
    env = dict(os.environ, PYTHONPATH=with_root())
    proc = subprocess.Popen([sys.executable, "-c", SERVER, cfg.agent.socket_path], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    nvml = FakeNvml([{"uuid": GPU.encode(), "total": 80_000 * MB, "used": 10_000 * MB,
                      "procs": [(proc.pid, 2_000 * MB)]}])
    clock = Clock(t=time.time())
    d = Daemon(cfg, path, structlog.get_logger(), nvml=NvmlSource(nvml), clock=clock,
               serve_metrics=False)
    live: list = []
    act = d._act
    d._act = lambda a: (live.append(a.as_dict()), act(a))
    d.start()
    level, key = 2_000, 0

    def poll(grow: int = 0, records: int = 0) -> None:
        nonlocal level, key
        for _ in range(records):
            key += 1
            proc.stdin.write(f"rec {clock.t} {key}\n")
            proc.stdin.flush()
            while (line := proc.stdout.readline().strip()) != "ok":
                assert line, proc.stderr.read()
                seen.append(line)
        level += grow
        nvml.devices[0]["procs"] = [(proc.pid, level * MB)]
        clock.t += 0.1
        d.tick()

    def wait_for(what, polls: int = 100) -> None:
        for _ in range(polls):
            if what():
                return
            time.sleep(0.05)
            poll()
        raise AssertionError(f"not seen in {polls} polls: {[a['action'] for a in live]}")

    seen: list[str] = []
    try:
        assert proc.stdout.readline().strip() == "serving", proc.stderr.read()
        wait_for(lambda: proc.pid in d.reloads.control.connected())
        for _ in range(80):      # each poll: a recording and 1 MB more (FACTS: MB per graph)
            poll(grow=1, records=1)
            if any(a["action"] == "freeze" for a in live):
                break
        freeze = [a for a in live if a["action"] == "freeze"]
        assert len(freeze) == 1 and freeze[0]["cause"] == "cudagraph_per_shape", live
        assert freeze[0]["pids"] == [proc.pid]
        assert not any(a["action"] == "reload" for a in live)
        # the agent answers over the events socket: frozen at the sizes it recorded
        wait_for(lambda: (d.host.servers and next(iter(d.host.servers.values()))
                          .state.freeze.frozen))
        for _ in range(40):      # 4 s flat: the freeze took; no reload
            poll()
        assert not any(a["action"] in ("reload", "execute") for a in live), live
        server = next(iter(d.host.servers.values()))
        kept = server.state.freeze.view()["sizes_kept"]
        assert kept is not None and kept >= 10       # the agent's own count, as it said
        assert server.firing.get("graphs_frozen", {}).get("frozen") is True
        assert server.policy.held is None or server.policy.held.reason == "frozen"
        metrics = render(d.registry).decode()
        assert "torch_watchdog_graphs_frozen{" in metrics and \
            [ln for ln in metrics.splitlines()
             if ln.startswith("torch_watchdog_graphs_frozen{")][0].endswith(" 1.0")
        text = format_terminal(build_status(d.publisher.status, clock.t), "x", clock.t)
        assert "recording frozen at" in text and "new sizes run without CUDA graphs" in text
        # `torch-watchdog unfreeze`: asked by hand, taken at the next poll
        write_request(cfg.state_dir, server.name, "unfreeze")
        wait_for(lambda: any(a["action"] == "unfreeze" for a in live))
        wait_for(lambda: not server.state.freeze.frozen)
        poll(records=1)   # reads what the server printed meanwhile
        # frozen at the sizes recorded, then as before
        assert seen == [f"now {kept}", "now None"], seen
        for _ in range(12):      # growing again: no freeze now, a reload
            poll(grow=8)
        wait_for(lambda: any(a["action"] == "execute" for a in live))
        assert [a["action"] for a in live].count("freeze") == 1
    finally:
        d.halt()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        proc.kill()
        proc.wait()

