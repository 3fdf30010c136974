"""Agent demo (CPU is enough): a small transformer under torch.compile, fed variable lengths.

What you will see, live, as the agent reports it over its socket:
  1. dynamic=False: a recompile per new length, with Dynamo's reason, until the recompile
     limit; then the eager fallback (no error: only a torch warning in the log) — and
     what it costs here, measured: compiled and eager calls timed side by side;
  2. the fix: the same traffic bucketed to 3 lengths — a few compiles, then nothing.

    python examples/agent_demo.py [--limit 4] [--backend inductor|eager]
"""
from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torch_watchdog.agent  # noqa: E402
from torch_watchdog import events  # noqa: E402

SHOWN = ("compile", "recompile", "recompile_limit", "graph_break", "stall", "cudagraph_record",
         "mitigation", "oom", "dropped")


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.block = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True,
                                                      dropout=0.0)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(ids)))


def show(e: events.Event, t0: float) -> None:
    at = f"[{e.t - t0:6.1f}s]"
    if e.kind == "compile":
        print(f"{at} compiled {e.function} in {e.seconds:.2f} s")
    elif e.kind == "recompile":
        print(f"{at} RECOMPILE in {e.seconds:.2f} s — {e.reason}")
    elif e.kind == "recompile_limit":
        print(f"{at} RECOMPILE LIMIT ({e.limit}) hit: new lengths now run EAGER (no error; "
              "torch only logs a warning)")
    elif e.kind == "stall":
        print(f"{at} stall {e.seconds * 1e3:.0f} ms on shape {e.shape} ({e.cause or 'unknown'})")
    else:
        print(f"{at} {e.kind}: {events.to_dict(e)}")


def listener(path: str, t0: float, seen: list) -> threading.Thread:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)

    def run() -> None:
        while True:
            for line in sock.recv(events.MAX_DATAGRAM_BYTES).split(b"\n"):
                e = events.decode(line)
                seen.append(e)
                if e.kind in SHOWN:
                    show(e, t0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def timed_pair(model, compiled_len: int, eager_len: int, rounds: int = 40) -> tuple[float, float]:
    """Median ms of a compiled length and of a length past the limit (eager), interleaved call
    by call so that load on the machine hits both alike (timing them one after the other
    printed 0.8x on a quiet run and 0.0x under load)."""
    compiled, eager = [], []
    with torch.no_grad():
        for _ in range(rounds):
            for n, out in ((compiled_len, compiled), (eager_len, eager)):
                t = time.perf_counter()
                model(torch.randint(0, 512, (1, n)))
                out.append(time.perf_counter() - t)
    return 1e3 * sorted(compiled)[rounds // 2], 1e3 * sorted(eager)[rounds // 2]


def verdict(compiled_ms: float, eager_ms: float, margin: float = 1.05) -> str:
    """What the numbers show, nothing more: "slower" only when measured slower."""
    ratio = eager_ms / compiled_ms if compiled_ms > 0 else float("nan")
    if ratio >= margin:
        return f"eager is {ratio:.2f}x slower here"
    return f"eager is not slower here ({ratio:.2f}x)"


def serve(model, lengths: list[int], label: str) -> float:
    """Serve requests; return the median latency of the last half (the steady state)."""
    took = []
    with torch.no_grad():
        for i, n in enumerate(lengths):
            t = time.perf_counter()
            model(torch.randint(0, 512, (1, n)))
            took.append(time.perf_counter() - t)
            if (i + 1) % 40 == 0:
                print(f"  … {label}: {i + 1}/{len(lengths)} requests served")
    steady = sorted(took[len(took) // 2:])
    return steady[len(steady) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=4, help="recompile limit (torch default: 8)")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--requests", type=int, default=120)
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="torch-watchdog-demo-")
    sock, log = os.path.join(work, "events.sock"), os.path.join(work, "events.jsonl")
    t0, seen = time.time(), []
    listener(sock, t0, seen)
    torch_watchdog.agent.install(socket_path=sock, event_log=log, stall_threshold_s=0.1)
    rng = random.Random(0)
    traffic = [rng.randint(16, 256) for _ in range(a.requests)]
    torch.manual_seed(0)
    model = TinyLM().eval()

    print(f"== 1. dynamic=False, {len(set(traffic))} distinct lengths, recompile limit {a.limit}")
    with torch._dynamo.config.patch(recompile_limit=a.limit):
        static = torch_watchdog.agent.watch(torch.compile(model, dynamic=False, backend=a.backend),
                                      name="static")
        serve(static, traffic, "static")
        compiled = list(dict.fromkeys(traffic))[:a.limit]   # the first lengths: compiled
        compiled_len = compiled[0]
        eager_len = next(n for n in reversed(traffic) if n not in compiled)  # past the limit
        print(f"  timing a compiled length ({compiled_len}) and one past the limit "
              f"({eager_len}), call by call …")
        compiled_ms, fallback_ms = timed_pair(static, compiled_len, eager_len)

    print("== 2. the fix: the same traffic padded to 3 bucket lengths")
    torch._dynamo.reset()
    buckets = [64, 128, 256]
    bucketed = torch_watchdog.agent.watch(torch.compile(model, dynamic=False, backend=a.backend),
                                    name="bucketed")
    bucket_ms = serve(bucketed, [next(b for b in buckets if b >= n) for n in traffic],
                      "bucketed") * 1e3
    time.sleep(0.5)
    torch_watchdog.agent.uninstall()
    time.sleep(0.2)

    kinds = [e.kind for e in seen]
    print("\n== What the agent saw")
    print(f"  recompiles: {kinds.count('recompile')}, recompile-limit hits: "
          f"{kinds.count('recompile_limit')}, new shapes: {kinds.count('new_shape')}, "
          f"stalls: {kinds.count('stall')}")
    print(f"  measured: {compiled_ms:.2f} ms per call on a compiled length ({compiled_len}), "
          f"{fallback_ms:.2f} ms on a length past the limit ({eager_len}, eager): "
          f"{verdict(compiled_ms, fallback_ms)}")
    print(f"  bucketed: {bucket_ms:.2f} ms per request (padding included), no fallback")
    tool = os.path.join(os.path.dirname(sys.executable), "torch-watchdog")
    print(f"  the post-mortem event log: {log}")
    print(f"  check it:  {tool} events {log}")
    print(f"  replay it through the sidecar's pipeline:  {tool} replay {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
