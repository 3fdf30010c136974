"""The standby launcher (`torch-watchdog run`), real subprocesses on CPU: a drain makes the
serving child exit 75 and the pre-imported standby takes over; SIGTERM stops everything
with no orphan; a standby whose preload fails or initialises CUDA falls back to plain
starts, and the server still comes back."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT, wait_for, with_root
from torch_watchdog.sidecar.actions.control import ControlServer

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "standby_server.py")


def lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(x) for x in fh if x.endswith("\n")]


def of(path: str, kind: str) -> list[dict]:
    return [x for x in lines(path) if x["kind"] == kind]


def children(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return {int(x) for x in fh.read().split()}
    except OSError:
        return set()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def launch(tmp: str, *opts: str, server_args: tuple = ()) -> tuple[subprocess.Popen, str, str]:
    prog, err = os.path.join(tmp, "progress"), os.path.join(tmp, "launcher.err")
    # HERE: where the fault case's preload module lives
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([with_root(), HERE]))
    cmd = [sys.executable, "-m", "torch_watchdog.cli", "run", *opts, "--",
           "python", SERVER, "--socket", os.path.join(tmp, "ev.sock"), "--progress", prog,
           "--event-log", os.path.join(tmp, "events.jsonl"), "--call-s", "0.05", *server_args]
    with open(err, "w") as fh:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=fh, stdout=subprocess.DEVNULL)
    return p, prog, err


def recorded_file(pid: int) -> str:
    """Where the launcher has its children record their imports (their environment)."""
    with open(f"/proc/{pid}/environ", "rb") as fh:
        env = dict(x.split(b"=", 1) for x in fh.read().split(b"\0") if b"=" in x)
    return env[b"TORCH_WATCHDOG_IMPORTS_FILE"].decode()


def drain_and_come_back(tmp: str, launcher: subprocess.Popen, prog: str) -> tuple[dict, dict]:
    """First generation answers (and recorded its imports, which the standby takes up within
    a second: 3 s here); a drain request; the next generation answers."""
    control = ControlServer(os.path.join(tmp, "ev.sock.ctl"))
    try:
        assert wait_for(lambda: len(of(prog, "ready")) >= 1, 90), "first generation never answered"
        first = of(prog, "script")[0]
        assert wait_for(lambda: first["pid"] in control.connected(), 30)
        assert wait_for(lambda: os.path.exists(recorded_file(first["pid"])), 30)
        time.sleep(3)
        outcome = control.drain({first["pid"]}, 10.0)
        assert outcome.ok, outcome.detail
        assert wait_for(lambda: len(of(prog, "ready")) >= 2, 90), "no next generation"
        second = of(prog, "script")[1]
        assert launcher.poll() is None
        return first, second
    finally:
        control.close()


def stop(launcher: subprocess.Popen) -> int:
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
    try:
        return launcher.wait(60)
    except subprocess.TimeoutExpired:
        launcher.kill()
        raise


def test_a_drain_hands_over_to_the_preimported_standby_and_sigterm_leaves_no_orphan(short_tmp):
    launcher, prog, err = launch(short_tmp)
    try:
        first, second = drain_and_come_back(short_tmp, launcher, prog)
        # the first generation imported torch itself; the second found it already imported,
        # and the library the first one imported too, not the script's own module
        assert first["preloaded"] is False and second["preloaded"] is True
        assert first["recorded_preloaded"] is False and second["recorded_preloaded"] is True
        assert second["own_module_preloaded"] is False
        assert second["name"] == "__main__" and second["pid"] != first["pid"]
        assert first["ppid"] == second["ppid"] == launcher.pid
        # a new standby is pre-spawned next to the serving child
        assert wait_for(lambda: len(children(launcher.pid)) == 2, 30), children(launcher.pid)
        standby = (children(launcher.pid) - {second["pid"]}).pop()
        code = stop(launcher)
        assert code == -signal.SIGTERM  # the child died of SIGTERM; so did the launcher
        assert wait_for(lambda: not alive(standby) and not alive(second["pid"]), 10), \
            "an orphan was left"
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "released standby" in open(err).read()
    assert "more modules the server had" in open(err).read(), open(err).read()


def test_a_standby_that_initialises_cuda_is_refused_and_starts_are_plain(short_tmp):
    launcher, prog, err = launch(short_tmp, "--preload", "fake_cuda_preload")
    try:
        assert wait_for(lambda: "standby disabled" in open(err).read(), 90), open(err).read()
        assert "must never hold GPU memory" in open(err).read()
        first, second = drain_and_come_back(short_tmp, launcher, prog)
        assert second["preloaded"] is False and not second["cuda_preload_ran"]
        assert children(launcher.pid) == {second["pid"]}  # no standby any more
        stop(launcher)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_preload_that_fails_falls_back_to_plain_starts(short_tmp):
    launcher, prog, err = launch(short_tmp, "--preload", "no_such_module_for_the_test")
    try:
        assert wait_for(lambda: "standby disabled after repeated failures"
                        in open(err).read(), 120), open(err).read()
        assert "no_such_module_for_the_test" in open(err).read()
        first, second = drain_and_come_back(short_tmp, launcher, prog)
        assert second["preloaded"] is False
        stop(launcher)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_after_the_sidecar_drains_a_launched_server_it_sees_one_server_and_stays_in_cooldown(
        short_tmp):
    """The real sidecar (`reload.method: agent`) drains a growing server run by the launcher;
    the released standby serves next. Once in two runs here a server named `default` took
    over the released standby's pid ~10 s later and its own policy decided a second drain,
    outside the real server's 600 s cooldown. Now: one server, `drain-test`, before and after
    (its new pid among its own), one reload decided, and the next generation's growth meets
    the cooldown (no second reload) for the 25 s watched."""
    import urllib.request

    from tests.conftest import free_port
    port = free_port()
    sock = os.path.join(short_tmp, "ev.sock")
    cfg = os.path.join(short_tmp, "w.yaml")
    with open(cfg, "w") as fh:
        fh.write(f"""metrics_port: {port}
state_dir: {short_tmp}/state
agent: {{socket_path: {sock}}}
forecast: {{process_budget_bytes: 600000000, window_s: 3}}
policy: {{reload_lead_s: 8, alert_lead_s: 30, hold_polls: 3, warmup_s: 1}}
reload: {{method: agent, grace_s: 10, hello_timeout_s: 60}}
""")
    env = dict(os.environ, PYTHONPATH=with_root())
    with open(os.path.join(short_tmp, "sidecar.err"), "w") as side_err:
        sidecar = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                                    "--config", cfg], cwd=ROOT, env=env, stderr=side_err)
    launcher = None

    def status() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=5) as r:
            return json.load(r)

    try:
        assert wait_for(lambda: os.path.exists(sock), 30), "the sidecar never bound its socket"
        # the server grows once it answers (20 MiB/s): the forecast meets the budget soon
        launcher, prog, err = launch(short_tmp, server_args=("--grow-mib-per-s", "20"))
        assert wait_for(lambda: len(of(prog, "ready")) >= 2, 120), open(err).read()[-3000:]
        second = of(prog, "script")[1]
        assert second["preloaded"] is True  # the released standby
        names: set = set()
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            names |= {s["server"] for s in status()["servers"]}
            time.sleep(0.5)
        final = status()
        assert names == {"drain-test"}, names
        assert second["pid"] in final["servers"][0]["pids"]
        decided = [a for a in final["actions"] if a["action"] == "reload"]
        outcomes = [a["action"] for a in final["actions"] if a["action"].startswith("reload_")]
        assert len(decided) == 1 and outcomes == ["reload_ok"], final["actions"]
        # newest first: the next generation's growth was forecast too, and alerted only
        since = final["actions"][:[a["action"] for a in final["actions"]].index("reload_ok")]
        assert any(a["action"] == "alert" for a in since), final["actions"]
    finally:
        if launcher is not None:
            stop(launcher)
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(30)

