"""What a frozen server costs (issue 52), on a GPU: the corpus's GPT-2 and ResNet-50 servers
growing toward their (emulated) OOM under variable traffic, each watched by a real sidecar with
`policy.remedy: freeze`, beside the same run with no remedy (the sidecar in dry run: it runs
into its OOM, the corpus's label). Per model, from the sidecar's sample log, the server's
event log and its per-request latency log:

- when the freeze was decided and when the agent said "engaged";
- the server's NVML memory growth from 1 s after the freeze to the end (within one allocator
  segment is the target), and in the same span before it;
- p50/p99 latency of sizes recorded before the freeze, before and after it; of new sizes after
  it (no graph) against recorded ones; requests failed (a crash);
- whether the frozen server served past the point where the unfrozen run crashed.

    python3 benchmarks/freeze.py --out DIR [--only gpt2-variable-seq resnet-variable-images]
                                 [--seconds 150]

Prints one JSON summary per model and writes DIR/freeze.json. The reload's own figures (time
to serving again, the same graphs recorded again) are benchmarks/results/reload_serving.md's.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "corpus"))

import record_corpus  # noqa: E402

MODELS = ("gpt2-variable-seq", "resnet-variable-images")


class Arm(record_corpus.Run):
    """One server and its sidecar: `remedy` freeze (acting), or none (dry run, to its OOM)."""

    def __init__(self, name: str, scenario: str, remedy: str, base: str, env: dict,
                 seconds: float):
        self.remedy = remedy
        self.latency = os.path.join(base, name, "latency.log")
        super().__init__(name, [scenario], base, env, seconds,
                         server_args=("--latency-log", self.latency))

    def write_config(self) -> None:
        super().write_config()
        if self.remedy == "none":
            return
        with open(self.cfg) as fh:
            text = fh.read().replace("policy: {dry_run: true}",
                                     f"policy: {{remedy: {self.remedy}}}")
        with open(self.cfg + ".tmp", "w") as fh:
            fh.write(text)
        os.replace(self.cfg + ".tmp", self.cfg)


def lines(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    out = []
    with opener(path, "rt") as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def summarise(run_dir: str, scenario: str, events_log: str, latency_log: str,
              crashed_t: float | None) -> dict:
    log = lines(os.path.join(run_dir, "sidecar.log.gz"))
    freeze_t = next((d.get("t") for d in log if d.get("event") == "action"
                     and d.get("action") == "freeze"), None)
    evs = lines(events_log) if os.path.exists(events_log) else []
    engaged = next((e for e in evs if e.get("kind") == "mitigation"
                    and e.get("name") == "freeze"), None)
    samples = [s for s in lines(os.path.join(run_dir, "samples.jsonl.gz"))
               if s.get("kind") == "sample"]
    pid = next((e["pid"] for e in evs if e.get("kind") == "hello"), None)

    def mem(s: dict) -> int | None:
        for p in s.get("processes") or []:
            if p.get("pid") == pid:
                return sum((p.get("gpu") or {}).values())
        return None

    series = [(s["t"], m) for s in samples if (m := mem(s)) is not None]
    reqs = []
    with open(latency_log) as fh:
        for line in fh:
            t, n, b, ms = line.split()
            reqs.append((float(t), int(n), int(b), float(ms)))
    progress = record_corpus.progress(os.path.join(run_dir, f"progress-{scenario}.jsonl"))
    out: dict = {"freeze_decided_t": freeze_t, "engaged": engaged and engaged["detail"],
                 "engaged_after_s": None if not (engaged and freeze_t) else
                 round(engaged["t"] - freeze_t, 3),
                 "crash": next((p["error"] for p in progress if p["kind"] == "crash"), None),
                 "requests": len(reqs)}
    if freeze_t is None:
        return out
    end = series[-1][0] if series else freeze_t

    def grown(t0: float, t1: float) -> float | None:
        v = [m for t, m in series if t0 <= t <= t1]
        return round((v[-1] - v[0]) / 2**20, 1) if len(v) > 1 else None

    span = end - (freeze_t + 1)
    out["mib_grown_after_freeze"] = grown(freeze_t + 1, end)
    out["mib_grown_same_span_before"] = grown(freeze_t - span, freeze_t)
    out.update(latencies(reqs, freeze_t))
    out["served_past_unfrozen_crash_s"] = None if crashed_t is None or not reqs else \
        round(reqs[-1][0] - crashed_t, 1)
    return out


def latencies(reqs: list[tuple[float, int, int, float]], freeze_t: float) -> dict:
    """Sizes recorded before the freeze (called twice: warm-up, then recording), before and
    after it; sizes first seen after it (no graph)."""
    calls_before: dict[tuple, int] = {}
    for t, n, b, _ in reqs:
        if t < freeze_t:
            calls_before[(n, b)] = calls_before.get((n, b), 0) + 1
    seen: dict[tuple, int] = {}
    before_rec, after_rec, after_new = [], [], []
    for t, n, b, ms in reqs:
        key = (n, b)
        calls = seen.get(key, 0)
        seen[key] = calls + 1
        if t < freeze_t:
            if calls >= 2:          # its graph recorded at its 2nd call: replays from the 3rd
                before_rec.append((key, ms))
        elif calls_before.get(key, 0) >= 2:   # recorded before the freeze
            after_rec.append((key, ms))
        elif calls == 0:
            after_new.append(ms)
    keys = {k for k, _ in before_rec} & {k for k, _ in after_rec}
    b_ms = [ms for k, ms in before_rec if k in keys]
    a_ms = [ms for k, ms in after_rec if k in keys]
    return {
        "recorded_sizes_compared": len(keys),
        "recorded_p50_ms_before": pct(b_ms, 0.5), "recorded_p50_ms_after": pct(a_ms, 0.5),
        "recorded_p99_ms_before": pct(b_ms, 0.99), "recorded_p99_ms_after": pct(a_ms, 0.99),
        "recorded_p50_change": None if not (b_ms and a_ms) else
        round(statistics.median(a_ms) / statistics.median(b_ms) - 1, 4),
        "new_sizes_after": len(after_new), "new_p50_ms_after": pct(after_new, 0.5)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--only", nargs="*", default=list(MODELS))
    p.add_argument("--seconds", type=float, default=150.0, help="each server, once warm")
    a = p.parse_args()
    base = tempfile.mkdtemp(prefix="tw-freeze-")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(base, "inductor"),
               TORCHINDUCTOR_COMPILE_THREADS="1", TOKENIZERS_PARALLELISM="false")
    os.makedirs(a.out, exist_ok=True)
    record_corpus.prewarm(a.only, base, env)
    results = {}
    for scenario in a.only:
        # both arms of a model side by side (each its own emulated GPU): the same GPU load
        arms = {remedy: Arm(f"{scenario}-{remedy}", scenario, remedy, base, env, a.seconds)
                for remedy in ("none", "freeze")}
        for arm in arms.values():
            arm.start_servers()
        deadline = time.monotonic() + a.seconds + 240
        while not all([arm.check() for arm in arms.values()]) and time.monotonic() < deadline:
            time.sleep(0.5)
        crashed_t = None
        for remedy, arm in arms.items():   # the unfrozen run first: where it crashed
            arm.finish(a.out)
            run_dir = os.path.join(a.out, arm.name)
            events_log = os.path.join(arm.dir, f"events-{scenario}.jsonl")
            got = summarise(run_dir, scenario, events_log, arm.latency, crashed_t)
            if remedy == "none":
                crashed_t = next((p["t"] for p in record_corpus.progress(
                    arm.progress_path(scenario)) if p["kind"] == "crash"), None)
                got["crash_t"] = crashed_t
            results[arm.name] = got
            print(json.dumps({arm.name: got}), flush=True)
            subprocess.run(["cp", arm.latency, events_log, run_dir], check=False)
    with open(os.path.join(a.out, "freeze.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
