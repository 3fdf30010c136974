"""Host-memory mode's PSS meter against PSS read fresh every poll, across a fork.

`gunicorn --preload -w 2` serving an app whose master holds 200 MB (touched) before it forks
its workers: the workers share those pages, so the master's PSS falls to a third at the fork.
The sidecar's PssMeter (each process's PSS read every 10 s, carried by its RSS between reads)
meters the master from its start and the workers as they come, at 10 Hz for 25 s; beside it,
every process's smaps_rollup read each poll (the truth, too dear to pay every poll). Prints
the largest gap between the two once the first worker has forked (before it, the master's
200 MB come in milliseconds, faster than two reads of the same instant), and when.

    python benchmarks/pss_fork.py          # {"max_gap_mb": ..., "at_s": ..., ...}
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torch_watchdog.sidecar.sources.process import (  # noqa: E402
    ProcessReader, PssMeter, read_pss)

APP = '''hoard = bytearray(200 << 20)
for i in range(0, len(hoard), 4096):
    hoard[i] = 1


async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})
'''


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="pss-fork-")
    with open(os.path.join(tmp, "app.py"), "w") as fh:
        fh.write(APP)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "gunicorn", "--preload", "-w", "2", "-k",
                               "uvicorn.workers.UvicornWorker", "-b", f"127.0.0.1:{port}",
                               "app:app"], cwd=tmp, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    reader, meter, t0 = ProcessReader(), PssMeter(), time.monotonic()
    worst = (0.0, 0.0, 0)
    try:
        while time.monotonic() - t0 < 25:
            try:
                pids = {server.pid, *(c.pid for c in psutil.Process(server.pid).children())}
            except psutil.Error:
                break
            metered = sum(p.host_bytes or 0 for p in meter.apply(reader.read(pids)))
            truth = sum(read_pss(pid) or 0 for pid in pids)
            gap = (metered - truth) / 2 ** 20
            if len(pids) > 1 and abs(gap) > abs(worst[0]):
                worst = (gap, time.monotonic() - t0, len(pids))
            time.sleep(0.1)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(20)
    print(json.dumps({"max_gap_mb": round(worst[0], 1), "at_s": round(worst[1], 1),
                      "processes_then": worst[2], "truth_mb_at_end": round(truth / 2 ** 20)}))


if __name__ == "__main__":
    main()
