"""How many requests a multi-worker server loses by itself when its master is sent SIGHUP.

No watchdog: `gunicorn --preload -w 2 -k uvicorn.workers.UvicornWorker` serving a bare ASGI
app, a client opening a new connection every 10 ms (100 requests/s, 2 s timeout), and SIGHUP to
the master every 2 s (`--hups` times); `--no-hup` runs the same load without them, as the
control. uvicorn's graceful shutdown closes the connections it has accepted but whose request
it has not read yet (`Server.shutdown` → the protocol's `shutdown` with no request cycle), so
such a client sees a reset or a broken pipe: this is the floor under any reload that ends an
old worker, and why `tests/integration/test_real_servers.py` allows one such request.

    python benchmarks/server_exit_race.py [--hups 30] [--no-hup]   # prints the outcomes
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

APP = '''async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hups", type=int, default=30)
    ap.add_argument("--no-hup", action="store_true", help="the same load, no SIGHUP (control)")
    args = ap.parse_args()
    tmp, port = tempfile.mkdtemp(prefix="exit-race-"), free_port()
    with open(os.path.join(tmp, "app.py"), "w") as fh:
        fh.write(APP)
    server = subprocess.Popen([sys.executable, "-m", "gunicorn", "--preload", "-w", "2", "-k",
                               "uvicorn.workers.UvicornWorker", "-b", f"127.0.0.1:{port}",
                               "--graceful-timeout", "10", "app:app"], cwd=tmp,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    outcomes: collections.Counter = collections.Counter()
    stop = threading.Event()

    def one() -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("POST", "/", body=b"{}")
            conn.getresponse().read()
            outcomes["ok"] += 1
        except (OSError, http.client.HTTPException) as e:
            outcomes[type(e).__name__] += 1

    def load() -> None:
        while not stop.is_set():
            threading.Thread(target=one, daemon=True).start()
            time.sleep(0.01)

    try:
        time.sleep(3)  # the master and its workers up
        threading.Thread(target=load, daemon=True).start()
        for _ in range(args.hups):
            time.sleep(2)
            if not args.no_hup:
                server.send_signal(signal.SIGHUP)
        time.sleep(3)
        stop.set()
        time.sleep(2.5)  # the last requests answered or timed out
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(20)
    print(json.dumps({"hups": 0 if args.no_hup else args.hups, "outcomes": dict(outcomes)}))


if __name__ == "__main__":
    main()
