"""Record a real GPU trace in the recorded-trace format of ../shared/FACTS.md (and the agent's
event log beside it): a reduce-overhead model fed variable or bucketed seq_len, optionally with
a ballast tensor that leaves only `--free-mib` free, so that per-size CUDA graphs run it out of
memory (FACTS #9).

    python benchmarks/record_trace.py OUT.jsonl --seconds 120 [--free-mib 400] [--bucketed]

Each line is flushed at once: a crash (the point of the OOM scenario) loses nothing.
Lines: start, req {i, shape, ms}, compile_start/compile_end {trigger, id}, nvml {used, total,
proc, query_us}, end {requests} or crash {error}; `t` = seconds since this process started.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

T0 = time.monotonic()


class Writer:
    def __init__(self, path: str):
        self.fh = open(path, "w", buffering=1)
        self.lock = threading.Lock()

    def put(self, kind: str, **fields) -> None:
        fields.update(kind=kind, t=round(time.monotonic() - T0, 4))
        with self.lock:
            self.fh.write(json.dumps(fields) + "\n")
            self.fh.flush()


def sample_nvml(w: Writer, stop: threading.Event) -> None:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    pid = os.getpid()
    while not stop.wait(0.1):
        s = time.perf_counter()
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        q = (time.perf_counter() - s) * 1e6
        mine = next((p.usedGpuMemory for p in procs if p.pid == pid), None)
        w.put("nvml", used=mem.used, total=mem.total, proc=mine, query_us=round(q, 1))


class Layer(torch.nn.Module):
    """Pre-norm attention + MLP. Written out rather than nn.TransformerEncoderLayer, whose
    inference fast path (a fused op) ran without any CUDA-graph recording in our first run."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.n2(x))


class Model(torch.nn.Module):
    """FACTS.md's model: 12 layers, 12 heads, hidden 768, FFN 3072 (fp16 via .half())."""

    def __init__(self, layers: int, dim: int = 768, heads: int = 12, vocab: int = 32000):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Layer(dim, heads) for _ in range(layers))

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return x


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--free-mib", type=int, default=0, help="ballast leaving this much free")
    p.add_argument("--bucketed", action="store_true")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--event-log", help="also run the agent, writing its event log here")
    a = p.parse_args()
    w = Writer(a.out)
    w.put("start", scenario=("bucketed" if a.bucketed else "seq-default")
          + (f"-oom{a.free_mib}" if a.free_mib else ""), torch=torch.__version__,
          gpu=torch.cuda.get_device_name())
    if a.event_log:
        import torch_watchdog.agent

        torch_watchdog.agent.install(socket_path="", event_log=a.event_log)

    @torch._dynamo.on_compile_start
    def _start(args=None):
        w.put("compile_start", trigger=str(getattr(args, "callback_trigger", "")),
              id=str(getattr(args, "compile_id", "")))

    @torch._dynamo.on_compile_end
    def _end(args=None):
        w.put("compile_end", trigger=str(getattr(args, "callback_trigger", "")),
              id=str(getattr(args, "compile_id", "")))

    stop = threading.Event()
    threading.Thread(target=sample_nvml, args=(w, stop), daemon=True).start()
    model = Model(a.layers).cuda().half().eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    rng = random.Random(0)
    buckets = [32, 64, 128, 256, 512, 768, 1024, 1536, 2048]
    i = 0
    try:
        with torch.no_grad():
            compiled(torch.randint(0, 32000, (1, 64), device="cuda"))  # compile before ballast
            if a.free_mib:
                free = torch.cuda.mem_get_info()[0]
                ballast = torch.empty(free - a.free_mib * 2**20, dtype=torch.uint8,
                                      device="cuda")
                w.put("ballast", bytes=ballast.numel())
            end = time.monotonic() + a.seconds
            while time.monotonic() < end:
                n = rng.randint(32, 2048)
                if a.bucketed:
                    n = next(b for b in buckets if b >= n)
                s = time.perf_counter()
                compiled(torch.randint(0, 32000, (1, n), device="cuda"))
                torch.cuda.synchronize()
                w.put("req", i=i, shape=[1, n], ms=round((time.perf_counter() - s) * 1e3, 3))
                i += 1
    except Exception as e:  # the OOM scenario ends here; record how
        w.put("crash", error=f"{type(e).__name__}: {str(e)[:300]}", requests=i)
        stop.set()
        return 3
    stop.set()
    w.put("end", requests=i)
    return 0


if __name__ == "__main__":
    sys.exit(main())
