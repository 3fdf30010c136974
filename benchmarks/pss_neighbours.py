"""Host-memory mode's reading of an idle server while its neighbours exit (issue 50).

A "server" (a master that imports torch and forks 2 workers, as `gunicorn --preload` does)
and 3 neighbour servers (each a master importing torch and 1 forked worker) on one host, all
watched by one PssMeter as the sidecar does. The neighbours stop one after the other; then the
server's master allocates and touches 200 MiB. Each step is metered for `--step-s` seconds at
2 Hz; printed per step: what the meter read for the idle server (its last value, and the
largest and smallest while the step lasted), beside the server's fresh PSS and USS (Private_
Clean + Private_Dirty, smaps_rollup), read each poll.

A process's PSS shares each page among every process mapping it: the library pages of torch
that the neighbours mapped too become the server's as they exit (566 -> 594 -> 660 MiB, a
user's idle server, forecast to OOM in ~1 h 39 min).

Then the cost of one smaps_rollup read (what the meter pays per process every 10 s), over the
server's torch processes. `--record FILE` writes each step's smaps_rollup texts and RSS of the
server's processes (tests/fixtures/smaps_rollup_neighbours.json is one such run).

    python benchmarks/pss_neighbours.py [--step-s 12] [--unwatched] [--record FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torch_watchdog.sidecar.sources import process  # noqa: E402
from torch_watchdog.sidecar.sources.process import ProcessReader, PssMeter  # noqa: E402

# a master that imports torch, forks `workers` workers, says their pids, and on SIGUSR1
# allocates and touches 200 MiB
SERVER = r'''
import os, signal, sys, time
import torch
torch.ones(8) + 1
hoard = []
def grow(*_):
    b = bytearray(200 << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    hoard.append(b)
    os.write(1, b"grown\n")
kids = []
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        while True:
            time.sleep(3600)
    kids.append(pid)
signal.signal(signal.SIGUSR1, grow)
signal.signal(signal.SIGTERM, lambda *_: [os.kill(k, 9) for k in kids] + [os._exit(0)])
print(" ".join(map(str, [os.getpid(), *kids])), flush=True)
while True:
    time.sleep(3600)
'''


def smaps(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def start(workers: int) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(workers)], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout is not None
    return proc, [int(p) for p in proc.stdout.readline().split()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-s", type=float, default=12.0)
    ap.add_argument("--neighbours", type=int, default=3)
    ap.add_argument("--unwatched", action="store_true",
                    help="meter the server alone (the neighbours are no servers of this sidecar)")
    ap.add_argument("--record", help="write the server's smaps_rollup texts per step here")
    args = ap.parse_args()
    recorded: dict[str, list[dict[str, object]]] = {}
    server, mine = start(2)
    neighbours = [start(1) for _ in range(args.neighbours)]
    reader, meter = ProcessReader(), PssMeter()
    mib = 2 ** 20

    def step(name: str) -> None:
        seen = []
        t_end = time.monotonic() + args.step_s
        while time.monotonic() < t_end:
            pids = set(mine) | (set() if args.unwatched else
                                {p for proc, ps in neighbours if proc.poll() is None for p in ps})
            out = {p.pid: p for p in meter.apply(reader.read(pids))}
            seen.append(sum(out[p].host_bytes or 0 for p in mine))
            time.sleep(0.5)
        fresh = [smaps(p) for p in mine]
        rss = {p.pid: p.rss_bytes for p in reader.read(set(mine))}
        recorded[name] = [{"rss": rss[p], "smaps_rollup": open(f"/proc/{p}/smaps_rollup").read()}
                          for p in mine]
        print(json.dumps({"step": name, "metered_mib": round(seen[-1] / mib, 1),
                          "metered_max_mib": round(max(seen) / mib, 1),
                          "metered_min_mib": round(min(seen) / mib, 1),
                          "pss_mib": round(sum(s["Pss"] for s in fresh) / mib, 1),
                          "uss_mib": round(sum(s["Private_Clean"] + s["Private_Dirty"]
                                               for s in fresh) / mib, 1),
                          "pss_anon_mib": round(sum(s["Pss_Anon"] for s in fresh) / mib, 1),
                          "pss_file_shmem_mib": round(sum(s["Pss_File"] + s["Pss_Shmem"]
                                                          for s in fresh) / mib, 1)}),
              flush=True)

    try:
        step(f"{args.neighbours + 1} servers")
        for i, (proc, _) in enumerate(neighbours):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)
            step(f"neighbour {i + 1} stopped")
        os.kill(server.pid, signal.SIGUSR1)
        assert server.stdout is not None and server.stdout.readline() == b"grown\n"
        step("server allocated 200 MiB")
        # what the meter calls per process (before issue 50's fix: read_pss)
        read = getattr(process, "read_pss_parts", None) or process.read_pss
        took = []
        for _ in range(50):
            for p in mine:
                t0 = time.perf_counter()
                read(p)
                took.append(time.perf_counter() - t0)
        print(json.dumps({"read": read.__name__, "reads": len(took),
                          "mean_ms": round(1000 * sum(took) / len(took), 3),
                          "max_ms": round(1000 * max(took), 3)}), flush=True)
        if args.record:
            with open(args.record, "w") as fh:
                json.dump(recorded, fh, indent=1)
    finally:
        for proc in [server] + [p for p, _ in neighbours]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(20)


if __name__ == "__main__":
    main()
