"""Inside Ray Serve, with the real engine on CPU: a growing replica reloaded by Serve itself.

A local Ray cluster started by the test (2 CPUs, no dashboard: tests/integration/serve_app.py),
a Serve application of 2 replicas of a `torch.compile`d model behind Serve's HTTP proxy, each
with the agent and the WatchdogReplica mixin; the real sidecar daemon in host-memory mode with
`reload.method: agent`; an open-loop client at 10 requests/s (2 s timeout), each request of a
new length. One replica keeps 4 MB per distinct length until the sidecar forecasts it over
its process budget. Asserted: the sidecar sees two servers named after the deployment's
replicas (`serve:llm/Model/0` and `/1`, what the replicas say of themselves); the growing one
is drained through Serve (its health check fails, Serve's controller logs it and stops the
replica gracefully, the agent replies "stopped by Ray Serve", and a replacement says hello under
the same name and serves); the other replica keeps its
process and serves throughout; at most 1 % of the requests made during the reload failed;
the sidecar's sample log replayed takes the same decisions. `pytest -s` prints the figures;
`RAY_SERVE_DEBUG=1` also the sidecar's and the driver's logs.
"""
from __future__ import annotations

import glob
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

import psutil
import pytest

from tests.conftest import ROOT, free_port, with_root
from tests.conftest import wait_until as wait

pytest.importorskip("ray.serve")

MB = 1 << 20
APP = os.path.join(ROOT, "tests", "integration", "serve_app.py")
NAMES = {"serve:llm/Model/0", "serve:llm/Model/1"}
DEBUG = os.environ.get("RAY_SERVE_DEBUG") == "1"
# the reload's decisions, live and replayed (newest first in the status page)
KINDS = ("reload", "cancel", "execute", "restart", "reload_ok", "reload_failed",
         "reload_not_done")


class Client(threading.Thread):
    """Open loop: a request every 0.1 s whatever the answers, each on its own thread with a 2 s
    timeout and a length not asked before; keeps (start, end, answer dict or error)."""

    RATE, TIMEOUT_S = 10.0, 2.0

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.stop, self.done = port, threading.Event(), []

    def run(self) -> None:
        due, n = time.monotonic(), 100
        while not self.stop.is_set():
            n += 1
            threading.Thread(target=self.one, args=(n,), daemon=True).start()
            due += 1 / self.RATE
            time.sleep(max(0.0, due - time.monotonic()))

    def one(self, n: int) -> None:
        started = time.time()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/?n={n}",
                                        timeout=self.TIMEOUT_S) as r:
                got = json.loads(r.read())
        except (OSError, ValueError) as e:
            got = f"{type(e).__name__}: {e}"
        self.done.append((started, time.time(), got))

    def served(self, since: float = 0.0) -> list[dict]:
        return [r[2] for r in list(self.done) if r[0] >= since and isinstance(r[2], dict)]


def status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=5) as r:
        return json.load(r)


def live_servers(port: int) -> dict[str, list[int]]:
    """Server name -> its pids still running, for the servers with one."""
    out = {}
    for s in status(port)["servers"]:
        pids = [p for p in s["pids"] if psutil.pid_exists(p)]
        if pids:
            out[s["server"]] = pids
    return out


def sidecar_config(path: str, tmp: str, sock: str, port: int, budget: int) -> None:
    with open(path, "w") as fh:
        fh.write(f"""metrics_port: {port}
state_dir: {tmp}/state
sample_log: {tmp}/samples.jsonl
agent: {{socket_path: {sock}, allowed_uids: [{os.getuid()}]}}
forecast: {{process_budget_bytes: {budget}, window_s: 3}}
policy: {{reload_lead_s: 6, alert_lead_s: 30, hold_polls: 3, warmup_s: 1,
          max_concurrent_reloads: 1}}
reload: {{method: agent, grace_s: 20, hello_timeout_s: 90}}
""")


def reload_entry(tmp: str) -> Optional[dict]:
    path = os.path.join(tmp, "state", "reloads.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        entries = json.load(fh)["reloads"]
    return entries[-1] if entries else None


def loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address (::ffff:127.0.0.1)."""
    a = ipaddress.ip_address(ip)
    mapped = getattr(a, "ipv4_mapped", None)
    return (mapped or a).is_loopback


class Family:
    """Every process the driver started (Ray's GCS, raylet, workers, Serve's actors), noted
    while they run, so that none outlives the test: Ray's workers lead process groups of their
    own, out of reach of a signal to the driver's."""

    def __init__(self, root: int):
        self.root, self.seen = root, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def note(self) -> None:
        try:
            for p in psutil.Process(self.root).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.note()

    def off_loopback(self) -> list[str]:
        """The family's TCP and UDP sockets with an address that is not loopback: a peer's
        (any), or its own on a connected socket (`ss -tunp` of its processes). A listener on
        every address is not a connection, and is left to Ray."""
        out = []
        for p in [self.seen.get(self.root) or psutil.Process(self.root), *self.seen.values()]:
            try:
                conns = p.net_connections(kind="inet")
            except psutil.Error:
                continue
            for c in conns:
                ips = [c.raddr.ip] if c.raddr else []
                ips += [c.laddr.ip] if c.raddr and c.laddr else []
                if any(not loopback(ip) for ip in ips):
                    out.append(f"pid {p.pid}: {c.laddr} -> {c.raddr} {c.status}")
        return out

    def kill(self, grace_s: float = 15.0) -> list[str]:
        """What is left of them `grace_s` after the driver stopped, SIGKILLed; returns them
        (pid and command line)."""
        self.stop.set()
        self.thread.join(2)
        _, left = psutil.wait_procs([p for p in self.seen.values() if p.is_running()],
                                    timeout=grace_s)
        named = []
        for p in left:
            try:
                named.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=10)
        return named


def test_a_growing_replica_is_replaced_by_serve_and_the_other_one_is_untouched(short_tmp):
    tmp, sock = short_tmp, os.path.join(short_tmp, "ev.sock")
    cfg, mport, port = os.path.join(tmp, "w.yaml"), free_port(), free_port()
    sidecar_config(cfg, tmp, sock, mport, 1 << 40)  # no budget yet: start-up is growth
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_WATCHDOG_", "RAY_"))}
    env.update(PYTHONPATH=with_root(), OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")   # the node's address: loopback
    err = open(os.path.join(tmp, "sidecar.err"), "w")
    out = open(os.path.join(tmp, "driver.log"), "w")
    sidecar = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                                "--config", cfg], cwd=ROOT, env=env, stderr=err)
    driver = family = client = None
    t0 = time.monotonic()
    try:
        wait(lambda: os.path.exists(sock), 30, "the sidecar's socket")
        driver = subprocess.Popen([sys.executable, APP, "--port", str(port), "--tmp", tmp],
                                  cwd=tmp, env=dict(env, TORCH_WATCHDOG_SOCKET=sock),
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        family = Family(driver.pid)
        wait(lambda: driver.poll() is None and "ready" in open(out.name).read(), 150,
             "Serve's two replicas answering")
        ready_s = time.monotonic() - t0
        # two servers, named after the deployment's replicas, as the replicas name themselves
        before = wait(lambda: (lambda s: s if set(s) == NAMES else None)(live_servers(mport)),
                      30, "the two replicas' servers")
        client = Client(port)
        client.start()
        wait(lambda: {(r["server"], r["pid"]) for r in client.served()} >=
             {(n, ps[0]) for n, ps in before.items()}, 30, "both replicas served the client")
        for r in client.served():
            assert r["server"] == f"serve:{r['app']}/{r['deployment']}/{r['rank']}", r
        family.note()
        assert family.off_loopback() == [], "Ray talks beyond loopback"
        grower, other = before["serve:llm/Model/1"][0], before["serve:llm/Model/0"][0]

        # a budget just above the replicas' memory now; then one of them grows toward it
        level = max(psutil.Process(p).memory_info().rss for ps in before.values() for p in ps)
        sidecar_config(cfg, tmp, sock, mport, level + 160 * MB)
        sidecar.send_signal(signal.SIGHUP)
        wait(lambda: "config reloaded" in open(err.name).read(), 10, "the new budget")
        with open(os.path.join(tmp, "grow"), "w") as fh:
            fh.write(str(grower))
        entry = wait(lambda: (lambda e: e if e and e.get("ok") is not None else None)(
            reload_entry(tmp)), 120, "the reload's outcome")
        assert entry["ok"] is True and not entry.get("failed"), entry["detail"]
        assert entry["server"] == "serve:llm/Model/1", entry
        assert "stopped by Ray Serve" in entry["detail"], entry["detail"]
        assert not psutil.pid_exists(grower)
        # Serve's controller did it: the replica failed its health check, stopped gracefully
        logs = glob.glob(os.path.join(tmp, "ray", "session_*", "logs", "serve", "controller_*"))
        said = "".join(open(f, errors="replace").read() for f in logs)
        assert "failed health check, stopping it" in said, (logs, said[-2000:])

        # the replacement: the same name, a new process, serving; the other one untouched
        began = entry["t"]
        after = wait(lambda: (lambda s: s if set(s) == NAMES and s["serve:llm/Model/1"] !=
                              [grower] else None)(live_servers(mport)), 30,
                     "the replacement watched")
        new = after["serve:llm/Model/1"][0]
        wait(lambda: {r["pid"] for r in client.served(began)} >= {new, other}, 30,
             "both replicas serving after the reload")
        assert after["serve:llm/Model/0"] == [other] and psutil.pid_exists(other)
        family.note()
        assert family.off_loopback() == [], "Ray talks beyond loopback"
        end = began + entry["seconds"] + 3
        wait(lambda: max(r[0] for r in client.done) > end, 30, "requests after the reload")
        client.stop.set()
        client.join(5)
        time.sleep(Client.TIMEOUT_S + 0.5)  # the last requests answered or timed out
        during = [r for r in list(client.done) if began <= r[0] <= end]
        failed = [r for r in during if not isinstance(r[2], dict)]
        final = status(mport)
        # every server the sidecar ever knew is one of the deployment's slots (a replacement
        # given a spare rank for a while would show as serve:llm/Model/2, then no pid)
        ever = sorted(s["server"] for s in final["servers"])
        live = [a for a in final["actions"] if a["action"] in KINDS]
        line = {"servers_ever": ever, "servers_before": {n: ps for n, ps in sorted(before.items())},
                "servers_after": {n: ps for n, ps in sorted(after.items())},
                "reload": entry["detail"], "back_s": round(entry["seconds"], 2),
                "requests_during_reload": len(during), "failed_during_reload": len(failed),
                "requests_in_all": len(client.done),
                "failed_in_all": sum(not isinstance(r[2], dict) for r in client.done),
                "ready_s": round(ready_s, 1), "scenario_s": round(time.monotonic() - t0, 1)}
        print("\nray-serve:", json.dumps(line))
        assert all(n.startswith("serve:llm/Model/") for n in ever), ever
        assert len(during) >= 20, line  # enough requests for 1 % to mean something
        assert len(failed) <= 0.01 * len(during), (line, failed[:5])
        assert [a["server"] for a in live if a["action"] == "execute"] == \
            ["serve:llm/Model/1"], live

        # the sample log replayed: the same decisions, at the same times, for the same servers
        replayed = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "replay",
                                   os.path.join(tmp, "samples.jsonl"), "--json"], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=120)
        assert replayed.returncode == 0, replayed.stderr[-2000:]
        def decisions(actions: list[dict]) -> list[tuple]:
            return [(a["action"], round(a["t"], 3), a["server"], a["pids"], a["reason"])
                    for a in actions if a["action"] in KINDS]

        again = decisions(json.loads(replayed.stdout)["actions"])
        assert again == decisions(reversed(live)), (again, live)
    finally:
        if client is not None:
            client.stop.set()
        if driver is not None and driver.poll() is None:
            driver.send_signal(signal.SIGTERM)  # serve.shutdown(), ray.shutdown()
            try:
                driver.wait(60)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait(5)
        left = family.kill() if family is not None else []
        if sidecar.poll() is None:
            sidecar.send_signal(signal.SIGTERM)
            sidecar.wait(30)
        err.close()
        out.close()
        if DEBUG:
            print(open(err.name).read()[-6000:], open(out.name).read()[-6000:])
    assert not left, f"Ray processes left running after the driver stopped: {left}"
