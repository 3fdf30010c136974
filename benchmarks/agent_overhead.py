"""Agent cost, measured in one run and printed as ratios (not a pass/fail test).

1. watch() overhead per call on a trivial callable: bare vs watched, interleaved batches,
   median ns per call; target <= 1 us added.
2. emit() with no sidecar listening: 100,000 events; per-emit median and max, total wall time.
3. With a CUDA GPU: a watched reduce-overhead model vs the bare one, and the same under
   torch.cuda.set_sync_debug_mode("error") (any GPU sync the agent added would raise).

    python benchmarks/agent_overhead.py [--batches 200] [--calls 5000] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from time import perf_counter_ns

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torch_watchdog.agent as agent  # noqa: E402
from torch_watchdog import events  # noqa: E402
from torch_watchdog.agent.emitter import Emitter  # noqa: E402


def per_call_ns(fn, args, kwargs, calls: int) -> float:
    t0 = perf_counter_ns()
    for _ in range(calls):
        fn(*args, **kwargs)
    return (perf_counter_ns() - t0) / calls


def compare(bare, watched, args, kwargs, batches: int, calls: int) -> dict:
    b, w = [], []
    for _ in range(batches):  # interleaved, so drift and noise hit both alike
        b.append(per_call_ns(bare, args, kwargs, calls))
        w.append(per_call_ns(watched, args, kwargs, calls))
    mb, mw = statistics.median(b), statistics.median(w)
    return {"bare_ns": round(mb, 1), "watched_ns": round(mw, 1),
            "added_ns": round(mw - mb, 1), "ratio": round(mw / mb, 3)}


def bench_watch(batches: int, calls: int) -> dict:
    def trivial(x=None, mask=None):
        return x

    watched = agent.watch(trivial, name="trivial")
    x = torch.ones(1, 128)
    out = {"one_tensor": compare(trivial, watched, (x,), {}, batches, calls),
           "two_kwargs": compare(trivial, watched, (), {"x": x, "mask": x}, batches, calls)}
    return out


def bench_emit(n: int = 100_000) -> dict:
    with tempfile.TemporaryDirectory() as d:
        em = Emitter(os.path.join(d, "nobody-listens.sock"), None)
        em.start()
        ev = events.Heartbeat(t=time.time(), pid=os.getpid(), seq=1, uptime_s=0.0,
                              queue_depth=0, errors=0)
        each = []
        t0 = perf_counter_ns()
        for _ in range(n):
            s = perf_counter_ns()
            em.emit(ev)
            each.append(perf_counter_ns() - s)
        total = perf_counter_ns() - t0
        time.sleep(0.3)
        em.stop()
    each.sort()
    return {"emits": n, "total_ms": round(total / 1e6, 2),
            "median_ns": each[n // 2], "p99_ns": each[int(n * 0.99)], "max_ns": each[-1],
            "dropped": dict(em.dropped)}


def bench_gpu(calls: int) -> dict:
    from torch_watchdog.agent import timing

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)

        def forward(self, x):
            return self.l2(torch.relu(self.l1(x)))

    model = Block().cuda().half().eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    watched = timing.watch(compiled, name="block")
    x = torch.randn(8, 64, 256, device="cuda", dtype=torch.half)
    with torch.no_grad():
        for _ in range(5):
            watched(x)
        torch.cuda.synchronize()
        result = compare(compiled, watched, (x,), {}, 50, calls)
        # the cost of any Python wrapper layer around a compiled module, for comparison
        result["passthrough"] = compare(compiled, lambda *a, **k: compiled(*a, **k), (x,), {},
                                        50, calls)
        result["repeat"] = compare(compiled, watched, (x,), {}, 50, calls)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(100):
                watched(x)
            synced = False
        except RuntimeError:
            synced = True
        finally:
            torch.cuda.set_sync_debug_mode("default")
    result["sync_under_debug_mode_error"] = synced
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    agent.install(socket_path="", event_log=None)  # live hooks and runtime, nowhere to send
    results = {"torch": torch.__version__, "python": sys.version.split()[0],
               "watch": bench_watch(args.batches, args.calls), "emit": bench_emit()}
    if torch.cuda.is_available():
        results["gpu_reduce_overhead"] = bench_gpu(200)
    agent.uninstall()
    for name, r in results["watch"].items():
        print(f"watch() {name:10s}: bare {r['bare_ns']:7.1f} ns  watched {r['watched_ns']:7.1f} ns"
              f"  added {r['added_ns']:6.1f} ns  ratio {r['ratio']:.2f}x  (target <= 1000 ns)")
    e = results["emit"]
    print(f"emit() x{e['emits']} with no sidecar: total {e['total_ms']} ms, median "
          f"{e['median_ns']} ns, p99 {e['p99_ns']} ns, max {e['max_ns']} ns; dropped {e['dropped']}")
    if "gpu_reduce_overhead" in results:
        g = results["gpu_reduce_overhead"]
        print(f"GPU reduce-overhead call: bare {g['bare_ns'] / 1e3:.1f} us, watched "
              f"{g['watched_ns'] / 1e3:.1f} us, ratio {g['ratio']:.3f}x (a bare passthrough "
              f"wrapper: {g['passthrough']['ratio']:.3f}x); GPU sync raised under "
              f"set_sync_debug_mode('error'): {g['sync_under_debug_mode_error']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
