"""The seed scenario's inference server: FACTS.md's 12-layer model compiled with
`reduce-overhead`, the agent installed, a ballast tensor leaving `--free-mib` free, and
variable (or bucketed) seq_len traffic until it crashes or is stopped.

Progress goes to `--progress` as JSON lines (`t` = wall clock): start, ready (the first request
served), every 25th request, then crash {error} or stopped (SIGTERM, graceful: the request in
flight finishes). The agent's own event log says what compiling cost (seconds, FX-cache hits).

    python tests/gpu/ballast_server.py --socket S --progress P [--free-mib 300] [--bucketed]
        [--leak-mib-per-s 6]

`--leak-mib-per-s`: after the ballast, the server's own code keeps that much GPU memory alive
per second, in 1 MiB tensors (the allocator's small pool: NVML grows in 2 MiB steps), as a
list of per-request caches that is never trimmed would. The agent's server name comes from
`TORCH_WATCHDOG_SERVER` when set (one name per replica).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))

import torch  # noqa: E402

import torch_watchdog.agent as agent  # noqa: E402
from record_trace import Model  # noqa: E402  (the model FACTS.md measured)

BUCKETS = [32, 64, 128, 256, 512, 768, 1024, 1536, 2048]
stopping = False


def put(fh, kind: str, **fields) -> None:
    fh.write(json.dumps({"kind": kind, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")
    fh.flush()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--event-log", required=True)
    p.add_argument("--free-mib", type=int, default=300)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--bucketed", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--leak-mib-per-s", type=float, default=0.0)
    a = p.parse_args()
    fh = open(a.progress, "a")
    put(fh, "start")

    def stop(*_):
        global stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    torch.cuda.init()
    agent.install(socket_path=a.socket, event_log=a.event_log)
    model = Model(a.layers).cuda().half().eval()
    served = agent.watch(torch.compile(model, mode="reduce-overhead"), name="model")
    rng = random.Random(a.seed)
    i = 0
    try:
        with torch.no_grad():
            served(torch.randint(0, 32000, (1, 64), device="cuda"))  # compile before ballast
            torch.cuda.synchronize()
            put(fh, "ready")
            if a.free_mib:
                free = torch.cuda.mem_get_info()[0]
                ballast = torch.empty(free - a.free_mib * 2**20, dtype=torch.uint8,
                                      device="cuda")
                put(fh, "ballast", bytes=ballast.numel())
            leaked, owed, last = [], 0.0, time.monotonic()
            while not stopping:
                if a.leak_mib_per_s:
                    now = time.monotonic()
                    owed += a.leak_mib_per_s * (now - last)
                    last = now
                    while owed >= 1.0:
                        leaked.append(torch.empty(2**20, dtype=torch.uint8, device="cuda"))
                        owed -= 1.0
                n = rng.randint(32, 2048)
                if a.bucketed:
                    n = next(b for b in BUCKETS if b >= n)
                served(torch.randint(0, 32000, (1, n), device="cuda"))
                torch.cuda.synchronize()
                i += 1
                if i % 25 == 0:
                    put(fh, "served", requests=i)
    except Exception as e:  # the crash the watchdog must pre-empt (FACTS #9)
        put(fh, "crash", error=f"{type(e).__name__}: {str(e)[:300]}", requests=i)
        return 3
    put(fh, "stopped", requests=i)
    agent.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
