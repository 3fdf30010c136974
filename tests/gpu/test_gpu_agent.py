"""On a real GPU: what the agent counts equals what the cudagraph tree manager recorded.

Run on the GPU machine:  python -m pytest -q -m gpu tests/gpu   (see docs/gpu-tests.md).
Set WATCHDOG_GPU_RESULTS=DIR to keep each scenario's numbers as JSON.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HERE = os.path.dirname(os.path.abspath(__file__))


def scenario(*args: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.join(HERE, "scenario.py"), *args],
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    out = os.environ.get("WATCHDOG_GPU_RESULTS")
    if out:
        name = "scenario" + "".join(a.strip("-") + "_" for a in args).rstrip("_") + ".json"
        with open(os.path.join(out, name), "w") as fh:
            json.dump(result, fh, indent=1)
    return result


@pytest.mark.parametrize("dynamic", ["none", "true"])
def test_recordings_seen_by_the_agent_equal_the_truth(dynamic):
    r = scenario("--dynamic", dynamic, "--traffic", "variable")
    assert r["agent_errors"] == 0
    assert r["truth"]["nodes"] > 0
    assert r["agent_records"] == r["truth"]["nodes"]
    # one graph per size called at least twice (times graph partitions), none for sizes seen once
    assert r["agent_records"] % r["sizes_called_twice_or_more"] == 0
    assert r["agent_warmups"] >= r["distinct_sizes"]
    # every size key recorded is known; under dynamic=None the 1st size runs the static graph,
    # whose recording has no symint key (FACTS #1: static compile, then automatic-dynamic)
    static_sizes = 1 if r["agent_records_static"] else 0
    if dynamic == "true":
        assert static_sizes == 0  # symbolic from the first compile
    assert r["agent_record_keys"] + static_sizes == r["sizes_called_twice_or_more"]
    assert r["compiles"] + r["recompiles"] <= 3  # static then automatic-dynamic (FACTS #1)
    assert r["devices"] and r["devices"][0].startswith("GPU-")


def test_bucketed_traffic_records_nothing_after_warm_up():
    r = scenario("--dynamic", "none", "--traffic", "bucketed")
    assert r["agent_records"] == r["truth"]["nodes"]
    assert r["truth"]["nodes"] == r["truth_after_first_pass"]["nodes"]
    assert r["distinct_sizes"] == 4
    assert r["agent_record_keys"] + (1 if r["agent_records_static"] else 0) == 4


def test_graph_budget_stops_recordings():
    budget = 6
    unbounded = scenario("--dynamic", "none", "--traffic", "variable", "--seed", "1")
    r = scenario("--dynamic", "none", "--traffic", "variable", "--seed", "1",
                 "--budget", str(budget))
    assert r["mitigations"] == [["graph_budget", "engaged"]]
    assert r["agent_records"] == r["truth"]["nodes"]
    assert r["agent_record_keys"] <= budget < unbounded["agent_record_keys"]
    assert r["truth"]["nodes"] < unbounded["truth"]["nodes"]
    assert r["max_abs_err_vs_eager"] < 0.1  # unrecorded sizes still serve correct results


def test_a_freeze_from_another_thread_stops_recordings_and_keeps_serving():
    # the control channel's freeze (issue 52): asked on another thread after half the calls
    seq_calls = 78                       # scenario.sizes_for("variable"): 24 sizes x3 + 6
    r = scenario("--dynamic", "none", "--traffic", "variable", "--seed", "1",
                 "--freeze-after", str(seq_calls // 2))
    assert [m for m in r["mitigations"] if m[0] == "freeze"] == [["freeze", "engaged"]]
    assert r["truth_at_freeze"]["nodes"] > 0           # it had been recording
    # first run (H100, torch 2.11): 10 recordings after the freeze, all of sizes warmed up
    # before it (the freeze keeps the keys seen at warm-up); none of a size first seen after
    assert r["records_after_freeze_unwarmed"] == 0
    assert r["truth"]["nodes"] - r["truth_at_freeze"]["nodes"] <= r["records_after_freeze"]
    assert r["max_abs_err_vs_eager"] < 0.1   # sizes past the freeze still serve correct results
    assert r["agent_errors"] == 0


def test_watch_adds_no_gpu_sync():
    import torch_watchdog.agent as agent

    agent.install(socket_path="", event_log=None)
    try:
        model = torch.nn.Linear(64, 64).cuda().half()
        compiled = agent.watch(torch.compile(model, mode="reduce-overhead"), name="lin")
        x = torch.randn(4, 64, device="cuda", dtype=torch.half)
        with torch.no_grad():
            for _ in range(3):
                compiled(x)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(50):
                    compiled(x)  # a sync anywhere in the watched call would raise here
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        agent.uninstall()


def test_oom_observer_reports_the_allocator_oom(short_tmp):
    import torch_watchdog.agent as agent
    from torch_watchdog import events

    log = os.path.join(short_tmp, "events.jsonl")
    torch.cuda.init()
    agent.install(socket_path="", event_log=log)
    try:
        total = torch.cuda.get_device_properties(0).total_memory
        with pytest.raises(torch.OutOfMemoryError):
            agent.watch(lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"))(2 * total)
    finally:
        agent.uninstall()
    with open(log) as fh:
        ooms = [e for e in map(events.decode, fh) if e.kind == "oom"]
    assert len(ooms) == 1  # the observer's, not doubled by watch()
    assert ooms[0].source == "allocator" and ooms[0].requested_bytes >= 2 * total
