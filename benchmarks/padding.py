"""Issue 14's table: a causal transformer served one request at a time with variable lengths,
five ways, each in a process of its own (fresh compile state, fresh memory baseline):

    eager          the model, uncompiled
    as_is          torch.compile(mode="reduce-overhead"): one CUDA graph per length
    graph_budget   the same with the agent installed, graph_budget=64
    agent_padding  the same, watched with pad=pad.Tokens(buckets=(max_len,), max_buckets=8)
    hand_padding   the same, padded by hand to 8 equal buckets (max_len/8, 2*max_len/8, ...)

and the refusal case: a mean-pooling model (no mask) under the agent's padding, which must turn
itself off with a `mitigation` event; and check_memory: every call checked, on the eager model,
the agent's check pool against the shared allocator (reserved memory after warm-up).

Per variant: real tokens/s (the requests' own lengths, padding not counted), p50/p99 latency,
memory growth and CUDA graphs recorded, all within the measuring window (the run's last
`--window` share, and never before the first call, its compile, is done: at least 10 s after
it); for the padded ones, the outputs of 16 lengths
compared with the eager model unpadded (largest relative error per dtype), and the agent's own
checks (count, time: the comparison's cost). Memory in the window, broken down: total (the
device's used memory on a GPU, cudaMemGetInfo, as NVML sees it; RSS on a CPU), the caching
allocator's reserved bytes (`reserved_growth_bytes`), and for the agent's padding the checks'
private pool (`check_memory_in_window`: its mode, its reserved bytes at both ends, the checks
run and skipped in the window; agent/pad/memory.py CheckMemory).

    python benchmarks/padding.py                 # CPU (CI size): tiny model, ~35 s a variant
    python benchmarks/padding.py --gpu           # CUDA: 12 layers x 768, fp16, lengths 16-2048,
                                                 # 32 s a variant, < 5 min in all
JSON results: --out FILE, else $WATCHDOG_GPU_RESULTS/padding.json (GPU) when set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
try:  # installed (pip install -e .)
    import torch_watchdog  # noqa: F401
except ImportError:  # a bare checkout: the import name is torch_watchdog, the folder watchdog/
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "torch_watchdog", os.path.join(ROOT, "watchdog", "__init__.py"),
        submodule_search_locations=[os.path.join(ROOT, "watchdog")])
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["torch_watchdog"] = _module
    _spec.loader.exec_module(_module)

VARIANTS = ("eager", "as_is", "graph_budget", "agent_padding", "hand_padding")
SIZES = {  # model and traffic per mode
    "cpu": dict(vocab=1024, d=64, layers=2, heads=4, max_len=256, lo=8, dtype="float32",
                seconds=35.0),
    "gpu": dict(vocab=50257, d=768, layers=12, heads=12, max_len=2048, lo=16, dtype="float16",
                seconds=32.0),  # 36 took ~250 s in all; check_memory adds ~20 s
    # --hf: transformers' GPT2LMHeadModel from its config (random weights, use_cache=False):
    # what the agent's padding slices is a ModelOutput
    "hf-cpu": dict(hf=True, vocab=1024, d=64, layers=2, heads=4, max_len=256, lo=8,
                   dtype="float32", seconds=35.0),
    "hf-gpu": dict(hf=True, vocab=50257, d=768, layers=12, heads=12, max_len=1024, lo=16,
                   dtype="float16", seconds=40.0),
}
EXACT_LENGTHS = 16
SLOWEST = 30  # the slowest calls kept per variant, with their checks and recordings
MIN_WINDOW_S = 10.0  # measured at least this long after the first call (its compile)
MIN_WINDOW_CALLS = 50  # and at least this many calls (a recompile can take 40 s on a busy CPU)


def build(torch, cfg: dict, device: str, pooled: bool = False):
    if cfg.get("hf"):
        return build_hf(torch, cfg, device)
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x, causal):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads) \
                .permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        """GPT-2 shaped: token + position embeddings, pre-norm blocks, tied LM head."""

        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(cfg["vocab"], cfg["d"])
            self.pos = nn.Embedding(cfg["max_len"], cfg["d"])
            self.blocks = nn.ModuleList(Block(cfg["d"], cfg["heads"])
                                        for _ in range(cfg["layers"]))
            self.ln = nn.LayerNorm(cfg["d"])

        def forward(self, ids):
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x, not pooled)
            x = self.ln(x)
            if pooled:  # mean over every position, no mask: right padding changes it
                return x.mean(dim=1)
            return x @ self.tok.weight.t()

    torch.manual_seed(0)
    model = GPT().eval().to(device=device, dtype=getattr(torch, cfg["dtype"]))
    return model


def build_hf(torch, cfg: dict, device: str):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=cfg["vocab"], n_embd=cfg["d"], n_layer=cfg["layers"], n_head=cfg["heads"],
        n_positions=cfg["max_len"], use_cache=False, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    return model.to(device=device, dtype=getattr(torch, cfg["dtype"]))


def logits(out):
    """A ModelOutput's logits, or the tensor itself: what padding by hand slices."""
    return out.logits if hasattr(out, "logits") else out


def memory(torch, device: str) -> int:
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return total - free
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reserved(torch, device: str) -> Optional[int]:
    """The caching allocator's reserved bytes (every pool, the checks' private one included)."""
    return torch.cuda.memory_reserved() if device == "cuda" else None


def check_memory(torch, fn) -> dict:
    """The padded model's check bookkeeping (agent/pad/memory.py CheckMemory): the pool mode, the
    checks run and skipped, and what the checks' pool holds now (a "released" pool holds
    nothing between checks; a "kept" one its segments). Never raises: a benchmark row."""
    try:
        memory = fn.memory
        out = {"check_pool": memory.mode, "checks": fn.checks, "checks_skipped": memory.skipped,
               "check_pool_bytes": memory.pool_bytes, "check_left_bytes": memory.left,
               "checks_stopped": memory.stopped, "check_pool_reserved_bytes": 0}
        if memory.pool is not None:
            segments = memory.pool.snapshot()
            out["check_pool_reserved_bytes"] = sum(s["total_size"] for s in segments)
        return out
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def count_recordings(torch) -> list:
    """CUDA graphs recorded, counted at cudagraph trees' record_function."""
    count = [0]
    try:
        from torch._inductor import cudagraph_trees as ct

        original = ct.CUDAGraphTreeManager.record_function

        def record(self, *args, **kwargs):
            count[0] += 1
            return original(self, *args, **kwargs)

        ct.CUDAGraphTreeManager.record_function = record
    except Exception:
        count[0] = -1  # unknown
    return count


# over the complexity bound: one variant's setup, run and measurements, read top to bottom
def run_variant(name: str, mode: str, seconds: float, window: float) -> dict:  # noqa: C901
    import torch

    import torch_watchdog.agent as agent
    from torch_watchdog import events
    from torch_watchdog.agent import pad, settings

    cfg = SIZES[mode]
    device = "cuda" if mode.endswith("gpu") else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)  # steadier on a shared machine; the same for every variant
    model = build(torch, cfg, device, pooled=name == "refusal")
    recorded = count_recordings(torch) if device == "cuda" else [0]
    mitigations: list = []
    max_len, lo = cfg["max_len"], cfg["lo"]
    hand = [max_len * (i + 1) // 8 for i in range(8)]
    fn = model
    if name == "check_memory":
        return check_memory_ab(torch, cfg, device, model)
    if name != "eager":
        # the refusal on a GPU runs uncompiled: its point is the check, not 15 s of compile
        compiled = model if name == "refusal" and device == "cuda" else torch.compile(
            model, mode="reduce-overhead")
        fn = compiled
        if name in ("graph_budget", "agent_padding", "refusal"):
            agent.install(socket_path="", event_log=None, heartbeat_s=3600,
                          graph_budget=64 if name == "graph_budget" else 0)
            forward = settings.current.emit
            settings.configure(emit=lambda e: (mitigations.append(e) if e.kind == "mitigation"
                                               else None, forward(e)))
        if name == "graph_budget":
            fn = agent.watch(compiled, "llm")
        elif name in ("agent_padding", "refusal"):
            fn = agent.watch(compiled, "llm", pad=pad.Tokens(buckets=(max_len,), max_buckets=8))
        elif name == "hand_padding":
            def fn(ids, compiled=compiled):
                n = ids.shape[1]
                bucket = next(b for b in hand if b >= n)
                if bucket > n:
                    ids = torch.cat([ids, ids.new_zeros(1, bucket - n)], dim=1)
                return logits(compiled(ids)).narrow(1, 0, n)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    calls: list = []  # (end time, length, seconds)
    start = time.perf_counter()
    window_at, end_at = start + seconds * (1 - window), start + seconds
    first_call_s = mem_start = graphs_start = reserved_start = checks_start = None
    measured, slowest = 0, []
    with torch.inference_mode():
        if name == "refusal":
            for n in (37, 100, 5):
                ids = torch.randint(0, cfg["vocab"], (1, n), generator=gen).to(device)
                out, want = fn(ids), model(ids)
                calls.append((0.0, n, pad.compare(out, want)[1]))
            return {"name": name, "padding_on": fn.on, "events": [
                events.to_dict(e) for e in mitigations], "outputs_max_error": calls[0][2]}
        while True:
            n = rng.randint(lo, max_len)
            ids = torch.randint(0, cfg["vocab"], (1, n), generator=gen).to(device)
            checks0, graphs0 = getattr(fn, "checks", 0), recorded[0]
            t0 = time.perf_counter()
            out = fn(ids)
            sync()
            t1 = time.perf_counter()
            del out
            # where the time goes: the slowest calls, with what happened in them
            slowest.append((round(1e3 * (t1 - t0), 2), round(t1 - start, 3), n,
                            getattr(fn, "checks", 0) - checks0, recorded[0] - graphs0))
            if len(slowest) > 2 * SLOWEST:
                slowest.sort(reverse=True)
                del slowest[SLOWEST:]
            if first_call_s is None:  # the first compile: a slow one still leaves a window
                first_call_s = t1 - start
                window_at = max(window_at, t1)
                end_at = max(end_at, t1 + MIN_WINDOW_S)
            if mem_start is None and t1 >= window_at:
                mem_start, graphs_start = memory(torch, device), recorded[0]
                reserved_start = reserved(torch, device)
                checks_start = check_memory(torch, fn) if name == "agent_padding" else None
            calls.append((t1, n, t1 - t0))
            if t1 >= window_at:
                measured += 1
            if (t1 >= end_at and measured >= MIN_WINDOW_CALLS) or t1 - start >= 3 * seconds:
                break
        mem_end, graphs_end = memory(torch, device), recorded[0]
        reserved_end = reserved(torch, device)
        checks_end = check_memory(torch, fn) if name == "agent_padding" else None
        in_window = [c for c in calls if c[0] >= window_at]
        span = (in_window[-1][0] - window_at) if in_window else 0.0
        result = {
            "name": name, "calls": len(calls), "window_s": round(span, 3),
            "first_call_s": round(first_call_s, 3),
            "window_calls": len(in_window),
            "real_tokens_per_s": round(sum(c[1] for c in in_window) / span, 1) if span else None,
            "p50_ms": round(1e3 * statistics.median(c[2] for c in in_window), 3)
            if in_window else None,
            "p99_ms": round(1e3 * sorted(c[2] for c in in_window)[
                math.ceil(0.99 * len(in_window)) - 1], 3) if in_window else None,
            "memory_growth_bytes": None if mem_start is None else mem_end - mem_start,
            "memory_end_bytes": mem_end,
            # the same window, as the caching allocator counts it (every pool): total minus
            # this is memory outside torch's allocator (CUDA context, cuBLAS workspaces, ...)
            "reserved_growth_bytes": None if reserved_start is None or reserved_end is None
            else reserved_end - reserved_start,
            "graphs_recorded": graphs_end if recorded[0] >= 0 else None,
            "graphs_recorded_in_window": (graphs_end - graphs_start)
            if recorded[0] >= 0 and graphs_start is not None else None,
            "distinct_lengths": len({c[1] for c in calls}),
            # (ms, seconds since start, length, checks in the call, graphs recorded in it)
            "slowest_calls": sorted(slowest, reverse=True)[:SLOWEST],
        }
        if name in ("agent_padding", "hand_padding"):
            errors: dict = {}
            for n in sorted(rng.sample(range(lo, max_len + 1), EXACT_LENGTHS)):
                ids = torch.randint(0, cfg["vocab"], (1, n), generator=gen).to(device)
                served = fn(ids)
                served = served.clone() if hasattr(served, "clone") else served
                want = model(ids)
                ok, errs, _ = pad.compare(served, logits(want) if name == "hand_padding"
                                          else want)
                for k, v in errs.items():
                    errors[k] = max(errors.get(k, 0.0), v)
            result["outputs_max_error"] = errors
        if name == "agent_padding":
            window = {"start": checks_start, "end": checks_end}
            try:  # the checks in the window, and what the checks' pool reserved then
                window["checks"] = checks_end["checks"] - checks_start["checks"]
                window["checks_skipped"] = (checks_end["checks_skipped"]
                                            - checks_start["checks_skipped"])
                window["check_pool_reserved_growth_bytes"] = (
                    checks_end["check_pool_reserved_bytes"]
                    - checks_start["check_pool_reserved_bytes"])
            except Exception:
                pass  # a missing half (a window that never started): the rows say so
            result["check_memory_in_window"] = window
            stats = fn.stats()
            result["agent"] = {
                "on": fn.on, "buckets": list(fn.plan), "checks": stats.checks,
                "check_seconds": round(stats.check_seconds, 4),
                "check_ms_each": round(1e3 * stats.check_seconds / stats.checks, 3)
                if stats.checks else None,
                "check_share_of_run": round(stats.check_seconds / (time.perf_counter() - start),
                                            5),
                "max_error": stats.max_error, "padding_fraction": round(
                    stats.padding_tokens / max(1, stats.padding_tokens + stats.real_tokens), 4),
                "recordings_saved": stats.recordings_saved,
                "check_pool": stats.check_pool, "check_pool_bytes": stats.check_pool_bytes,
                "check_left_bytes": stats.check_left_bytes,
                "checks_skipped": stats.checks_skipped, "checks_stopped": stats.checks_stopped,
                "events": [events.to_dict(e) for e in mitigations]}
        if name == "hand_padding":
            result["buckets"] = hand
        return result


CHECK_CALLS = 40  # check_memory: calls after warm-up, every one checked


def check_memory_ab(torch, cfg: dict, device: str, model) -> dict:
    """The checks' memory alone, every call checked (sample=1.0, no cap), on the eager model
    (no compile: the checks are the point), twice: with the agent's pool mode, then forced to
    the shared allocator (the fallback, and what the agent did before). Warm-up is one call at
    the longest length (a bucket's first check); then CHECK_CALLS random lengths. Per mode: the
    reserved bytes after warm-up and at the end, the largest in between, checks run."""
    from torch_watchdog.agent import pad, watch

    max_len, lo = cfg["max_len"], cfg["lo"]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out: dict = {"name": "check_memory", "calls_after_warm_up": CHECK_CALLS}
    for mode in ("agent", "shared"):
        fn = watch(model, f"check-{mode}", pad=pad.Tokens(
            buckets=(max_len,), max_buckets=1, sample=1.0, check_memory_bytes=1 << 50))
        if mode == "shared":
            fn.memory.mode = "shared"  # forced: the baseline
        rng, gen = random.Random(2), torch.Generator().manual_seed(2)
        series, t0 = [], time.perf_counter()
        with torch.inference_mode():
            # max_len - 1: padded to max_len, so checked (a length equal to a bucket is not)
            for n in [max_len - 1] + [rng.randint(lo, max_len) for _ in range(CHECK_CALLS)]:
                ids = torch.randint(0, cfg["vocab"], (1, n), generator=gen).to(device)
                fn(ids)
                sync()
                series.append(reserved(torch, device) or 0)
        row = check_memory(torch, fn)
        row.update(seconds=round(time.perf_counter() - t0, 2), on=fn.on,
                   reserved_after_warm_up_bytes=series[0], reserved_end_bytes=series[-1],
                   growth_after_warm_up_bytes=series[-1] - series[0],
                   largest_growth_after_warm_up_bytes=max(series) - series[0])
        out[mode] = row
        del fn
        if device == "cuda":
            torch.cuda.empty_cache()  # the next mode starts from the same allocator state
    return out


def wrapper_overhead() -> dict:
    """The agent's padding wrapper against the same padding by hand (CPU, thread time per
    call, lengths 1-256 into 8 buckets, no checks): what padding by the agent adds to a call
    beyond the padding itself. On a callable that returns its input; and, with transformers,
    one that returns a ModelOutput (logits), called with and without an attention mask, where
    the hand version pads both and slices the logits."""
    import torch

    torch.set_num_threads(1)
    out = dict(zip(("agent", "hand"), _overhead(lambda x: x, masked=False)))
    try:
        from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
    except Exception as e:  # no transformers: the plain rows only
        out["model_output"] = f"not measured: {type(e).__name__}: {e}"
        return out

    def model(input_ids, attention_mask=None):
        return CausalLMOutputWithCrossAttentions(logits=input_ids.unsqueeze(-1).float())

    for key, masked in (("model_output", False), ("model_output_masked", True)):
        agent, hand = _overhead(model, masked)
        out[key] = {"agent": agent, "hand": hand, "over_hand_us": round(agent - hand, 2),
                    "ratio": round(agent / hand, 3)}
    return out


def _overhead(model, masked: bool) -> tuple[float, float]:
    import torch

    from torch_watchdog.agent import pad, watch

    hand_buckets = [32 * (i + 1) for i in range(8)]
    agent = watch(model, "overhead", pad=pad.Tokens(buckets=tuple(hand_buckets),
                                                    max_buckets=8, sample=0.0))
    watched = watch(model, "overhead-hand")

    def hand(ids, **kwargs):
        n = ids.shape[1]
        bucket = next(b for b in hand_buckets if b >= n)
        if bucket > n:
            ids = torch.cat([ids, ids.new_zeros(1, bucket - n)], dim=1)
            kwargs = {k: torch.cat([v, v.new_zeros(1, bucket - n)], dim=1)
                      for k, v in kwargs.items()}
        return logits(watched(ids, **kwargs)).narrow(1, 0, n)

    xs = [(torch.randint(0, 100, (1, n)),
           {"attention_mask": torch.ones(1, n, dtype=torch.long)} if masked else {})
          for n in range(1, 257)]
    for x, kw in xs:  # warm-up: every bucket's first check
        agent(x, **kw), hand(x, **kw)
    us: dict = {"agent": [], "hand": []}
    for _ in range(30):  # interleaved: the machine's load falls on both alike
        for name, fn in (("agent", agent), ("hand", hand)):
            t0 = time.thread_time_ns()
            for x, kw in xs:
                fn(x, **kw)
            us[name].append((time.thread_time_ns() - t0) / len(xs) / 1e3)
    return round(statistics.median(us["agent"]), 2), round(statistics.median(us["hand"]), 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="the CUDA configuration (H200)")
    ap.add_argument("--hf", action="store_true",
                    help="transformers' GPT-2 (a ModelOutput) instead of the plain model")
    ap.add_argument("--seconds", type=float, help="per variant (default 35 CPU, 32 GPU)")
    ap.add_argument("--window", type=float, default=0.6,
                    help="measured share at the end of each run (default 0.6)")
    ap.add_argument("--variants", default=",".join(VARIANTS) + ",refusal,check_memory")
    ap.add_argument("--out", help="JSON results (default $WATCHDOG_GPU_RESULTS/padding.json "
                                  "with --gpu)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # a child process: one variant
    args = ap.parse_args()
    mode = ("hf-" if args.hf else "") + ("gpu" if args.gpu else "cpu")
    seconds = args.seconds or SIZES[mode]["seconds"]
    if args.variant:
        print(json.dumps(run_variant(args.variant, mode, seconds, args.window)))
        return 0
    results, started = [], time.time()
    for name in args.variants.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", name, "--seconds",
               str(seconds), "--window", str(args.window)] + (["--gpu"] if args.gpu else []) \
            + (["--hf"] if args.hf else [])
        t0 = time.time()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
            line = (done.stdout.strip().splitlines() or [""])[-1]
            result = json.loads(line) if done.returncode == 0 else {
                "name": name, "error": done.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            result = {"name": name, "error": f"timed out after {seconds + 120:.0f} s"}
        except ValueError:
            result = {"name": name, "error": done.stderr[-2000:]}
        result["wall_s"] = round(time.time() - t0, 1)
        results.append(result)
        print(row(result), flush=True)
    summary = summarise(results)
    summary["wrapper_us_per_call"] = wrapper_overhead()
    print(json.dumps(summary, indent=1))
    out = args.out or (os.path.join(os.environ["WATCHDOG_GPU_RESULTS"], "padding.json")
                       if args.gpu and os.environ.get("WATCHDOG_GPU_RESULTS") else None)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"mode": mode, "config": SIZES[mode], "seconds": seconds,
                       "window": args.window, "total_s": round(time.time() - started, 1),
                       "torch": _torch_version(), "results": results, "summary": summary},
                      f, indent=1)
        print(f"wrote {out}")
    return 0


def _torch_version() -> str:
    try:
        import torch
        return torch.__version__
    except Exception:
        return "?"


def row(r: dict) -> str:
    if "error" in r:
        return f"{r['name']:14s} FAILED: {r['error'][-400:]}"
    if r["name"] == "check_memory":
        return "\n".join(
            f"{'check_memory':14s} {mode:6s} pool={m.get('check_pool')}: reserved after warm-up "
            f"{_mb(m.get('reserved_after_warm_up_bytes'), sign=False)}, growth "
            f"{_mb(m.get('growth_after_warm_up_bytes'))} (largest "
            f"{_mb(m.get('largest_growth_after_warm_up_bytes'))}), {m.get('checks')} checks, "
            f"largest check {_mb(m.get('check_pool_bytes'), sign=False)}, {m.get('seconds')} s"
            for mode, m in ((k, r.get(k) or {}) for k in ("agent", "shared")))
    if r["name"] == "refusal":
        ev = (r.get("events") or [{}])[-1]
        return (f"{'refusal':14s} padding on={r['padding_on']}; event {ev.get('name')}/"
                f"{ev.get('action')} error={ev.get('error')}: {ev.get('detail')}")
    mem = r.get("memory_growth_bytes")
    text = (f"{r['name']:14s} {r['real_tokens_per_s'] or 0:>12,.0f} real tokens/s  p50 "
            f"{r['p50_ms']} ms  p99 {r['p99_ms']} ms  memory "
            f"{'?' if mem is None else f'{mem / 1e6:+.0f} MB'}  graphs "
            f"{r.get('graphs_recorded')} ({r.get('graphs_recorded_in_window')} in window)  "
            f"{r['window_calls']} calls in {r['window_s']} s")
    if "outputs_max_error" in r:
        text += f"  max error {r['outputs_max_error']}"
    if "agent" in r:
        a = r["agent"]
        text += (f"\n{'':14s} agent: on={a['on']} buckets={a['buckets']} padding "
                 f"{100 * a['padding_fraction']:.1f} %, {a['checks']} checks, "
                 f"{a['check_ms_each']} ms each ({100 * a['check_share_of_run']:.3f} % of the run)")
        w = r.get("check_memory_in_window") or {}
        text += (f"\n{'':14s} memory in the window: total {_mb(mem)}, torch reserved "
                 f"{_mb(r.get('reserved_growth_bytes'))}, checks' pool "
                 f"{_mb(w.get('check_pool_reserved_growth_bytes'))} ({a.get('check_pool')}; "
                 f"largest check {_mb(a.get('check_pool_bytes'), sign=False)}), "
                 f"{w.get('checks')} checks and {w.get('checks_skipped')} skipped in the window"
                 + (f"; STOPPED: {a['checks_stopped']}" if a.get("checks_stopped") else ""))
    return text


def _mb(n: Optional[int], sign: bool = True) -> str:
    return "?" if n is None else f"{n / 1e6:{'+' if sign else ''}.0f} MB"


def summarise(results: list) -> dict:
    by = {r["name"]: r for r in results if "error" not in r}
    out: dict = {}
    agent, hand = by.get("agent_padding"), by.get("hand_padding")
    if agent and hand and hand.get("real_tokens_per_s"):
        ratio = agent["real_tokens_per_s"] / hand["real_tokens_per_s"]
        out["agent_over_hand"] = round(ratio, 3)
        out["agent_reaches_90_percent_of_hand"] = ratio >= 0.9
    if agent:
        out["agent_memory_growth_in_window_bytes"] = agent.get("memory_growth_bytes")
        out["agent_reserved_growth_in_window_bytes"] = agent.get("reserved_growth_bytes")
        window = agent.get("check_memory_in_window") or {}
        out["agent_checks_in_window"] = window.get("checks")
        out["agent_check_pool"] = (agent.get("agent") or {}).get("check_pool")
        out["agent_check_pool_reserved_growth_in_window_bytes"] = window.get(
            "check_pool_reserved_growth_bytes")
        out["agent_outputs_max_error"] = agent.get("outputs_max_error")
    if "refusal" in by:
        out["refusal_turned_padding_off"] = by["refusal"]["padding_on"] is False and any(
            e.get("action") == "refused" for e in by["refusal"]["events"])
    if "check_memory" in by:
        for mode in ("agent", "shared"):
            m = by["check_memory"].get(mode) or {}
            out[f"check_memory_{mode}_growth_after_warm_up_bytes"] = m.get(
                "growth_after_warm_up_bytes")
        out["check_memory_agent_pool"] = (by["check_memory"].get("agent") or {}).get(
            "check_pool")
    out["failed"] = [r["name"] for r in results if "error" in r]
    return out


if __name__ == "__main__":
    sys.exit(main())
