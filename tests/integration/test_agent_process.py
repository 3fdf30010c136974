"""The agent in a real server process: one import, quiet stderr, dead sidecar, post-mortem log."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import Collector, wait_until, with_root
from torch_watchdog import events

SCRIPT = os.path.join(os.path.dirname(__file__), "server_script.py")


def run_server(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_WATCHDOG_")}
    env.update(env_extra, PYTHONPATH=with_root())
    return subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)


def _torch_lines(stderr: str) -> list[str]:
    # torch's own warnings, without paths/numbers that differ between runs
    return [re.sub(r"0x[0-9a-f]+|\d+", "N", line) for line in stderr.splitlines()]


def test_one_import_records_everything_and_prints_nothing(short_tmp, collector):
    log = os.path.join(short_tmp, "events.jsonl")
    bare = run_server({"WITH_AGENT": "0"})
    watched = run_server({"WITH_AGENT": "1", "TORCH_WATCHDOG_SOCKET": collector.path,
                          "TORCH_WATCHDOG_EVENT_LOG": log})
    assert bare.returncode == 0 and watched.returncode == 0, watched.stderr
    assert "served" in watched.stdout
    # the agent adds nothing to the server's stderr: only torch's own recompile-limit warning
    assert _torch_lines(watched.stderr) == _torch_lines(bare.stderr)
    with open(log) as fh:
        logged = [events.decode(line) for line in fh]
    kinds = [e.kind for e in logged]
    for kind in ("hello", "compile", "recompile", "recompile_limit", "graph_break",
                 "new_shape", "calls"):
        assert kind in kinds, kind
    assert collector.wait(lambda c: len(c.events) == len(logged), 5)
    assert [e.kind for e in collector.events] == kinds
    assert all(e.pid == logged[0].pid for e in logged)


def test_dead_sidecar_and_readonly_log_never_hurt_the_server(short_tmp):
    result = run_server({"WITH_AGENT": "1",
                         "TORCH_WATCHDOG_SOCKET": os.path.join(short_tmp, "nobody.sock"),
                         "TORCH_WATCHDOG_EVENT_LOG": "/proc/forbidden/events.jsonl"})
    assert result.returncode == 0 and "served" in result.stdout
    # one line says where the events are not going (it said nothing: a typo in the path
    # looked like a quiet server), and nothing else
    said = [line for line in result.stderr.splitlines() if "watchdog" in line.lower()]
    assert len(said) == 1 and "no sidecar listens at" in said[0], result.stderr
    assert os.path.join(short_tmp, "nobody.sock") in said[0]


def test_bad_env_value_is_reported_not_fatal(short_tmp, collector):
    result = run_server({"WITH_AGENT": "1", "TORCH_WATCHDOG_SOCKET": collector.path,
                         "TORCH_WATCHDOG_STALL_S": "soon"})
    assert result.returncode == 0 and "served" in result.stdout
    assert collector.wait(lambda c: bool(c.of("hello")), 5)
    problems = [v for k, v in collector.of("hello")[0].config.items() if "problem" in k]
    assert problems and "TORCH_WATCHDOG_STALL_S" in problems[0]


def test_importing_the_package_pulls_in_nothing_heavy():
    code = ("import sys, watchdog, torch_watchdog.events, torch_watchdog.agent, "
            "torch_watchdog.cli; "
            "print(sorted(m for m in ('torch', 'pynvml', 'prometheus_client', 'yaml') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=with_root()),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


INDUCTOR_SERVER = """
import sys, torch, torch_watchdog.agent
torch_watchdog.agent.install(socket_path="", event_log=sys.argv[1])
model = torch.compile(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()), dynamic=False)
for n in (3, 5):
    model(torch.randn(n, 32))
torch_watchdog.agent.uninstall()
"""


def test_compiles_report_the_inductor_cache_so_a_restart_shows_its_cost(short_tmp):
    """A restarted server with a persistent TORCHINDUCTOR_CACHE_DIR hits the FX-graph cache;
    the first run misses. The agent reports both on each compile event."""
    env = dict(os.environ, PYTHONPATH=with_root(), TORCHINDUCTOR_FX_GRAPH_CACHE="1",  # < 2.5: off
               TORCHINDUCTOR_CACHE_DIR=os.path.join(short_tmp, "inductor"))
    runs = []
    for n in range(2):
        log = os.path.join(short_tmp, f"run{n}.jsonl")
        done = subprocess.run([sys.executable, "-c", INDUCTOR_SERVER, log], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        with open(log) as fh:
            runs.append([e for e in map(events.decode, fh) if e.kind in ("compile", "recompile")])
    cold, warm = runs
    assert [e.kind for e in cold] == [e.kind for e in warm] == ["compile", "recompile"]
    assert sum(e.fx_cache_misses for e in cold) >= 2 and sum(e.fx_cache_hits for e in cold) == 0
    assert sum(e.fx_cache_hits for e in warm) >= 2 and sum(e.fx_cache_misses for e in warm) == 0


# A server that keeps serving until killed; hello_every_s is left at its 30 s.
SERVING = r"""
import sys, time, torch, torch_watchdog.agent as agent
agent.install(socket_path=sys.argv[1])
model = agent.watch(torch.nn.Linear(8, 8), name="lin")
while True:
    model(torch.ones(2, 8))
    time.sleep(0.01)
"""


def _serving(path: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_WATCHDOG_")}
    env.update(PYTHONPATH=with_root(), TORCH_WATCHDOG_RESTART_FILE="")  # none in /run
    return subprocess.Popen([sys.executable, "-c", SERVING, path], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.parametrize("down_s", [0.0, 2.0], ids=["rebound-at-once", "down-for-2s"])
def test_a_restarted_sidecar_hears_the_hello_at_once_not_30_s_later(short_tmp, down_s):
    """The sidecar's restart: its socket closed and unlinked, the path bound again at once or
    after 2 s without one. The serving process's hello reaches the new socket within seconds."""
    path = os.path.join(short_tmp, "events.sock")
    old = Collector(path)
    proc = _serving(path)
    new = None
    try:
        hello = wait_until(lambda: old.of("hello"), 120, "the first hello")[0]
        assert hello.pid == proc.pid
        wait_until(lambda: old.of("calls"), 30, "the server serving")
        old.close()
        os.unlink(path)
        time.sleep(down_s)
        new = Collector(path)
        bound = time.monotonic()
        again = wait_until(lambda: [e for e in new.of("hello") if e.pid == proc.pid], 10,
                           "a hello on the new socket")
        took = time.monotonic() - bound
        print(f"hello {took:.2f} s after the re-bind (down {down_s:g} s)")
        assert took < 5.0 and again[0].server == hello.server
        time.sleep(3.0)  # more traffic to the same receiver: no more hellos (30 s period)
        assert len(new.of("hello")) == 1 and new.of("heartbeat")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        old.close()
        if new is not None:
            new.close()


# A server with the agent whose graphs for sizes 4 and 5 are recorded (on a GPU the cudagraph
# log reports each size key; on CPU the server reports two), then serving: it prints what torch
# reads on every call whenever that changes.
FROZEN_SERVER = r"""
import sys, time, torch
import torch_watchdog.agent as agent
a = agent.install(socket_path=sys.argv[1], tick_s=0.02)
model = agent.watch(torch.compile(torch.nn.Linear(8, 8), dynamic=False, backend="eager"))
a.budget.note_key(4)
a.budget.note_key(5)
triton = torch._inductor.config.triton
def state():
    if hasattr(triton, "cudagraph_capture_sizes"):
        sizes = triton.cudagraph_capture_sizes
        return None if sizes is None else sorted(map(repr, sizes))
    return "eager" if agent.settings.current.route_eager else None
print("serving", state(), flush=True)
seen, deadline = state(), time.monotonic() + 60
while time.monotonic() < deadline:
    with torch.no_grad():
        model(torch.randn(int(time.monotonic() * 10) % 7 + 1, 8))   # new sizes keep coming
    if state() != seen:
        seen = state()
        print("now", seen, flush=True)
        if seen is None:
            break
    time.sleep(0.02)
"""


def test_the_sidecar_freezes_recording_over_the_control_channel_and_unfreezes_it(collector):
    """The freeze remedy's agent end (issue 52): the sidecar's control server asks a serving
    agent to stop recording CUDA graphs for new sizes. The agent sets what torch reads on every
    call (`cudagraph_capture_sizes` to the sizes recorded so far, 2.9+; older: unseen shapes to
    the uncompiled model), says so in a `mitigation` event and keeps serving; `unfreeze` puts
    torch's setting back."""
    from torch_watchdog.sidecar.actions.control import ControlServer

    ctl = ControlServer(collector.path + ".ctl")
    env = dict(os.environ, PYTHONPATH=with_root())
    proc = subprocess.Popen([sys.executable, "-c", FROZEN_SERVER, collector.path], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split() == ["serving", "None"]
        assert collector.wait(lambda c: proc.pid in ctl.connected(), 30)
        assert ctl.tell({proc.pid}, "freeze") == ([proc.pid], [])
        assert collector.wait(lambda c: any(m.name == "freeze" for m in c.of("mitigation")), 10)
        m = next(m for m in collector.of("mitigation") if m.name == "freeze")
        assert m.action == "engaged" and m.detail.startswith("2 sizes recorded"), m.detail
        frozen = proc.stdout.readline().strip()
        assert frozen in ("now ['4', '5']", "now eager"), frozen   # None is in the set too
        assert ctl.tell({proc.pid}, "unfreeze") == ([proc.pid], [])
        assert proc.stdout.readline().strip() == "now None"
        assert collector.wait(lambda c: any(m.action == "released"
                                            for m in c.of("mitigation")), 10)
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        ctl.close()
