"""The real daemon reloads a real (toy) server before it runs out of its memory budget:
host-memory mode, a forecast from the growth of its RSS, SIGTERM, a record that survives; the
reload is done once a new process of the server says hello, and failed when none does."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, with_root

TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_server.py")


@pytest.mark.parametrize("case", ["restarted", "dry_run", "not_restarted"])
def test_the_sidecar_reloads_the_server_before_its_budget_runs_out(short_tmp, case):
    dry_run = case == "dry_run"
    sock, marker = os.path.join(short_tmp, "ev.sock"), os.path.join(short_tmp, "stopped")
    cfg = os.path.join(short_tmp, "w.yaml")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(cfg, "w") as fh:
        fh.write(f"""metrics_port: {port}
state_dir: {short_tmp}/state
agent: {{socket_path: {sock}, allowed_uids: [{os.getuid()}]}}
forecast: {{process_budget_bytes: 600000000, window_s: 3}}
policy: {{reload_lead_s: 6, alert_lead_s: 30, hold_polls: 3, warmup_s: 1,
         dry_run: {str(dry_run).lower()}}}
reload: {{method: signal, grace_s: 5, hello_timeout_s: 5}}
""")
    env = dict(os.environ, PYTHONPATH=with_root())
    daemon = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                               "--config", cfg], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                              text=True)
    toy = again = None
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock) and time.monotonic() < deadline:
            assert daemon.poll() is None, daemon.stderr.read()
            time.sleep(0.05)
        toy = subprocess.Popen([sys.executable, TOY, sock, marker], cwd=ROOT, env=env)
        try:
            code = toy.wait(25)
        except subprocess.TimeoutExpired:
            code = None
        if case == "restarted" and code is not None:  # its supervisor's Restart=: a new hello
            again = subprocess.Popen([sys.executable, TOY, sock, marker + "2"], cwd=ROOT, env=env)
        record = os.path.join(short_tmp, "state", "reloads.json")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the outcome is written once the reload returns
            entries = json.load(open(record))["reloads"] if os.path.exists(record) else []
            if entries and entries[-1].get("ok") is not None:
                break
            time.sleep(0.1)
        (entry,) = entries
        if dry_run:
            assert code is None and not os.path.exists(marker)  # still running, untouched
            assert entry["ok"] is False and "dry run" in entry["detail"]
        elif case == "restarted":
            assert code == 0 and open(marker).read() == "graceful"
            assert entry["ok"] is True, entry["detail"]
            assert entry["detail"] == f"exited after SIGTERM; back: pid {again.pid} said hello"
        else:  # nothing restarted it: reload_failed, not reload_ok
            assert code == 0 and open(marker).read() == "graceful"
            assert entry["ok"] is False and entry["failed"] is True, entry
            assert "no hello from a new process of the server within 5 s" in entry["detail"]
    finally:
        for proc in (toy, again):
            if proc is not None and proc.poll() is None:
                proc.kill()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(15)
    logs = [json.loads(line) for line in daemon.stderr.read().splitlines() if line.startswith("{")]
    decided = [e for e in logs if e["event"] == "action" and e.get("action") == "reload"]
    assert len(decided) == 1 and decided[0]["seconds_to_oom"] <= 6
    outcomes = [e["action"] for e in logs if e["event"] == "action" and
                e.get("action", "").startswith("reload_")]
    assert outcomes == {"restarted": ["reload_ok"], "dry_run": [],
                        "not_restarted": ["reload_failed"]}[case]
