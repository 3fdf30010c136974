"""Warm restart on CPU, two real processes with Inductor, each with an empty compile cache
directory of its own (a new machine, a new pod): the first saves the bundle once warmed up,
the second loads it at install and its compile is an FX-cache hit.

On CPU the compile time is mostly g++ building the kernels (12 shared objects here), which
the bundle does not carry (on a GPU, Triton kernels are in it): the time saved is measured on
the GPU by benchmarks/reload_to_ready.py; here the hit is what is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT, wait_for, with_root

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drain_server.py")


def events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.endswith("\n")]


def serve_until_saved(tmp: str, gen: int, warm: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=with_root(), TORCH_WATCHDOG_WARM="1",
               TORCH_WATCHDOG_WARM_DIR=warm, TORCH_WATCHDOG_WARM_SAVE_QUIET_S="0.3",
               TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, f"inductor{gen}"),
               TORCHINDUCTOR_COMPILE_THREADS="1")
    env.pop("TORCH_COMPILE_JOB_ID", None)
    log = os.path.join(tmp, f"events{gen}.jsonl")
    p = subprocess.Popen([sys.executable, SERVER, "--socket", os.path.join(tmp, "ev.sock"),
                          "--progress", os.path.join(tmp, f"progress{gen}"), "--event-log", log,
                          "--backend", "inductor", "--call-s", "0.05"],
                         cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: any(e["kind"] == "warm" and e["action"] == "saved"
                                    for e in events(log)), 240), [e["kind"] for e in events(log)]
    finally:
        p.kill()
        p.wait(10)
    return events(log)


def test_the_next_process_loads_the_bundle_and_its_compile_hits_the_cache(short_tmp):
    warm = os.path.join(short_tmp, "warm")
    first = serve_until_saved(short_tmp, 1, warm)
    (compiled,) = [e for e in first if e["kind"] == "compile"]
    assert compiled["fx_cache_misses"] >= 1 and compiled["fx_cache_hits"] == 0
    assert not [e for e in first if e["kind"] == "warm" and e["action"] != "saved"]
    (bundle,) = os.listdir(warm)
    assert bundle.startswith("drain-test--torch")

    second = serve_until_saved(short_tmp, 2, warm)
    loaded = [e for e in second if e["kind"] == "warm" and e["action"] == "loaded"]
    assert loaded and "inductor" in loaded[0]["detail"]
    (compiled2,) = [e for e in second if e["kind"] == "compile"]
    assert compiled2["fx_cache_hits"] >= 1 and compiled2["fx_cache_misses"] == 0
    assert loaded[0]["t"] < compiled2["t"]  # loaded at install, before the first compile
    print(f"compile: cold {compiled['seconds']:.1f} s, with the bundle "
          f"{compiled2['seconds']:.1f} s")


def test_with_nothing_configured_the_agent_leaves_compiles_as_they_are(short_tmp):
    """The bundle is opt-in: an agent installed with no warm setting loads and saves no
    bundle and sets no job id (PGO state of an earlier run would make the first compile
    dynamic), even with a writable warm_dir."""
    warm = os.path.join(short_tmp, "warm")
    os.makedirs(warm)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_WATCHDOG_WARM", "TORCH_COMPILE_JOB_ID")}
    code = f"""
import time, torch, torch_watchdog.agent as agent
agent.install(socket_path=None, warm_dir={warm!r}, warm_save_quiet_s=0.1)
f = agent.watch(torch.compile(lambda x: x.sin() + 1, backend="eager"), name="f")
f(torch.ones(3)); f(torch.ones(5))
time.sleep(1.0)
import os
print(os.environ.get("TORCH_COMPILE_JOB_ID"), torch.compiler.config.job_id,
      agent.current().warm)
"""
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=with_root()),
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "None", "None"], out.stdout
    assert os.listdir(warm) == []
