"""The host model on real GPUs: one sidecar, two replicas on two GPUs (each its own budget,
each its own server: only the growing one is reloaded), and a leak under bucketed traffic on
one GPU (growth recordings do not explain is forecast too: decided as
`memory_growth_unexplained`, the lead time measured in a dry run).

Evidence under $WATCHDOG_GPU_RESULTS/<scenario>/ as in test_gpu_reload.py.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.gpu.test_gpu_reload import epoch, run_scenario, save

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def hello_devices(path: str) -> list[str]:
    with open(path) as fh:
        hellos = [json.loads(line) for line in fh if '"hello"' in line]
    return next((h["devices"] for h in reversed(hellos) if h["devices"]), [])


def test_two_replicas_on_two_gpus_only_the_growing_one_is_reloaded(short_tmp):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    replicas = [
        {"tag": "a", "extra": [], "starts": 2,  # variable seq_len: grows toward OOM
         "env": {"CUDA_VISIBLE_DEVICES": "0", "TORCH_WATCHDOG_SERVER": "replica-a"}},
        {"tag": "b", "extra": ["--bucketed", "--seed", "1"], "starts": 2,  # flat, near full
         "env": {"CUDA_VISIBLE_DEVICES": "1", "TORCH_WATCHDOG_SERVER": "replica-b"}}]

    def a_restarted_and_serving(sups) -> bool:
        a = sups["a"]
        return len(a.procs) == 2 and any(p["kind"] == "served" and p["requests"] >= 50
                                         for p in a.progress(1))

    ev = run_scenario(short_tmp, "two-replicas", dry_run=False, replicas=replicas,
                      until=a_restarted_and_serving, limit_s=420)
    a_runs, b_runs = ev["progress"]["a"], ev["progress"]["b"]
    gpu_a = hello_devices(os.path.join(short_tmp, "events-a-0.jsonl"))
    decisions = ev["reload_decisions"]
    summary = {"decisions": [(d["server"], d["gpus"], d.get("cause"), d["seconds_to_oom"])
                             for d in decisions],
               "b_pids": ev["pids"]["b"], "a_pids": ev["pids"]["a"], "gpu_a": gpu_a}
    sigterm = epoch(ev["reloads_started"][0]["timestamp"]) if ev["reloads_started"] else None
    if sigterm is not None and len(a_runs) > 1:
        ballast = next(p["t"] for p in a_runs[0] if p["kind"] == "ballast")
        ready = next((p["t"] for p in a_runs[1] if p["kind"] == "ready"), None)
        b_served = [p for p in b_runs[0] if p["kind"] == "served"]
        summary.update({
            "decided_after_ballast_s": round(epoch(decisions[0]["timestamp"]) - ballast, 1),
            "sigterm_after_ballast_s": round(sigterm - ballast, 1),
            "a_serving_again_after_sigterm_s": None if ready is None else round(ready - sigterm, 1),
            "b_requests_before_sigterm": max((p["requests"] for p in b_served
                                              if p["t"] < sigterm), default=0),
            "b_requests_at_end": max((p["requests"] for p in b_served), default=0)})
    save(short_tmp, "two-replicas", {**ev, "summary": summary})
    # the growing replica: reloaded before its OOM, serving again
    assert not [p for p in a_runs[0] if p["kind"] == "crash"], summary
    assert [d["server"] for d in decisions] == ["replica-a"], summary
    assert decisions[0]["gpus"] == gpu_a and decisions[0]["pids"] == [ev["pids"]["a"][0]]
    (entry,) = ev["reload_record"]
    assert entry["ok"] is True and entry["server"] == "replica-a"
    assert any(p["kind"] == "served" and p["requests"] >= 50 for p in a_runs[1])
    # the other replica: the same process throughout, never signalled, serving all along
    assert len(ev["pids"]["b"]) == 1 and len(b_runs) == 1
    assert not [p for p in b_runs[0] if p["kind"] == "crash"]
    assert summary["b_requests_at_end"] > summary["b_requests_before_sigterm"] > 0


def test_a_leak_under_bucketed_traffic_is_decided_as_unexplained_growth_before_the_oom(
        short_tmp):
    """Dry run: the sidecar decides but does not act; the server runs on into its OOM. The
    lead time is the crash time minus the decision time, in one run."""
    def crashed(sup) -> bool:
        return bool(sup.exits)

    replicas = [{"tag": "", "starts": 1, "env": {"CUDA_VISIBLE_DEVICES": "0"},
                 "extra": ["--bucketed", "--leak-mib-per-s", "6", "--free-mib", "900"]}]
    ev = run_scenario(short_tmp, "leak", dry_run=True, replicas=replicas,
                      until=lambda sups: crashed(sups[""]), limit_s=420)
    run = ev["progress"][""][0]
    crash = next((p for p in run if p["kind"] == "crash"), None)
    decisions = ev["reload_decisions"]
    ballast = next(p["t"] for p in run if p["kind"] == "ballast")
    lead = {"crash": crash and crash["error"],
            "crash_after_ballast_s": crash and round(crash["t"] - ballast, 1),
            "decisions": [(d.get("cause"), d["seconds_to_oom"],
                           round(epoch(d["timestamp"]) - ballast, 1)) for d in decisions],
            "findings": [f["cause"] for f in ev["findings"]]}
    if crash and decisions:
        lead["lead_s"] = round(crash["t"] - epoch(decisions[0]["timestamp"]), 1)
    save(short_tmp, "leak", {**ev, "lead": lead})
    assert crash is not None and decisions, lead
    assert decisions[0]["cause"] == "memory_growth_unexplained", lead
    assert lead["lead_s"] >= 10, lead
