"""The README's five-minute path, run as written: its `sh` blocks of "Wire a server to the
sidecar", each line as is, in a fresh directory holding only `.venv` and `examples/` (links to
the checkout's), like a user's checkout. The sidecar `--dev`, the example FastAPI server under
`uvicorn --workers 2` with the environment the sidecar saved, a request, `status`, then the
server stopped (Ctrl-C), the sidecar stopped, and `report` over its sample log.

Checked, as the README says them: `status` names the server `pgid:<uvicorn's pid>` with both
workers' pids, their compiles and distinct shapes, `agent up` and (without a GPU)
`nvml not used (no GPU: host-memory mode)`; once the server stops, `status` says so and waits;
the report writes its page, and it and `replay --json` count what `status` counted.
`WATCHDOG_SCREENSHOTS=DIR` also saves headless-Chromium screenshots of the status page before
an agent, with the server, after it stopped, and of the report (docs/screenshots/).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from tests.conftest import ROOT
from tests.conftest import wait_until as wait

pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

PORTS = (8000, 9464)  # the README's: uvicorn's and the sidecar's


def readme_blocks() -> list[str]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Wire a server to the sidecar", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def commands(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def status_json() -> dict:
    with urllib.request.urlopen("http://127.0.0.1:9464/status.json", timeout=5) as r:
        return json.load(r)


def shoot(url: str, name: str, height: int = 1100) -> None:
    where = os.environ.get("WATCHDOG_SCREENSHOTS")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not where or not browser:
        return
    os.makedirs(where, exist_ok=True)
    profile = tempfile.mkdtemp(prefix="chromium-")
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                    f"--user-data-dir={profile}", f"--screenshot={os.path.join(where, name)}",
                    f"--window-size=1280,{height}", url], capture_output=True, timeout=60)
    shutil.rmtree(profile, ignore_errors=True)


def test_the_readme_commands_work_as_written(short_tmp):
    blocks = [commands(b) for b in readme_blocks()]
    assert len(blocks) == 4, blocks
    (sidecar,), (source, server), (request, status), (make_report,) = blocks
    assert sidecar.startswith(".venv/bin/torch-watchdog sidecar --dev")
    assert source == ". .torch-watchdog/env" and "uvicorn examples.fastapi_server:app" in server
    assert request.startswith("curl ") and status.startswith(".venv/bin/torch-watchdog status")
    assert make_report.startswith(".venv/bin/torch-watchdog report .torch-watchdog/samples.jsonl")
    taken = [p for p in PORTS if not port_free(p)]
    assert not taken, f"port(s) {taken} in use here: the README's commands need them"

    home = os.path.join(short_tmp, "checkout")
    os.makedirs(home)
    os.symlink(sys.prefix, os.path.join(home, ".venv"))
    os.symlink(os.path.join(ROOT, "examples"), os.path.join(home, "examples"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_WATCHDOG_")}
    env.pop("PYTHONPATH", None)

    def shell(line: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(["bash", "-c", line], cwd=home, env=env, text=True,
                                start_new_session=True, **kw)

    logs = {name: open(os.path.join(short_tmp, f"{name}.log"), "w+") for name in
            ("sidecar", "server")}
    procs = []
    try:
        side = shell(sidecar, stdout=logs["sidecar"], stderr=subprocess.STDOUT)
        procs.append(side)
        wait(lambda: "Start the server with" in open(logs["sidecar"].name).read(), 30,
             "the sidecar's --dev banner", 0.5)
        banner = open(logs["sidecar"].name).read()
        sock = os.path.join(home, ".torch-watchdog", "run", "events.sock")
        assert f"export TORCH_WATCHDOG_SOCKET={sock}" in banner
        assert "waiting  no server yet" in subprocess.run(
            ["bash", "-c", status], cwd=home, env=env, capture_output=True, text=True).stdout
        shoot("http://127.0.0.1:9464/", "1-before-an-agent.png", 700)

        uv = shell(f"{source}\n{server}", stdout=logs["server"], stderr=subprocess.STDOUT)
        procs.append(uv)
        name = f"pgid:{uv.pid}"  # bash -c's process group, which uvicorn and its workers keep
        wait(lambda: any(s["server"] == name and len(s["pids"]) == 2
                         for s in status_json()["servers"]), 120,
             "both uvicorn workers said hello: " + open(logs["server"].name).read()[-2000:], 0.5)
        wait(lambda: port_free(8000) is False, 60, "uvicorn listens on 8000", 0.5)
        time.sleep(1.0)  # the workers accept once their warm-up is done
        if shutil.which("curl"):
            got = subprocess.run(["bash", "-c", request], cwd=home, env=env,
                                 capture_output=True, text=True, timeout=60)
            answer = got.stdout
        else:  # the same request (CI installs curl: .ci/run)
            req = urllib.request.Request("http://localhost:8000/generate",
                                         data=b'{"text": "hello world"}',
                                         headers={"content-type": "application/json"})
            answer = urllib.request.urlopen(req, timeout=60).read().decode()
        assert len(json.loads(answer)["tokens"][0]) == len("hello world"), answer
        time.sleep(2.5)  # the agents' calls event (every 2 s) and a status publication
        out = subprocess.run(["bash", "-c", status], cwd=home, env=env, capture_output=True,
                             text=True, timeout=30).stdout
        pids = sorted(status_json()["scope"]["pids"])
        assert f"counts of server {name} (pids {pids[0]}, {pids[1]})" in out, out
        assert re.search(r"graphs   0 recorded, \d+ distinct shapes, \d+ compiles?\b", out), out
        assert "agent up" in out, out
        if not os.path.exists("/dev/nvidiactl"):
            assert "nvml not used (no GPU: host-memory mode)" in out, out
        seen = status_json()["graphs"]
        shoot("http://127.0.0.1:9464/", "2-with-the-server.png", 1500)

        os.killpg(uv.pid, signal.SIGINT)  # Ctrl-C in the server's terminal
        uv.wait(timeout=30)
        out = wait(lambda: (lambda o: "stopped" in o and o)(subprocess.run(
            ["bash", "-c", status], cwd=home, env=env, capture_output=True, text=True).stdout),
            60, "status says the server stopped", 0.5)
        assert f"waiting  no server now: {name} stopped" in out, out
        shoot("http://127.0.0.1:9464/", "3-after-the-server-stopped.png", 700)
        os.killpg(side.pid, signal.SIGINT)  # Ctrl-C in the sidecar's terminal
        assert side.wait(timeout=30) == 0

        done = subprocess.run(["bash", "-c", make_report + " --json"], cwd=home, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        numbers = json.loads(done.stdout)["summary"]
        page = open(os.path.join(home, "report.html"), encoding="utf-8").read()
        assert "torch-watchdog report" in page and "server seen for" in page
        replayed = subprocess.run([".venv/bin/torch-watchdog", "replay",
                                   ".torch-watchdog/samples.jsonl", "--json"], cwd=home,
                                  env=env, capture_output=True, text=True, timeout=120)
        assert replayed.returncode == 0, replayed.stderr
        again = json.loads(replayed.stdout)["estimates"]
        for key in ("compiles", "recompiles", "distinct_shapes", "requests", "stalls"):
            # one source for each count: what status said live, the report and replay after
            assert numbers[key] == again[key] == seen[key], (key, numbers[key], again[key],
                                                             seen[key])
        shoot("file://" + os.path.join(home, "report.html"), "4-the-report.png", 2400)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        for f in logs.values():
            f.close()
