"""The sidecar restarted beside running servers (issue 50, part 4, live). The user's report:
three servers under one sidecar (`reload.method: agent`, a per-server budget), two flat well
under it, one growing; `kill -TERM` the sidecar and start it again, and 1.7 s later it
reloaded "default" (every pid of the host, summed against the one server's budget) and
drained them all: agents heard before their next hello (every 30 s) all landed in one
server, `default`.

Here, with real processes: the real sidecar (a subprocess, host-memory mode: CI has no GPU)
and three real servers with the real agent (restart_server.py), `flat-a`, `flat-b` and
`growing`, each at 60 % of the per-server budget (any two together 120 %: a server made of
them is over it). The sidecar is SIGTERMed and started again five times, then SIGKILLed and
started again five times (same config, same state_dir); the growing server starts growing
(3 MiB/s, CUDA-graph recordings) when the SIGKILLs begin. What a user would notice:

- after each restart, within KNOWN_WITHIN_S, the sidecar lists the three servers by their
  names with their processes (/status.json), and never a server `default`;
- no reload (nor any action but an alert) names a flat server, `default` or a flat server's
  pid, in any incarnation's log (structlog JSON lines on its stderr); the flat servers keep
  their processes and go on answering requests;
- nothing acts on the growing server while it is flat; once it grows it is reloaded (drained,
  exit 75, started again by this test as systemd's RestartForceExitStatus=75 would) when it
  truly nears its budget (the reload's own level past what it had while flat), and the
  reload's outcome is ok.

About two minutes on the shared 2-core machine (the suite has no marker for slow tests:
pyproject.toml declares only `gpu`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any, Callable, Optional

import pytest

from tests.conftest import ROOT, free_port, wait_until, with_root
from torch_watchdog.agent.drain import EX_TEMPFAIL

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "restart_server.py")
MIB = 1 << 20
BUDGET_MIB = 500             # forecast.process_budget_bytes: each server's own
LEVEL_MIB = 300              # each server's PSS at first: 60 % of it; two together 120 %
FLATS = ("flat-a", "flat-b")
GROWING = "growing"
SERVERS = (*FLATS, GROWING)
RESTARTS = [signal.SIGTERM] * 5 + [signal.SIGKILL] * 5
GROW_FROM = RESTARTS.index(signal.SIGKILL)  # the growing server grows from the first SIGKILL
KNOWN_WITHIN_S = 5.0         # a restarted sidecar lists the three by name within this
WATCH_S = 6.0                # each incarnation watched this long before the next restart
RELOAD_WITHIN_S = 150.0      # growth begun: its reload's outcome within this


def config(tmp: str, port: int) -> str:
    # reload_lead_s 30: the growing server (3 MiB/s) is within it from ~410 MiB of its 500;
    # a flat one (200 MiB left) would be only at 6.7 MiB/s of growth. cooldown_s 600: one
    # reload of the growing server in this test (its next process grows too, held back)
    return f"""poll_interval_s: 0.1
metrics_port: {port}
state_dir: {tmp}/state
agent: {{socket_path: {tmp}/ev.sock, allowed_uids: [{os.getuid()}]}}
forecast: {{process_budget_bytes: {BUDGET_MIB * MIB}, window_s: 30}}
policy: {{reload_lead_s: 30, alert_lead_s: 600, hold_polls: 20, warmup_s: 5,
         cooldown_s: 600, max_reloads_per_hour: 3}}
reload: {{method: agent, grace_s: 5, hello_timeout_s: 60}}
"""


class Host:
    """The sidecar (one incarnation after another) and the three servers; `growing` is
    started again whenever it exits with the drain code."""

    def __init__(self, tmp: str):
        self.tmp, self.port = tmp, free_port()
        self.sock = os.path.join(tmp, "ev.sock")
        self.cfg = os.path.join(tmp, "watchdog.yaml")
        self.progress = os.path.join(tmp, "progress")
        os.makedirs(os.path.join(tmp, "state"))
        with open(self.cfg, "w") as fh:
            fh.write(config(tmp, self.port))
        self.env = dict(os.environ, PYTHONPATH=with_root(), OMP_NUM_THREADS="1",
                        TORCH_WATCHDOG_RESTART_FILE=os.path.join(tmp, "restart-requested"))
        self.env.pop("NOTIFY_SOCKET", None)
        self.sidecar: Optional[subprocess.Popen] = None
        self.incarnation = 0
        self.servers: dict[str, subprocess.Popen] = {}
        self.growing_pids: list[int] = []
        self.growing_exits: list[int] = []
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)

    def log_path(self, incarnation: int) -> str:
        return os.path.join(self.tmp, f"sidecar-{incarnation}.log")

    def start_sidecar(self) -> float:
        """A new incarnation; returns (monotonic) when it logged `started` (its socket, control
        socket and port bound)."""
        self.incarnation += 1
        with open(self.log_path(self.incarnation), "w") as log:
            self.sidecar = subprocess.Popen(
                [sys.executable, "-m", "torch_watchdog.cli", "sidecar", "--config", self.cfg],
                cwd=ROOT, env=self.env, stderr=log, stdout=subprocess.DEVNULL)
        until(lambda: self.sidecar.poll() is not None or any(
            e.get("event") == "started" for e in self.log()), 60,
            lambda: f"the sidecar's `started`: {self.tail()}")
        assert self.sidecar.poll() is None, self.tail()
        return time.monotonic()

    def stop_sidecar(self, sig: int) -> None:
        self.sidecar.send_signal(sig)
        code = self.sidecar.wait(30)
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL), (code, self.tail())

    def log(self, incarnation: Optional[int] = None) -> list[dict[str, Any]]:
        with open(self.log_path(incarnation or self.incarnation)) as fh:
            return [json.loads(line) for line in fh if line.startswith("{")
                    and line.endswith("\n")]

    def tail(self, n: int = 3000) -> str:
        with open(self.log_path(self.incarnation)) as fh:
            return fh.read()[-n:]

    def start_server(self, name: str) -> None:
        kind = "grow" if name == GROWING else "flat"
        proc = self.servers[name] = subprocess.Popen(
            [sys.executable, SERVER, self.sock, name, kind, str(LEVEL_MIB), self.progress],
            cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if name == GROWING:
            self.growing_pids.append(proc.pid)

    def grow(self) -> None:
        open(self.progress + ".grow", "w").close()

    def _supervise(self) -> None:
        """`growing` started again when it exits with the drain code, as systemd would."""
        while not self._stop.wait(0.2):
            code = self.servers[GROWING].poll()
            if code is not None:
                self.growing_exits.append(code)
                if code != EX_TEMPFAIL:
                    return
                self.start_server(GROWING)

    def serving(self) -> dict[int, str]:
        """pid -> server of every process that answered its first call."""
        try:
            with open(self.progress) as fh:
                return {int(p): n for p, n, _ in (line.split() for line in fh
                                                  if line.endswith("\n"))}
        except FileNotFoundError:
            return {}

    def answered(self, pid: int) -> int:
        """The calls process `pid` has answered (as of its last second)."""
        try:
            with open(f"{self.progress}.{pid}") as fh:
                return int(fh.read() or 0)
        except FileNotFoundError:
            return 0

    def rows(self) -> dict[str, dict[str, Any]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status.json",
                                    timeout=5) as reply:
            return {r["server"]: r for r in json.loads(reply.read())["servers"]}

    def record(self) -> list[dict[str, Any]]:
        with open(os.path.join(self.tmp, "state", "reloads.json")) as fh:
            return json.load(fh)["reloads"]

    def actions(self) -> list[tuple[int, dict[str, Any]]]:
        """(incarnation, entry) of every action every incarnation logged, in order."""
        return [(i, e) for i in range(1, self.incarnation + 1) for e in self.log(i)
                if e.get("event") == "action"]

    def __enter__(self) -> "Host":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for proc in [*self.servers.values(), self.sidecar]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


def until(cond: Callable[[], Any], timeout: float, what: Callable[[], str]) -> Any:
    """wait_until, its message built when it fails (`what()`: the state then)."""
    try:
        return wait_until(cond, timeout, "")
    except pytest.fail.Exception:
        pytest.fail(f"not within {timeout:g} s: {what()}")


def short(entry: dict[str, Any]) -> str:
    keys = ("event", "action", "reason", "server", "pids", "seconds_to_oom", "level_bytes",
            "budget_bytes", "detail", "timestamp")
    return json.dumps({k: entry[k] for k in keys if k in entry})


def action_problems(host: Host, flat_pids: set[int], grown_from: Optional[int]) -> list[str]:
    """The logged actions that must not be: any but an alert naming a flat server or a flat
    server's pid; any naming `default`; any on the growing server before it grew (incarnation
    `grown_from` on), or on a process that is not one of its own."""
    problems = []
    for inc, entry in host.actions():
        server, pids, kind = entry.get("server"), set(entry.get("pids") or ()), entry["action"]
        where = f"incarnation {inc}"
        if server == "default":
            problems.append(f"{where}: an action for `default`: {short(entry)}")
        elif (server in FLATS or pids & flat_pids) and kind != "alert":
            problems.append(f"{where}: an action for {server} (flat pids "
                            f"{sorted(pids & flat_pids)}): {short(entry)}")
        elif server == GROWING and (grown_from is None or inc < grown_from):
            problems.append(f"{where}: an action for the growing server while flat: "
                            f"{short(entry)}")
        elif server == GROWING and not pids <= set(host.growing_pids):
            problems.append(f"{where}: an action for the growing server on processes not its "
                            f"own ({sorted(pids - set(host.growing_pids))}): {short(entry)}")
    return problems


def known(host: Host, flat_pids: dict[str, int]) -> Optional[dict[str, dict[str, Any]]]:
    """The rows, once the three servers are listed by name with their processes (a flat one
    up with its one pid, the growing one with a process of its own)."""
    rows = host.rows()
    for name, pid in flat_pids.items():
        r = rows.get(name)
        if r is None or r["state"] != "up" or r["pids"] != [pid]:
            return None
    g = rows.get(GROWING)
    if g is None or not g["pids"] or not set(g["pids"]) <= set(host.growing_pids):
        return None
    return rows


def test_restarting_the_sidecar_beside_running_servers_drains_none_of_them(short_tmp):
    started = time.monotonic()
    with Host(short_tmp) as host:
        host.start_sidecar()
        for name in SERVERS:
            host.start_server(name)
        host._supervisor.start()
        until(lambda: set(host.serving().values()) == set(SERVERS), 90,
              lambda: f"the three servers answering; serving {host.serving()}")
        flat_pids = {n: host.servers[n].pid for n in FLATS}
        rows = until(lambda: known(host, flat_pids), 60,
                     lambda: f"the three servers listed by name: {host.rows()}")
        for name in SERVERS:  # each alone well under its budget; any two together over it
            level = rows[name]["level_bytes"]
            assert 0.45 * BUDGET_MIB * MIB < level < 0.75 * BUDGET_MIB * MIB, (name, level)
        flat_level = max(rows[n]["level_bytes"] for n in SERVERS)
        print(f"\nset-up: {time.monotonic() - started:.0f} s; levels "
              f"{ {n: round(rows[n]['level_bytes'] / MIB) for n in SERVERS} } MiB of "
              f"{BUDGET_MIB}")
        answered = {n: host.answered(p) for n, p in flat_pids.items()}

        grown_from: Optional[int] = None
        for i, sig in enumerate(RESTARTS):
            what = f"restart {i + 1} ({signal.Signals(sig).name})"
            if i == GROW_FROM:
                host.grow()
                grown_from = host.incarnation  # the incarnation it starts to grow under
            host.stop_sidecar(sig)
            ready_at = host.start_sidecar()
            rows = until(lambda: known(host, flat_pids), KNOWN_WITHIN_S,
                         lambda what=what: f"{what}: the three servers listed by name: "
                                           f"{host.rows()}")
            known_s = time.monotonic() - ready_at
            problems, deadline = [], ready_at + WATCH_S
            while not problems and time.monotonic() < deadline:
                problems = action_problems(host, set(flat_pids.values()), grown_from)
                try:
                    rows = host.rows()
                except OSError:
                    pass
                if "default" in rows:
                    problems.append(f"{what}: /status.json lists `default`: {rows['default']}")
                problems += [f"{what}: {n} exited ({host.servers[n].poll()})" for n in FLATS
                             if host.servers[n].poll() is not None]
                time.sleep(0.25)
            assert not problems, "\n".join(problems)
            print(f"{what}: the three listed by name {known_s:.1f} s after `started`; nothing "
                  f"done to a flat one ({time.monotonic() - started:.0f} s)")

        # the growing one is reloaded, once it nears its budget, and comes back
        until(lambda: any(r["server"] == GROWING and r.get("ok") is True
                          for r in host.record()), RELOAD_WITHIN_S,
              lambda: f"the growing server's reload and its outcome; rows "
                      f"{json.dumps(host.rows().get(GROWING))[:800]}; exits "
                      f"{host.growing_exits}; {host.tail()}")
        reloads = [e for _, e in host.actions()
                   if e["server"] == GROWING and e["action"] == "reload"]
        assert reloads, host.actions()
        level = reloads[0].get("detail", reloads[0]).get("level_bytes")
        assert level is not None and level > flat_level + 60 * MIB, (flat_level, reloads[0])
        assert host.growing_exits[:1] == [EX_TEMPFAIL], host.growing_exits
        assert [r["server"] for r in host.record()] == [GROWING], host.record()
        problems = action_problems(host, set(flat_pids.values()), grown_from)
        assert not problems, "\n".join(problems)
        for name, pid in flat_pids.items():  # still the same processes, still answering
            assert host.servers[name].poll() is None and host.servers[name].pid == pid
            assert host.answered(pid) > answered[name], (name, answered[name])
        print(f"the growing server reloaded at {level / MIB:.0f} MiB of {BUDGET_MIB} "
              f"(flat at most {flat_level / MIB:.0f}); the whole test: "
              f"{time.monotonic() - started:.0f} s")
