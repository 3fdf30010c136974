"""Chaos figures for the sidecar's reload record and HTTP endpoint, main's behaviour vs now.

(a) corrupt `reloads.json` variants: how many are handled, i.e. reported and no 4th reload
    allowed inside the hour after 3 reloads (main's reader is reproduced here as it was);
    a decision time in the future and a decision never carried out: when the next reload may
    come;
(b) 400 idle + 50 slowloris (one header byte a second) connections on loopback: the process's
    threads and /metrics latency, for a ThreadingHTTPServer as on main (one thread per
    connection, no timeout, listen backlog 16) and for web.StatusServer.

    python benchmarks/chaos_figures.py [--idle 400] [--slow 50]     # ~25 s
"""
from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import math
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest  # noqa: E402

from torch_watchdog.sidecar.actions.record import CANCELLED, ReloadLog  # noqa: E402
from torch_watchdog.sidecar.config import Config, PolicyConfig  # noqa: E402
from torch_watchdog.sidecar.core import policy, step  # noqa: E402
from torch_watchdog.sidecar.core.correlate import State  # noqa: E402
from torch_watchdog.sidecar.core.forecast import Forecast  # noqa: E402
from torch_watchdog.sidecar.core.observations import ReloadHistory  # noqa: E402
from torch_watchdog.sidecar.present import web  # noqa: E402
from torch_watchdog.sidecar.present.metrics import (SnapshotCollector, make_registry,  # noqa: E402
                                                     stop)

# --- (a) the reload record -----------------------------------------------------------------

START = 1_000_000.0
POLICY = PolicyConfig(hold_polls=1, warmup_s=0, cooldown_s=600, max_reloads_per_hour=3)
THREE = [{"t": START - d, "reason": "oom_forecast", "server": "a", "ok": True,
          "detail": "exited after SIGTERM", "seconds": 3.0} for d in (1800.0, 1200.0, 600.0)]


def main_decisions(path: str) -> list:
    """reloads.json as main read it (actions/reload.py before this change)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        entries = [e for e in data.get("reloads", []) if isinstance(e.get("t"), (int, float))]
    except (OSError, ValueError, AttributeError):
        entries = []
    return [(e["t"], e.get("server") if isinstance(e.get("server"), str) else None)
            for e in entries if e.get("detail") != CANCELLED]


def first_reload(decisions: list, horizon_s: float = 7200) -> float:
    """Seconds from START to the first reload the policy decides, seeded with `decisions`
    as the daemon seeds it, under a forecast calling for one every poll (10 s polls)."""
    host = step.Host()
    step.step(host, ReloadHistory(START, tuple(decisions)), Config())
    ps = host.server("a").policy
    fc = Forecast(budget_bytes=1, level_bytes=1, seconds_linear=10.0)
    for i in range(int(horizon_s / 10)):
        now = START + 10 * i
        try:
            if any(a.kind == "reload" for a in policy.decide(State(first_t=0.0, now=now),
                                                               fc, ps, POLICY)):
                return now - START
        except TypeError:  # main: a non-number in the history crashed the policy
            return -1.0
    return math.inf


def _file(text: str) -> callable:
    return lambda p: open(p, "w").write(text)


def _entry(**change) -> str:
    return json.dumps({"reloads": THREE[:2] + [{**THREE[2], **change}]})


GOOD = json.dumps({"reloads": THREE})
CORRUPT = {
    "truncated JSON": _file(GOOD[:len(GOOD) // 2]),
    "garbage bytes": lambda p: open(p, "wb").write(b"\x00\xff\xfe\x81garbage\x9c" * 10),
    "empty file": _file(""),
    "list at top level": _file(json.dumps(THREE)),
    "reloads not a list": _file(json.dumps({"reloads": {"t": START}})),
    "t a string": _file(_entry(t=str(START))),
    "t NaN": _file(_entry(t=float("nan"))),
    "t a bool": _file(_entry(t=True)),
    "server a number": _file(_entry(server=7)),
    "ok a string": _file(_entry(ok="yes")),
    "a directory": os.mkdir,
    "no permission": lambda p: (_file(GOOD)(p), os.chmod(p, 0)),
}


def record_figures() -> None:
    print("(a) reloads.json: 3 reloads in the last hour (at -30, -20, -10 min), then the file "
          "is damaged;\n    handled = reported, and no 4th reload inside the hour")
    print(f"  {'variant':<20} {'main: 4th reload at':>20} {'now: 4th reload at':>19}  now says")
    handled_main = handled_now = counted = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, make) in enumerate(CORRUPT.items()):
            path = os.path.join(tmp, f"{i}", "reloads.json")
            os.makedirs(os.path.dirname(path))
            make(path)
            if name == "no permission" and os.access(path, os.R_OK):
                print(f"  {name:<20} {'(skipped: root reads it anyway)':>41}")
                continue
            counted += 1
            log = ReloadLog(path, now=START, max_per_hour=POLICY.max_reloads_per_hour)
            main_t, now_t = first_reload(main_decisions(path)), first_reload(log.decisions())
            # 3 reloads at -1800, -1200, -600: the 4th may come at +1800 at the earliest
            handled_main += main_t >= 1800
            handled_now += bool(log.unreadable) and now_t >= 1800
            said = (log.unreadable or "(nothing)").split(": ", 1)[1].split(";")[0]
            print(f"  {name:<20} {_when(main_t):>20} {_when(now_t):>19}  {said}")
        print(f"  handled: now {handled_now}/{counted}; main {handled_main}/{counted} kept the "
              f"history by chance (nothing reported), the others dropped it silently")

        ahead = os.path.join(tmp, "ahead.json")
        _file(json.dumps({"reloads": [{**THREE[0], "t": START + 30 * 86400}]}))(ahead)
        main_t = first_reload(main_decisions(ahead))
        now_t = first_reload(ReloadLog(ahead, now=START, max_per_hour=3).decisions())
        print(f"  a decision 30 days in the future: next reload main {_when(main_t)}, now "
              f"{_when(now_t)} (clamped to now: one cooldown)")
        undone = os.path.join(tmp, "undone.json")
        _file(json.dumps({"reloads": [{**THREE[0], "t": START - 30, "ok": None}]}))(undone)
        main_t = first_reload(main_decisions(undone))
        now_t = first_reload(ReloadLog(undone, now=START, max_per_hour=3).decisions())
        print(f"  a decision never carried out (killed 30 s before): next reload main "
              f"{_when(main_t)}, now {_when(now_t)}")


def _when(seconds: float) -> str:
    if seconds < 0:
        return "policy crashed"
    return "never (2 h)" if math.isinf(seconds) else f"+{seconds:.0f} s"


# --- (b) the HTTP endpoint -----------------------------------------------------------------

def main_like_server(registry: CollectorRegistry):
    """The shape of main's web.StatusServer: a ThreadingHTTPServer, a daemon thread per
    connection, no timeout, a listen backlog of 16."""
    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 16

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              daemon=True)
    thread.start()
    return server, thread


def load_figures(name: str, server, idle: int, slow: int) -> None:
    port = server.server_port
    scrape(port)
    before = psutil.Process().num_threads()
    socks, slow_socks = [], []
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 64 + b"\r\n\r\n"
    started = time.monotonic()
    try:
        for i in range(idle + slow):
            if time.monotonic() - started > 20:
                break
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                continue
            socks.append(s)
            if i >= idle:
                s.send(head[:1])
                slow_socks.append(s)
        opened_s = time.monotonic() - started
        times = []
        until = time.monotonic() + 3.0
        sent = 1
        while time.monotonic() < until:
            for s in slow_socks:  # one more header byte each, about every second
                if len(times) % 4 == 0:
                    with contextlib.suppress(OSError):
                        s.send(head[sent:sent + 1])
            sent += len(times) % 4 == 0
            times.append(scrape(port))
            time.sleep(0.25)
        threads = psutil.Process().num_threads() - before
        print(f"  {name:<34} {len(socks):>5} open in {opened_s:4.1f} s   threads +{threads:<4}"
              f" /metrics p50 {statistics.median(times) * 1000:6.1f} ms, max "
              f"{max(times) * 1000:6.1f} ms")
    finally:
        for s in socks:
            s.close()


def scrape(port: int) -> float:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            r.read()
    except OSError:
        return math.inf
    return time.monotonic() - started


def http_figures(idle: int, slow: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    print(f"\n(b) HTTP: {idle} idle + {slow} slowloris connections on loopback, then /metrics "
          f"every 0.25 s for 3 s (threads: the process's, over its count before)")
    registry = make_registry(SnapshotCollector())
    server, thread = main_like_server(registry)
    try:
        load_figures("main (ThreadingHTTPServer)", server, idle, slow)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    server, thread = web.serve("127.0.0.1", 0, registry)
    try:
        load_figures(f"now (1 + {web.WORKERS} threads, {web.MAX_OPEN} open)", server, idle,
                     slow)
    finally:
        stop(server, thread)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle", type=int, default=400)
    ap.add_argument("--slow", type=int, default=50)
    args = ap.parse_args()
    started = time.monotonic()
    record_figures()
    http_figures(args.idle, args.slow)
    print(f"\n{time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
