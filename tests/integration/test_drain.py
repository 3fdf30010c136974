"""Reload method `agent`, end to end on CPU: the real sidecar daemon forecasts the server's
OOM and asks its agent to drain; the server stops taking work, finishes the call in hand,
exits 75; a supervisor (this test, as systemd's RestartForceExitStatus=75 would) starts it
again, and it answers. And: no other local process can make the agent drain."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ROOT, free_port, wait_for, with_root
from torch_watchdog.sidecar.actions.control import ControlServer

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drain_server.py")


def progress(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.endswith("\n")]


def kinds(lines: list[dict]) -> list[str]:
    return [line["kind"] for line in lines]


def start_server(tmp: str, gen: int, env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, SERVER, "--socket", os.path.join(tmp, "ev.sock"),
         "--progress", os.path.join(tmp, f"progress{gen}"),
         "--event-log", os.path.join(tmp, f"events{gen}.jsonl"), *extra],
        cwd=ROOT, env=env, stderr=None if os.environ.get("DRAIN_DEBUG") else subprocess.DEVNULL)


def test_the_sidecar_drains_the_server_through_its_agent_and_it_comes_back(short_tmp):
    tmp = short_tmp
    restart_file = os.path.join(tmp, "restart-requested")
    env = dict(os.environ, PYTHONPATH=with_root(), TORCH_WATCHDOG_RESTART_FILE=restart_file)
    cfg = os.path.join(tmp, "w.yaml")
    with open(cfg, "w") as fh:
        fh.write(f"""metrics_port: {free_port()}
state_dir: {tmp}/state
agent: {{socket_path: {tmp}/ev.sock, allowed_uids: [{os.getuid()}]}}
forecast: {{process_budget_bytes: 1000000000, window_s: 3}}
policy: {{reload_lead_s: 6, alert_lead_s: 30, hold_polls: 3, warmup_s: 1}}
reload: {{method: agent, grace_s: 10}}
""")
    daemon = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                               "--config", cfg], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                              text=True)
    gens: list[subprocess.Popen] = []
    codes: list[int] = []

    def supervise() -> None:  # Restart=on-failure with RestartForceExitStatus=75, in short
        gens.append(start_server(tmp, 1, env, "--grow-mib-per-s", "60"))
        codes.append(gens[0].wait(120))
        if codes[0] == 75:
            gens.append(start_server(tmp, 2, env))

    supervisor = threading.Thread(target=supervise, daemon=True)
    try:
        assert wait_for(lambda: os.path.exists(f"{tmp}/ev.sock.ctl"), 30), "no control socket"
        supervisor.start()
        assert wait_for(lambda: "ready" in kinds(progress(f"{tmp}/progress2")), 120), \
            (codes, kinds(progress(f"{tmp}/progress1"))[-5:])
        record = os.path.join(tmp, "state", "reloads.json")
        assert wait_for(lambda: json.load(open(record))["reloads"][-1]["ok"] is not None, 10)
        first = progress(f"{tmp}/progress1")
        second = progress(f"{tmp}/progress2")
    finally:
        for p in gens:
            if p.poll() is None:
                p.kill()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(15)
    assert codes == [75]  # the documented exit: the supervisor restarts it
    seen = kinds(first)
    # the server stopped taking work once asked: nothing began after the drain callback,
    # and the request in hand when it came was answered
    drained_at = seen.index("on_drain")
    assert "begin" not in seen[drained_at:]
    last_begin = max(i for i, k in enumerate(seen) if k == "begin")
    assert last_begin < drained_at
    # the request in hand when it came was answered, or, taken as the drain began and its
    # call started after, refused with Draining (a 503 the load balancer retries): never lost
    last = first[last_begin]["i"]
    outcome = [x["kind"] for x in first if x.get("i") == last and x["kind"] != "begin"]
    assert outcome in (["end"], ["refused"]), outcome
    # and its health check said so from the drain's start. (Whether the server's loop reads
    # ready() once more is a race it may lose: the agent exits once no call is in hand or ended
    # for QUIET_S, which a loop descheduled on a loaded machine can outlast.)
    assert first[drained_at]["ready"] is False
    # the agent said so to the sidecar, in its event log too
    with open(f"{tmp}/events1.jsonl") as fh:
        drains = [e for e in map(json.loads, fh) if e["kind"] == "drain"]
    assert [d["phase"] for d in drains] == ["draining", "drained"]
    assert drains[1]["in_flight"] == 0 and drains[1]["exit_code"] == 75
    # recorded like any reload
    entries = json.load(open(os.path.join(tmp, "state", "reloads.json")))["reloads"]
    assert len(entries) == 1, entries
    (entry,) = entries
    assert entry["ok"] is True and entry["detail"].startswith("drained 1 of 1 process(es), exit "
                                                              "code 75, calls in hand finished")
    logs = [json.loads(line) for line in daemon.stderr.read().splitlines()
            if line.startswith("{")]
    assert [e["action"] for e in logs if e["event"] == "action" and
            e.get("action", "").startswith("reload")] == ["reload", "reload_ok"]
    # the new process answered, and cleared the restart request the old one left
    assert second[0]["pid"] != first[0]["pid"] and "ready" in kinds(second)
    assert not os.path.exists(restart_file)


def test_a_busy_server_drains_in_the_time_of_its_call_in_hand(short_tmp):
    """A queue worker calling the model back to back, never reading ready(): the drain used
    to wait for the whole grace period, a new call always in hand ("1 call(s) still in hand at
    the grace deadline"). Now the call in hand finishes, the next one raises Draining at once,
    and the process exits 75 within about one call (0.3 s) of the request."""
    tmp = short_tmp
    env = dict(os.environ, PYTHONPATH=with_root(),
               TORCH_WATCHDOG_RESTART_FILE=os.path.join(tmp, "restart-requested"))
    ctl = ControlServer(os.path.join(tmp, "ev.sock.ctl"))
    server = start_server(tmp, 1, env, "--busy", "--call-s", "0.3")
    try:
        assert wait_for(lambda: server.pid in ctl.connected()
                        and "end" in kinds(progress(f"{tmp}/progress1")), 120)
        asked = time.monotonic()
        outcome = ctl.drain({server.pid}, 30.0)
        took = time.monotonic() - asked
        server.wait(30)  # exited (its status went to the control end, which reaped its child)
    finally:
        if server.poll() is None:
            server.kill()
        ctl.close()
    assert outcome.ok, outcome.detail
    assert outcome.detail.startswith("drained 1 of 1 process(es), exit code 75, calls in hand "
                                      "finished"), outcome.detail
    assert "refused (Draining)" in outcome.detail, outcome.detail
    assert took < 5.0, f"the drain took {took:.1f} s of its 30 s grace"
    seen = progress(f"{tmp}/progress1")
    refused = [x for x in seen if x["kind"] == "refused"]
    assert len(refused) == 1
    # the call in hand when the drain came was answered; the one after it was refused
    assert [x["i"] for x in seen if x["kind"] == "end"][-1] == refused[0]["i"] - 1
    print(f"\nbusy drain: {took:.2f} s from the request to the reply ({outcome.detail})")


def impostor(path: str, log: str) -> int:
    """Fork a process of uid/gid 65534 (nobody) that binds `path` and tells every peer to
    drain; returns its pid. Forked, not executed: nobody may not reach this interpreter."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setgid(65534)
        os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        os.chmod(path, 0o777)
        s.listen(8)
        n = 0
        while True:
            c, _ = s.accept()
            n += 1
            try:
                c.sendall(json.dumps({"v": 1, "kind": "drain", "grace_s": 1}).encode() + b"\n")
            except OSError:
                pass
            with open(log, "a") as fh:
                fh.write(f"{n}\n")
            c.close()
    finally:
        os._exit(1)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the impostor as another uid")
def test_no_other_local_process_can_make_the_agent_drain(short_tmp):
    """A process of another uid binds the control socket's path first (a world-writable
    directory) and tells every agent that connects to drain: the agent refuses the peer and
    keeps serving. The sidecar refuses to drain a pid that is not the server's. Then the real
    sidecar (root) binds the path, and its request is obeyed."""
    tmp = os.path.join(short_tmp, "run")
    os.mkdir(tmp)
    os.chmod(tmp, 0o1777)
    ctl, attempts = os.path.join(tmp, "ev.sock.ctl"), os.path.join(tmp, "attempts")
    os.chmod(short_tmp, 0o755)
    other = impostor(ctl, attempts)
    env = dict(os.environ, PYTHONPATH=with_root())
    server, control = None, None
    try:
        assert wait_for(lambda: os.path.exists(ctl), 20)
        assert os.stat(ctl).st_uid == 65534
        server = start_server(tmp, 1, env, "--call-s", "0.05")
        prog = os.path.join(tmp, "progress1")

        def ended() -> int:
            return sum(1 for line in progress(prog) if line["kind"] == "end")

        # the agent connected twice (refused the peer, retried), was told to drain each time
        assert wait_for(lambda: os.path.exists(attempts) and
                        len(open(attempts).read().split()) >= 2, 60)
        served = ended()
        assert wait_for(lambda: ended() >= served + 10, 30)  # and went on serving
        assert "on_drain" not in kinds(progress(prog)) and server.poll() is None
        os.kill(other, signal.SIGKILL)
        os.waitpid(other, 0)
        other = 0
        control = ControlServer(ctl)  # the sidecar, root, binds the path once it is free
        assert wait_for(lambda: server.pid in control.connected(), 30)
        # a drain for pids that are not this server's does not reach it
        refused = control.drain({server.pid + 100000}, 1.0)
        assert not refused.ok and "no agent of the server is connected" in refused.detail
        served = ended()
        assert wait_for(lambda: ended() >= served + 5, 30)
        outcome = control.drain({server.pid}, 5.0)
        assert outcome.ok, outcome.detail
        assert "on_drain" in kinds(progress(prog))
    finally:
        if other:
            os.kill(other, signal.SIGKILL)
            os.waitpid(other, 0)
        if server is not None and server.poll() is None:
            server.kill()
        if control is not None:
            control.close()
