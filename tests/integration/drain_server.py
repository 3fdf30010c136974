"""A small inference server for the drain and warm-restart tests: the agent installed, a
torch.compile'd model, a health flag read from `torch_watchdog.agent.ready()`.

It serves requests one after another (each a watched call lasting `--call-s`), and takes new
work only while ready() is True, as a server behind a load balancer whose health check reads
it. Progress goes to `--progress` as JSON lines: start, compiled {seconds}, ready (the first
answer), begin/end {i} per request, on_drain {ready} (the callback, with what ready() said
then), not_ready (work refused once). Reading ready() and taking a request happen under one
lock the on_drain callback also takes, as a load balancer's health check and its dispatch:
a request either began before the drain's callback or was refused. A request taken just
before the drain began whose model call starts after it gets `Draining` (`refused {i}`), as a
server answers 503 for the load balancer to retry elsewhere.
`--grow-mib-per-s`: host memory it keeps after the first answer (the sidecar's forecast).
`--busy`: a queue worker that never reads ready(): calls back to back, and a call refused with
`torch_watchdog.agent.Draining` is requeued (`refused {i}`, once) and retried.

    python tests/integration/drain_server.py --socket S --progress P --event-log L
        [--server NAME] [--backend eager|inductor] [--call-s 0.3] [--requests N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

import torch_watchdog.agent as agent


def put(fh, kind: str, **fields) -> None:
    fh.write(json.dumps({"kind": kind, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")
    fh.flush()


class Net(torch.nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))).softmax(-1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--event-log", required=True)
    p.add_argument("--server", default="drain-test")
    p.add_argument("--backend", default="eager")
    p.add_argument("--call-s", type=float, default=0.3)
    p.add_argument("--requests", type=int, default=0, help="0: until stopped")
    p.add_argument("--grow-mib-per-s", type=float, default=0.0)
    p.add_argument("--busy", action="store_true")
    a = p.parse_args()
    fh = open(a.progress, "a")
    put(fh, "start", ppid=os.getppid())
    agent.install(socket_path=a.socket, event_log=a.event_log, server=a.server, tick_s=0.05,
                  reconnect_s=0.2)
    gate = threading.Lock()

    def drained() -> None:
        with gate:
            put(fh, "on_drain", ready=agent.ready())

    agent.on_drain(drained)
    torch.manual_seed(0)
    model = torch.compile(Net(), backend=a.backend)

    def handle(x):
        out = model(x)
        time.sleep(a.call_s)  # the rest of the request: a call in hand lasts this long
        return out

    served = agent.watch(handle, name="model")
    x = torch.randn(8, 64)
    started = time.monotonic()
    with torch.no_grad():
        served(x)
        put(fh, "ready", seconds=time.monotonic() - started)
        hoard, i, refused = [], 0, False
        grow_from = time.monotonic()
        while a.busy:
            i += 1
            put(fh, "begin", i=i)
            try:
                served(x)
            except agent.Draining:
                if not refused:
                    put(fh, "refused", i=i)
                    refused = True
                time.sleep(0.01)
                continue
            put(fh, "end", i=i)
        while not a.requests or i < a.requests:
            with gate:
                taken = agent.ready()  # the health endpoint says 503: no new work comes
                if taken:
                    i += 1
                    put(fh, "begin", i=i)
                elif not refused:
                    put(fh, "not_ready")
                    refused = True
            if not taken:
                time.sleep(0.01)
                continue
            try:
                served(x)
            except agent.Draining:  # taken as the drain began: a 503, retried elsewhere
                put(fh, "refused", i=i)
                continue
            put(fh, "end", i=i)
            owed = a.grow_mib_per_s * (time.monotonic() - grow_from) - len(hoard)
            for _ in range(int(owed)):
                hoard.append(bytearray(1 << 20))  # touched: it counts in RSS
    put(fh, "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
