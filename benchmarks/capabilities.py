"""What the agent sees on this torch, against torch's own logs; the README's per-version table.

Probe (in a virtualenv holding the torch to measure and this project):
    python benchmarks/capabilities.py --json /tmp/caps-2.4.1.json
runs one small workload twice in child processes of this interpreter: once under
`TORCH_LOGS=recompiles,graph_breaks` without the agent (the truth: torch's own recompile,
recompile-limit and graph-break log lines, and its FX-graph cache counters), once with the agent
writing an event log. It records the agent's `hello` capabilities, the events it saw and the
truth. The workload: a graph break on a builtin `print`; a function compiled with
dynamic=False called at 8 sizes under a recompile limit of 4 (1 compile, 3 recompiles, 1 limit
hit, then eager); a Linear under Inductor compiled twice with the FX-graph cache on (a miss,
then a hit). About 20 s on CPU.

Table (from probes of several versions):
    python benchmarks/capabilities.py --readme README.md /tmp/caps-*.json
rewrites the README between its `torch-versions` markers; without --readme it prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- torch-versions:begin -->", "<!-- torch-versions:end -->"

WORKLOAD = r"""
import json, sys, torch, torch._dynamo, torch._inductor.config
if sys.argv[1]:
    import torch_watchdog.agent
    torch_watchdog.agent.install(socket_path="", event_log=sys.argv[1])
limit = ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
         else "cache_size_limit")
setattr(torch._dynamo.config, limit, 4)
torch._inductor.config.fx_graph_cache = True  # off by default before 2.5

def breaks(x):
    x = x + 1
    print("", end="")  # a graph break: builtin print
    return x * 2

torch.compile(breaks, backend="eager")(torch.ones(3))
f = torch.compile(lambda x: x.sin(), dynamic=False, backend="eager")
for n in range(1, 9):
    f(torch.ones(n))
lin = torch.nn.Linear(8, 8)
for _ in range(2):
    torch._dynamo.reset()
    torch.compile(lin, dynamic=False)(torch.randn(2, 8))
inductor = torch._dynamo.utils.counters["inductor"]
print("FX", json.dumps([inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]]))
if sys.argv[1]:
    torch_watchdog.agent.uninstall()
"""


def _run(event_log: str, extra_env: dict[str, str], tmp: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCH_WATCHDOG_", "TORCH_LOGS", "TORCHINDUCTOR_"))}
    env.update(extra_env, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    script = os.path.join(tmp, "server.py")  # graph breaks name the user's file:line
    os.makedirs(tmp, exist_ok=True)
    with open(script, "w") as fh:
        fh.write(WORKLOAD)
    done = subprocess.run([sys.executable, script, event_log], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"workload failed:\n{done.stderr[-3000:]}")
    return done


def truth_from_logs(stderr: str) -> dict[str, int]:
    """torch's own counts. A limit hit is logged as "Recompiling function" first, then "hit
    config.…" (it compiles nothing): such an attempt is not a recompile."""
    limit_hits = len(re.findall(r"torch\._dynamo hit config\.", stderr))
    return {
        "recompile": len(re.findall(r"Recompiling function", stderr)) - limit_hits,
        "recompile_limit": limit_hits,
        "graph_break": len(re.findall(r"Graph break(?: in user code at|: from user code at"
                                      r"|: skip: from user code at)", stderr)),
    }


def probe() -> dict:
    from torch_watchdog import events

    with tempfile.TemporaryDirectory() as tmp:
        bare = _run("", {"TORCH_LOGS": "recompiles,graph_breaks"}, tmp)
        log = os.path.join(tmp, "events.jsonl")
        _run(log, {}, os.path.join(tmp, "agent"))
        with open(log) as fh:
            seen = [events.decode(line) for line in fh]
    fx_truth = json.loads(bare.stdout.split("FX ", 1)[1].splitlines()[0])
    hello = next(e for e in seen if e.kind == "hello")
    counts = {k: sum(1 for e in seen if e.kind == k)
              for k in ("compile", "recompile", "recompile_limit", "graph_break")}
    compiles = [e for e in seen if e.kind in ("compile", "recompile")]
    breaks = [e for e in seen if e.kind == "graph_break"]
    recompiles = [e for e in seen if e.kind == "recompile"]
    return {
        "torch": hello.torch.split("+")[0],
        "capabilities": hello.capabilities,
        "seen": dict(counts,
                     fx_cache_hits=sum(e.fx_cache_hits or 0 for e in compiles),
                     fx_cache_misses=sum(e.fx_cache_misses or 0 for e in compiles)),
        "truth": dict(truth_from_logs(bare.stderr), fx_cache_hits=fx_truth[0],
                      fx_cache_misses=fx_truth[1]),
        "compile_ids": sum(1 for e in compiles if e.compile_id) == len(compiles),
        "graph_break": {"reason": breaks[0].reason if breaks else None,
                        "location": breaks[0].location if breaks else None},
        "recompile_reason": recompiles[0].reason if recompiles else None,
    }


def _vs(p: dict, key: str) -> str:
    seen, truth = p["seen"][key], p["truth"][key]
    return f"{seen}/{truth}" + ("" if seen == truth else " ✗")


def _yes(flag: bool, yes: str = "yes", no: str = "no") -> str:
    return yes if flag else no


def table(probes: list[dict]) -> str:
    probes = sorted(probes, key=lambda p: tuple(int(x) for x in re.findall(r"\d+", p["torch"])))
    rows = [
        "| torch | recompiles | limit hits | graph breaks | FX cache | compile ids "
        "| recompile reason from | graph-break cause (a `print`) | graph budget "
        "| recompile guard |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in probes:
        caps = p["capabilities"]
        cause = (p["graph_break"]["reason"] or "").replace("|", "\\|")
        cause = cause if len(cause) <= 60 else cause[:59] + "…"
        where = os.path.basename(p["graph_break"]["location"] or "") or "none"
        rows.append(" | ".join([
            f"| {p['torch']}", _vs(p, "recompile"), _vs(p, "recompile_limit"),
            _vs(p, "graph_break"),
            f"hits {_vs(p, 'fx_cache_hits')}, misses {_vs(p, 'fx_cache_misses')}",
            _yes(p["compile_ids"]),
            _yes(caps.get("recompile_reason"), "metrics", "guard failures"),
            f"`{cause}` at `{where}`",
            _yes(caps.get("cudagraph_capture_sizes"), "capture_sizes, eager", "eager"),
            _yes(caps.get("set_stance"), "yes", "unavailable") + " |",
        ]))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--json", help="probe this torch, write the result here")
    ap.add_argument("--readme", help="rewrite this README's table from the probe files")
    ap.add_argument("probes", nargs="*", help="probe files (JSON) for the table")
    args = ap.parse_args(argv)
    if args.json:
        result = probe()
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
        print(json.dumps(result, indent=1))
        return 0
    probes = []
    for path in args.probes:
        with open(path) as fh:
            probes.append(json.load(fh))
    text = table(probes)
    if not args.readme:
        print(text)
        return 0
    with open(args.readme) as fh:
        readme = fh.read()
    head, _, rest = readme.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"{args.readme} has no {BEGIN} marker")
    with open(args.readme, "w") as fh:
        fh.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
