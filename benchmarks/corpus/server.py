"""One scenario of the judgment corpus: a real model (HF GPT-2, a Llama-style decoder, BERT-base;
timm ResNet-50, ViT-S) under `reduce-overhead` with the agent, served until it runs out of
memory or is stopped.

The GPU it runs out of is emulated, so that many scenarios can be recorded side by side on one
large GPU: once warm, the server takes a budget of `--headroom-mib` above its NVML memory (the
number the sidecar reads) and a thread keeps the caching allocator's cap at that budget less
what NVML counts outside the allocator (the CUDA context, graph instantiations). So the
allocator runs out, frees its cache and retries, and raises `torch.OutOfMemoryError` where a
GPU of that size would; and once NVML counts the whole budget (graphs grow outside the
allocator) the server raises it itself, as a real GPU's cudaGraphInstantiate would fail.
The budget goes to `--progress` ({"kind": "budget"}), which `benchmarks/record_corpus.py`
hands to the sidecar (`forecast.process_budget_bytes`, SIGHUP).

`--ballast-free-mib N` (record_corpus.py --real-oom): no emulated GPU. Where the budget would be
taken, a ballast tensor leaves N MiB of the real device free, and the scenario runs into the
device's own out-of-memory error; the "budget" line then says what this process could reach
(its NVML memory plus what the device had free), with `real: true`. One server per GPU.

Progress lines (`t` = wall clock): start, compiled, budget {bytes}, growth (the scenario's own
growth starts), served {requests} every 50th, crash {error} or stopped.

    python benchmarks/corpus/server.py --scenario NAME --socket S --progress P --event-log E
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import torch_watchdog.agent as agent  # noqa: E402

MiB = 1 << 20
SEQ_BUCKETS = [64, 128, 256, 512, 1024]
WARM_S = 40.0   # bucketed traffic before the budget and the scenario's growth: past warm-up

# name -> (model, headroom MiB, what the scenario does once warm); "budget_at": "compile"
# takes the budget right after the first compile (growth inside the sidecar's warm-up)
SCENARIOS: dict[str, dict] = {
    "gpt2-variable-seq": {"model": "gpt2", "headroom": 400, "traffic": "variable"},
    "resnet-variable-images": {"model": "resnet", "headroom": 500, "traffic": "variable"},
    "resnet-images-oom": {"model": "resnet", "headroom": 120, "traffic": "variable",
                          "sizes": (96, 641, 1), "rate": 10.0},
    "leak-small": {"model": "gpt2", "headroom": 600, "leak": (0.25, 0.0625)},   # MiB, every s
    "leak-medium": {"model": "gpt2", "headroom": 800, "leak": (3.0, 0.5)},
    "leak-large": {"model": "gpt2", "headroom": 800, "leak": (48.0, 8.0)},
    "kv-cache-growth": {"model": "gpt2", "headroom": 800, "sessions": True},
    "fragmentation": {"model": "gpt2", "headroom": 700, "fragment": True},
    "warmup-growth": {"model": "gpt2", "headroom": 600, "traffic": "variable",
                      "budget_at": "compile"},
    "plateau-99.5": {"model": "gpt2", "headroom": 0, "plateau": 0.995},
    "sawtooth": {"model": "gpt2", "headroom": 900, "sawtooth": (600, 20.0)},
    "bursty": {"model": "gpt2", "headroom": 350, "traffic": "variable", "bursts": (6.0, 10.0)},
    "shared-grows": {"model": "gpt2", "headroom": 400, "traffic": "variable"},
    "shared-flat": {"model": "gpt2", "headroom": 400},
    "huge-request": {"model": "gpt2", "headroom": 500, "huge_after": 60.0},
    "bucketed-control": {"model": "gpt2", "headroom": 400},
    # batch x seq: every pair its own graph; seq to 512, batch to 4 and 6 requests/s keep the
    # growth slow (at full speed a new pair's warm-up, its logits above all, ran out of the
    # 700 MiB within 26 s)
    "batchseq-growth": {"model": "gpt2", "headroom": 700, "traffic": "variable",
                        "batch": (1, 2, 4), "sizes": (32, 513, 1), "rate": 6.0},
    # 385 sizes whose graphs fit under the budget: the shape space saturates, no OOM
    "gpt2-saturating": {"model": "gpt2", "headroom": 450, "traffic": "variable",
                        "sizes": (16, 401, 1)},
    # held out (issue 51): architectures and growth the runs above lack, recorded and scored
    # before any forecast change they prompt (tests/fixtures/heldout)
    "llama-variable-seq": {"model": "llama", "headroom": 500, "traffic": "variable"},
    "bert-variable-seq": {"model": "bert", "headroom": 300, "traffic": "variable",
                          "sizes": (8, 513, 1)},
    "bert-variable-seq-paced": {"model": "bert", "headroom": 300, "traffic": "variable",
                                "sizes": (8, 513, 1), "rate": 4.0},
    "vit-variable-res": {"model": "vit", "headroom": 300, "traffic": "variable",
                         "sizes": (64, 449, 4), "batch": (4,)},
    # a static KV cache per session (max_cache_len 1024, preallocated): a fixed step per session
    "static-kv-cache": {"model": "llama", "headroom": 900, "static_sessions": (1024, 5.0)},
    "tenant-llama": {"model": "llama", "headroom": 400, "traffic": "variable"},
    "tenant-bert": {"model": "bert", "headroom": 500, "leak": (4.0, 1.0), "sizes": (8, 513, 1)},
    "slow-leak": {"model": "gpt2", "headroom": 40, "leak": (1.0, 3.0)},   # minutes to the OOM
}

stopping = False


def put(fh, kind: str, **fields) -> None:
    fh.write(json.dumps({"kind": kind, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")
    fh.flush()


class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).logits


class Hidden(Logits):
    def forward(self, ids):
        return self.m(input_ids=ids).last_hidden_state


def static_cache(model, ids, max_len: int) -> list:
    """One session's static KV cache: per layer a key and a value buffer of `max_len`
    positions, allocated whole at the session's start (as transformers' StaticCache does),
    the prompt's keys and values copied in."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    dim = cfg.hidden_size // cfg.num_attention_heads
    bufs = [torch.zeros(2, ids.shape[0], heads, max_len, dim, dtype=torch.half, device="cuda")
            for _ in range(cfg.num_hidden_layers)]
    try:
        past = model(input_ids=ids, use_cache=True).past_key_values
        for buf, layer in zip(bufs, past.layers):
            buf[0, :, :, :ids.shape[1]].copy_(layer.keys)
            buf[1, :, :, :ids.shape[1]].copy_(layer.values)
    except Exception:   # the memory is the buffers'; a cache API of another version
        pass
    return bufs


def build(kind: str):
    """The model, fp16 on the GPU, and a call that runs it on a size."""
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12,
                                           n_positions=1024)).cuda().half().eval()

        wrapped = Logits(model)
        return model, wrapped, lambda n, b=1: torch.randint(0, 50000, (b, n), device="cuda")
    if kind == "llama":   # a Llama-style decoder (RMSNorm, rotary, SwiGLU), 8 layers
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
            num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
            max_position_embeddings=2048)).cuda().half().eval()
        return model, Logits(model), lambda n, b=1: torch.randint(0, 32000, (b, n),
                                                                   device="cuda")
    if kind == "bert":   # a BERT-base encoder: the last hidden states
        from transformers import BertConfig, BertModel

        model = BertModel(BertConfig()).cuda().half().eval()
        return model, Hidden(model), lambda n, b=1: torch.randint(0, 30000, (b, n),
                                                                   device="cuda")
    import timm

    if kind == "vit":   # ViT-S/16 at any resolution (position embeddings resampled, padded)
        model = timm.create_model("vit_small_patch16_224", pretrained=False,
                                  dynamic_img_size=True, dynamic_img_pad=True)
        model = model.cuda().half().eval()
        return model, model, lambda n, b=1: torch.randn(b, 3, n, n, device="cuda",
                                                        dtype=torch.half)

    model = timm.create_model("resnet50", pretrained=False).cuda().half().eval()
    model = model.to(memory_format=torch.channels_last)
    return model, model, lambda n, b=1: torch.randn(b, 3, n, n, device="cuda", dtype=torch.half
                                                    ).to(memory_format=torch.channels_last)


class Budget:
    """Keeps the allocator's cap at `budget` less what NVML counts outside the allocator, and
    says when NVML reaches the budget (`full`): the graphs' own memory is outside the allocator,
    where a real GPU's cudaGraphInstantiate or cudaMalloc would then fail."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.total = torch.cuda.get_device_properties(0).total_memory
        self.budget = None
        self.full = False

    def used(self) -> int:
        for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if p.pid == os.getpid():
                return int(p.usedGpuMemory or 0)
        return 0

    def set(self, budget: int) -> None:
        self.budget = budget
        self.cap()
        threading.Thread(target=self._run, daemon=True).start()

    def ballast(self, free_mib: int) -> tuple[torch.Tensor, int]:
        """A tensor leaving `free_mib` of the real device free; and the NVML memory this
        process can then reach (its own now plus what the device has free)."""
        free = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).free
        kept = torch.empty(max(0, free - free_mib * MiB), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        return kept, self.used() + self.nvml.nvmlDeviceGetMemoryInfo(self.handle).free

    def cap(self) -> None:
        used = self.used()
        self.full = self.full or used >= self.budget
        outside = max(0, used - torch.cuda.memory_reserved())
        torch.cuda.set_per_process_memory_fraction(
            max(0.0, min(1.0, (self.budget - outside) / self.total)))

    def _run(self) -> None:
        while True:
            try:
                self.cap()
            except Exception:
                pass
            time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--socket", required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--event-log", required=True)
    p.add_argument("--seconds", type=float, default=330.0, help="stop after this long warm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prewarm", action="store_true",
                   help="compile for a bucket and a variable size (the shared cache), then exit")
    p.add_argument("--ballast-free-mib", type=int, default=None,
                   help="a real device OOM: a ballast leaves this much free, no emulated GPU")
    p.add_argument("--latency-log", help="one line per request once warm: wall time, size, "
                   "batch, milliseconds to the synchronised answer (benchmarks/freeze.py)")
    a = p.parse_args()
    lat = open(a.latency_log, "a", buffering=1 << 16) if a.latency_log else None
    sc = SCENARIOS[a.scenario]
    fh = open(a.progress, "a")
    put(fh, "start", scenario=a.scenario)

    def stop(*_):
        global stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    torch.cuda.init()
    agent.install(socket_path=a.socket, event_log=a.event_log)
    model, module, make = build(sc["model"])
    served = agent.watch(torch.compile(module, mode="reduce-overhead"), name=sc["model"])
    budget = Budget()
    rng = random.Random(a.seed)
    tokens = sc["model"] in ("gpt2", "llama", "bert")
    sizes = list(range(*sc.get("sizes", (32, 1025, 1) if tokens else (96, 641, 4))))
    batches = sc.get("batch", (1,))

    taken: list[int] = []  # the budget's bytes, once taken

    def take_budget(headroom: int) -> None:
        """The emulated GPU's budget, or (--ballast-free-mib) the real device's ballast."""
        taken.append(headroom)
        if a.ballast_free_mib is None:
            budget.set(budget.used() + headroom)
            put(fh, "budget", bytes=budget.budget, headroom=headroom)
            return
        ballast, reach = budget.ballast(a.ballast_free_mib)
        kept.append(ballast)
        put(fh, "budget", bytes=reach, headroom=reach - budget.used(), real=True,
            ballast=ballast.numel())
    buckets = [b for b in SEQ_BUCKETS if b <= max(sizes)] if tokens else [224]
    i, kept, sessions = 0, [], {}
    try:
        with torch.no_grad():
            served(make(buckets[0]))
            torch.cuda.synchronize()
            put(fh, "compiled")
            if a.prewarm:
                for n in (buckets[-1], sizes[7], sizes[9], sizes[11]):
                    served(make(n))
                torch.cuda.synchronize()
                put(fh, "stopped", requests=5)
                return 0
            if sc.get("budget_at") == "compile":
                take_budget(sc["headroom"] * MiB)
            if sc.get("plateau"):  # a KV pool sized to the GPU, as LLM servers allocate
                kept.append(torch.empty(20 << 30, dtype=torch.uint8, device="cuda"))
            started, warm_until = time.monotonic(), time.monotonic() + WARM_S
            if sc.get("budget_at") == "compile":
                warm_until = started
            grown = False
            owed, last, saw = 0.0, time.monotonic(), []
            while not stopping:
                now = time.monotonic()
                if now - warm_until > a.seconds:
                    break
                warm = now >= warm_until
                if warm and not grown:
                    grown = True
                    if not taken:
                        used = budget.used()
                        total = (int(used / sc["plateau"]) if sc.get("plateau")
                                 else used + sc["headroom"] * MiB)
                        take_budget(total - used)
                    put(fh, "growth")
                    last = now
                variable = warm and sc.get("traffic") == "variable" or \
                    sc.get("budget_at") == "compile"
                if warm and sc.get("bursts"):
                    on, off = sc["bursts"]
                    if (now - warm_until) % (on + off) >= on:
                        time.sleep(0.05)
                        continue
                if warm and sc.get("leak"):
                    size, every = sc["leak"]
                    owed += (now - last) / every
                    last = now
                    while owed >= 1.0:
                        kept.append(torch.empty(int(size * MiB), dtype=torch.uint8,
                                                device="cuda"))
                        owed -= 1.0
                if warm and sc.get("fragment"):  # every 4th kept: segments pinned, 4x reserved
                    owed += (now - last) / 0.1
                    last = now
                    while owed >= 1.0:
                        t = torch.empty(int((1.5 + rng.random()) * MiB), dtype=torch.uint8,
                                        device="cuda")
                        if rng.random() < 0.25:
                            kept.append(t)
                        owed -= 1.0
                if warm and sc.get("sawtooth"):  # a staircase up, then all freed
                    peak, period = sc["sawtooth"]
                    phase = (now - warm_until) % period
                    if phase < period / 2:
                        while len(saw) * 30 < peak * phase / (period / 2):
                            saw.append(torch.empty(30 * MiB, dtype=torch.uint8, device="cuda"))
                    elif saw:
                        saw.clear()
                        torch.cuda.empty_cache()
                if warm and sc.get("huge_after") and now - warm_until > sc["huge_after"]:
                    put(fh, "huge")
                    kept.append(torch.empty(budget.budget, dtype=torch.uint8, device="cuda"))
                if budget.full:
                    raise torch.OutOfMemoryError(f"the emulated GPU is full: NVML counts "
                                                 f"{budget.used()} of {budget.budget} bytes")
                if warm and sc.get("rate"):
                    time.sleep(1.0 / sc["rate"])
                n = rng.choice(sizes)
                if not variable:
                    n = next((b for b in buckets if b >= n), buckets[-1])
                ids = make(n, rng.choice(batches) if warm else 1)
                t0 = time.perf_counter()
                served(ids)
                if warm and sc.get("static_sessions") and now - last >= sc["static_sessions"][1]:
                    last = now
                    sessions[i] = static_cache(model, ids[:, :256], sc["static_sessions"][0])
                if warm and sc.get("sessions") and now - last >= 1.5:  # a session's cache, kept
                    last = now
                    sessions[i] = model(input_ids=ids[:, :256], use_cache=True).past_key_values
                torch.cuda.synchronize()
                if lat is not None and warm:
                    lat.write(f"{time.time():.4f} {n} {ids.shape[0]} "
                              f"{(time.perf_counter() - t0) * 1e3:.3f}\n")
                i += 1
                if i % 50 == 0:
                    put(fh, "served", requests=i)
    except Exception as e:  # the OOM the watchdog must pre-empt
        put(fh, "crash", error=f"{type(e).__name__}: {str(e)[:300]}", requests=i)
        return 3
    finally:
        if lat is not None:
            lat.close()
    put(fh, "stopped", requests=i)
    agent.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
