"""One GPU scenario in a fresh process: a reduce-overhead model fed sizes, the agent watching.

Prints one JSON object: what the agent reported (from its event log) and the truth, read from
the cudagraph tree manager on the serving thread (reference torch-hooks §3.3).

    python tests/gpu/scenario.py --dynamic none|true --traffic variable|bucketed [--budget N]
                                 [--freeze-after CALLS]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_watchdog.agent as agent  # noqa: E402
from torch_watchdog import events  # noqa: E402


class Block(torch.nn.Module):
    """Embedding, one attention layer and an MLP over (1, seq_len) token ids, fp16."""

    def __init__(self, vocab: int = 1000, dim: int = 256, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(x)


def truth() -> dict:
    from torch._inductor import cudagraph_trees

    m = cudagraph_trees.get_manager(torch.cuda.current_device(), False)
    if m is None:
        return {"nodes": 0, "functions": 0}
    nodes = sum(1 + n.num_descendants() for n in m.get_roots())
    return {"nodes": nodes, "functions": len(m.ids_to_funcs)}


def sizes_for(traffic: str, rng: random.Random) -> list[int]:
    if traffic == "bucketed":
        buckets = [64, 128, 256, 512]
        raw = [rng.randint(32, 512) for _ in range(120)]
        return [next(b for b in buckets if b >= s) for s in raw]
    twice = rng.sample(range(32, 1024), 24)        # each called 3x: warm-up, record, replay
    once = rng.sample(sorted(set(range(32, 1024)) - set(twice)), 6)  # warm-up only
    seq = [s for s in twice for _ in range(3)] + once
    rng.shuffle(seq)
    return seq


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dynamic", choices=["none", "true"], default="none")
    p.add_argument("--traffic", choices=["variable", "bucketed"], default="variable")
    p.add_argument("--budget", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--freeze-after", type=int, default=0,
                   help="after this many calls, freeze recording from another thread, as the "
                        "control channel does")
    p.add_argument("--socket", default="", help="also send events to a sidecar here")
    p.add_argument("--linger", type=float, default=0.0,
                   help="seconds to stay alive after serving, agent on (for a sidecar scrape)")
    a = p.parse_args()
    log = os.path.join(tempfile.mkdtemp(), "events.jsonl")
    torch.cuda.init()
    installed = agent.install(socket_path=a.socket, event_log=log, graph_budget=a.budget,
                              stall_threshold_s=0.02)
    model = Block().cuda().half().eval()
    compiled = torch.compile(model, mode="reduce-overhead",
                             dynamic=None if a.dynamic == "none" else True)
    served = agent.watch(compiled, name="block")
    rng = random.Random(a.seed)
    seq = sizes_for(a.traffic, rng)
    free0 = torch.cuda.mem_get_info()[0]
    worst_err = 0.0
    t0 = time.perf_counter()
    at_freeze: dict | None = None
    with torch.no_grad():
        for i, s in enumerate(seq):
            if a.freeze_after and i == a.freeze_after and installed:
                asker = threading.Thread(target=installed.freeze, args=(True,))
                asker.start()
                asker.join()
                torch.cuda.synchronize()
                at_freeze = truth()
            ids = torch.randint(0, 1000, (1, s), device="cuda")
            out = served(ids)
            worst_err = max(worst_err, (out.float() - model(ids).float()).abs().max().item())
        # bucketed control: after warm-up, many more calls must record nothing new
        mid = truth()
        extra = [rng.choice(seq) for _ in range(200)] if a.traffic == "bucketed" else []
        for s in extra:
            served(torch.randint(0, 1000, (1, s), device="cuda"))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    real = truth()
    free1 = torch.cuda.mem_get_info()[0]
    if a.linger:
        print(json.dumps({"lingering": True, "agent_truth_nodes": real["nodes"]}), flush=True)
        time.sleep(a.linger)
    agent.uninstall()
    with open(log) as fh:
        evs = [events.decode(line) for line in fh]
    rec = [e for e in evs if e.kind == "cudagraph_record"]
    freeze_t = next((e.t for e in evs if e.kind == "mitigation" and e.name == "freeze"), 0.0)
    records = [e for e in rec if e.phase == "record"]
    result = {
        "torch": torch.__version__, "dynamic": a.dynamic, "traffic": a.traffic,
        "budget": a.budget, "calls": len(seq) + len(extra), "distinct_sizes": len(set(seq)),
        "sizes_called_twice_or_more": sum(1 for s in set(seq) if seq.count(s) >= 2),
        "agent_records": len(records),
        "agent_warmups": sum(1 for e in rec if e.phase == "warmup"),
        "agent_record_keys": len({tuple(e.key) for e in records if e.key}),
        "agent_records_static": sum(1 for e in records if e.key is None),  # graph w/o symints
        "truth": real, "truth_after_first_pass": mid, "truth_at_freeze": at_freeze,
        "records_after_freeze": sum(1 for e in records if at_freeze and e.t >= freeze_t),
        # the freeze keeps the keys seen at their warm-up: a size warmed before it is still
        # recorded at its next call; one first seen after it never is
        "records_after_freeze_unwarmed": sum(
            1 for e in records if at_freeze and e.t >= freeze_t and tuple(e.key or ()) not in
            {tuple(w.key or ()) for w in rec if w.phase == "warmup" and w.t < freeze_t}),
        "compiles": sum(1 for e in evs if e.kind == "compile"),
        "recompiles": sum(1 for e in evs if e.kind == "recompile"),
        "mitigations": [(e.name, e.action) for e in evs if e.kind == "mitigation"],
        "cudagraph_warnings": sum(1 for e in evs if e.kind == "cudagraph_warning"),
        "new_shapes": sum(1 for e in evs if e.kind == "new_shape"),
        "stalls": sum(1 for e in evs if e.kind == "stall"),
        "stall_causes": sorted({str(e.cause) for e in evs if e.kind == "stall"}),
        "record_seconds_median": sorted(e.seconds for e in records)[len(records) // 2]
        if records else None,
        "device_bytes_used_growth": free0 - free1,
        "max_abs_err_vs_eager": worst_err, "wall_s": round(wall, 2),
        "agent_errors": installed.errors if installed else None,
        "devices": next((e.devices for e in reversed(evs) if e.kind == "hello"), []),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
