"""Real multi-worker servers, reloaded by the real sidecar while a client keeps asking.

docs/agent.md's FastAPI app (its CPU-sized twin: a tiny model, `torch.compile(backend="eager")`, as
inductor takes minutes to compile on a 2-core CI machine) under `uvicorn --workers 2`,
`gunicorn -w 2 -k uvicorn.workers.UvicornWorker` and the same with `--preload`; the sidecar
daemon in host-memory mode, its server found from the agents' hellos. Each scenario: every
worker reports (its pid is in the sidecar's /status.json), a client thread sends requests
(open loop: 10 requests/s, a new connection each, 2 s timeout), the app is made to leak until
the sidecar forecasts an OOM against a budget set just above the server's memory, and the
sidecar reloads it with the scenario's `reload.method`. The app loads its weights for 3 s
after the agent's hello (a stand-in for a real model) and warms up before it accepts
requests: a reload that stopped the next worker at its replacement's hello timed out 15 of 77
requests here. Asserted: at most 1 % of the requests made during the reload failed (besides
one reset, uvicorn's own race at a worker's exit), every worker was replaced, its replacement
said hello to the sidecar and served, and the master kept running. The figures (failed
requests, time until every worker was back) are printed (`pytest -s`) and appended to
`$WATCHDOG_REAL_SERVERS_RESULTS` when set;
`REAL_SERVERS_DEBUG=1` also prints the failed requests and the server's and sidecar's logs.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Optional

import psutil
import pytest

from tests.conftest import ROOT, free_port, with_root
from tests.conftest import wait_until as wait

pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("gunicorn")

MB = 1 << 20

# docs/agent.md, "In a FastAPI server", sized for a CPU; /leak and /pid are the test's own
APP = r'''
import torch_watchdog.agent.auto          # first, before the model is compiled
import os
import time
import torch
from fastapi import FastAPI, Response
import torch_watchdog.agent

app = FastAPI()
time.sleep(3)  # the weights loading: a real model takes seconds, after the agent's hello
model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)).eval()
llm = torch_watchdog.agent.watch(torch.compile(model, backend="eager"), name="llm")
hoard = []


def tokenize(text):
    return torch.tensor([[ord(c) % 64 for c in text[:16].ljust(16)]])


with torch.inference_mode():  # warm up before accepting requests
    llm(tokenize("warm-up"))


@app.exception_handler(torch_watchdog.agent.Draining)
async def draining(request, exc):
    return Response(status_code=503, headers={"Retry-After": "1"})


@app.post("/generate")
async def generate(req: dict):
    ids = tokenize(req["text"])
    with torch.inference_mode():
        return {"tokens": llm(ids).argmax(-1).tolist(), "pid": os.getpid()}


@app.post("/leak")
async def leak():
    hoard.append(bytearray(os.urandom(16)) * (10 << 20 >> 4))   # 10 MB, touched
    return {"pid": os.getpid()}
'''

SERVERS = {
    "uvicorn": lambda port: ["-m", "uvicorn", "app:app", "--host", "127.0.0.1", "--port",
                             str(port), "--workers", "2", "--log-level", "info", "--no-access-log",
                             # a replacement must be ready within this, or uvicorn keeps the
                             # old worker (its default, 5 s, is less than torch's import here)
                             "--timeout-worker-healthcheck", "60"],
    "gunicorn": lambda port: ["-m", "gunicorn", "-w", "2", "-k", "uvicorn.workers.UvicornWorker",
                              "-b", f"127.0.0.1:{port}", "--timeout", "120",
                              "--graceful-timeout", "10", "app:app"],
}
SERVERS["gunicorn-preload"] = lambda port: SERVERS["gunicorn"](port)[:2] + ["--preload"] + \
    SERVERS["gunicorn"](port)[2:]

# uvicorn with `rolling` is left out: in 2 of 4 runs here its supervisor started no replacement
# for the second worker within 60 s (the reload then failed, as it should); `master-hup` is
# uvicorn's method
SCENARIOS = [
    ("uvicorn", "master-hup"),
    ("gunicorn", "rolling"),
    ("gunicorn-preload", "master-hup"),
    ("gunicorn-preload", "signal"),   # main SIGTERMed the master too: gunicorn stopped for good
]


def post(port: int, path: str, body: dict, timeout: float = 10.0) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                      "Connection": "close"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise OSError(f"HTTP {resp.status}")
        return json.loads(data)
    finally:
        conn.close()


class Client(threading.Thread):
    """Open loop, as users arrive: a request every 0.1 s (10 requests/s) whatever the answers,
    each on a thread of its own with a new connection and a 2 s timeout; keeps (start, end,
    pid or error)."""

    RATE, TIMEOUT_S = 10.0, 2.0

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.stop, self.done = port, threading.Event(), []

    def run(self) -> None:
        due = time.monotonic()
        while not self.stop.is_set():
            threading.Thread(target=self.one, daemon=True).start()
            due += 1 / self.RATE
            time.sleep(max(0.0, due - time.monotonic()))

    def one(self) -> None:
        started = time.time()
        try:
            got = post(self.port, "/generate", {"text": "hello world"}, self.TIMEOUT_S)["pid"]
        except (OSError, ValueError, http.client.HTTPException) as e:
            got = f"{type(e).__name__}: {e}"
        self.done.append((started, time.time(), got))

    def between(self, t0: float, t1: float) -> list:
        return [r for r in list(self.done) if t0 <= r[0] <= t1]


def workers_of(master: int) -> list[int]:
    """The master's workers: its children but multiprocessing's resource tracker (uvicorn)."""
    return sorted(c.pid for c in psutil.Process(master).children()
                  if "resource_tracker" not in " ".join(c.cmdline()))


def status_pids(port: int) -> set[int]:
    status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json",
                                               timeout=5).read())
    return {p for s in status["servers"] if s["server"] == "llm" for p in s["pids"]}


def sidecar_config(path: str, tmp: str, sock: str, port: int, method: str,
                   budget: int) -> None:
    with open(path, "w") as fh:
        fh.write(f"""metrics_port: {port}
state_dir: {tmp}/state
agent: {{socket_path: {sock}, allowed_uids: [{os.getuid()}]}}
forecast: {{process_budget_bytes: {budget}, window_s: 3}}
policy: {{reload_lead_s: 6, alert_lead_s: 30, hold_polls: 3, warmup_s: 1}}
reload: {{method: {method}, grace_s: 10, hello_timeout_s: 60}}
""")


def stop(proc: Optional[subprocess.Popen], group: bool) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        (os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill())
        proc.wait(5)


def reload_entry(tmp: str) -> Optional[dict]:
    """The last reload decision that was not cancelled at its re-check. A cancel is the
    sidecar's answer to a level that fell under the budget one poll after the decision; the
    leak goes on, and the next decision is carried out. (The meter made such falls with
    `--preload`, as a preloaded master's PSS from before its fork, carried, read the server
    high until its next read; it now reads every PSS again when a process comes or goes:
    benchmarks/results/real_servers.md.)"""
    path = os.path.join(tmp, "state", "reloads.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        entries = json.load(fh)["reloads"]
    kept = [e for e in entries if not str(e.get("detail")).startswith("cancelled")]
    return kept[-1] if kept else None


def carried_out(entry: Optional[dict]) -> bool:
    """The decision's execution started (or it already has its outcome)."""
    return entry is not None and (entry.get("executing") is not None or
                                  entry.get("ok") is not None)


def reload_story(tmp: str, err: str) -> str:
    """What a failure needs to be read: the reload record and the sidecar's reload lines."""
    path = os.path.join(tmp, "state", "reloads.json")
    record = open(path).read() if os.path.exists(path) else "no reloads.json"
    with open(err) as fh:
        lines = [ln.rstrip() for ln in fh if any(w in ln for w in (
            "reload", "cancel", "execut", "hello", "drain", "poll failed", "error"))]
    return f"reloads.json: {record}\nsidecar log (reload lines): " + "\n".join(lines[-40:])


@pytest.mark.parametrize("kind,method", SCENARIOS, ids=[f"{k}-{m}" for k, m in SCENARIOS])
def test_a_reload_keeps_a_multi_worker_server_serving(short_tmp, kind, method):
    tmp, sock = short_tmp, os.path.join(short_tmp, "ev.sock")
    with open(os.path.join(tmp, "app.py"), "w") as fh:
        fh.write(APP)
    cfg, mport, port = os.path.join(tmp, "w.yaml"), free_port(), free_port()
    sidecar_config(cfg, tmp, sock, mport, method, 1 << 40)  # no budget yet: start-up is growth
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_WATCHDOG_")}
    env.update(PYTHONPATH=os.pathsep.join([tmp, with_root()]), OMP_NUM_THREADS="1")
    err = open(os.path.join(tmp, "sidecar.err"), "w")
    daemon = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                               "--config", cfg], cwd=ROOT, env=env, stderr=err)
    server = client = None
    out = open(os.path.join(tmp, "server.log"), "w")
    try:
        wait(lambda: os.path.exists(sock), 30, "the sidecar's socket")
        server = subprocess.Popen([sys.executable, *SERVERS[kind](port)], cwd=tmp,
                                  env=dict(env, TORCH_WATCHDOG_SOCKET=sock,
                                           TORCH_WATCHDOG_SERVER="llm"),
                                  stdout=out, stderr=out, start_new_session=True)
        master, t0 = server.pid, time.monotonic()
        # every worker reports: its hello reached the sidecar, which watches its pid
        old = wait(lambda: (lambda w: w if len(w) == 2 and set(w) <= status_pids(mport)
                            else None)(workers_of(master)), 60, "both workers said hello")
        served: set = set()  # uvicorn listens once a worker's app is up, after its hello
        wait(lambda: served.add(post(port, "/generate", {"text": "hi"}, 2)["pid"]) or
             served >= set(old), 60, "both workers served", tick=0.02)
        client = Client(port)
        client.start()

        # a budget just above the server's memory now, then a leak toward it
        level = sum(psutil.Process(p).memory_info().rss for p in status_pids(mport))
        sidecar_config(cfg, tmp, sock, mport, method, level + 300 * MB)
        daemon.send_signal(signal.SIGHUP)
        wait(lambda: "config reloaded" in open(err.name).read(), 10, "the new budget")
        # the leak goes on until a decision is carried out: one cancelled at its re-check (the
        # level read lower one poll later) is followed by the next
        deadline = time.monotonic() + 60
        while not carried_out(reload_entry(tmp)) and time.monotonic() < deadline:
            post(port, "/leak", {})
            time.sleep(0.1)
        # the executor fails a reload that makes no progress for hello_timeout_s + grace_s
        # (70 s), each worker's replacement counted: 180 s is past any outcome it can have
        try:
            entry = wait(lambda: (lambda e: e if e and e.get("ok") is not None else None)(
                reload_entry(tmp)), 180, "the reload's outcome")
        except pytest.fail.Exception:
            pytest.fail(f"no reload outcome: {reload_story(tmp, err.name)}")
        assert entry["ok"] is True and not entry.get("failed"), entry["detail"]

        # every worker replaced; the replacements said hello and serve; the master stayed
        assert server.poll() is None and psutil.pid_exists(master)
        new = wait(lambda: (lambda w: w if len(w) == 2 else None)(workers_of(master)), 10,
                   "two workers")
        assert not set(new) & set(old), (old, new)
        wait(lambda: set(new) <= status_pids(mport), 10, f"the sidecar watches {new}")
        wait(lambda: {r[2] for r in client.done} >= set(new), 30, "both new workers served")
        began = entry["t"]  # the decision; carried out one poll (0.1 s) later
        # the reload, and 3 s after it: the requests that waited for a new worker's start-up
        end = began + entry["seconds"] + 3
        wait(lambda: max(r[0] for r in client.done) > end, 30, "requests after the reload")
        client.stop.set()
        client.join(15)
        during = client.between(began, end)
        failed = [r for r in during if not isinstance(r[2], int)]
        slowest = max((r[1] - r[0] for r in during), default=0.0)
        everything = [r for r in client.done if not isinstance(r[2], int)]
        line = {"server": kind, "method": method, "requests_during_reload": len(during),
                "failed_during_reload": len(failed), "failed_in_all": len(everything),
                "requests_in_all": len(client.done), "back_s": round(entry["seconds"], 2),
                "slowest_request_s": round(slowest, 2), "detail": entry["detail"],
                "scenario_s": round(time.monotonic() - t0, 1)}
        print("\nreal-servers:", json.dumps(line))
        if os.environ.get("REAL_SERVERS_DEBUG"):
            for r in everything[:3] + everything[-3:]:
                print("failed", round(r[0] - began, 2), r[2])
        if os.environ.get("WATCHDOG_REAL_SERVERS_RESULTS"):
            with open(os.environ["WATCHDOG_REAL_SERVERS_RESULTS"], "a") as fh:
                fh.write(json.dumps(line) + "\n")
        assert len(during) >= 20, line  # enough requests for 1 % to mean something
        # uvicorn's graceful shutdown closes a connection it has accepted but not yet read:
        # that client sees a reset or a broken pipe. One such request is the server's own race
        # at an old worker's exit (benchmarks/server_exit_race.py); a reload that stops a
        # worker before its replacement serves fails many.
        resets = [r for r in failed if r[2].startswith(("ConnectionResetError", "BrokenPipe"))]
        assert len(failed) - min(len(resets), 1) <= 0.01 * len(during), (line, failed[:5])
    finally:
        if os.environ.get("REAL_SERVERS_DEBUG") and server is not None:
            try:
                print("children", [(c.pid, c.status()) for c in
                                   psutil.Process(server.pid).children()])
            except psutil.Error:
                pass
            print(open(out.name).read()[-4000:], open(err.name).read()[-3000:])
        if client is not None:
            client.stop.set()
        stop(server, group=True)
        if server is not None:
            try:
                os.killpg(server.pid, signal.SIGKILL)  # a worker left behind
            except ProcessLookupError:
                pass
        stop(daemon, group=False)
        err.close()
        out.close()
