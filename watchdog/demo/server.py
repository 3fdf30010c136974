"""The demo's inference server: a real small transformer under torch.compile, fed requests of
variable length, with the agent installed. `torch-watchdog demo` runs it as a subprocess:

    python -m torch_watchdog.demo.server --socket S --event-log F [--device auto|cpu|cuda] ...

It reports on stdout, one JSON object per line (`ev`: start, traffic, serving, progress,
stopping, error), for the demo's timeline; torch's own warnings go to stderr. SIGTERM (the
sidecar's reload) finishes the request in hand and exits 0.

The model is compiled with `dynamic=False` (on CUDA also `mode="reduce-overhead"`: a real CUDA
graph per compiled length): a recompile per new length until the recompile limit, then new
lengths run eager. The memory a CUDA graph pool takes per size is a STAND-IN here: the server
keeps `--standin-mb` per distinct length, written so it is resident (RSS on a CPU, GPU memory
that NVML sees on CUDA), so that the sidecar's memory policy has growth to forecast and act on
within minutes. There are no CUDA graphs on a CPU; on an H200 this tiny model's graphs (305
lengths, one graph each) left NVML's reading flat at 1.03 GiB: too little to show.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from typing import Any, Optional

STOP: dict[str, Optional[str]] = {"signal": None}
# The stand-in is kept in 512 KiB tensors: CUDA's caching allocator packs blocks of 1-10 MB
# into 20 MiB segments, steps the sidecar's trend counts only as a staircase (jump_bytes);
# blocks under 1 MB come from 2 MiB segments, so memory grows as a CUDA graph pool's would.
CHUNK = 512 << 10


def say(ev: str, **fields: Any) -> None:
    """One line for the demo driver; a closed pipe (the driver is gone) ends the server."""
    try:
        print(json.dumps({"ev": ev, "t": time.time(), "pid": os.getpid(), **fields}),
              flush=True)
    except (BrokenPipeError, ValueError):
        os._exit(1)


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True, help="the sidecar's agent socket")
    p.add_argument("--event-log", required=True, help="the agent's JSON-lines event log")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--rate", type=float, default=5.0, help="requests per second")
    p.add_argument("--warm-requests", type=int, default=40)
    p.add_argument("--warm-lengths", default="120,168,216")
    p.add_argument("--lengths", default="16:320", help="MIN:MAX, inclusive")
    p.add_argument("--limit", type=int, default=4, help="torch's recompile limit")
    p.add_argument("--standin-mb", type=int, default=4, help="MB kept per distinct length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress-s", type=float, default=2.0)
    return p.parse_args(argv)


def build_model(torch: Any, dim: int, layers: int) -> Any:
    """Embedding, `layers` pre-norm blocks (RMSNorm, causal self-attention, SwiGLU), LM head."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = 4
            self.norm1, self.norm2 = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))
            self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, False)
            self.gate, self.up = nn.Linear(dim, 4 * dim, False), nn.Linear(dim, 4 * dim, False)
            self.down = nn.Linear(4 * dim, dim, bias=False)

        def rms(self, x: Any, w: Any) -> Any:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                       for z in self.qkv(self.rms(x, self.norm1)).split(d, dim=-1))
            att = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~causal, float("-inf")).softmax(-1)
            x = x + self.out((att @ v).transpose(1, 2).reshape(b, t, d))
            h = self.rms(x, self.norm2)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(512, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(dim, 512, bias=False)

        def forward(self, ids: Any) -> Any:
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return TinyLM


def memory(torch: Any, device: str) -> dict[str, Optional[int]]:
    rss = None
    try:
        with open("/proc/self/statm") as fh:
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    gpu = torch.cuda.memory_reserved() if device == "cuda" else None
    return {"rss_bytes": rss, "gpu_bytes": gpu}


def main(argv: Optional[list[str]] = None) -> int:
    a = parse(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _f: STOP.update(signal=signal.Signals(signum).name))
    import torch

    import torch_watchdog.agent

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)   # the sidecar and the demo share the machine (2 cores in CI)
    torch._dynamo.config.recompile_limit = a.limit
    torch_watchdog.agent.install(socket_path=a.socket, event_log=a.event_log, heartbeat_s=1.0)
    torch.manual_seed(0)
    dim, layers, batch = (256, 2, 8) if device == "cuda" else (64, 1, 1)
    model = build_model(torch, dim, layers)().to(device).eval()
    options = {"mode": "reduce-overhead"} if device == "cuda" else {}
    lm = torch_watchdog.agent.watch(torch.compile(model, dynamic=False, **options), name="lm")
    compile_text = "torch.compile(dynamic=False" + (', mode="reduce-overhead")' if options
                                                      else ")")
    where = "GPU memory" if device == "cuda" else "RSS"
    say("start", device=device.upper(), torch=torch.__version__, standin_mb=a.standin_mb,
        standin_where=where, model=f"{layers}-layer transformer (dim {dim}, batch {batch})",
        compile=compile_text, recompile_limit=a.limit)
    return serve(torch, a, device, batch, lm)


def serve(torch: Any, a: argparse.Namespace, device: str, batch: int, lm: Any) -> int:
    rng = random.Random(a.seed)
    warm = [int(n) for n in a.warm_lengths.split(",")]
    lo, hi = (int(n) for n in a.lengths.split(":"))
    standin: dict[int, Any] = {}
    seen: set[int] = set()
    served, first_s, next_at = 0, None, time.monotonic()
    next_progress = time.monotonic() + a.progress_s
    say("traffic", what=f"{a.warm_requests} requests in {len(warm)} lengths "
        f"({', '.join(map(str, warm))}) at {a.rate:g}/s")
    while STOP["signal"] is None:
        if served == a.warm_requests:
            say("traffic", what=f"now any length {lo}..{hi}, uniformly: variable-length traffic")
        n = rng.choice(warm) if served < a.warm_requests else rng.randint(lo, hi)
        ids = torch.randint(0, 512, (batch, n), device=device)
        started = time.perf_counter()
        with torch.no_grad():
            lm(ids)
        if device == "cuda":
            torch.cuda.synchronize()
        served += 1
        seen.add(n)
        if a.standin_mb and n not in standin:  # ones: written, so resident (RSS, NVML)
            standin[n] = [torch.ones(CHUNK // 4, device=device)
                          for _ in range((a.standin_mb << 20) // CHUNK)]
        if first_s is None:
            first_s = time.perf_counter() - started
            say("serving", first_s=round(first_s, 3), served=served)
        now = time.monotonic()
        if now >= next_progress:
            next_progress = now + a.progress_s
            say("progress", served=served, distinct=len(seen),
                standin_bytes=sum(t.nbytes for ts in standin.values() for t in ts),
                **memory(torch, device))
        next_at = max(next_at + 1.0 / a.rate, now)  # after a stall: no burst to catch up
        time.sleep(max(0.0, next_at - time.monotonic()))
    say("stopping", signal=STOP["signal"], served=served)
    watchdog_agent_uninstall()
    return 0


def watchdog_agent_uninstall() -> None:
    import torch_watchdog.agent

    torch_watchdog.agent.uninstall()  # flushes the agent's last events


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # reported on the timeline; the traceback is in the server log
        import traceback

        traceback.print_exc()
        say("error", error=f"{type(exc).__name__}: {exc}")
        sys.exit(1)
