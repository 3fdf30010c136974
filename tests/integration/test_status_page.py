"""The status page of the real daemon (a subprocess): agent events over the real socket, then
/, /status.json, /metrics and a 404 over HTTP, `torch-watchdog status` as a subprocess, and the
page as headless Chromium renders it (its DOM, and a screenshot checked pixel by pixel)."""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib

import pytest

from tests.conftest import free_port, wait_for, with_root
from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUNCTION = "<lambda>"   # what torch names a compiled lambda: must come out escaped
RECORDINGS = 5
WIDTH, HEIGHT = 1200, 1400  # tall enough that causes and actions never push the chart out
LINE_RGB = (0x33, 0x33, 0x33)   # plot.py's memory-line stroke, #333


def get(port: int, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.headers.get("Content-Type"), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type"), err.read()


def status(port: int) -> dict:
    return json.loads(get(port, "/status.json")[2])


def agent_events(pid: int) -> list:
    t = time.time()
    evs: list = [events.Hello(t=t, pid=pid, torch="2.13", agent="test", devices=[], config={},
                              capabilities={}, watched=[FUNCTION], argv="serve", server=None),
                 events.Compile(t=t, pid=pid, compile_id="0/0", function=FUNCTION, seconds=1.5)]
    evs += [events.Recompile(t=t + 0.01 * i, pid=pid, compile_id=f"0/{i}", function=FUNCTION,
                             seconds=0.8, reason=f"tensor 'x' size mismatch at index 0. "
                             f"expected {i}, actual {i + 1}") for i in range(1, 5)]
    evs.append(events.RecompileLimit(t=t + 0.1, pid=pid, function=FUNCTION, limit=8,
                                     reason="size mismatch", compile_id="0/8"))
    evs += [events.CudagraphRecord(t=t + 0.2 + 0.01 * i, pid=pid, phase=phase, compile_id="1/0",
                                   key=[i], shape=[[1, i]], seconds=0.01)
            for i in range(RECORDINGS) for phase in ("warmup", "record")]
    return evs


@pytest.fixture(scope="module")
def sidecar():
    """The real daemon, fed one story: a compile, a recompile storm, the recompile limit and
    a few CUDA-graph recordings, all from this process (so it watches this process's RSS)."""
    with tempfile.TemporaryDirectory(prefix="tw-") as tmp:
        port = free_port()
        sock = os.path.join(tmp, "events.sock")
        cfg = os.path.join(tmp, "watchdog.yaml")
        with open(cfg, "w") as fh:
            fh.write(f"metrics_port: {port}\nstate_dir: {tmp}\nagent:\n  socket_path: {sock}\n")
        env = dict(os.environ, PYTHONPATH=with_root())
        env.pop("NOTIFY_SOCKET", None)
        proc = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                                 "--config", cfg], env=env, stderr=subprocess.PIPE, text=True,
                                cwd=ROOT)
        try:
            assert wait_for(lambda: os.path.exists(sock) and get(port, "/metrics")[0] == 200)
            sender = Emitter(sock, None)
            for e in agent_events(os.getpid()):
                sender.emit(e)
            sender.drain()
            assert wait_for(lambda: len(status(port)["causes"]) == 2
                            and status(port)["graphs"]["recordings"] == RECORDINGS
                            and len(status(port)["history"]["points"]) >= 3)
            yield {"port": port, "config": cfg, "proc": proc, "tmp": tmp}
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_status_json_tells_the_story(sidecar):
    s = status(sidecar["port"])
    assert s["memory"]["source"] == "rss"          # no GPU here: host-memory mode
    assert s["memory"]["server"]["alive"] is True
    assert s["memory"]["level_bytes"] > 10 << 20
    g = s["graphs"]
    assert (g["compiles"], g["recompiles"], g["recompile_limit_hits"]) == (1, 4, 1)
    assert (g["recordings"], g["warmups"]) == (RECORDINGS, RECORDINGS)
    causes = {c["cause"]: c for c in s["causes"]}
    assert set(causes) == {"recompile_storm", "recompile_limit_eager_fallback"}
    assert causes["recompile_limit_eager_fallback"]["summary"] == (
        f"recompile limit 8 reached in {FUNCTION} (reported by the agent): new shapes run eager")
    assert {(a["action"], a["reason"]) for a in s["actions"]} >= {
        ("alert", "recompile_storm"), ("alert", "recompile_limit_eager_fallback")}
    kinds = [k for _, k in s["history"]["marks"]]
    assert (kinds.count("compile"), kinds.count("recompile"), kinds.count("record"),
            kinds.count("recompile_limit")) == (1, 4, RECORDINGS, 1)
    assert s["sources"] == {"nvml": False, "process": True, "agent": True}
    assert s["forecast"]["budget_bytes"] > 0 and s["age_s"] < 5
    assert s["sidecar"]["polls"] > 0 and s["sidecar"]["reload_method"] == "none"


def test_page_metrics_and_404_on_the_same_port(sidecar):
    port = sidecar["port"]
    code, ctype, body = get(port, "/")
    page = body.decode()
    assert code == 200 and ctype.startswith("text/html")
    assert 'class="memory-line"' in page and 'id="causes"' in page and 'id="forecast"' in page
    assert "&lt;lambda&gt;" in page and FUNCTION not in page
    assert "<script" not in page
    code, ctype, body = get(port, "/metrics")
    assert code == 200 and ctype.startswith("text/plain")
    assert re.search(r'torch_watchdog_recompiles_total\{server="[^"]+"\} 4.0', body.decode())
    assert re.search(r'torch_watchdog_cause_active\{cause="recompile_storm",server="[^"]+"\} 1.0',
                     body.decode())
    code, _, _ = get(port, "/nope")
    assert code == 404


def run_status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "status", *args],
                          env=dict(os.environ, PYTHONPATH=with_root()), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_status_command_against_the_running_sidecar(sidecar):
    url = f"http://127.0.0.1:{sidecar['port']}"
    done = run_status("--url", url)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith(f"sidecar  {url}, last poll ")
    assert "server   " in out and "(the server's own memory, PSS (host-memory mode))" in out
    assert (f"graphs   {RECORDINGS} recorded, 0 distinct shapes, 1 compile, 4 recompiles, "
            "memory per graph: not enough recordings yet") in out
    assert "recompile_storm: 4 recompiles within 5 min" in out
    assert f"recompile_limit_eager_fallback: recompile limit 8 reached in {FUNCTION}" in out
    # a CPU-only host: NVML is not used there, not "DOWN"
    assert "forecast " in out
    assert "sources  agent up, nvml not used (no GPU: host-memory mode), process up" in out
    assert "counts of server " in out and "when the sidecar started watching" in out
    assert "alert recompile_limit_eager_fallback" in out
    by_config = run_status("--config", sidecar["config"], "--json")
    assert by_config.returncode == 0, by_config.stderr
    assert json.loads(by_config.stdout)["graphs"]["recompiles"] == 4


def test_status_command_when_nothing_answers():
    url = f"http://127.0.0.1:{free_port()}"
    done = run_status("--url", url)
    assert done.returncode == 1 and done.stdout == ""
    assert f"no sidecar is running at {url}" in done.stderr
    assert "torch-watchdog sidecar --config FILE" in done.stderr


# -- headless Chromium -------------------------------------------------------------------------
def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no chromium binary found (Debian: apt-get install chromium)")


def run_chromium(tmp: str, *args: str) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(dir=tmp, prefix="chromium-")
    return subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                           "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}",
                           *args], capture_output=True, text=True, timeout=120)


def test_chromium_renders_the_key_elements(sidecar):
    done = run_chromium(sidecar["tmp"], "--dump-dom", f"http://127.0.0.1:{sidecar['port']}/")
    dom = done.stdout
    assert done.returncode == 0 and "<svg" in dom, done.stderr[-2000:]
    assert 'class="memory-line"' in dom
    assert 'id="causes"' in dom and 'data-cause="recompile_storm"' in dom
    assert 'id="forecast"' in dom and "time to OOM" in dom
    assert dom.count('class="mark mark-record"') == RECORDINGS
    assert "&lt;lambda&gt;" in dom   # escaped in the source, so text in the DOM


def read_png(path: str) -> tuple[int, int, list[bytearray], int]:
    """(width, height, rows, bytes per pixel) of an 8-bit RGB or RGBA PNG, stdlib only."""
    with open(path, "rb") as fh:
        data = fh.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat.append(chunk)
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(b"".join(idat)), width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        rows.append(prev := _unfilter(raw[start], bytearray(raw[start + 1:start + 1 + stride]),
                                      prev, bpp))
    return width, height, rows, bpp


def _unfilter(kind: int, line: bytearray, prev: bytearray, bpp: int) -> bytearray:
    if kind == 1:
        for i in range(bpp, len(line)):
            line[i] = (line[i] + line[i - bpp]) & 0xFF
    elif kind == 2:
        line = bytearray((a + b) & 0xFF for a, b in zip(line, prev))
    elif kind == 3:
        for i in range(len(line)):
            left = line[i - bpp] if i >= bpp else 0
            line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
    elif kind == 4:
        for i in range(len(line)):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return line


def widest_stroke(rows: list[bytearray], bpp: int, rgb: tuple[int, int, int],
                  tol: int = 24, reach: int = 2) -> int:
    """The width in pixels of the widest connected shape drawn in colour `rgb` (pixels within
    `reach` of each other connect, bridging anti-aliased gaps): a plotted line is one shape as
    wide as the chart; text in the same colour falls apart into glyphs."""
    ink = {(x, y) for y, row in enumerate(rows) for x in range(len(row) // bpp)
           if abs(row[x * bpp] - rgb[0]) <= tol and abs(row[x * bpp + 1] - rgb[1]) <= tol
           and abs(row[x * bpp + 2] - rgb[2]) <= tol}
    widest = 0
    while ink:
        todo = [ink.pop()]
        xs = [todo[0][0]]
        while todo:
            x, y = todo.pop()
            for dx in range(-reach, reach + 1):
                for dy in range(-reach, reach + 1):
                    if (x + dx, y + dy) in ink:
                        ink.discard((x + dx, y + dy))
                        todo.append((x + dx, y + dy))
                        xs.append(x + dx)
        widest = max(widest, max(xs) - min(xs) + 1)
    return widest


def test_chromium_screenshot_shows_the_page_and_the_memory_line(sidecar):
    shot = os.path.join(sidecar["tmp"], "status.png")
    keep = os.environ.get("TW_STATUS_SHOT")  # where to keep the screenshot, to look at it
    done = run_chromium(sidecar["tmp"], f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}",
                        f"http://127.0.0.1:{sidecar['port']}/")
    assert done.returncode == 0 and os.path.exists(shot), done.stderr[-2000:]
    if keep:
        shutil.copyfile(shot, keep)
    width, height, rows, bpp = read_png(shot)
    assert (width, height) == (WIDTH, HEIGHT)
    background = bytes(rows[0][:3])
    assert background == b"\xff\xff\xff"          # the page's white, not an error page's grey
    inked = sum(1 for row in rows for x in range(0, len(row), bpp)
                if row[x:x + 3] != background)
    assert inked / (width * height) > 0.03, f"only {inked} pixels differ from the background"
    # the memory line spans the chart's plot area (900 px less 90 px of margins), from the
    # first poll to the last
    assert widest_stroke(rows, bpp, LINE_RGB) > 600


def test_before_any_agent_the_page_and_status_say_waiting_and_how_to_connect(short_tmp):
    """A fresh sidecar on this GPU-less host, no agent yet: one state ("waiting for a
    server", the socket to set), no green "no OOM forecast" beside "memory not known", and
    NVML not reported down in red (there is no GPU here)."""
    port, sock = free_port(), os.path.join(short_tmp, "events.sock")
    cfg = os.path.join(short_tmp, "watchdog.yaml")
    with open(cfg, "w") as fh:
        fh.write(f"metrics_port: {port}\nstate_dir: {short_tmp}\nagent:\n  socket_path: {sock}\n")
    env = dict(os.environ, PYTHONPATH=with_root())
    env.pop("NOTIFY_SOCKET", None)
    proc = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar", "--config",
                             cfg], env=env, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        assert wait_for(lambda: status(port)["t"] is not None)
        out = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "status", "--url",
                              f"http://127.0.0.1:{port}"], env=env, capture_output=True,
                             text=True, timeout=60).stdout
        page = get(port, "/")[2].decode()
        done = run_chromium(short_tmp, "--dump-dom", f"http://127.0.0.1:{port}/") \
            if shutil.which("chromium") else None
    finally:
        proc.terminate()
        proc.wait(10)
    assert f"waiting  no server yet: no agent has said hello on {sock}" in out, out
    assert f"TORCH_WATCHDOG_SOCKET={sock}" in out
    assert "forecast" not in out and "no forecast" not in out
    nvml_down_expected = "nvml not used (no GPU: host-memory mode)" in out
    assert nvml_down_expected or "nvml up" in out, out  # a GPU host: NVML is up
    assert 'id="waiting"' in page and "Waiting for a server" in page
    assert "no OOM forecast" not in page and "memory not known" not in page
    assert '<span class="bad">down</span>' not in page
    if done is not None:
        assert done.returncode == 0 and "Waiting for a server" in done.stdout
