"""Turn `benchmarks/record_corpus.py` output into the judgment corpus: each scenario's sample log
copied to tests/fixtures/corpus/<name>.jsonl.gz and its truth into labels.json.

    python benchmarks/corpus/label.py DIR [DIR ...] [--out tests/fixtures/corpus]

A label holds, per server process (its pid in the log): when the scenario's growth began, its
budget, when it ended (crashed or was stopped), and when it ran out of memory: its crash, or
the first sample at which the sidecar read its NVML memory at the budget (the emulated GPU
full: in the first round the server did not yet stop itself there), else null (a run that
must not be reloaded).
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# what each scenario shows, in the scoreboard's words
WHAT = {
    "gpt2-variable-seq": "HF GPT-2, variable seq_len: a CUDA graph per new size",
    "gpt2-variable-seq-2": "the same, an earlier recording",
    "resnet-images-oom": "timm ResNet-50, variable image sizes: a CUDA graph per size",
    "resnet-variable-images": "ResNet-50, 137 image sizes: the graphs plateau under the budget",
    "leak-small": "bucketed GPT-2 keeping 0.25 MiB tensors (2 MiB segments)",
    "leak-medium": "bucketed GPT-2 keeping 3 MiB every 0.5 s (20 MiB segments)",
    "leak-large": "bucketed GPT-2 keeping 48 MiB every 8 s",
    "kv-cache-growth": "a per-session KV cache kept for every session",
    "fragmentation": "1.5-2.5 MiB tensors, one in four kept: segments pinned",
    "warmup-growth": "variable seq_len, 600 MiB headroom from the first compile on",
    "plateau-99.5": "a 20 GiB KV pool, flat at 99.5 % of the budget",
    "sawtooth": "600 MiB taken in 30 MiB steps then freed, every 20 s",
    "bursty": "variable seq_len in 6 s bursts with 10 s idle gaps",
    "shared-grows": "two servers on one GPU: the one growing (variable seq_len)",
    "shared-flat": "two servers on one GPU: the bucketed one",
    "huge-request": "flat, then one request larger than the headroom",
    "bucketed-control": "bucketed GPT-2, flat",
    "batchseq-growth": "variable batch (1-4) x seq_len (32-512), 6 requests/s",
    "gpt2-saturating": "385 seq_lens (16-400): the graphs plateau under the device's memory",
    "llama-variable-seq": "a Llama-style decoder (8 layers), variable seq_len: a graph per size",
    "bert-variable-seq": "BERT-base, variable seq_len (8-512): a graph per size",
    "bert-variable-seq-paced": "the same at 4 requests/s",
    "vit-variable-res": "ViT-S/16, batch 4 at 97 resolutions (64-448): a graph per resolution",
    "static-kv-cache": "a Llama-style decoder, a static KV cache (1024 positions) per session",
    "tenant-llama": "two tenants on one GPU: the Llama-style one, variable seq_len",
    "tenant-bert": "two tenants on one GPU: the BERT one, keeping 4 MiB every second",
    "slow-leak": "bucketed GPT-2 keeping 1 MiB every 3 s: minutes to the OOM",
}
NO_TREND = {"huge-request"}   # runs out of memory with nothing growing before


def read_progress(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def first_full(samples: str, pid: int, budget: int) -> float | None:
    with gzip.open(samples, "rt") as fh:
        for line in fh:
            o = json.loads(line)
            if o.get("kind") != "sample":
                continue
            for p in o["processes"]:
                if p["pid"] == pid and p.get("gpu") and sum(p["gpu"].values()) >= budget:
                    return o["t"]
    return None


def label(run_dir: str, name: str) -> dict:
    samples = os.path.join(run_dir, "samples.jsonl.gz")
    servers = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "progress-*.jsonl"))):
        scenario = os.path.basename(path)[len("progress-"):-len(".jsonl")]
        prog = read_progress(path)
        pid = prog[0]["pid"]
        at = {p["kind"]: p["t"] for p in prog if p["kind"] != "served"}
        got = next(p for p in prog if p["kind"] == "budget")
        budget, real = got["bytes"], bool(got.get("real"))
        oom = at.get("crash")
        full = first_full(samples, pid, budget)
        if full is not None and (oom is None or full < oom):
            oom = full
        what = WHAT.get(scenario, scenario)
        servers[str(pid)] = {"scenario": scenario,
                             "what": f"real device OOM: {what}" if real else what,
                             # a ballast left the device short (record_corpus --real-oom): the
                             # OOM is the device's own, its error as the server saw it
                             "real_oom": real,
                             "error": next((p["error"] for p in prog if p["kind"] == "crash"),
                                           None),
                             "compiled_t": at["compiled"], "growth_t": at["growth"],
                             "budget_bytes": budget, "oom_t": oom,
                             "end_t": at.get("crash", at.get("stopped")),
                             "growth_visible_s": None if oom is None else
                             0.0 if scenario in NO_TREND else round(oom - at["growth"], 1)}
    return {"file": f"{name}.jsonl.gz", "servers": servers}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+")
    p.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "corpus"))
    p.add_argument("--rename", nargs="*", default=[], help="DIR/NAME=NEW: a second recording")
    a = p.parse_args()
    renames = dict(r.split("=", 1) for r in a.rename)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "labels.json")
    labels = json.load(open(path)) if os.path.exists(path) else {}
    for d in a.dirs:
        for run_dir in sorted(glob.glob(os.path.join(d, "*", "samples.jsonl.gz"))):
            run_dir = os.path.dirname(run_dir)
            name = os.path.basename(run_dir)
            name = renames.get(f"{os.path.basename(os.path.normpath(d))}/{name}", name)
            labels[name] = label(run_dir, name)
            shutil.copy(os.path.join(run_dir, "samples.jsonl.gz"),
                        os.path.join(a.out, f"{name}.jsonl.gz"))
    with open(path, "w") as fh:
        json.dump(dict(sorted(labels.items())), fh, indent=1)
        fh.write("\n")
    print(f"{len(labels)} scenarios in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
