"""A server for the sidecar-restart chaos test (test_sidecar_restart.py): the real agent
installed (`server=NAME`, the default `hello_every_s` of 30 s and `heartbeat_s` of 2 s), a
watched torch model, and host memory (its own PSS: what the sidecar reads in host-memory mode)
brought up to TARGET_MIB once its first watched call is answered, whatever torch's and the
agent's footprint on this machine (~300 MiB with torch 2.13 on CPU): one step in its first
second. Then:

- `flat`: a request every 0.2 s, all of one size; nothing more;
- `grow`: the same until the file PROGRESS.grow exists, then a CUDA-graph server's growth:
  GROW_PER_S requests a second, each of a size never seen before (the agent's own
  `new_shape`, from watch()), a graph recorded for each and 1 MiB kept (host memory,
  written: it counts in PSS), at most CAP_MIB. A CPU has no CUDA graphs: their warm-up and
  record are told through the installed agent's own emitter, as its hooks tell them on a GPU.

A drain (reload method `agent`) ends it with the agent's drain exit code: a watched call begun
after the drain started raises `Draining`, which the loop answers by waiting for the exit.
Appends "<pid> <name> <kind>" to PROGRESS once it serves (its first watched call answered),
and keeps the count of the calls it has answered in PROGRESS.<pid> (rewritten each second).

    python restart_server.py SOCKET NAME flat|grow TARGET_MIB PROGRESS
"""
import os
import sys
import time

import torch

import torch_watchdog.agent as agent
from torch_watchdog import events

MIB = 1 << 20
GROW_PER_S = 3
CAP_MIB = 250


def pss_mib() -> float:
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no Pss in /proc/self/smaps_rollup")


def touched(mib: float) -> bytearray:
    block = bytearray(int(mib * MIB))
    block[::4096] = b"x" * len(block[::4096])
    return block


def record(size: int) -> None:
    """A CUDA graph recorded for batch size `size`, as the agent's hooks tell it."""
    emit, pid = agent.current().emitter.emit, os.getpid()
    for phase in ("warmup", "record"):
        emit(events.CudagraphRecord(t=time.time(), pid=pid, phase=phase, compile_id="0/0",
                                    key=[size], shape=[[size, 16]], seconds=0.01))


def main(sock: str, name: str, kind: str, target_mib: str, progress: str) -> None:
    torch.set_num_threads(1)
    model = torch.nn.Linear(16, 16)
    hoard = []
    agent.install(socket_path=sock, server=name, reconnect_s=0.2)
    served = agent.watch(model, name="model")
    size, answered, counted_at = 1, 0, 0.0
    counter = f"{progress}.{os.getpid()}"
    with torch.no_grad():
        served(torch.randn(size, 16))
        hoard.append(touched(max(0.0, float(target_mib) - pss_mib())))
        with open(progress, "a") as fh:
            fh.write(f"{os.getpid()} {name} {kind}\n")
        while True:
            growing = kind == "grow" and os.path.exists(progress + ".grow")
            if growing and len(hoard) <= CAP_MIB:  # each request of a size never seen before
                size += 1
                record(size)
                hoard.append(touched(1))
            try:
                served(torch.randn(size, 16))
            except agent.Draining:  # the drain thread exits the process once it is done
                time.sleep(0.05)
                continue
            answered += 1
            if time.monotonic() - counted_at >= 1.0:
                counted_at = time.monotonic()
                with open(counter + ".tmp", "w") as fh:
                    fh.write(str(answered))
                os.replace(counter + ".tmp", counter)
            time.sleep(1 / GROW_PER_S if growing else 0.2)


if __name__ == "__main__":  # run by the test; importing it (pytest given its path) does nothing
    main(*sys.argv[1:6])
