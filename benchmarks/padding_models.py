"""Padding by the agent on real Hugging Face `transformers` models (issue 29's table): tiny
configs, random weights, fp32 on CPU, each compiled with `torch.compile(backend="eager",
dynamic=False)` (Dynamo's graphs, no Inductor: a graph per input shape) and served through
`watch(..., pad=pad.Tokens(buckets=(16, 32, 64)))`, lengths uniform in 3-60.

Per case: exact (padding stayed on) or refused (with the reason), the largest relative error of
any answer the caller got against the same model unpadded (every tensor of the output, the KV
cache included; and one decoding step from the returned cache, where there is one), the checks
run, and the graphs Dynamo compiled padded against the same calls unpadded.

    python benchmarks/padding_models.py [--calls 12] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

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

import torch  # noqa: E402
import transformers as T  # noqa: E402

from torch_watchdog.agent import pad, watch  # noqa: E402

VOCAB, BUCKETS = 100, (16, 32, 64)
MODELS = {
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=128, bos_token_id=0,
        eos_token_id=0)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=0,
        eos_token_id=0, pad_token_id=0)),
    "bert": lambda: T.BertModel(T.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=128)),
    "distilbert": lambda: T.DistilBertModel(T.DistilBertConfig(
        n_layers=2, dim=32, hidden_dim=64, n_heads=2, vocab_size=VOCAB,
        max_position_embeddings=128)),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0)),
}


def ones(n: int, batch: int = 1) -> torch.Tensor:
    return torch.ones(batch, n, dtype=torch.long)


def ids(rng: random.Random, n: int, batch: int = 1) -> torch.Tensor:
    return torch.tensor([[rng.randint(1, VOCAB - 1) for _ in range(n)] for _ in range(batch)])


# case -> (model, keywords of call i at length n); decoding: one step from the cache
CASES = {
    "use_cache=True, a decoding step": ("gpt2", lambda r, i, n: {
        "input_ids": ids(r, n), "use_cache": True}),
    "use_cache=True, position_ids, a step": ("llama", lambda r, i, n: {
        "input_ids": ids(r, n), "position_ids": torch.arange(n)[None], "use_cache": True}),
    "batch 4, uneven lengths, mask": ("llama", lambda r, i, n: {
        "input_ids": ids(r, n, 4), "attention_mask": uneven(r, n)}),
    "output_hidden_states after calls without": ("gpt2", lambda r, i, n: {
        "input_ids": ids(r, n), "output_hidden_states": i >= 4}),
    "mask, token_type_ids": ("bert", lambda r, i, n: {
        "input_ids": ids(r, n), "attention_mask": ones(n),
        "token_type_ids": torch.zeros(1, n, dtype=torch.long)}),
    "no mask": ("bert", lambda r, i, n: {"input_ids": ids(r, n)}),
    "mask, then none": ("bert", lambda r, i, n: dict(
        {"input_ids": ids(r, n)}, **({"attention_mask": ones(n)} if i < 6 else {}))),
    "mask": ("distilbert", lambda r, i, n: {"input_ids": ids(r, n), "attention_mask": ones(n)}),
    "masks, decoder ids, use_cache=True, a step": ("t5", lambda r, i, n: {
        "input_ids": ids(r, n), "attention_mask": ones(n),
        "decoder_input_ids": ids(r, max(1, n // 3)), "use_cache": True}),
}


def uneven(rng: random.Random, n: int) -> torch.Tensor:
    mask = ones(n, 4)
    for row in range(1, 4):
        mask[row, rng.randint(1, n):] = 0
    return mask


def graphs() -> int:
    import torch._dynamo.utils as du

    return int(du.counters["stats"]["unique_graphs"])


def step_error(eager, out, want, kw: dict) -> float:
    """One decoding step from the served cache against one from the unpadded run's."""
    nxt = torch.ones(kw["input_ids"].shape[0], 1, dtype=torch.long)
    if "decoder_input_ids" in kw:
        def step(o):
            return eager(encoder_outputs=(o.encoder_last_hidden_state,),
                         past_key_values=o.past_key_values, attention_mask=kw["attention_mask"],
                         decoder_input_ids=nxt).logits
    else:
        def step(o):
            return eager(nxt, past_key_values=o.past_key_values, use_cache=True).logits
    a, b = step(out), step(want)
    return float((a - b).abs().max() / b.abs().max())


def run_case(case: str, calls: int) -> dict:
    name, make = CASES[case]
    torch.manual_seed(0)
    eager = MODELS[name]().eval()
    pick = random.Random(case)
    lengths = [pick.randint(3, 60) for _ in range(calls)]
    row = {"model": name, "case": case, "calls": calls}
    for variant in ("unpadded", "padded"):
        torch._dynamo.reset()
        compiled = torch.compile(eager, backend="eager", dynamic=False)
        model = compiled if variant == "unpadded" else watch(
            compiled, f"{name}:{case}", pad=pad.Tokens(buckets=BUCKETS))
        rng, worst, before, t0 = random.Random(1), 0.0, graphs(), time.perf_counter()
        with torch.no_grad():
            for i, n in enumerate(lengths):
                kw = make(rng, i, n)
                out = model(**kw)
                if variant == "unpadded":
                    continue
                want = eager(**kw)
                if "attention_mask" in kw and kw["input_ids"].shape[0] > 1:  # real rows only
                    real = kw["attention_mask"].bool()
                    out, want = out.logits[real], want.logits[real]
                ok, errors, problem = pad.compare(out, want, tolerance=float("inf"))
                if problem is not None and not errors:  # a structure or shape mismatch
                    worst = float("inf")
                worst = max([worst, *errors.values()])
                if kw.get("use_cache"):
                    worst = max(worst, step_error(eager, out, want, kw))
        row[f"graphs_{variant}"] = graphs() - before
        row[f"seconds_{variant}"] = round(time.perf_counter() - t0, 1)
        if variant == "padded":
            row.update(exact=model.on, refused=model.refused, checks=model.checks,
                       max_error=worst)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    T.logging.set_verbosity_error()
    torch.set_num_threads(1)
    rows = []
    print("| model | case | exact / refused | max rel. error | checks | graphs padded "
          "(unpadded) |\n| --- | --- | --- | --- | --- | --- |")
    for case in CASES:
        r = run_case(case, args.calls)
        rows.append(r)
        verdict = "exact" if r["exact"] else f"refused: {r['refused']}"
        print(f"| {r['model']} | {r['case']} | {verdict} | {r['max_error']:.2g} | "
              f"{r['checks']} | {r['graphs_padded']} ({r['graphs_unpadded']}) |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "transformers": T.__version__,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
