"""`torch-watchdog demo --short`, for real: a torch.compile server, the agent and the sidecar as
subprocesses. What the user reads, and the facts behind it: the agent's event log, the sidecar's
reload record and log, the report, and no process left behind."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import ROOT, with_root

pytest.importorskip("torch")


def demo(work: str, *extra: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "demo", "--short",
                             "--device", "cpu", "--workdir", work, *extra], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=with_root()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def left_running(work: str) -> list[str]:
    """Processes that carry the demo's marker for this work dir (descendants inherit it)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get("TORCH_WATCHDOG_DEMO") == work:
                found.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])}")
        except psutil.Error:
            continue
    return found


def test_the_short_demo_shows_every_step_and_each_one_happened(short_tmp):
    work = os.path.join(short_tmp, "demo")
    started = time.monotonic()
    proc = demo(work)
    out, err = proc.communicate(timeout=300)
    took = time.monotonic() - started
    assert proc.returncode == 0, out + err
    print(f"demo --short took {took:.1f} s")  # shown with pytest -s
    # what the user reads
    assert re.search(r"\+ *\d+\.\ds agent +recompile #\d of forward: tensor 'ids' size mismatch "
                     r"at index 1\. expected \d+, actual \d+ \(", out), out
    assert re.search(r"stall .* on new shape \[1, \d+\]: cause recompile", out)
    assert "RECOMPILE LIMIT 4 hit in forward" in out
    assert "sidecar  FOUND recompile_limit_eager_fallback" in out
    assert re.search(r"eager fallback: [\d.]+ ms per call while compiled, [\d.]+ ms after", out)
    assert "STAND-IN: it keeps 4 MB of RSS per distinct length" in out
    assert re.search(r"sidecar  RELOAD decided: forecast OOM in [\d.]+ s", out)
    assert "sidecar  reload done: exited after SIGTERM" in out
    again = re.search(r"server   pid (\d+) serving again \([\d.]+ s after SIGTERM", out)
    assert again, out
    assert "What the demo saw" in out and "Every step was seen." in out
    assert f"{work}/report.html" in out and "/metrics" in out and "replay" in out
    # the facts behind it: the agent's events ...
    evs = [json.loads(line) for line in open(os.path.join(work, "events.jsonl"))]
    reasons = [e["reason"] for e in evs if e["kind"] == "recompile"]
    assert any("size mismatch" in (r or "") for r in reasons)
    # the first server hit the limit (the restarted one may too, with the same traffic)
    first_pid = next(e["pid"] for e in evs if e["kind"] == "recompile_limit")
    # ... the sidecar's record of the reload ...
    (reload,) = json.load(open(os.path.join(work, "state", "reloads.json")))["reloads"]
    assert reload["ok"] is True and reload["detail"].startswith("exited after SIGTERM; back: pid ")
    logs = [json.loads(line) for line in open(os.path.join(work, "sidecar.log"))]
    (reloading,) = [e for e in logs if e["event"] == "reloading the server"]
    assert reloading["pids"] == [first_pid]
    assert any(e["event"] == "finding" and e["cause"] == "recompile_limit_eager_fallback"
               for e in logs)
    # ... a new process served requests after the reload
    new_pid = int(again.group(1))
    assert new_pid != first_pid
    served = sum(e["calls"] for e in evs if e["kind"] == "calls" and e["pid"] == new_pid
                 and e["t"] > reload["t"])
    assert served >= 12
    report = open(os.path.join(work, "report.html")).read()
    assert "torch-watchdog report" in report and "recompile_limit_eager_fallback" in report
    # one server, restarted under a new process group: its old name, whose history the new
    # one took, is not a second server of the report ("2 servers", one with no process)
    assert " servers</p>" not in report and "Server pgid:" not in report
    assert left_running(work) == []


def test_ctrl_c_stops_everything_the_demo_started(short_tmp):
    work = os.path.join(short_tmp, "demo")
    proc = demo(work)
    try:
        deadline = time.monotonic() + 60
        while not any("demo.server" in " ".join(c) for c in _children(proc.pid)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        assert len(left_running(work)) == 2  # the sidecar and the server
        proc.send_signal(signal.SIGINT)      # what Ctrl-C sends the driver
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "interrupted (Ctrl-C): stopping what the demo started" in out
    assert "Not seen:" in out
    assert left_running(work) == []


def _children(pid: int) -> list[list[str]]:
    try:
        return [c.cmdline() for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def test_without_torch_the_demo_says_how_to_get_it(monkeypatch, capsys):
    import importlib.util

    from torch_watchdog import demo as demo_mod

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    args = argparse.Namespace(short=True, workdir=None, keep=False, device="auto")
    assert demo_mod.run(args) == 1
    err = capsys.readouterr().err
    assert "pip install torch==2.13.0" in err and "make demo" in err
